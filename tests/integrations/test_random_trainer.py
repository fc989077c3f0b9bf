"""Random Trainer / SFTTrainer cases (tests/integrations/cases_random.py) on 2 and 4 gloo ranks: the first cases
of seed 0, each against the plain trainer in one process.

Each case must train to the same per-step losses (and gradient norms where clipped), the same eval loss, the
same count of tokens seen and the same weights as one process, or be refused for a reason its parameters
give: heads that do not split over the ranks, or left padding under an eager model (docs/semantics.md). Some
cases stop halfway with a checkpoint and resume from it in a new trainer, as their one-process run does; some
load the model sharded with FSDP2 over the world (transformers' DistributedConfig). An MoE's load-balancing term
is drawn on half the time (TRL's router_aux_loss_coef, the Trainer's output_router_logits) and must be exact too.
A campaign of any seed and length runs from the command line and prints one line per case::

    python -m tests.integrations.test_random_trainer --world 4 --seed 3 --count 20
"""

from __future__ import annotations

import os
import sys
import tempfile
from unittest import mock

import pytest
import torch

from tests.helpers.harness import campaign_args, print_campaign, refused_for_its_parameters, run_world
from tests.integrations.cases_random import COUNT_ENV, SEED_ENV, START_ENV, case_dir, random_case, reference
from tests.integrations.common import read_json

COUNTS = {2: 5, 4: 4}  # cases of seed 0 per world size in the suite
LOSS_ATOL = 1e-5  # fp32 logged losses, as tests/integrations/test_equivalence.py
WEIGHT_ATOL = 1e-4


def run(world: int, seed: int, start: int, count: int, out: str) -> dict[str, dict[int, str]]:
    """``{index: {rank: result}}`` of cases ``start .. start + count - 1`` of ``seed`` on ``world`` ranks."""
    env = {SEED_ENV: str(seed), START_ENV: str(start), COUNT_ENV: str(count), "ULYSSES_IT_OUT": out}
    with mock.patch.dict(os.environ, env):  # the spawned ranks read them
        return run_world(world, f"tests.integrations.cases_random:world{world}", timeout=60 * count + 120)


def _eager_left(case: dict) -> bool:
    return case["attn"] == "eager" and case["pad"] == "left" and len(set(case["lengths"])) > 1


def compare(case: dict, out: str) -> str | None:
    """None when the SP run written under ``out`` equals the plain trainer in one process; else what differs."""
    want, want_weights = reference(case, os.path.join(out, "reference"))
    got = read_json(os.path.join(out, "result.json"))
    got_weights = torch.load(os.path.join(out, "weights.pt"))
    problems = []
    for key in ("global_step", "tokens_seen", "trl_num_tokens"):
        if got[key] != want[key]:
            problems.append(f"{key}: {got[key]} under SP, {want[key]} in one process")
    # a gradient norm sums the squares of every gradient, each added over the shards in another order
    for key, rtol in (("losses", 1e-5), ("grad_norms", 1e-4), ("eval_losses", 1e-5), ("eval_loss", 1e-5)):
        if got[key] is None or want[key] is None:  # no eval set
            if got[key] != want[key]:
                problems.append(f"{key}: {got[key]} under SP, {want[key]} in one process")
            continue
        try:
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), atol=LOSS_ATOL, rtol=rtol)
        except (AssertionError, TypeError) as error:
            problems.append(f"{key}: {got[key]} under SP, {want[key]} in one process ({error})")
    if got["eval_metrics"].keys() != want["eval_metrics"].keys():
        problems.append(f"eval metrics: {got['eval_metrics']} under SP, {want['eval_metrics']} in one process")
    if case["metrics"] and want["eval_loss"] is not None and not want["eval_metrics"]:  # (drop_last may leave none)
        problems.append("compute_metrics gave no metrics in one process")
    for key in got["eval_metrics"].keys() & want["eval_metrics"].keys():
        pair = torch.tensor([got["eval_metrics"][key], want["eval_metrics"][key]], dtype=torch.float64)
        if not torch.allclose(pair[0], pair[1], rtol=0, atol=1e-4, equal_nan=True):  # NaN on one side differs
            problems.append(f"{key}: {got['eval_metrics'][key]} under SP, {want['eval_metrics'][key]} in one process")
    if got_weights.keys() != want_weights.keys():
        problems.append(f"trained parameters differ: {sorted(got_weights.keys() ^ want_weights.keys())}")
    for name in got_weights.keys() & want_weights.keys():
        try:
            torch.testing.assert_close(got_weights[name], want_weights[name], atol=WEIGHT_ATOL, rtol=0)
        except AssertionError as error:
            problems.append(f"weight {name}: {error}")
            break
    return "; ".join(problems) or None


def refusal_problem(case: dict, reason: str) -> str | None:
    """None when the case's parameters give ``reason`` for refusing it; else what is wrong."""
    if refused_for_its_parameters(reason, _eager_left(case)):
        return None
    return f"refused for a reason the case does not give: {reason}"


def verdict(case: dict, results: dict[int, str], world: int, out: str) -> str | None:
    """None when every rank's result is right for ``case``; else what is wrong. The ranks of different dp
    groups may refuse in their own words (e.g. each names its own left-padded row)."""
    refused = [r.removeprefix("refused: ") for r in results.values() if r.startswith("refused: ")]
    if len(results) == world and len(refused) == world:
        return next((p for p in (refusal_problem(case, reason) for reason in refused) if p), None)
    if len(results) != world or len(set(results.values())) != 1:
        return f"the ranks disagree or some are missing: {results}"
    return compare(case, out) if results[0] == "ok" else results[0]  # else the traceback


def failures(world: int, seed: int, results: dict[str, dict[int, str]], out: str) -> dict[str, str]:
    """``{index: what is wrong}`` over a run's cases (the whole run's failure under its own key)."""
    wrong = {key: str(results[key]) for key in ("<setup>", "<process>") if key in results}
    for index, per_rank in results.items():
        if index.isdigit():
            why = verdict(random_case(seed, int(index), world), per_rank, world, case_dir(out, seed, world, int(index)))
            if why is not None:
                wrong[index] = why
    return wrong


@pytest.mark.parametrize("world", sorted(COUNTS))
def test_random_trainer_cases_equal_one_process_or_are_refused_for_their_reason(world, tmp_path):
    results = run(world, 0, 0, COUNTS[world], str(tmp_path))
    wrong = failures(world, 0, results, str(tmp_path))
    assert not wrong, "\n\n".join(f"case {i} of seed 0 on {world} ranks: {why}" for i, why in wrong.items())
    assert sorted(results, key=int) == [str(i) for i in range(COUNTS[world])], sorted(results)
    ran = sum(per_rank[0] == "ok" for per_rank in results.values())
    assert ran >= COUNTS[world] // 2, f"only {ran} of {COUNTS[world]} cases ran: {results}"


def main(argv: list[str] | None = None) -> int:
    args = campaign_args("a campaign of random Trainer / SFTTrainer cases", argv)
    with tempfile.TemporaryDirectory() as out:
        results = run(args.world, args.seed, args.start, args.count, out)
        wrong = failures(args.world, args.seed, results, out)
    keys = sorted(results, key=lambda i: int(i) if i.isdigit() else -1)
    return print_campaign(keys, results, wrong, args)


if __name__ == "__main__":
    sys.exit(main())
