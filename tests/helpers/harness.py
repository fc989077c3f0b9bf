"""Run a function on several gloo ranks (spawned processes) and collect per-case results, never hanging.

One spawn per world size runs many cases: ``run_world(4, "tests.dist.cases_core:world4")`` starts four
processes, each calls the target ``fn()`` which returns ``{case: "ok" | traceback}``; the parent returns
``{case: {rank: result}}``. A process that dies or outlives ``timeout`` is reported, not waited on forever.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

from ulysses_sp.bench.world import free_port, spawn_ranks

__all__ = ["assert_case", "campaign_args", "dist_suite", "free_port", "print_campaign", "run_cases", "run_world"]


# what every rank of the suites imports: a forkserver that holds them starts a rank in well under a second
# instead of the seconds a fresh interpreter spends importing torch and transformers (module state that those
# libraries read from the environment at import is the suite's own, as it is for the tests in this process)
_PRELOAD = ["torch", "torch.distributed", "transformers", "ulysses_sp.model", "tests.helpers.models"]


@functools.cache
def rank_context() -> Any:
    """The multiprocessing context that starts the ranks of :func:`run_world`: a forkserver preloading
    ``_PRELOAD``, started once per test session (it runs nothing else, so forking it is safe)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _call(params: dict[str, Any]) -> dict[str, str]:
    """On each rank: call ``params["target"]()`` (a case function of the suites, which takes no arguments)."""
    module, name = params["target"].split(":")
    return getattr(importlib.import_module(module), name)()


def run_world(world: int, target: str, timeout: float = 900.0) -> dict[str, dict[int, str]]:
    """``{case: {rank: "ok" | traceback}}`` from ``target()`` on ``world`` gloo ranks (1 thread each).

    A rank whose setup raised is reported under ``"<setup>"``, one that died or timed out under ``"<process>"``.
    """
    params = {"target": target, "threads_per_rank": 1, "collective_timeout_s": 90}
    reports = spawn_ranks(world, "tests.helpers.harness:_call", params, timeout_s=timeout, context=rank_context())
    merged: dict[str, dict[int, str]] = {}
    for rank, report in enumerate(reports):
        if "died" in report:
            merged.setdefault("<process>", {})[rank] = report["died"]
        elif "error" in report:
            merged.setdefault("<setup>", {})[rank] = report["error"]
        else:
            for case, result in report["ok"].items():
                merged.setdefault(case, {})[rank] = result
    return merged


def run_cases(cases: dict[str, Callable[[], None]]) -> dict[str, str]:
    """Run each case on this rank; 'ok' or the traceback. A barrier after each keeps ranks in step."""
    import torch.distributed as dist

    results = {}
    for name, case in cases.items():
        try:
            case()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
        if dist.is_initialized():
            dist.barrier()
    return results


def assert_case(results: dict[str, dict[int, str]], case: str, world: int) -> None:
    """Fail with every rank's traceback unless the case passed on all ranks."""
    if "<setup>" in results or "<process>" in results:
        raise AssertionError(f"the {world}-rank run failed: {results.get('<setup>') or results.get('<process>')}")
    per_rank = results.get(case)
    assert per_rank is not None, f"case {case!r} did not run; ran: {sorted(results)}"
    failed = {r: msg for r, msg in per_rank.items() if msg != "ok"}
    assert not failed and len(per_rank) == world, "\n".join(f"--- rank {r}:\n{m}" for r, m in failed.items())


def dist_suite(cases_module: str, worlds: dict[int, list[str]]):
    """The pytest side of a multi-rank case module: ``(results, test_case, test_every_worker_case_is_checked)``.

    Assign the three to module globals of a test file. Each world size in ``worlds`` is spawned once, on first
    use, running ``{cases_module}:world{N}``; one test per listed case; and a test that fails when a worker
    ran a case that is not listed (it would otherwise pass unseen).
    """
    import pytest

    @pytest.fixture(scope="module")
    def results():
        runs: dict[int, dict[str, dict[int, str]]] = {}

        def get(world: int) -> dict[str, dict[int, str]]:
            if world not in runs:
                runs[world] = run_world(world, f"{cases_module}:world{world}")
            return runs[world]

        return get

    @pytest.mark.parametrize("world,case", [(w, c) for w, cases in worlds.items() for c in cases])
    def test_case(results, world, case):
        assert_case(results(world), case, world)

    @pytest.mark.parametrize("world", sorted(worlds))
    def test_every_worker_case_is_checked(results, world):
        listed = set(worlds[world])
        assert set(results(world)) == listed, set(results(world)) ^ listed

    return results, test_case, test_every_worker_case_is_checked


def refused_for_its_parameters(reason: str, eager_left: bool) -> bool:
    """Whether ``reason`` (a ValueError's text) is one a random case's parameters give for refusing it: heads or
    head chunks that do not split over the ranks, or (``eager_left``: the case left-pads rows under an eager
    model) a query that sees no key."""
    split = "do not split over" in reason or "does not split" in reason
    return split or (eager_left and "starts with padding, and" in reason)


def campaign_args(description: str, argv: list[str] | None, count: int = 20):
    """The command line of a random campaign: ``--world 2|4 --seed S --start I --count N``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--world", type=int, choices=(2, 4), default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=count)
    return parser.parse_args(argv)


def print_campaign(keys: list[str], results: dict[str, dict[int, str]], wrong: dict[str, str], args) -> int:
    """One line per case (in the order of ``keys``: what failed, else rank 0's result) and a count; 1 if any failed."""
    for key in keys:
        status = f"FAILED {wrong[key]}" if key in wrong else results[key][0].splitlines()[0][:160]
        print(f"case {key}: {status}", flush=True)
    print(f"{len(wrong)} of {len(results)} failed (seed {args.seed}, world {args.world})")
    return 1 if wrong else 0
