"""``spawn_ranks`` started by a forkserver (as the multi-rank suites start their ranks): a rank sees the caller's
environment, working directory and import path as they are at the call, not as they were when the server
started (the suites pass settings to their ranks through the environment)."""

from __future__ import annotations

from multiprocessing import forkserver

from tests.helpers.harness import rank_context
from ulysses_sp.bench.world import spawn_ranks

PROBE = """
import os, sys


def worker(params):
    return {"mark": os.environ.get("ULYSSES_SP_WORLD_PROBE"), "cwd": os.getcwd(), "path": sys.path[0],
            "rank": os.environ["RANK"]}
"""


def test_a_forkserver_rank_sees_the_callers_environment_directory_and_path(tmp_path, monkeypatch):
    context = rank_context()
    forkserver.ensure_running()  # the server runs before the settings below change
    (tmp_path / "world_probe.py").write_text(PROBE)
    monkeypatch.setenv("ULYSSES_SP_WORLD_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    reports = spawn_ranks(2, "world_probe:worker", {}, timeout_s=120, context=context)
    expected = {"mark": "set after the server started", "cwd": str(tmp_path), "path": str(tmp_path)}
    assert reports == [{"ok": {**expected, "rank": str(rank)}} for rank in range(2)], reports
