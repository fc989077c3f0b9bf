"""Ring and hybrid Ulysses x Ring runs on 2 and 4 gloo ranks against one process on the full batch.

The sdpa core runs the ring's fused kernel (cpu_flash here), the eager core its plain-PyTorch kernel.

Each world size is spawned once (on first use) and runs every case of tests/dist/cases_ring.py.
"""

from tests.helpers.harness import dist_suite

WORLD2 = [
    "ring2_llama_gqa",
    "ring2_mha_eager_core",
    "ring2_mqa",
    "ring2_packed",
    "ring2_padded_right",
    "ring2_padded_left",
    "ring2_seq_not_divisible",
    "ring2_gemma3n_zero_pad_embedding",
    "ring2_sliding_window_packed",
    "ring2_qwen2_mixed_window",
    "ring2_gemma2_softcap",
    "ring2_window_padded_left",
    "ring2_plain_kernel_packed_window",
    "ring2_gradient_checkpointing",
    "ring2_bytes",
    "ulysses2_bytes",
    "bad_layouts",
    "automatic_choice",
    "gathered_on_another_layout",
]
WORLD4 = [
    "ring4_llama",
    "ring4_packed",
    "ring4_padded_not_divisible",
    "ring4_mqa_packed_window",
    "ring4_plain_kernel_packed",
    "hybrid_2x2_llama",
    "hybrid_2x2_kv1_window_padded_right",
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
    "topology_choice",
    "shards_of_another_layout_ring4",
    "shards_of_another_layout_hybrid",
    "shards_of_another_layout_dp2_ring2",
    "shards_on_a_model_without_ulysses_hybrid",
    "shards_on_a_model_without_ulysses_dp2_ring2",
    "wrapper_over_part_of_the_world_dp2_ring2",
    "fsdp2_over_part_of_the_model_dp2_ring2",
]

results, test_case, test_every_worker_case_is_checked = dist_suite("tests.dist.cases_ring", {2: WORLD2, 4: WORLD4})
