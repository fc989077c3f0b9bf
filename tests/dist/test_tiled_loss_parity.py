"""The tiled lm_head + loss under Ulysses SP on 2 and 4 gloo ranks against one process (cases in
cases_tiled_loss.py; one spawn per world size)."""

from tests.helpers.harness import dist_suite

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
    "sp2_ddp_grad_accumulation",
    "sp2_fsdp2_grad_accumulation",
    "sp2_gpt2",
    "sp2_label_smoothing_tiled",
    "sp2_label_smoothing_logits",
    "sp2_label_smoothing_moe_aux_tiled_ddp",
    "sp2_float64_default_dtype",
]
WORLD4 = [
    "dp2_sp2_fsdp2_tied",
    "dp2_sp2_ddp",
    "hybrid_2x2_fsdp2_packed",
    "sp4_afmoe_kv_heads_lt_sp",
    "dp2_sp2_label_smoothing_untiled",
]

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_tiled_loss", {2: WORLD2, 4: WORLD4}
)
