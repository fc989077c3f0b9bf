"""Issue 8 on 2 and 4 gloo ranks: every accepted architecture is exact, bad input raises on every rank.

Each world size is spawned once (module-scoped fixture) and runs every case; each test checks one case.
"""

import pytest

from tests.dist.cases_hardening import WORLD2, WORLD4
from tests.helpers.harness import assert_case, run_world


@pytest.fixture(scope="module")
def world2():
    return run_world(2, "tests.dist.cases_hardening:world2")


@pytest.fixture(scope="module")
def world4():
    return run_world(4, "tests.dist.cases_hardening:world4")


@pytest.mark.parametrize("case", WORLD2)
def test_world2(world2, case):
    assert_case(world2, case, 2)


@pytest.mark.parametrize("case", WORLD4)
def test_world4(world4, case):
    assert_case(world4, case, 4)


def test_every_worker_case_is_checked(world2, world4):
    """A case the workers ran but no test checks would pass unseen: fail instead."""
    assert set(world2) == set(WORLD2), set(world2) ^ set(WORLD2)
    assert set(world4) == set(WORLD4), set(world4) ^ set(WORLD4)
