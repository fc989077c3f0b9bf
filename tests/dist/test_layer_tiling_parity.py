"""The sequence-tiled layer (tiled norms fused into the tiled MLP, checkpointing; a checkpoint stride of 2 on a
few) on every parity architecture under sp=2 (unwrapped and FSDP2) and dp=2 x sp=2 (FSDP2), against one process
on the full batch. Each world size is spawned once and runs every case; each test checks one case."""

from tests.dist.cases_architectures import PARITY_ARCHS
from tests.helpers.harness import dist_suite


def STRIDE(prefix: str) -> list[str]:  # noqa: N802 (a case list, like WORLD2)
    archs = ("llama_dynamic", "deepseek_v3_mla", "qwen3_moe", "opt")
    return [f"{prefix}_{arch}_{mode}_stride2_fsdp2" for arch in archs for mode in ("checkpoint", "offload")]


WORLD2 = [
    *(f"sp2_{arch}_{wrapper}" for arch in PARITY_ARCHS for wrapper in ("none", "fsdp2")),
    "sp2_llama_dynamic_offload_fsdp2",
    "sp2_llama_dynamic_no_checkpointing",
    *STRIDE("sp2"),
]
WORLD4 = [*(f"dp2_sp2_{arch}_fsdp2" for arch in PARITY_ARCHS), *STRIDE("dp2_sp2")]

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_layer_tiling", {2: WORLD2, 4: WORLD4}
)
