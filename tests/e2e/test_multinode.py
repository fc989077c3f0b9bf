"""Two "nodes" on one machine: two torchrun agents (c10d rendezvous) of 2 processes each, ulysses 2 x ring 2.

Each agent is started in its own process group and killed as a whole on timeout; the ranks' verdicts come back
as files written by tests/e2e/multinode_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.harness import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300  # seconds for both agents together
_LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def _agent(node: int, port: int, out_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"ulysses-sp-{port}",
        "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=120", "--max-restarts", "0",
        "-m", "tests.e2e.multinode_worker", str(out_dir),
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def test_two_nodes_ulysses_inside_ring_across(tmp_path):
    port = free_port()
    agents = [_agent(node, port, tmp_path) for node in (0, 1)]
    deadline, logs = time.monotonic() + TIMEOUT, []
    try:
        for agent in agents:
            logs.append(agent.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two torchrun agents did not finish in {TIMEOUT} s")
    finally:
        for agent in agents:  # only the agents this test started, with their ranks (own process groups)
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    output = "\n".join(f"--- agent {i}:\n{log[-4000:]}" for i, log in enumerate(logs))
    assert [agent.returncode for agent in agents] == [0, 0], output
    reports = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)}
    failed = {rank: r["error"] for rank, r in reports.items() if "error" in r}
    assert not failed, "\n".join(f"--- rank {rank}:\n{err}" for rank, err in failed.items())
    losses = {tuple(r["ok"]["losses"]) for r in reports.values()}
    assert len(losses) == 1, losses  # the same token-weighted loss on every rank
