"""The parts around a run in one process: the output directory's lock and checks, the refusal of an earlier
run's files, the resolved RunSpec, one-line errors, the rank's signals, tracking and the loss curve."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal

import pytest
import torch
import yaml

from ulysses_sp.train.config import TrainConfig, config_to_dict, load_config
from ulysses_sp.train.errors import disk_error, read_rank_errors, report_error
from ulysses_sp.train.lifeline import RankSignals
from ulysses_sp.train.metrics import read_metrics
from ulysses_sp.train.outdir import OutputDirLock, prepare_output_dir, previous_run_files, remove_previous_run
from ulysses_sp.train.runspec import RunSpec, check_same_model_and_data, resolve_run, resume_point
from ulysses_sp.train.tracking import make_reporter, write_loss_curve


def test_one_run_at_a_time_and_the_lock_never_sticks(tmp_path):
    first = OutputDirLock(tmp_path, wait_s=0)
    with pytest.raises(ValueError, match=rf"in use by another ulysses-sp train run \(pid {os.getpid()} on "):
        OutputDirLock(tmp_path, wait_s=0.2)  # a second open file description: flock refuses it
    first.release()
    with OutputDirLock(tmp_path, wait_s=0) as again:
        assert again.fileno() >= 0


def test_output_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="--output-dir .*file.* is not a directory"):
        prepare_output_dir(str(tmp_path / "file" / "run"))
    assert prepare_output_dir(str(tmp_path / "new" / "run")).is_dir()


def test_a_fresh_run_refuses_an_earlier_runs_files_unless_overwrite(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path))
    assert resume_point(config) is None and previous_run_files(tmp_path, config) == []
    # a run that failed before its first record (a bad --attn-core in the ranks) left an empty metrics file, and
    # the same command with the flag mended was refused ("already holds an earlier run's files (metrics.jsonl)")
    (tmp_path / "metrics.jsonl").write_text("")
    assert resume_point(config) is None and previous_run_files(tmp_path, config) == []
    (tmp_path / "metrics.jsonl").write_text('{"event": "train", "step": 1}\n')
    (tmp_path / "tensorboard").mkdir()
    with pytest.raises(ValueError, match=r"metrics\.jsonl.*--resume.*--overwrite"):
        resume_point(config)
    assert resume_point(TrainConfig(output_dir=str(tmp_path), resume=True)) is None  # nothing to resume: fresh
    overwrite = TrainConfig(output_dir=str(tmp_path), overwrite=True)
    assert resume_point(overwrite) is None
    assert {p.name for p in remove_previous_run(tmp_path, overwrite)} == {"metrics.jsonl", "tensorboard"}
    assert previous_run_files(tmp_path, config) == []


def test_resume_from_another_folder_into_one_that_holds_another_run_is_refused(tmp_path):
    """--resume runA/checkpoint-1 --output-dir runB moved runB's own newer checkpoints aside and appended runA's
    continuation to runB's metrics.jsonl: two runs' histories in one folder."""
    run_a, run_b = tmp_path / "runA", tmp_path / "runB"
    checkpoint = run_a / "checkpoint-0000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 1}')
    (run_b / "checkpoint-0000004").mkdir(parents=True)
    (run_b / "checkpoint-0000004" / "trainer_state.json").write_text('{"step": 4}')
    into_b = TrainConfig(output_dir=str(run_b), resume=str(checkpoint))
    with pytest.raises(ValueError, match=r"holds another run's files \(checkpoint-0000004\).*empty --output-dir"):
        resume_point(into_b)
    (run_b / "checkpoint-0000004" / "trainer_state.json").unlink()  # runB holds no run: resuming into it is fine
    assert resume_point(into_b) == checkpoint
    assert resume_point(TrainConfig(output_dir=str(run_a), resume=str(checkpoint))) == checkpoint  # its own folder


def test_the_run_spec_is_resolved_once_and_travels_as_json(tmp_path):
    config = load_config(["--output-dir", str(tmp_path), "--seq-len", "256", "--report-to", "wandb"])
    spec = resolve_run(config, world_size=2)
    assert (spec.config.nproc, spec.config.tokenizer, spec.config.lr, spec.ring) == (2, "gpt2-bpe", 1e-2, 1)
    assert spec.resume_from is None and spec.model_source is None
    if spec.config.report_to == "none":  # wandb is not a test dependency: skipped with a note, not an error
        assert "wandb" in spec.notes[0] and "pip install" in spec.notes[0]
    again = RunSpec.load(spec.save(tmp_path / "run.json"))
    assert again == spec and again.model_config().to_dict() == spec.model_config().to_dict()
    assert spec.model_config().num_attention_heads == 4
    with pytest.raises(ValueError, match="--tokenizer: .*no such directory"):
        resolve_run(TrainConfig(output_dir=str(tmp_path), tokenizer=str(tmp_path / "none")), world_size=2)
    data = tmp_path / "docs.json"  # a --text-field the dataset lacks: refused here, before any rank starts
    data.write_text(json.dumps([{"body": "In the beginning", "id": 1}]))
    with pytest.raises(ValueError, match=r"docs.json row 1 has no --text-field 'text' \(it holds \['body', 'id'\]\)"):
        resolve_run(TrainConfig(output_dir=str(tmp_path), dataset=str(data)), world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals are of a machine without CUDA")
def test_a_core_that_cannot_train_here_is_refused_before_any_rank_starts(tmp_path):
    """`ulysses-sp train --attn-core flex` on CPU started its ranks, which failed at the first backward with torch's
    traceback ("FlexAttention does not support backward on CPU", exit 1); --attn-core flash without flash_attn failed
    in the ranks, telling a command-line user to "use core='sdpa'"."""
    flex = TrainConfig(output_dir=str(tmp_path), seq_len=256, attn_core="flex")
    with pytest.raises(
        ValueError,
        match=r"^--attn-core flex: core 'flex_attention' cannot train on a cpu .* use --attn-core sdpa to train",
    ):
        resolve_run(flex, world_size=2)
    if importlib.util.find_spec("flash_attn") is None:
        flash = TrainConfig(output_dir=str(tmp_path), seq_len=256, attn_core="flash")
        with pytest.raises(ValueError, match=r"^--attn-core flash: core 'flash_attention_2' needs .*--attn-core sdpa$"):
            resolve_run(flash, world_size=2)


def test_a_built_in_model_name_is_the_shape_even_beside_a_run_folder_of_that_name(tmp_path, monkeypatch):
    """`ulysses-sp train --output-dir llama-tiny` leaves a run folder named as the default --model; every later run
    from that directory (a fresh one elsewhere, or `--resume` of that one) was refused as "--model names a run's
    --output-dir". A built-in name means the shape, and a resume takes its model from the checkpoint."""
    checkpoint = tmp_path / "llama-tiny" / "checkpoint-0000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 2}')
    monkeypatch.chdir(tmp_path)
    spec = resolve_run(load_config(["--output-dir", str(tmp_path / "other"), "--seq-len", "256"]), world_size=2)
    assert spec.config.model == "llama-tiny" and spec.model_source is None


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            {"model": "llama-small"},
            "--model 'llama-small' differs from the model of .*'llama-tiny'.*--model llama-tiny",
        ),
        ({"seed": 7}, "--seed 1234 -> 7"),
        ({"pack": False}, "--pack True -> False"),
        ({"eval_fraction": 0.2}, "--eval-fraction 0.05 -> 0.2"),
        ({"text_field": "body"}, "--text-field 'text' -> 'body'"),
    ],
)
def test_a_resume_under_another_model_or_other_documents_is_refused(tmp_path, change, needle):
    """The checkpoint's weights would train on under another --model's name (and its default --lr); other
    documents or another order would make the saved data position meaningless."""
    saved = config_to_dict(TrainConfig(model="llama-tiny", eval_fraction=0.05))  # as a run saves it: resolved
    check_same_model_and_data(saved, TrainConfig(model="llama-tiny", lr=3e-3, sp=1), tmp_path)  # may change
    with pytest.raises(ValueError, match=needle):
        check_same_model_and_data(saved, TrainConfig(**change), tmp_path)
    check_same_model_and_data({}, TrainConfig(**change), tmp_path)  # a checkpoint without a config.yaml
    (tmp_path / "base").mkdir(exist_ok=True)  # one local model directory, spelled two ways: the same model
    spelled = config_to_dict(TrainConfig(model=str(tmp_path / "base")))
    check_same_model_and_data(spelled, TrainConfig(model=f"{tmp_path}/./base/"), tmp_path)


@pytest.mark.parametrize(
    "argv",
    [["--lr", "inf"], ["--weight-decay", "nan"], ["--min-lr-ratio", "-inf"], ["--nproc", "0"]],
)
def test_non_finite_numbers_and_nproc_0_exit_2_naming_their_flag(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_config(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[0] in error and "--sp" not in error, error


def test_a_full_disk_deep_in_a_library_is_one_line(tmp_path):
    wrapped = RuntimeError("checkpoint failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    message = disk_error(wrapped, tmp_path)
    assert message.startswith("No space left on device while writing to --output-dir") and str(tmp_path) in message
    copied = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert disk_error(copied, tmp_path) is not None  # safetensors copies the OS message into its own error
    failures = type("CheckpointException", (Exception,), {})("dcp")
    failures.failures = {1: (OSError(errno.EROFS, "Read-only file system"), None)}
    assert disk_error(failures, tmp_path).startswith("Read-only file system")
    assert disk_error(ValueError("shapes differ"), tmp_path) is None


def test_a_rank_hands_its_one_line_to_the_launcher(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("ulysses_sp.train.errors._HANDOFF_S", 0.0)  # no launcher here to stop the rank
    assert read_rank_errors(tmp_path) == {}
    assert report_error("bad --dataset", 2, 1, {"ULYSSES_SP_ERROR_DIR": str(tmp_path)}) == 2
    assert read_rank_errors(tmp_path) == {1: (2, "bad --dataset")}
    assert capsys.readouterr().err == ""
    report_error("disk full", 1, 0, {})
    assert capsys.readouterr().err == "ulysses-sp train: error: disk full\n"


def test_sigterm_only_sets_a_flag_and_the_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    signals = RankSignals(save_on_sigterm=True, under_launcher=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.sigterm
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    RankSignals(save_on_sigterm=False, under_launcher=False)  # --no-save-on-sigterm: SIGTERM keeps its default
    assert signal.getsignal(signal.SIGTERM) is before


def test_loss_curve_and_no_reporter_for_none(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"event": "train", "step": s, "loss": 10.0 - s} for s in range(1, 6)]
    rows += [{"event": "eval", "step": 5, "eval_loss": 5.5}, {"event": "summary", "step": 5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"event": "tr')  # a line cut by a kill
    assert write_loss_curve(metrics, tmp_path / "loss_curve.png") is None
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    kwargs = {"output_dir": tmp_path, "tensorboard_dir": tmp_path / "tb", "config": {}, "resume_step": None}
    assert make_reporter("none", **kwargs) is None


_EXIT_NOW = """
import atexit, sys, threading, time
from ulysses_sp.train.lifeline import exit_now

atexit.register(lambda: open(sys.argv[1], "a").write("exit handler ran\\n"))
if sys.argv[2] == "thread":  # a non-daemon thread still working: a normal exit waits for it
    threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[1], "a").write("thread finished\\n"))).start()
print("unflushed output", end="")
exit_now(3)
print("never printed")
"""


@pytest.mark.parametrize("thread", [False, True])
def test_exit_now_runs_the_exit_handlers_flushes_and_waits_for_a_working_thread(tmp_path, thread):
    """The command and its ranks end by exit_now: the status, the exit handlers (where trackers close their files),
    the output not yet flushed, all kept; a non-daemon thread still running is waited for (a normal exit)."""
    import subprocess
    import sys

    log = tmp_path / "log"
    mode = "thread" if thread else "none"
    done = subprocess.run([sys.executable, "-c", _EXIT_NOW, str(log), mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed output"
    expected = ["thread finished", "exit handler ran"] if thread else ["exit handler ran"]
    assert log.read_text().splitlines() == expected


@pytest.mark.parametrize(("nproc", "needle"), [(None, "--sp 4 must divide the number of ranks, but the launcher "
                                                 "started 2; start a multiple of 4 ranks or change --sp"),
                                                (4, "--nproc 4 but the launcher started 2 ranks")])  # fmt: skip
def test_under_another_launcher_a_world_sp_does_not_divide_names_the_world_not_an_nproc_never_given(
    nproc, needle, tmp_path
):
    """torchrun --nproc-per-node 2 ... train --sp 4: rank 0 names the launcher's ranks (it used to say '--nproc must
    be a multiple of --sp, got --nproc 2', a flag the user never gave)."""
    from ulysses_sp.standin import fake_world
    from ulysses_sp.train.run import _spec_from_rank_0

    config = TrainConfig(sp=4, nproc=nproc, output_dir=str(tmp_path / "run"))
    with fake_world(2), pytest.raises(ValueError) as refused:
        _spec_from_rank_0(config)
    assert str(refused.value) == needle
    assert not (tmp_path / "run").exists()


def test_without_evaluation_every_document_trains_and_a_resume_keeps_its_checkpoints_held_out_share(tmp_path):
    """--eval-every 0 used to hold out 5% of the documents all the same (never evaluated) and refused a one-document
    dataset for it; now the share is 0 unless given, and a resumed run keeps its checkpoint's share (its training
    documents), whatever its --eval-every now."""
    from ulysses_sp.train.config import EVAL_FRACTION
    from ulysses_sp.train.runspec import _with_held_out_fraction

    book = tmp_path / "book.txt"  # one document
    book.write_text("In the beginning God created the heaven and the earth. " * 20)
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    no_eval = resolve_run(TrainConfig(output_dir=str(tmp_path / "a"), dataset=str(book), eval_every=0), world_size=2)
    assert no_eval.config.eval_fraction == 0.0
    assert resolve_run(TrainConfig(output_dir=str(tmp_path / "b")), world_size=2).config.eval_fraction == EVAL_FRACTION
    given = TrainConfig(output_dir=str(tmp_path / "c"), eval_every=0, eval_fraction=0.1)
    assert resolve_run(given, world_size=2).config.eval_fraction == 0.1
    with pytest.raises(ValueError, match="--eval-fraction 0.05 needs at least 2 documents"):
        resolve_run(TrainConfig(output_dir=str(tmp_path / "c"), dataset=str(book)), world_size=2)

    checkpoint = tmp_path / "run" / "checkpoint-0000002"
    checkpoint.mkdir(parents=True)
    assert _with_held_out_fraction(TrainConfig(eval_every=0), checkpoint, {}).eval_fraction == 0.0  # no config.yaml
    for saved, eval_every in ((EVAL_FRACTION, 0), (0.2, 3), (0.0, 0)):
        got = _with_held_out_fraction(TrainConfig(eval_every=eval_every), checkpoint, {"eval_fraction": saved})
        assert got.eval_fraction == saved
    with pytest.raises(ValueError, match=r"--eval-every 7: .*checkpoint-0000002 trained on every document .* resume "
                                         r"with --eval-every 0"):  # fmt: skip
        _with_held_out_fraction(TrainConfig(eval_every=7), checkpoint, {"eval_fraction": 0.0})
    given = _with_held_out_fraction(TrainConfig(eval_every=7, eval_fraction=0.3), checkpoint, {"eval_fraction": 0.0})
    assert given.eval_fraction == 0.3


def flags_differ_on_rank_1() -> dict[str, str]:
    """On 2 gloo ranks (run_world): rank 1 started with another --seq-len than rank 0."""
    import tempfile

    import torch.distributed as dist

    from tests.helpers.harness import run_cases
    from ulysses_sp.train.run import _spec_from_rank_0

    def case() -> None:
        seq_len = 512 if dist.get_rank() == 0 else 1024
        config = TrainConfig(sp=2, seq_len=seq_len, output_dir=os.path.join(tempfile.gettempdir(), "flags_differ"))
        with pytest.raises(ValueError) as refused:
            _spec_from_rank_0(config)
        if dist.get_rank() == 0:  # the reason, once; the other ranks stop with an empty ValueError
            want = "rank 1 was started with other flags than rank 0 (--seq-len 1024 (rank 0: 512));"
            assert want in str(refused.value), refused.value
        else:
            assert str(refused.value) == ""

    return run_cases({"flags_differ": case})


def test_under_another_launcher_ranks_given_other_flags_are_refused():
    """torchrun ... train with another flag on one rank (a per-node command line): rank 0 resolved the run for every
    rank and the other rank's flags were ignored in silence; now every rank stops, rank 0 naming the flag."""
    from tests.helpers.harness import assert_case, run_world

    results = run_world(2, "tests.unit.test_train_run:flags_differ_on_rank_1", timeout=120)
    assert_case(results, "flags_differ", 2)


def train_in_one_process(output_dir, *flags: str) -> int:
    """``ulysses-sp train`` in this process (--nproc 1: no rank is started): a tiny model on a few short documents
    of ``output_dir``'s parent; returns the exit status."""
    from ulysses_sp.train.run import train_command

    docs = output_dir.parent / "docs"
    if not docs.is_dir():  # 3 short documents: a few steps of 256 tokens an epoch
        docs.mkdir()
        for index in range(3):
            (docs / f"d{index}.txt").write_text(f"Chapter {index}. In the beginning God created the earth. " * 40)
    common = ["--model", "llama-tiny", "--nproc", "1", "--sp", "1", "--seq-len", "256", "--eval-every", "0"]
    return train_command([*common, "--log-every", "1", "--dataset", str(docs), "--output-dir", str(output_dir), *flags])


def test_every_step_reports_the_epoch_it_trained_on(tmp_path, monkeypatch):
    """The last step of each epoch was logged with the next epoch's number (steps 3 and 6 of 2 epochs of 3 steps
    showed epoch 1 and 2): the record read the loader's epoch after the step had moved it past the epoch's end."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert train_in_one_process(out, "--epochs", "2", "--max-steps", "none", "--save-every", "0") == 0
    records = read_metrics(out / "metrics.jsonl")
    epochs = [r["epoch"] for r in records if r["event"] == "train"]
    per_epoch = len(epochs) // 2
    assert per_epoch >= 2 and epochs == [0] * per_epoch + [1] * per_epoch, epochs
    assert records[-1]["epochs_completed"] == 2


def test_resume_without_a_checkpoint_keeps_the_earlier_runs_metrics(tmp_path, monkeypatch, capsys):
    """A run stopped before its first checkpoint (SIGTERM with --no-save-on-sigterm) leaves only metrics.jsonl;
    --resume then started at step 0 and replaced the file without a word. Now the whole earlier file is kept as
    abandoned-metrics-<time>.jsonl (and the loss curve beside it), and the run says so."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    out.mkdir()
    earlier = [{"event": "train", "step": step, "loss": 10.0 - step, "epoch": 0} for step in range(1, 7)]
    earlier.insert(5, {"event": "eval", "step": 5, "eval_loss": 6.0})
    text = "".join(json.dumps(record) + "\n" for record in earlier)
    (out / "metrics.jsonl").write_text(text)
    (out / "loss_curve.png").write_bytes(b"earlier curve")
    assert train_in_one_process(out, "--max-steps", "2", "--save-every", "0", "--resume") == 0
    [kept] = out.glob("abandoned-metrics-*.jsonl")
    assert kept.read_text() == text
    assert [p.read_bytes() for p in out.glob("abandoned-loss_curve-*.png")] == [b"earlier curve"]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["event"] == "train"]
    assert steps == [1, 2]
    stdout = capsys.readouterr().out
    assert f"--resume: no checkpoint in {out}, so the run starts at step 0" in stdout
    assert f"moved aside (not deleted): {kept.name}, abandoned-loss_curve-" in stdout, stdout


def test_a_rewind_keeps_the_newer_steps_metrics_and_loss_curve_beside_the_newer_checkpoints(
    tmp_path, monkeypatch, capsys
):
    """Resuming from an older checkpoint moved the newer checkpoints aside but dropped the newer steps' records
    and the summary from metrics.jsonl and drew over loss_curve.png, without a note. Now both are kept under the
    same abandoned-...-<time> names as the checkpoints, in the one note that lists them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    assert train_in_one_process(out, "--max-steps", "4", "--save-every", "2") == 0
    before = (out / "metrics.jsonl").read_text()
    curve = (out / "loss_curve.png").read_bytes()
    capsys.readouterr()
    rewind = ["--max-steps", "3", "--save-every", "2", "--keep-last", "0", "--resume", str(out / "checkpoint-0000002")]
    assert train_in_one_process(out, *rewind) == 0
    [checkpoint] = out.glob("abandoned-checkpoint-0000004-*")
    stamp = checkpoint.name.rsplit("-", 1)[1]
    assert (out / f"abandoned-metrics-{stamp}.jsonl").read_text() == before
    assert (out / f"abandoned-loss_curve-{stamp}.png").read_bytes() == curve
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3]
    note = [line for line in capsys.readouterr().out.splitlines() if "moved aside" in line]
    assert len(note) == 1 and checkpoint.name in note[0] and f"abandoned-metrics-{stamp}.jsonl" in note[0], note
    assert f"abandoned-loss_curve-{stamp}.png" in note[0] and "keeps the records up to step 2" in note[0]


def test_a_checkpoint_saves_the_placement_asked_for_and_its_config_reruns(tmp_path, monkeypatch, capsys):
    """With --host-memory on GPUs the planner places the checkpoints (here a stand-in for a GPU's choice: CPU runs
    place none). The run uses its place and stride, and a checkpoint's config.yaml holds what was asked (auto, none,
    beside host_memory): it held the choice beside host_memory, which --config now refuses as the typed pair is, so
    the original command over its saved config.yaml loads and places them again."""
    import dataclasses

    from ulysses_sp.train import loop, model_factory

    def gpu_choice(config, *args, **kwargs):
        placed = dataclasses.replace(config, activation_checkpointing="checkpoint", checkpoint_stride=2)
        return placed, "checkpoints: 1 in 2 layer inputs on the GPU (a stand-in for the planner's choice)"

    built = []

    def build_model(config, *args, **kwargs):
        built.append((config.activation_checkpointing, config.checkpoint_stride, config.dtype))
        return model_factory.build_model(config, *args, **kwargs)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(model_factory, "place_checkpoints", gpu_choice)
    monkeypatch.setattr(loop, "build_model", build_model)
    out = tmp_path / "run"
    assert train_in_one_process(out, "--host-memory", "1TiB", "--max-steps", "1", "--save-every", "1") == 0
    assert built == [("checkpoint", 2, "fp32")]  # the dtype too made concrete for the run, and named at start-up
    assert "\ndtype: fp32 (--dtype auto: on CPU)\n" in capsys.readouterr().out
    saved = yaml.safe_load((out / "checkpoint-0000001" / "config.yaml").read_text())
    assert saved["dtype"] == "auto"
    assert (saved["host_memory"], saved["activation_checkpointing"], saved["checkpoint_stride"]) == (
        "1TiB",
        "auto",
        None,
    )
    path = str(out / "checkpoint-0000001" / "config.yaml")
    for argv in ([], ["--host-memory", "1TiB"]):
        config = load_config(["--config", path, *argv])
        assert (config.host_memory, config.activation_checkpointing, config.checkpoint_stride) == ("1TiB", "auto", None)
