"""Tiled MLP and activation checkpointing/offload under sp=2 (and dp=2 x sp=2), DDP and FSDP2, against one
process on the full batch. Each world size is spawned once and runs every case; each test checks one case."""

from tests.helpers.harness import dist_suite

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
    "sp2_tiled_offload_stride2_copy_fsdp2",
    "sp2_tiled_offload_padded_ddp",
    "sp2_tiled_checkpoint_left_padded_fsdp2",
    "ddp_different_chunk_counts_per_rank",
]
WORLD4 = ["dp2_sp2_tiled_offload_ddp", "dp2_sp2_tiled_offload_fsdp2"]

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_memory_features", {2: WORLD2, 4: WORLD4}
)
