"""Ring and hybrid Ulysses x Ring runs on 2 and 4 gloo ranks against one process on the full batch.

Each world size is spawned once (on first use) and runs every case of tests/dist/cases_ring.py.
"""

import pytest

from tests.helpers.harness import assert_case, run_world

WORLD2 = [
    "ring2_llama_gqa",
    "ring2_mha_eager_core",
    "ring2_mqa",
    "ring2_packed",
    "ring2_padded_right",
    "ring2_padded_left",
    "ring2_seq_not_divisible",
    "ring2_sliding_window_packed",
    "ring2_qwen2_mixed_window",
    "ring2_gemma2_softcap",
    "ring2_gradient_checkpointing",
    "ring2_bytes",
    "ulysses2_bytes",
    "bad_layouts",
    "automatic_choice",
]
WORLD4 = [
    "ring4_llama",
    "ring4_packed",
    "ring4_padded_not_divisible",
    "hybrid_2x2_llama",
    "hybrid_2x2_mqa_packed",
    "hybrid_2x2_padded_left",
    "hybrid_2x2_gemma3_packed_window",
    "hybrid_2x2_from_groups",
    "dp2_ring2",
    "dp2_ring2_packed",
    "bf16_merge_error_ring2_vs_ring4",
    "ring4_bytes",
    "hybrid_2x2_bytes",
    "hybrid_2x2_bytes_kv_lt_ulysses",
    "ulysses4_bytes",
    "bad_layouts",
    "automatic_choice",
]


CASES = [(2, case) for case in WORLD2] + [(4, case) for case in WORLD4]


@pytest.fixture(scope="module")
def results():
    """results(world): the {case: {rank: result}} of that world size, spawned on first use only."""
    runs = {}

    def get(world: int):
        if world not in runs:
            runs[world] = run_world(world, f"tests.dist.cases_ring:world{world}")
        return runs[world]

    return get


@pytest.mark.parametrize("world,case", CASES)
def test_case(results, world, case):
    assert_case(results(world), case, world)


@pytest.mark.parametrize("world,listed", [(2, WORLD2), (4, WORLD4)])
def test_every_worker_case_is_checked(results, world, listed):
    """A case added to a worker but not to the lists above would pass unseen: fail instead."""
    assert set(results(world)) == set(listed), set(results(world)) ^ set(listed)
