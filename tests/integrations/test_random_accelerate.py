"""Random custom Accelerate loops through SequenceParallelConfig.prepare (tests/integrations/
cases_random_accelerate.py) on 2 and 4 gloo ranks: the first cases of seed 0 and a few chosen from campaigns,
each against a plain loop in one process (tests/integrations/reference_accelerate.py).

Each case must train to the same per-micro-batch losses, the same gradient norms where clipped, the same learning
rates, the same eval losses and the same trained weights as one process, or be refused for a reason its
parameters give: heads that do not split over the ranks, left padding under an eager model (docs/semantics.md),
or an iterable dataset under accelerate's default dispatching from rank 0. A campaign of any seed and
length runs from the command line and prints one line per case::

    python -m tests.integrations.test_random_accelerate --world 4 --seed 3 --count 20
"""

from __future__ import annotations

import os
import sys
import tempfile
from unittest import mock

import pytest
import torch

from tests.helpers.harness import campaign_args, print_campaign, refused_for_its_parameters, run_world
from tests.integrations.cases_random_accelerate import (
    CASES_ENV,
    case_dir,
    dataset,
    dispatched,
    eager_left,
    random_case,
)
from tests.integrations.common import read_json
from tests.integrations.reference_accelerate import reference

# (seed, index) per world size in the suite: the first cases of seed 0, and (drawn from campaigns) the corners
# of a regression each: split_batches with a batch of 1 over sp=2 (refused by accelerate's split over the world)
# and with an iterable dataset's partial last batch (batch_size 0 before); an iterable dataset dealt to one dp
# group (its last batch completed with repeated samples before); dp=2 x sp=2 under split_batches with a scheduler
# (stepped twice per optimizer step before) and evaluations; the default dispatch of an iterable dataset (refused);
# stops inside an accumulation group (micro-batch and step weighting); a ring under FSDP2 with LoRA and clipping
# (ring 2 alone, 3 evaluations; hybrid ulysses 2 x ring 2, accumulation weighted over the step)
CASES = {
    2: [(0, i) for i in range(5)] + [(10, 2), (11, 2), (10, 6), (10, 11), (33, 45)],
    4: [(0, i) for i in range(4)] + [(10, 14), (10, 10), (11, 0), (32, 15)],
}
LOSS_ATOL = 1e-5  # fp32 losses, as tests/integrations/test_equivalence.py
WEIGHT_ATOL = 1e-4


def run(world: int, cases: list[tuple[int, int]], out: str) -> dict[str, dict[int, str]]:
    """``{"seed/index": {rank: result}}`` of ``cases`` (``(seed, index)`` each) on ``world`` ranks."""
    env = {CASES_ENV: ",".join(f"{seed}/{index}" for seed, index in cases), "ULYSSES_IT_OUT": out}
    with mock.patch.dict(os.environ, env):  # the spawned ranks read them
        target = f"tests.integrations.cases_random_accelerate:world{world}"
        return run_world(world, target, timeout=40 * len(cases) + 120)


def compare(case: dict, out: str) -> str | None:
    """None when the SP run written under ``out`` equals the plain loop in one process; else what differs."""
    want, want_weights = reference(case)
    got = read_json(os.path.join(out, "result.json"))
    got_weights = torch.load(os.path.join(out, "weights.pt"))
    problems = []
    # a gradient norm sums the squares of every gradient, each added over the shards in another order
    got["evals"], want["evals"] = flat_evals(got["evals"], want["evals"], problems)
    for key, rtol in (("losses", 1e-5), ("grad_norms", 1e-4), ("lrs", 1e-6), ("evals", 1e-5)):
        if len(got[key]) != len(want[key]):
            problems.append(f"{key}: {got[key]} under SP, {want[key]} in one process")
            continue
        try:
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), atol=LOSS_ATOL, rtol=rtol)
        except AssertionError as error:
            problems.append(f"{key}: {got[key]} under SP, {want[key]} in one process ({error})")
    problems += metrics_problems(case, got["eval_targets"])
    if got_weights.keys() != want_weights.keys():
        problems.append(f"trained parameters differ: {sorted(got_weights.keys() ^ want_weights.keys())}")
    for name in sorted(got_weights.keys() & want_weights.keys()):
        try:
            torch.testing.assert_close(got_weights[name], want_weights[name], atol=WEIGHT_ATOL, rtol=0)
        except AssertionError as error:
            problems.append(f"weight {name}: {error}")
            break
    return "; ".join(problems) or None


def metrics_problems(case: dict, got: list[list[list[int]]]) -> list[str]:
    """What ``gather_for_metrics`` gave wrong: each evaluation must see every eval sample's valid targets once, in
    the dataset's order (not for an iterable dataset over dp > 1: without a length the repeats that even out its
    last batch cannot be told apart, as in Accelerate)."""
    if case["iterable"] and case["dp"] > 1:
        return []
    want = [[t for t in sample["labels"][1:] if t != -100] for sample in dataset(case, case["eval_lengths"])]
    wrong = [i for i, targets in enumerate(got) if targets != want]
    return [f"gather_for_metrics, evaluation {wrong[0]}: {got[wrong[0]]} under SP, {want}"] if wrong else []


def flat_evals(got: list[list[float]], want: list[list[float]], problems: list[str]) -> tuple[list, list]:
    """Each evaluation's per-batch losses, flattened once their counts are checked (a problem when they differ)."""
    if [len(e) for e in got] != [len(e) for e in want]:
        problems.append(f"eval batches per evaluation: {[len(e) for e in got]} under SP, {[len(e) for e in want]}")
        return [], []
    return sum(got, []), sum(want, [])


def refused_by_design(case: dict, reason: str) -> bool:
    """Whether ``reason`` is one the case's parameters give: those of every random case (heads, eager left
    padding), or accelerate dispatching an iterable dataset's batches from rank 0 (its default for one)."""
    return refused_for_its_parameters(reason, eager_left(case)) or (dispatched(case) and "dispatch_batches" in reason)


def verdict(case: dict, results: dict[int, str], world: int, out: str) -> str | None:
    """None when every rank's result is right for ``case``; else what is wrong. The ranks of different dp
    groups may refuse in their own words (e.g. each names its own left-padded row)."""
    refused = [r.removeprefix("refused: ") for r in results.values() if r.startswith("refused: ")]
    if len(results) == world and len(refused) == world:
        wrong = [reason for reason in refused if not refused_by_design(case, reason)]
        return f"refused for a reason the case does not give: {wrong[0]}" if wrong else None
    if dispatched(case):
        return f"an iterable dataset dispatched from rank 0 was not refused: {results}"
    if len(results) != world or len(set(results.values())) != 1:
        return f"the ranks disagree or some are missing: {results}"
    return compare(case, out) if results[0] == "ok" else results[0]  # else the traceback


def failures(world: int, results: dict[str, dict[int, str]], out: str) -> dict[str, str]:
    """``{"seed/index": what is wrong}`` over a run's cases (the whole run's failure under its own key)."""
    wrong = {key: str(results[key]) for key in ("<setup>", "<process>") if key in results}
    for key, per_rank in results.items():
        if not key.startswith("<"):
            seed, index = (int(n) for n in key.split("/"))
            why = verdict(random_case(seed, index, world), per_rank, world, case_dir(out, seed, world, index))
            if why is not None:
                wrong[key] = why
    return wrong


@pytest.mark.parametrize("world", sorted(CASES))
def test_random_accelerate_cases_equal_one_process_or_are_refused_for_their_reason(world, tmp_path):
    results = run(world, CASES[world], str(tmp_path))
    wrong = failures(world, results, str(tmp_path))
    assert not wrong, "\n\n".join(f"case {key} on {world} ranks: {why}" for key, why in wrong.items())
    assert list(results) == [f"{seed}/{index}" for seed, index in CASES[world]], sorted(results)
    ran = sum(per_rank[0] == "ok" for per_rank in results.values())
    assert ran >= len(CASES[world]) // 2, f"only {ran} of {len(CASES[world])} cases ran: {results}"


def main(argv: list[str] | None = None) -> int:
    args = campaign_args("a campaign of random Accelerate loops under Ulysses SP", argv)
    with tempfile.TemporaryDirectory() as out:
        cases = [(args.seed, index) for index in range(args.start, args.start + args.count)]
        results = run(args.world, cases, out)
        wrong = failures(args.world, results, out)
    return print_campaign(list(results), results, wrong, args)


if __name__ == "__main__":
    sys.exit(main())
