"""Sequence-parallel runs on 2 and 4 gloo ranks against one process on the full batch.

Each world size is spawned once (module-scoped fixture) and runs every case; each test checks one case.
"""

from tests.helpers.harness import dist_suite

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
    "compiled_with_memory_features",
    "compiled_layers_fullgraph",
    "compiled_model_steps",
    "compiled_layers_batches_vary",
    "seq_not_divisible",
    "batch_size_3",
    "padded_right",
    "padded_left",
    "padded_eager_core",
    "padded_right_eager_model",
    "padded_left_unmasked_labels",
    "padding_with_targets_refused",
    "label_forms",
    "inputs_embeds",
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
    "dp2_sp1_refusal_on_one_replica",
    "changed_after_parallelize",
    "attention_copied_by_peft",
    "resized_vocabulary",
    "layouts_differ",
    "gloo_settles_at_exit",
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
    "dp2_sp2_refusal_on_one_replica",
]

results, test_case, test_every_worker_case_is_checked = dist_suite("tests.dist.cases_core", {2: WORLD2, 4: WORLD4})
