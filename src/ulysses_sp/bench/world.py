"""Run a benchmark function on ``world`` gloo ranks (spawned processes) and collect what each returns.

``run_world(2, "ulysses_sp.bench.steptime:worker", params)`` starts two processes; each initialises the
default gloo group, calls ``worker(params)`` and writes its JSON-able result to a file; the parent returns
the list of results by rank. A rank that raises, dies or outlives ``timeout_s`` makes ``run_world`` raise
with that rank's traceback: a benchmark never hangs and never reports a partial world as a result.
"""

from __future__ import annotations

import datetime
import importlib
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

__all__ = ["free_port", "run_world", "spawn_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, target: str, params: dict[str, Any], outdir: str, origin: dict[str, Any]
) -> None:
    # the caller's environment, directory and import path as they are now (a forkserver's children would
    # otherwise see them as they were when the server started)
    os.environ.clear()
    os.environ.update(origin["environ"])
    os.chdir(origin["cwd"])
    sys.path[:] = origin["path"]
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

    torch.set_num_threads(max(1, params.get("threads_per_rank", 1)))
    try:
        from ulysses_sp.process_group import init_default_group

        init_default_group("gloo", datetime.timedelta(seconds=params.get("collective_timeout_s", 300)))
        module, name = target.split(":")
        result = {"ok": getattr(importlib.import_module(module), name)(params)}
    except Exception:  # reported to the parent
        result = {"error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(
    world: int, target: str, params: dict[str, Any], *, timeout_s: float, context: Any = None
) -> list[dict[str, Any]]:
    """Run ``target(params)`` on ``world`` spawned gloo ranks; one report per rank, never hanging.

    Each report is ``{"ok": result}``, ``{"error": traceback}`` (the target or the group setup raised) or
    ``{"died": why}`` (the process exited without reporting, or outlived ``timeout_s`` and was killed).
    ``params`` may set ``threads_per_rank`` (default 1) and ``collective_timeout_s`` (default 300). ``context``:
    the multiprocessing context that starts the ranks (default: spawn; a forkserver that preloads torch starts
    them without importing it again). Either way a rank sees this process's environment, directory and
    ``sys.path`` as they are at the call.
    """
    ctx = context if context is not None else mp.get_context("spawn")
    origin = {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world, port, target, params, outdir, origin)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        reports: list[dict[str, Any]] = []
        for rank, proc in enumerate(procs):
            path = os.path.join(outdir, f"rank{rank}.json")
            if not os.path.exists(path):
                why = f"timed out after {timeout_s:.0f} s" if rank in hung else f"died (exit code {proc.exitcode})"
                reports.append({"died": f"rank {rank} {why} before reporting"})
                continue
            with open(path) as handle:
                reports.append(json.load(handle))
        return reports


def run_world(world: int, target: str, params: dict[str, Any], *, timeout_s: float = 1800.0) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world`` gloo ranks; returns each rank's result.

    Raises RuntimeError with every failing rank's traceback (or why it died) when any rank did not succeed.
    """
    reports = spawn_ranks(world, target, params, timeout_s=timeout_s)
    errors = [
        report.get("died") or f"rank {rank}:\n{report['error']}"
        for rank, report in enumerate(reports)
        if "ok" not in report
    ]
    if errors:
        raise RuntimeError(f"{target} on {world} ranks failed:\n" + "\n".join(errors))
    return [report["ok"] for report in reports]
