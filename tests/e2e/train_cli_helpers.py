"""Helpers for the end-to-end tests of ``ulysses-sp train``: start the command as a subprocess, read its
metrics, find and wait for the processes it started (only those: never by name)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

from ulysses_sp.train.documents import load_bible

TIMEOUT = 240  # seconds for any one command
TINY = ["--model", "llama-tiny", "--seq-len", "256", "--nproc", "2", "--sp", "2", "--log-every", "1"]
_LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")


def cli_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's or test fault's variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")}
    env = {k: v for k, v in env.items() if not k.startswith("ULYSSES_SP_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env


def train_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ulysses_sp", "train", *args]


def start_cli(
    args: list[str], env: dict[str, str], stdout: int = subprocess.PIPE, prefix: list[str] | None = None
) -> subprocess.Popen:
    """Start the command in its own process group (so a test can kill the launcher and all its ranks)."""
    command = [*(prefix or []), *train_command(args)]
    return subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_cli(
    args: list[str], timeout: float = TIMEOUT, prefix: list[str] | None = None, **env: str
) -> subprocess.CompletedProcess:
    """Run the command to completion (killed as a whole on timeout)."""
    process = start_cli(args, cli_env(**env), prefix=prefix)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"ulysses-sp train {' '.join(args)} did not finish in {timeout} s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


class _RanksStarted(AssertionError):
    """Raised in place of starting ranks by :func:`refuse_in_process`."""


def _no_ranks(*args, **kwargs):
    raise _RanksStarted("the command went on to train instead of refusing the run")


class _RanksNotStarted:
    """Stands in for :class:`~ulysses_sp.train.launch.LocalRanks`, which starts its ranks before the run is
    resolved: none is started here, and handing them a spec (the run was not refused) fails the test."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self) -> _RanksNotStarted:
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    train = staticmethod(_no_ranks)


def main_in_process(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """``ulysses-sp ARGV`` run by the console script's own ``main`` in this process with :func:`cli_env` (its exit
    status and output as a subprocess gives them), without the seconds a new interpreter spends importing torch
    and transformers. An exception other than the command's exit propagates, traceback and all."""
    from ulysses_sp.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, cli_env(**env), clear=True))
        stack.enter_context(contextlib.redirect_stdout(out))
        stack.enter_context(contextlib.redirect_stderr(err))
        try:
            status = main(argv)
        except SystemExit as exit_:  # argparse's exit on a bad flag
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "ulysses_sp", *argv], status, out.getvalue(), err.getvalue()
    )


def refuse_in_process(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``ulysses-sp train ARGS`` by :func:`main_in_process`, for a run the command must refuse before any rank
    trains: no rank process is started here, and going on to train fails the test."""
    with (
        mock.patch("ulysses_sp.train.launch.LocalRanks", _RanksNotStarted),
        mock.patch("ulysses_sp.train.run.run_rank", _no_ranks),
    ):
        return main_in_process(["train", *args], **env)


def records(output_dir: Path, event: str = "train") -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(line, parse_constant=_not_strict) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if r["event"] == event]


def _not_strict(name: str) -> None:
    raise AssertionError(f"metrics.jsonl holds {name}, which is not strict JSON (non-finite values are null)")


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    """A jsonl of Bible text: 24 single verses (far shorter than 256 tokens) and 6 chapters (longer).
    A fixture: a test module imports it by name."""
    books = load_bible()
    documents = [book.split("\n")[3] for book in books[:24]]  # one verse each
    documents += ["\n".join(book.split("\n")[:40]) for book in books[30:36]]  # the title and ~40 verses
    path = tmp_path_factory.mktemp("data") / "bible.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return path


def wait_for_step(output_dir: Path, step: int, process: subprocess.Popen, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in records(output_dir)):
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before step {step}: {process.stderr.read()}")
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"step {step} did not appear in {timeout} s")


# --- the processes a run started ---------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def rank_pids(launcher_pid: int, expected: int = 2, timeout: float = 30) -> dict[int, int]:
    """``{rank: pid}`` of the ranks that the launcher ``launcher_pid`` started (its children with ``RANK``)."""
    deadline = time.monotonic() + timeout
    ranks: dict[int, int] = {}
    while time.monotonic() < deadline:
        ranks = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                    continue
                environ = (entry / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError, IndexError):
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = int(entry.name)
        if len(ranks) == expected:
            return ranks
        time.sleep(0.1)
    pytest.fail(f"found ranks {ranks} of launcher {launcher_pid}, expected {expected}")


def assert_gone(pids: list[int] | dict[int, int], timeout: float = 15) -> None:
    """Every process in ``pids`` ends within ``timeout`` s (else they are killed and the test fails)."""
    pids = list(pids.values()) if isinstance(pids, dict) else list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} of the run were still alive {timeout} s after it ended"
