"""Head-chunked attention (C = 1, 2, 4) on 2 and 4 gloo ranks: exact against one process for every family,
layout (sp, dp x sp, Ulysses x ring) and wrapper (DDP, FSDP2 with the memory features on), with and without
PEFT LoRA adapters on the attention projections (their dropout too: each rank's masks).

Each world size is spawned once (module-scoped fixture) and runs every case; each test checks one case.
"""

from tests.dist.cases_head_chunks import WORLD2, WORLD4
from tests.helpers.harness import dist_suite

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_head_chunks", {2: WORLD2, 4: WORLD4}
)
