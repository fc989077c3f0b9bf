"""Tiled MLP and activation checkpointing/offload under sp=2 (and dp=2 x sp=2), DDP and FSDP2, against one
process on the full batch. Each world size is spawned once and runs every case; each test checks one case."""

import pytest

from tests.helpers.harness import assert_case, run_world


@pytest.fixture(scope="module")
def world2():
    return run_world(2, "tests.dist.cases_memory_features:world2")


@pytest.fixture(scope="module")
def world4():
    return run_world(4, "tests.dist.cases_memory_features:world4")


WORLD2 = [
    *(
        f"sp2_{feature}_{wrapper}_{tied}"
        for feature in ("tiled", "offload", "tiled_offload")
        for wrapper in ("ddp", "fsdp2")
        for tied in ("untied", "tied")
    ),
    "sp2_tiled_checkpoint_qwen3_ddp",
    "sp2_tiled_checkpoint_qwen3_fsdp2",
    "sp2_tiled_offload_enabled_after_ddp",
    "sp2_tiled_offload_enabled_after_fsdp2",
    "sp2_tiled_loss_tiled_mlp_offload_fsdp2_tied",
    "sp2_tiled_offload_padded_ddp",
    "ddp_different_chunk_counts_per_rank",
]
WORLD4 = ["dp2_sp2_tiled_offload_ddp", "dp2_sp2_tiled_offload_fsdp2"]


@pytest.mark.parametrize("case", WORLD2)
def test_world2(world2, case):
    assert_case(world2, case, 2)


@pytest.mark.parametrize("case", WORLD4)
def test_world4(world4, case):
    assert_case(world4, case, 4)


def test_every_worker_case_is_checked(world2, world4):
    """A case added to a worker but not to the lists above would pass unseen: fail instead."""
    assert set(world2) == set(WORLD2), set(world2) ^ set(WORLD2)
    assert set(world4) == set(WORLD4), set(world4) ^ set(WORLD4)
