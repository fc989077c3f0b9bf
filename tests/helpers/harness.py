"""Run a function on several gloo ranks (spawned processes) and collect per-case results, never hanging.

One spawn per world size runs many cases: ``run_world(4, "tests.dist.cases_core:world4")`` starts four
processes, each calls the target ``fn()`` which returns ``{case: "ok" | traceback}``; the parent returns
``{case: {rank: result}}``. A process that dies or outlives ``timeout`` is reported, not waited on forever.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, target: str, outdir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict[str, str] = {}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
        module, name = target.split(":")
        results = getattr(importlib.import_module(module), name)()
    except Exception:  # report the failure to the parent instead of dying silently
        results["<setup>"] = traceback.format_exc()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(world: int, target: str, timeout: float = 900.0) -> dict[str, dict[int, str]]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, target, outdir)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        merged: dict[str, dict[int, str]] = {}
        for r in range(world):
            path = os.path.join(outdir, f"rank{r}.json")
            if not os.path.exists(path):
                why = "timed out" if r in hung else f"died with exit code {procs[r].exitcode}"
                merged.setdefault("<process>", {})[r] = f"rank {r} {why} before reporting"
                continue
            with open(path) as f:
                for case, result in json.load(f).items():
                    merged.setdefault(case, {})[r] = result
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
