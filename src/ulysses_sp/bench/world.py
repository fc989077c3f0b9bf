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
import tempfile
import time
import traceback
from typing import Any

__all__ = ["run_world"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, target: str, params: dict[str, Any], outdir: str) -> None:
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
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=params.get("collective_timeout_s", 300)))
        module, name = target.split(":")
        result = {"ok": getattr(importlib.import_module(module), name)(params)}
    except Exception:  # reported to the parent, which raises with it
        result = {"error": traceback.format_exc()}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_world(world: int, target: str, params: dict[str, Any], *, timeout_s: float = 1800.0) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world`` gloo ranks; returns each rank's result."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, target, params, outdir)) for r in range(world)]
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
        results, errors = [], []
        for rank, proc in enumerate(procs):
            path = os.path.join(outdir, f"rank{rank}.json")
            if not os.path.exists(path):
                why = f"timed out after {timeout_s:.0f} s" if rank in hung else f"died (exit code {proc.exitcode})"
                errors.append(f"rank {rank} {why}")
                continue
            with open(path) as handle:
                result = json.load(handle)
            if "error" in result:
                errors.append(f"rank {rank}:\n{result['error']}")
            results.append(result.get("ok"))
        if errors:
            raise RuntimeError(f"{target} on {world} ranks failed:\n" + "\n".join(errors))
        return results
