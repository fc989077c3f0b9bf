"""On 2 and 4 gloo ranks: every accepted architecture is exact, bad input raises on every rank.

Each world size is spawned once (module-scoped fixture) and runs every case; each test checks one case.
"""

from tests.dist.cases_architectures import WORLD2, WORLD4
from tests.helpers.harness import dist_suite

results, test_case, test_every_worker_case_is_checked = dist_suite(
    "tests.dist.cases_architectures", {2: WORLD2, 4: WORLD4}
)
