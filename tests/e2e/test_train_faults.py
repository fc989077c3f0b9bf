"""End-to-end: ``ulysses-sp train`` under faults: a killed launcher, two runs in one folder, a damaged
checkpoint, SIGTERM (preemption), Ctrl-C, non-finite training, a full or read-only disk.

Each run is the real command as a subprocess on 2 CPU ranks (a run refused before any rank starts runs the
command's ``main`` in this process); every process a test started is accounted for (found through ``/proc`` as
the launcher's children, never by name) and must be gone when the test ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.e2e import train_cli_helpers as cli
from tests.e2e.train_cli_helpers import TINY
from ulysses_sp.train.checkpoint import checkpoint_name, list_checkpoints

pytestmark = pytest.mark.slow
corpus_file = cli.corpus_file  # the shared fixture: a jsonl of short and long Bible documents


def _names(output_dir: Path) -> list[str]:
    return [path.name for path in list_checkpoints(output_dir)]


def test_killed_launcher_lock_damaged_checkpoint_sigterm_and_ctrl_c(tmp_path, corpus_file):
    """One folder, four runs. (1) A run is paused at step 3; a second run into its folder is refused naming
    the first one's pid; SIGKILL of the first run's launcher alone takes its ranks along. (2) 4 KiB of flipped
    bytes in the newest checkpoint: --resume refuses it naming the file and the newest intact checkpoint.
    (3) SIGTERM to one rank only: every rank saves the same step, then the run exits 143. (4) Ctrl-C: one line,
    exit 130. No process of any run is left behind."""
    out = tmp_path / "run"
    base = [*TINY, "--dataset", str(corpus_file), "--max-steps", "300", "--eval-every", "0"]
    base += ["--keep-last", "0", "--output-dir", str(out)]

    # 1. the first run pauses after step 3 (before its save): checkpoints 1 and 2 are complete
    first = cli.start_cli(
        [*base, "--save-every", "1"], cli.cli_env(ULYSSES_SP_TEST_FAULT="pause:3"), stdout=subprocess.DEVNULL
    )
    try:
        cli.wait_for_step(out, 3, first)
        ranks = cli.rank_pids(first.pid)
        lines_before = (out / "metrics.jsonl").read_text()
        second = cli.refuse_in_process([*base, "--resume"])
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr and "--output-dir" in second.stderr, second.stderr
        assert (out / "metrics.jsonl").read_text() == lines_before  # the refused run wrote nothing
        os.kill(first.pid, signal.SIGKILL)  # the launcher alone (an OOM kill): its ranks must not train on
        first.wait(timeout=30)
        cli.assert_gone(ranks)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert _names(out) == [checkpoint_name(1), checkpoint_name(2)]

    # 2. a damaged checkpoint is named, with the newest intact one to use instead
    weights = out / checkpoint_name(2) / "model.safetensors"
    original = weights.read_bytes()
    middle = len(original) // 2
    flipped = bytes(b ^ 0xFF for b in original[middle : middle + 4096])
    weights.write_bytes(original[:middle] + flipped + original[middle + 4096 :])
    damaged = cli.refuse_in_process([*base, "--resume"])
    assert damaged.returncode == 2, damaged.stderr
    assert "model.safetensors" in damaged.stderr and checkpoint_name(2) in damaged.stderr, damaged.stderr
    assert f"--resume {out / checkpoint_name(1)}" in damaged.stderr and "Traceback" not in damaged.stderr
    weights.write_bytes(original)

    # 3. SIGTERM reaches rank 1 only: both ranks agree on the step, save it together and stop
    third = cli.start_cli([*base, "--resume", "--save-every", "0"], cli.cli_env())
    try:
        cli.wait_for_step(out, 5, third)
        ranks = cli.rank_pids(third.pid)
        os.kill(ranks[1], signal.SIGTERM)
        stdout, stderr = third.communicate(timeout=cli.TIMEOUT)
        assert third.returncode == 143, stdout + stderr
        cli.assert_gone(ranks)
    finally:
        if third.poll() is None:
            os.killpg(third.pid, signal.SIGKILL)
    last = cli.records(out)[-1]["step"]
    assert last >= 5 and _names(out)[-1] == checkpoint_name(last), (last, _names(out))
    assert "SIGTERM" in stdout + stderr and "--resume" in stdout + stderr
    saved = out / checkpoint_name(last)
    assert (saved / "rank-00000.pt").is_file() and (saved / "rank-00001.pt").is_file()

    # 4. Ctrl-C (SIGINT to the launcher, as a terminal sends it): one line, status 130, nothing left running
    fourth = cli.start_cli([*base, "--resume", "--save-every", "0"], cli.cli_env())
    try:
        cli.wait_for_step(out, last + 2, fourth)
        ranks = cli.rank_pids(fourth.pid)
        os.kill(fourth.pid, signal.SIGINT)
        _, stderr = fourth.communicate(timeout=60)
        assert fourth.returncode == 130, stderr
        assert len([line for line in stderr.splitlines() if line.strip()]) <= 2, stderr
        cli.assert_gone(ranks)
    finally:
        if fourth.poll() is None:
            os.killpg(fourth.pid, signal.SIGKILL)


@pytest.mark.parametrize("text", ["seq_len: [\n", "- 128\n"])
def test_an_unverified_checkpoint_with_a_damaged_config_is_one_line(text, tmp_path):
    """A checkpoint without checksums.sha256 (resumed unverified) whose config.yaml is no YAML mapping: one line
    naming the file, before any rank starts (it was a YAML ParserError's or an AttributeError's traceback)."""
    checkpoint = tmp_path / checkpoint_name(3)
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "config.yaml").write_text(text)
    result = cli.refuse_in_process([*TINY, "--output-dir", str(tmp_path), "--resume"])
    assert result.returncode == 2, result.stderr
    assert f"{checkpoint / 'config.yaml'} cannot be read" in cli.error_lines(result)[-1], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_non_finite_training_stops_without_saving_non_finite_weights(tmp_path, corpus_file):
    """A learning rate far too large: steps whose loss or gradient norm is not finite are skipped and counted;
    past --max-skipped-steps the run stops (exit 1, one line naming the flag); no checkpoint holds a
    non-finite weight."""
    out = tmp_path / "nan"
    args = [*TINY, "--dataset", str(corpus_file), "--max-steps", "8", "--eval-every", "0", "--output-dir", str(out)]
    args += ["--lr", "1e30", "--warmup-steps", "0", "--save-every", "1", "--keep-last", "0", "--max-skipped-steps", "1"]
    result = cli.run_cli(args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--max-skipped-steps" in result.stderr and "not finite" in result.stderr, result.stderr
    assert len(cli.error_lines(result)) <= 2 and "Traceback" not in result.stderr, result.stderr
    skipped = [r for r in cli.records(out) if r.get("skipped")]  # strict JSON: null, the spelling in non_finite
    assert len(skipped) == 2 and all(r["non_finite"] for r in skipped), cli.records(out)
    for record in skipped:  # the progress line still shows the value
        if "loss" in record["non_finite"]:
            assert f"step {record['step']}/8  loss {record['non_finite']['loss']}" in result.stdout, result.stdout
    assert cli.records(out)[-1]["step"] < 8
    assert list_checkpoints(out), "the good steps before the blow-up were saved"
    for path in list_checkpoints(out):
        for name, tensor in load_file(path / "model.safetensors").items():
            assert tensor.isfinite().all(), f"{path.name}: {name} is not finite"


def _namespace_prefix(mount_options: str, directory: Path) -> list[str]:
    """Run the command in a user + mount namespace with a small tmpfs at ``directory`` (skip where the
    machine does not allow it): a real full or read-only filesystem, without root on the host."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("user namespaces (unshare -rm) are not available here")
    directory.mkdir(parents=True, exist_ok=True)
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" && shift 2 && exec "$@"'
    return ["unshare", "-rm", "sh", "-c", script, "sh", mount_options, str(directory)]


def test_a_full_or_read_only_disk_is_one_line(tmp_path, corpus_file):
    """A filesystem that fills up at the first checkpoint: one line naming 'No space left on device' and the
    directory (not 183 lines of tracebacks). A read-only --output-dir: refused before any rank starts."""
    full = tmp_path / "full"
    args = [*TINY, "--dataset", str(corpus_file), "--max-steps", "2", "--eval-every", "0", "--output-dir", str(full)]
    result = cli.run_cli(args, prefix=_namespace_prefix("size=6m", full))
    assert result.returncode == 1, result.stderr
    assert "No space left on device" in result.stderr and str(full) in result.stderr, result.stderr
    assert len(cli.error_lines(result)) <= 2 and "Traceback" not in result.stderr, result.stderr

    read_only = tmp_path / "read-only"
    args[-1] = str(read_only)
    result = cli.run_cli(args, prefix=_namespace_prefix("ro,size=1m", read_only))
    assert result.returncode == 2, result.stderr
    assert "--output-dir" in result.stderr and "Read-only file system" in result.stderr, result.stderr
    assert len(cli.error_lines(result)) <= 2 and "Traceback" not in result.stderr, result.stderr


def test_sigterm_to_the_launcher_then_resume_keeps_every_held_out_loss(tmp_path, corpus_file):
    """SIGTERM to the launcher alone (``kill PID``): every rank saves the agreed step and the run exits 143. The
    save skips that step's held-out loss (it is due at every step here, --eval-every 1); the resumed run computes
    it first, so its metrics hold every held-out loss of the uninterrupted run, once each (they used to lack the
    stopped step's), and the same losses and weights."""
    common = [*TINY, "--dataset", str(corpus_file), "--max-steps", "5", "--eval-every", "1", "--save-every", "0"]
    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    cli.ok(cli.run_cli([*common, "--output-dir", str(reference)]))
    run = cli.start_cli([*common, "--output-dir", str(stopped)], cli.cli_env(), stdout=subprocess.DEVNULL)
    try:
        cli.wait_for_step(stopped, 2, run)
        ranks = cli.rank_pids(run.pid)
        os.kill(run.pid, signal.SIGTERM)
        run.wait(timeout=cli.TIMEOUT)
        assert run.returncode == 143, run.stderr.read()
        cli.assert_gone(ranks)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    last = cli.records(stopped)[-1]["step"]
    assert last < 5 and _names(stopped) == [checkpoint_name(last)]
    cli.ok(cli.run_cli([*common, "--output-dir", str(stopped), "--resume"]))
    for event, key in (("train", "loss"), ("eval", "eval_loss")):
        got = [(r["step"], r[key]) for r in cli.records(stopped, event)]
        assert got == [(r["step"], r[key]) for r in cli.records(reference, event)], (event, got)
    final = load_file(stopped / checkpoint_name(5) / "model.safetensors")
    for name, tensor in load_file(reference / checkpoint_name(5) / "model.safetensors").items():
        assert tensor.equal(final[name]), name


@pytest.mark.parametrize(("signum", "flags"), [(signal.SIGHUP, []), (signal.SIGTERM, ["--no-save-on-sigterm"])])
def test_a_signal_that_saves_nothing_ends_a_one_process_run_with_one_line(signum, flags, tmp_path, corpus_file):
    """--nproc 1 trains in the command's own process: a SIGHUP (the terminal closed), or a SIGTERM that is not to
    save, ends it as it ends a run of several ranks, with one line naming the signal and status 128 + the signal
    (it ended in silence, killed by the signal), its metrics file whole and no checkpoint."""
    one = [*TINY[: TINY.index("--nproc")], "--nproc", "1", "--sp", "1", "--log-every", "1"]
    out = tmp_path / "one"
    args = [*one, "--dataset", str(corpus_file), "--max-steps", "300", "--eval-every", "0", "--output-dir", str(out)]
    run = cli.start_cli([*args, "--save-every", "0", *flags], cli.cli_env(), stdout=subprocess.DEVNULL)
    try:
        cli.wait_for_step(out, 2, run)
        os.kill(run.pid, signum)
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 128 + signum, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ulysses-sp train: stopped by {signum.name}"), stderr
    assert cli.records(out)[-1]["step"] >= 2 and not _names(out)
