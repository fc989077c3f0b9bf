"""End-to-end: ``ulysses-sp train`` run as a subprocess with tiny settings, on 2 (or 4) CPU ranks.

Each test starts the real command (``python -m ulysses_sp train``, the same code as the console script),
which launches its own gloo ranks; faults are injected through ``ULYSSES_SP_TEST_FAULT`` (see
:mod:`ulysses_sp.train.faults`). Every subprocess has a timeout, and a killed run is killed as a whole
process group. A run the command must refuse before any rank trains runs its ``main`` in this process
(:func:`~tests.e2e.train_cli_helpers.refuse_in_process`), apart from one through the console script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

from tests.e2e.train_cli_helpers import (
    TINY,
    assert_gone,
    cli_env,
    rank_pids,
    records,
    refuse_in_process,
    run_cli,
    start_cli,
    wait_for_step,
)
from tests.e2e.train_cli_helpers import corpus_file as _corpus_file
from tests.e2e.train_cli_helpers import ok as _ok
from ulysses_sp.train.checkpoint import list_checkpoints, load_model_state_dict
from ulysses_sp.train.config import TrainConfig, load_config
from ulysses_sp.train.data import SequenceLoader
from ulysses_sp.train.documents import load_tokenizer, split_documents, tokenize_documents

pytestmark = pytest.mark.slow
corpus_file = _corpus_file  # the shared fixture: a jsonl of short and long Bible documents


def test_loss_falls_and_the_checkpoint_is_a_plain_hf_model(tmp_path, corpus_file):
    """Packed short and long documents, FSDP2 over 2 ranks at sp=2: the loss falls, a whole pass over the data
    is finished, the resolved config is printed and saved, and the saved model — loaded by plain
    transformers with no SP — reproduces the held-out loss computed under SP, and generates."""
    out = tmp_path / "run"
    args = [*TINY, "--dataset", str(corpus_file), "--max-steps", "14", "--output-dir", str(out)]
    args += ["--eval-every", "7", "--save-every", "7", "--lr", "5e-3", "--batch-size", "2"]
    args += ["--report-to", "tensorboard"]
    result = _ok(run_cli(args))
    train = records(out)
    # TensorBoard got every step's loss (as float32) and held-out loss; a loss curve lies beside metrics.jsonl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert logged == [(r["step"], float(np.float32(r["loss"]))) for r in train]
    held_out = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert held_out == [(r["step"], float(np.float32(r["eval_loss"]))) for r in records(out, "eval")]
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    losses = [r["loss"] for r in train]
    assert len(losses) == 14 and losses[0] > 10.0
    assert sum(losses[-3:]) / 3 < losses[0] - 2.0, losses
    # 14 steps of 2 x 256 tokens are one pass over this small data set: the summary counts it finished (a step's
    # epoch is the pass it trained on, 0 for all 14; the 14th read 1 before, the loader's epoch after the step)
    assert [r["epoch"] for r in train] == [0] * 14 and records(out, "summary")[-1]["epochs_completed"] >= 1
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [7, 14] and evals[1]["eval_loss"] < evals[0]["eval_loss"]

    assert "resolved config" in result.stdout and "checkpoint: " in result.stdout
    assert "\ndtype: fp32 (--dtype auto: on CPU)\n" in result.stdout  # the dtype 'auto' chose, named
    checkpoint = out / "checkpoint-0000014"
    assert str(checkpoint) in result.stdout and list_checkpoints(out)[-1] == checkpoint
    saved = load_config(["--config", str(checkpoint / "config.yaml")])
    assert (saved.dataset, saved.max_steps, saved.nproc, saved.tokenizer) == (str(corpus_file), 14, 2, "gpt2-bpe")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert model.config._attn_implementation != "ulysses_sdpa"
    # the held-out rows as the trainer built them (same data code, seed and split), one process, no SP
    config = TrainConfig(dataset=str(corpus_file), seq_len=256, batch_size=2)
    documents = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    _, held_out = split_documents(
        tokenize_documents(documents, load_tokenizer()), config.held_out_fraction(), config.seed
    )
    batch = next(iter(SequenceLoader(held_out, schedule=256, batch_size=2, shuffle=False, epochs=1)))
    with torch.no_grad():  # no attention_mask: transformers then keeps attention inside each document
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(loss.item(), evals[1]["eval_loss"], rtol=1e-4, atol=1e-4)
    prompt = tokenizer("In the beginning", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 6

    # the checkpoint is also a model directory `--model` accepts, with its own tokenizer: training goes on
    # from the trained weights (the loss starts far below a random init's ~10.8)
    further = tmp_path / "further"
    args = ["--model", str(checkpoint), "--seq-len", "256", "--nproc", "2", "--sp", "2", "--max-steps", "2"]
    _ok(run_cli([*args, "--dataset", str(corpus_file), "--eval-every", "0", "--output-dir", str(further)]))
    assert records(further)[0]["loss"] < losses[0] - 2.0
    assert load_config(["--config", str(further / "checkpoint-0000002" / "config.yaml")]).tokenizer == str(checkpoint)


def test_kills_mid_run_and_mid_checkpoint_then_resume_match_the_uninterrupted_run(tmp_path, corpus_file):
    """Bitwise on CPU: losses, held-out losses and final weights of a run that was killed twice (once
    inside a checkpoint write, once between steps) and resumed equal those of an uninterrupted run.
    Covers gradient accumulation, gradient checkpointing and a sequence-length schedule across the kills."""
    common = [*TINY, "--dataset", str(corpus_file), "--max-steps", "8", "--save-every", "2", "--eval-every", "4"]
    common += [
        "--grad-accum",
        "2",
        "--activation-checkpointing",
        "checkpoint",
        "--seq-len-schedule",
        "128:3,256",
        "--keep-last",
        "3",
    ]
    reference, broken = tmp_path / "reference", tmp_path / "broken"
    _ok(run_cli([*common, "--output-dir", str(reference)]))

    # 1. rank 0 is SIGKILLed inside the save of step 6, after every file is written, before the commit
    result = run_cli([*common, "--output-dir", str(broken)], ULYSSES_SP_TEST_FAULT="kill_in_save:6:0")
    assert result.returncode != 0
    assert "rank 0" in result.stderr and "SIGKILL" in result.stderr, result.stderr
    assert (broken / ".tmp-checkpoint-0000006").is_dir()
    assert [p.name for p in list_checkpoints(broken)] == ["checkpoint-0000002", "checkpoint-0000004"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(broken / "checkpoint-0000004")  # the previous one still loads

    # 2. resume from step 4; the whole run (launcher and ranks) is SIGKILLed while step 7 runs on
    resumed = [*common, "--output-dir", str(broken), "--resume"]
    process = start_cli(resumed, cli_env(ULYSSES_SP_TEST_FAULT="pause:7"), stdout=subprocess.DEVNULL)
    wait_for_step(broken, 7, process)
    ranks = rank_pids(process.pid)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher's process group: the ranks run in sessions of their own
    process.wait(timeout=30)
    assert_gone(ranks)  # the paused ranks die with their launcher (they used to sleep on for an hour)
    assert [p.name for p in list_checkpoints(broken)][-1] == "checkpoint-0000006"

    # 3. resume from step 6 and finish
    result = _ok(run_cli(resumed))
    assert "resumed from" in result.stdout
    expected, got = records(reference), records(broken)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["seq_len"] for r in got] == [128, 128, 128, 256, 256, 256, 256, 256]
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]  # exact float equality
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in expected]
    assert [r["eval_loss"] for r in records(broken, "eval")] == [r["eval_loss"] for r in records(reference, "eval")]
    final_ref = load_model_state_dict(reference / "checkpoint-0000008")
    final = load_model_state_dict(broken / "checkpoint-0000008")
    assert final.keys() == final_ref.keys()
    for name, tensor in final_ref.items():
        assert torch.equal(final[name], tensor), name


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--sp", "3", "--ring", "1", "--nproc", "3"], "--sp 3 --ring 1"),
        (["--lr", "fast"], "--lr"),
        (["--parallel", "ddp", "--cpu-offload-optimizer"], "--cpu-offload-optimizer"),
        # llama-tiny's 4 heads split over 2 ranks in 1 or 2 chunks: refused on the ranks, naming no flag, before
        (["--head-chunks", "3"], "--head-chunks 3 with --sp 2: head_chunks=3 does not split"),
    ],
)
def test_an_invalid_config_exits_2_naming_the_flag(args, needle, tmp_path):
    result = refuse_in_process([*args, "--output-dir", str(tmp_path)])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_fresh_run_refuses_a_directory_with_checkpoints_and_bad_yaml(tmp_path):
    (tmp_path / "checkpoint-0000003").mkdir()
    (tmp_path / "checkpoint-0000003" / "trainer_state.json").write_text("{}")
    script = Path(sys.executable).parent / "ulysses-sp"  # the console script, where pip installed it
    command = [str(script), "train"] if script.is_file() else [sys.executable, "-m", "ulysses_sp", "train"]
    result = subprocess.run(
        [*command, "--output-dir", str(tmp_path)], env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "--resume" in result.stderr and "--overwrite" in result.stderr
    # a folder that holds only an earlier run's metrics: refused too, the file untouched
    metrics_only = tmp_path / "metrics-only"
    metrics_only.mkdir()
    (metrics_only / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 10.8}\n')
    result = refuse_in_process(["--output-dir", str(metrics_only)])
    assert result.returncode == 2 and "metrics.jsonl" in result.stderr and "--overwrite" in result.stderr, result.stderr
    assert (metrics_only / "metrics.jsonl").read_text() == '{"event": "train", "step": 1, "loss": 10.8}\n'
    config = tmp_path / "c.yaml"
    config.write_text("seq_lenn: 128\n")
    result = refuse_in_process(["--config", str(config)])
    assert result.returncode == 2 and "seq_lenn" in result.stderr and "seq_len" in result.stderr


@pytest.mark.parametrize(
    ("how", "status", "line"),
    [
        ("refusal", 2, "ulysses-sp train: error: --dataset: refused by the test's resolution"),
        (
            "SIGTERM",
            128 + signal.SIGTERM,
            "ulysses-sp train: stopped by SIGTERM while resolving the run (nothing trained or saved); its ranks "
            "were stopped",
        ),
    ],
)
def test_the_ranks_start_while_the_launcher_resolves_and_a_refusal_or_sigterm_stops_them(
    how, status, line, tmp_path, corpus_file
):
    """The ranks import torch and transformers (about 11 s each on this VM) while the launcher resolves the run;
    a run refused there (here a stand-in resolution), or a SIGTERM then, kills them, leaves no temporary file
    behind and puts the signal handlers back; the refusal is the command's one line of output."""
    from tests.e2e.train_cli_helpers import main_in_process
    from ulysses_sp.train.launch import LocalRanks

    started: list[LocalRanks] = []
    enter = LocalRanks.__enter__

    def recorded_enter(self):
        started.append(enter(self))
        return started[-1]

    def stand_in_resolution(config, world_size):
        assert len(started) == 1 and len(started[0].run.processes) == world_size == 2
        assert all(process.poll() is None for process in started[0].run.processes), "a rank ended before its spec"
        if how == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler raises at the next bytecode
            time.sleep(5)
            raise AssertionError("SIGTERM did not stop the resolution")
        raise ValueError("--dataset: refused by the test's resolution")

    def not_the_launcher_s(signum, frame):  # without a handler of the launcher's, SIGTERM would end pytest
        raise AssertionError("SIGTERM reached the test's own handler: the launcher had none while it resolved")

    args = [*TINY, "--dataset", str(corpus_file), "--output-dir", str(tmp_path / "run")]
    previous = signal.signal(signal.SIGTERM, not_the_launcher_s)
    try:
        with (
            mock.patch.object(LocalRanks, "__enter__", recorded_enter),
            mock.patch("ulysses_sp.train.runspec.resolve_run", stand_in_resolution),
        ):
            result = main_in_process(["train", *args])
        handler = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.returncode == status and result.stderr.strip().splitlines() == [line], result.stderr
    # killed and reaped when the launcher stopped, long before they could have imported anything
    assert [process.returncode for process in started[0].run.processes] == [-signal.SIGKILL] * 2
    assert not started[0].spec_file.parent.exists(), "the run's temporary directory was left behind"
    assert handler is not_the_launcher_s
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_sighup_while_a_one_process_run_resolves_is_one_line(tmp_path, corpus_file):
    """--nproc 1 (no ranks started): a SIGHUP while the run is resolved ends the command with one line and 129, as
    with several ranks (the signal's default ended it in silence), and the handlers from before come back."""
    from tests.e2e.train_cli_helpers import main_in_process

    def stand_in_resolution(config, world_size):
        os.kill(os.getpid(), signal.SIGHUP)  # the command's handler raises at the next bytecode
        time.sleep(5)
        raise AssertionError("SIGHUP did not stop the resolution")

    def not_the_command_s(signum, frame):  # without a handler of the command's, SIGHUP would end pytest
        raise AssertionError("SIGHUP reached the test's own handler: the command had none while it resolved")

    one = [*TINY[: TINY.index("--nproc")], "--nproc", "1", "--sp", "1"]
    args = [*one, "--dataset", str(corpus_file), "--output-dir", str(tmp_path / "run")]
    previous = signal.signal(signal.SIGHUP, not_the_command_s)
    try:
        with mock.patch("ulysses_sp.train.runspec.resolve_run", stand_in_resolution):
            result = main_in_process(["train", *args])
        handler = signal.getsignal(signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, previous)
    line = "ulysses-sp train: stopped by SIGHUP while resolving the run (nothing trained or saved)"
    assert result.returncode == 128 + signal.SIGHUP and result.stderr.strip().splitlines() == [line], result.stderr
    assert handler is not_the_command_s


def test_when_a_rank_dies_the_run_ends_promptly_naming_it(tmp_path, corpus_file):
    """Our own launcher: rank 1 exits after step 2; the command stops rank 0 and exits non-zero."""
    start = time.monotonic()
    result = run_cli(
        [*TINY, "--dataset", str(corpus_file), "--max-steps", "50", "--output-dir", str(tmp_path / "a")],
        timeout=120,
        ULYSSES_SP_TEST_FAULT="exit:2:1",
    )
    assert result.returncode == 1
    assert "rank 1" in result.stderr and "exited with status 43" in result.stderr, result.stderr
    assert time.monotonic() - start < 90


def test_under_slurm_a_dead_peer_ends_the_survivor_within_the_timeout(tmp_path, corpus_file):
    """No torchrun (srun-style environment): the survivor's collective fails instead of hanging."""
    from tests.helpers.harness import free_port

    port = str(free_port())
    args = [*TINY, "--dataset", str(corpus_file), "--max-steps", "50", "--output-dir", str(tmp_path / "s")]
    args += ["--dist-timeout", "30"]
    processes = []
    for rank in (0, 1):
        env = cli_env(
            SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_TASKS="2", SLURM_JOB_ID="7",
            SLURM_LAUNCH_NODE_IPADDR="127.0.0.1", MASTER_PORT=port, ULYSSES_SP_TEST_FAULT="exit:2:1",
        )  # fmt: skip
        processes.append(start_cli(args, env))
    start = time.monotonic()
    try:
        _, stderr0 = processes[0].communicate(timeout=120)
        processes[1].communicate(timeout=30)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    assert processes[1].returncode == 43
    assert processes[0].returncode not in (0, None), stderr0
    assert time.monotonic() - start < 30 + 60
    assert "Error" in stderr0, stderr0  # the collective's error, not silence


def test_data_that_runs_out_stops_cleanly_with_dp2_x_sp2_and_ddp(tmp_path, corpus_file):
    """One epoch over unpacked documents on 4 ranks (2 SP groups): the run stops when the data ends,
    after exactly the steps the data holds, says so, and saves a final checkpoint. The last step has one window
    for 2 SP groups x 2 rows, so the second group holds nothing but padding (that used to kill the run in a
    mismatched gradient reduction: its attention made zeros that reached no q/k/v projection)."""
    out, seq_len = tmp_path / "epochs", 128
    args = ["--model", "llama-tiny", "--seq-len", str(seq_len), "--nproc", "4", "--sp", "2", "--parallel", "ddp"]
    args += ["--batch-size", "2"]
    args += ["--dataset", str(corpus_file), "--epochs", "1", "--max-steps", "none", "--no-pack", "--eval-every", "0"]
    args += ["--eval-fraction", "0", "--output-dir", str(out)]
    documents = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    corpus = tokenize_documents(documents, load_tokenizer())
    windows = int(sum(-(-length // seq_len) for length in corpus.doc_lengths))
    assert windows % 4 == 1, "the last micro-batch must give the second SP group padding alone"
    result = _ok(run_cli(args))
    loader = SequenceLoader(corpus, schedule=seq_len, batch_size=2, dp_size=2, pack=False, epochs=1)
    expected_steps = loader.total_micro_batches(1)
    train = records(out)
    assert [r["step"] for r in train] == list(range(1, expected_steps + 1))
    assert sum(r["valid_tokens"] for r in train) == corpus.num_tokens - windows  # every target exactly once
    assert "ran out after 1 epoch" in result.stdout
    assert list_checkpoints(out)[-1].name == f"checkpoint-{expected_steps:07d}"


def test_rewind_new_settings_and_overwrite_never_lose_checkpoints(tmp_path, corpus_file):
    """Resuming from an older checkpoint moves the newer ones aside (never pruned away); a resumed run uses
    its own --lr; a changed --grad-accum or --model is refused; --overwrite with a bad flag deletes nothing."""
    from ulysses_sp.train.optim import lr_factor

    out = tmp_path / "run"
    base = [*TINY, "--dataset", str(corpus_file), "--eval-every", "0", "--output-dir", str(out)]
    _ok(run_cli([*base, "--max-steps", "4", "--save-every", "2"]))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-0000002", "checkpoint-0000004"]

    rewind = ["--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--lr", "5e-2"]
    result = _ok(run_cli([*base, *rewind, "--resume", str(out / "checkpoint-0000002")]))
    assert "moved aside" in result.stdout
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-0000003"]
    assert len(list(out.glob("abandoned-checkpoint-0000004-*"))) == 1
    defaults = TrainConfig()
    expected = 5e-2 * lr_factor(
        2, warmup_steps=defaults.warmup_steps, total_steps=3, min_lr_ratio=defaults.min_lr_ratio
    )
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    assert records(out)[-1]["lr"] == pytest.approx(expected, rel=1e-9)

    refused = refuse_in_process([*base, "--max-steps", "5", "--grad-accum", "2", "--resume"])
    assert refused.returncode != 0 and "--grad-accum 1 -> 2" in refused.stdout + refused.stderr
    # another --model: the checkpoint's llama-tiny used to train on under the new name (and its default --lr)
    refused = refuse_in_process([*base, "--max-steps", "5", "--resume", "--model", "llama-small"])
    assert refused.returncode == 2 and "--model 'llama-small' differs" in refused.stderr, refused.stderr
    assert "--model llama-tiny" in refused.stderr and "layout:" not in refused.stdout  # before any rank started

    bad = refuse_in_process([*base, "--max-steps", "1", "--overwrite", "--dataset", str(tmp_path / "missing.jsonl")])
    assert bad.returncode != 0 and [p.name for p in list_checkpoints(out)] == ["checkpoint-0000003"]
    _ok(run_cli([*base, "--max-steps", "1", "--overwrite"]))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-0000001"]


def test_ring_and_pure_ulysses_train_the_losses_of_one_process(tmp_path, corpus_file):
    """--ring 2 (ulysses 1 x ring 2, zigzag shards) and pure Ulysses sp=2 on 2 ranks see the data one process
    (--nproc 1) sees and compute its losses: the per-step losses and the held-out loss agree to fp32 precision
    (the gradient norms only to 5e-3: Adam's first steps move near-zero gradients by +-lr whichever way their
    rounding falls)."""
    common = [*TINY, "--dataset", str(corpus_file), "--max-steps", "3", "--eval-every", "3", "--no-final-save"]
    one = [*common, "--nproc", "1", "--sp", "1"]  # (later flags win)
    runs = {}
    for name, args in {"one": one, "ring1": [*common, "--ring", "1"], "ring2": [*common, "--ring", "2"]}.items():
        out = tmp_path / name
        result = _ok(run_cli([*args, "--output-dir", str(out)]))
        if name == "ring2":
            assert "ulysses 1 x ring 2" in result.stdout
        runs[name] = [[r[key] for r in records(out)] for key in ("loss", "grad_norm")]
        runs[name].append([r["eval_loss"] for r in records(out, "eval")])
    assert len(runs["one"][0]) == 3 and len(runs["one"][2]) == 1
    for name in ("ring1", "ring2"):
        for got, want, rel in zip(runs[name], runs["one"], (1e-5, 5e-3, 1e-5), strict=True):
            assert got == pytest.approx(want, rel=rel), (name, got, want)
    # --label-smoothing reaches the training loss: at the first step (near-uniform predictions, the same weights and
    # data) the smoothed loss is about the plain one, and its gradient (1 - e) times the plain one's
    out = tmp_path / "smoothed"
    _ok(run_cli([*one, "--label-smoothing", "0.5", "--max-steps", "1", "--output-dir", str(out)]))
    (smoothed,), (plain, *_) = records(out), records(tmp_path / "one")
    assert smoothed["loss"] == pytest.approx(plain["loss"], rel=1e-2), (smoothed, plain)
    assert smoothed["grad_norm"] / plain["grad_norm"] == pytest.approx(0.5, rel=0.02), (smoothed, plain)
