"""benchmarks/gpu_session.sh: the prepared script of GPU checks (its steps run here only as far as a CPU allows)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
STEPS = ["env", "cpuchunks", "tests", "validation", "packed", "loss", "kernels", "lora"]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, *args: str, dry: bool = False) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # python3: this one
        "GPU_SESSION_WORK": str(tmp_path / "work"),
        "GPU_SESSION_DRY_RUN": "1" if dry else "0",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_every_step_names_a_script_and_flags_that_exist(tmp_path):
    """The dry run lists every step in order with its limit; each Python script it calls exists and defines every
    flag the step passes it (a renamed flag would waste a GPU lease on an argparse error)."""
    done = _run(tmp_path, dry=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == STEPS, lines
    assert not (tmp_path / "out").exists()  # a dry run makes nothing
    scripts = 0
    for line in lines:
        for path, flags in re.findall(r"python3 (\S+\.py)((?: \S+)*)", line):
            source = Path(path).read_text()
            for flag in re.findall(r"(--[a-z][a-z-]*)", flags):
                assert f'"{flag}"' in source, (path, flag)
            scripts += 1
    assert scripts == 6, lines
    listed = re.findall(rf"{ROOT}/tests/gpu/(test_\w+\.py)", done.stdout)  # in the order they should run
    assert sorted(listed) == sorted(p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")), listed


def test_limits_can_be_set_per_step_and_bad_steps_are_refused_before_any_runs(tmp_path):
    done = _run(tmp_path, "tests=120", "loss", dry=True)
    assert done.returncode == 0 and done.stdout.startswith("tests (120 s): ") and "loss (60 s): " in done.stdout
    for args, message in [
        (("env", "gpu"), "unknown step 'gpu'"),
        (("env", "tests=2m"), "step 'tests=2m': the limit after '=' must be a whole number of seconds"),
    ]:
        done = _run(tmp_path, *args)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()  # nothing ran, not even the good step before it
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "usage:" in done.stderr


def test_a_step_runs_logs_and_is_packed(tmp_path):
    """A real run of the env step (no GPU here: nvidia-smi's failure is logged, the versions still printed)."""
    done = _run(tmp_path, "env=60")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert "== env (60 s): " in log and re.search(r"== env: exit \d+ after \d+ s", log), log
    with tarfile.open(tmp_path / "out" / "gpu_session.tgz") as packed:
        names = packed.getnames()
        assert "./env.log" in names, names
        text = packed.extractfile("./env.log").read().decode()
    import torch

    assert torch.__version__ in text, text


def _run_with_stand_in(
    tmp_path: Path, source: str, *args: str, tools: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The script run with ``args``, a stand-in ``python3`` on the PATH running ``source`` (with the step's
    arguments) in place of every Python command; ``tools``: more stand-in commands, name -> sh script body."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "stand_in.py").write_text(source)
    scripts = {"python3": f'exec "{sys.executable}" "{tmp_path / "stand_in.py"}" "$@"', **(tools or {})}
    for name, body in scripts.items():
        fake = bin_dir / name
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "GPU_SESSION_WORK": str(tmp_path / "work"),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), *args], env=env, capture_output=True, text=True, timeout=60
    )


_INTERRUPTIBLE = """
import sys, time
print("started", flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:  # as pytest is interrupted: it then prints its failures, durations and junit XML
    print("interrupted: the summary is written", flush=True)
    sys.exit(2)
"""


def test_a_step_at_its_limit_is_interrupted_so_its_summary_is_kept(tmp_path):
    """A step that reaches its time limit gets SIGINT (pytest then still prints the failures' tracebacks and writes
    its junit XML; under SIGTERM it died with only its progress dots, as the first lease's tests step did). Here a
    stand-in ``python3`` on the PATH waits for the interrupt in place of the tests step's pytest."""
    done = _run_with_stand_in(tmp_path, _INTERRUPTIBLE, "tests=3")
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    assert re.search(r"== tests: exit 124 after \d+ s \(time limit\)", log), log
    step_log = (tmp_path / "work" / "tests.log").read_text()
    assert "started" in step_log and "interrupted: the summary is written" in step_log, step_log


_SLOW_IF_BENCH = """
import sys, time
if any("head_chunk_ratio" in arg for arg in sys.argv):
    time.sleep(3)
print("ran", *sys.argv[1:2], flush=True)
"""


def test_a_step_with_a_plus_runs_in_the_background_and_is_waited_for(tmp_path):
    """``+cpuchunks`` starts while the next steps run (its exit line comes after theirs) and the script waits for it:
    its log is in the pack. On 8 cores the background step gets cores 4-7 and the steps after it 0-3. Stand-ins: a
    ``python3`` that sleeps for the bench script only, ``nproc`` saying 8, ``taskset`` noting the cores it was given."""
    pinned = tmp_path / "pinned.txt"
    tools = {"nproc": "echo 8", "taskset": f'echo "$2" >> "{pinned}"; shift 2; exec "$@"'}
    done = _run_with_stand_in(tmp_path, _SLOW_IF_BENCH, "+cpuchunks=30", "env=30", tools=tools)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "out" / "session.log").read_text()
    exits = re.findall(r"== (\w+): exit 0 after", log)
    assert exits == ["env", "cpuchunks"], log
    with tarfile.open(tmp_path / "out" / "gpu_session.tgz") as packed:
        text = packed.extractfile("./cpuchunks.log").read().decode()
    assert "ran" in text and "head_chunk_ratio.py" in text, text
    assert "== cpuchunks (30 s, in the background, on cores 4-7): " in log and "== env (30 s, on cores 0-3): " in log
    assert sorted(pinned.read_text().split()) == ["0-3", "4-7"], pinned.read_text()
