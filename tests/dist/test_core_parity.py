"""Sequence-parallel runs on 2 and 4 gloo ranks against one process on the full batch.

Each world size is spawned once (module-scoped fixture) and runs every case; each test checks one case.
"""

import pytest

from tests.helpers.harness import assert_case, run_world


@pytest.fixture(scope="module")
def world2():
    return run_world(2, "tests.dist.cases_core:world2")


@pytest.fixture(scope="module")
def world4():
    return run_world(4, "tests.dist.cases_core:world4")


WORLD2 = [
    "llama_mha_sdpa",
    "llama_gqa_sdpa",
    "llama_mqa_sdpa",
    "mistral_sliding_window",
    "qwen2_mixed_window",
    "qwen3_sdpa",
    "gemma3_sdpa",
    "gemma2_eager_softcap",
    "phi3_packed_sliding",
    "olmo2_packed",
    "cohere2_packed_sliding",
    "gpt_neox_partial_rotary",
    "llama_eager_core",
    "llama_flex_core_forward",
    "seq_not_divisible",
    "batch_size_3",
    "padded_right",
    "padded_left",
    "padded_eager_core",
    "packed_documents",
    "packed_sliding_window",
    "packed_eager_core",
    "bf16_communication",
    "gradient_checkpointing",
    "bad_input_on_one_rank_raises_everywhere",
    "different_batches_in_sp_group",
    "collectives_per_layer",
    "shape_mismatch_raises",
    "heads_not_divisible",
    "missing_position_ids",
    "plain_attention_roundtrip",
]
WORLD4 = [
    "sp4_llama_mha",
    "sp4_kv_heads_lt_sp",
    "sp4_mqa",
    "sp4_gemma3_packed",
    "sp4_seq_not_divisible_padded",
    "dp2_sp2_llama",
    "dp2_sp2_packed",
    "from_groups_dp2_sp2",
    "world_not_divisible",
]


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
