"""The tiled lm_head + loss under Ulysses SP on 2 and 4 gloo ranks against one process (cases in
cases_tiled_loss.py; one spawn per world size)."""

import pytest

from tests.helpers.harness import assert_case, run_world


@pytest.fixture(scope="module")
def world2():
    return run_world(2, "tests.dist.cases_tiled_loss:world2")


@pytest.fixture(scope="module")
def world4():
    return run_world(4, "tests.dist.cases_tiled_loss:world4")


WORLD2 = [
    "sp2_untied",
    "sp2_tied",
    "sp2_gemma2_softcap",
    "sp2_packed_default_chunk",
    "sp2_ddp_untied",
    "sp2_ddp_tied",
    "sp2_fsdp2_untied",
    "sp2_fsdp2_tied",
    "sp2_fsdp2_lm_head_unit",
    "sp2_eval_no_grad",
]
WORLD4 = ["dp2_sp2_fsdp2_tied", "dp2_sp2_ddp", "hybrid_2x2_fsdp2_packed"]


@pytest.mark.parametrize("case", WORLD2)
def test_world2(world2, case):
    assert_case(world2, case, 2)


@pytest.mark.parametrize("case", WORLD4)
def test_world4(world4, case):
    assert_case(world4, case, 4)


def test_every_worker_case_is_checked(world2, world4):
    assert set(world2) == set(WORLD2), set(world2) ^ set(WORLD2)
    assert set(world4) == set(WORLD4), set(world4) ^ set(WORLD4)
