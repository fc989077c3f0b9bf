"""The sequence-tiled layer (tiled norms fused into the tiled MLP, checkpointing) on every parity architecture
under sp=2 (unwrapped and FSDP2) and dp=2 x sp=2 (FSDP2), against one process on the full batch. Each world size
is spawned once and runs every case; each test checks one case."""

from tests.dist.cases_architectures import PARITY_ARCHS
from tests.helpers.harness import dist_suite

WORLD2 = [
    *(f"sp2_{arch}_{wrapper}" for arch in PARITY_ARCHS for wrapper in ("none", "fsdp2")),
    "sp2_llama_dynamic_offload_fsdp2",
    "sp2_llama_dynamic_no_checkpointing",
]
WORLD4 = [f"dp2_sp2_{arch}_fsdp2" for arch in PARITY_ARCHS]

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_layer_tiling", {2: WORLD2, 4: WORLD4}
)
