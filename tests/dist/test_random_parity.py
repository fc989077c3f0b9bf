"""Random parity cases (tests/dist/cases_random.py) on 2 and 4 gloo ranks: the first cases of seed 0.

Each case must equal one process or be refused for a reason its parameters give: heads (or head chunks)
that do not split over the ranks, or left padding under an eager model (docs/semantics.md). A campaign of
any seed and length runs from the command line and prints one line per case::

    python -m tests.dist.test_random_parity --world 4 --seed 7 --count 100
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest

from tests.dist.cases_random import COUNT_ENV, SEED_ENV, START_ENV, random_case
from tests.helpers.harness import campaign_args, refused_for_its_parameters, run_world

COUNTS = {2: 12, 4: 8}  # cases of seed 0 per world size in the suite


def run(world: int, seed: int, start: int, count: int) -> dict[str, dict[int, str]]:
    """``{index: {rank: result}}`` of cases ``start .. start + count - 1`` of ``seed`` on ``world`` ranks."""
    env = {SEED_ENV: str(seed), START_ENV: str(start), COUNT_ENV: str(count)}
    with mock.patch.dict(os.environ, env):  # the spawned ranks read them
        return run_world(world, f"tests.dist.cases_random:world{world}", timeout=60 * count + 120)


def verdict(case: dict, results: dict[int, str], world: int) -> str | None:
    """None when every rank's result is right for ``case``; else what is wrong."""
    if len(results) != world or len(set(results.values())) != 1:
        return f"the ranks disagree or some are missing: {results}"
    result = results[0]
    batch = case["batch"]
    eager_left = case["core"] == "eager" and batch.get("pad") == "left" and any(batch["pad_lengths"])
    if result == "ok":
        return "left padding under an eager model was not refused" if eager_left else None
    if result.startswith("refused: "):
        reason = result.removeprefix("refused: ")
        if refused_for_its_parameters(reason, eager_left):
            return None
        return f"refused for a reason the case does not give: {reason}"
    return result  # the case's parameters and the traceback


@pytest.fixture(scope="module", params=sorted(COUNTS))
def world_results(request):
    world = request.param
    return world, run(world, 0, 0, COUNTS[world])


def test_random_cases_equal_one_process_or_are_refused_for_their_reason(world_results):
    world, results = world_results
    if "<setup>" in results or "<process>" in results:
        pytest.fail(f"the {world}-rank run failed: {results.get('<setup>') or results.get('<process>')}")
    assert sorted(results, key=int) == [str(i) for i in range(COUNTS[world])], sorted(results)
    wrong = {i: verdict(random_case(0, int(i), world), per_rank, world) for i, per_rank in results.items()}
    wrong = {i: why for i, why in wrong.items() if why is not None}
    assert not wrong, "\n\n".join(f"case {i} of seed 0 on {world} ranks: {why}" for i, why in wrong.items())
    exact = sum(per_rank[0] == "ok" for per_rank in results.values())
    assert exact >= COUNTS[world] // 2, f"only {exact} of {COUNTS[world]} cases ran: {results}"


def main(argv: list[str] | None = None) -> int:
    args = campaign_args("a campaign of random parity cases", argv, count=50)
    results = run(args.world, args.seed, args.start, args.count)
    failed = 0
    for index in sorted(results, key=lambda i: int(i) if i.isdigit() else -1):
        if not index.isdigit():
            print(index, results[index])
            failed += 1
            continue
        why = verdict(random_case(args.seed, int(index), args.world), results[index], args.world)
        failed += why is not None
        print(f"case {index}: {'FAILED ' + why if why else results[index][0].splitlines()[0][:160]}")
    print(f"{failed} of {len(results)} failed (seed {args.seed}, world {args.world})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
