"""The small pieces of ``ulysses-sp train`` in one process: LR schedule, step planning, Slurm mapping,
fault parsing, the metrics log across a resume, built-in models and the FLOPs count."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from ulysses_sp.process_group import under_launcher
from ulysses_sp.shapes import SHAPES
from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.documents import load_tokenizer
from ulysses_sp.train.faults import Fault
from ulysses_sp.train.launch import apply_slurm_env
from ulysses_sp.train.metrics import MetricsLog, Progress, format_summary, peak_tflops, read_metrics
from ulysses_sp.train.model_factory import (
    hf_model_config,
    resolve_ring,
    tokenizer_source,
    training_flops_per_token,
)
from ulysses_sp.train.optim import lr_factor, planned_steps
from ulysses_sp.train.tracking import make_reporter, write_loss_curve


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    factors = [lr_factor(s, warmup_steps=2, total_steps=10, min_lr_ratio=0.1) for s in range(12)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in zip(factors[2:], factors[3:], strict=False))
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[10] == pytest.approx(0.1) and factors[11] == pytest.approx(0.1)
    assert lr_factor(0, warmup_steps=0, total_steps=5, min_lr_ratio=0.0) == 1.0


def test_planned_steps_is_max_steps_or_the_end_of_the_epochs():
    assert planned_steps(TrainConfig(max_steps=16), None) == 16
    assert planned_steps(TrainConfig(max_steps=None, epochs=2, grad_accum=4), 30) == 8  # ceil(30 / 4)
    assert planned_steps(TrainConfig(max_steps=5, epochs=2), 30) == 5


def test_slurm_job_steps_become_torch_ranks_but_the_batch_script_does_not():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "123"}
    env |= {"SLURM_LAUNCH_NODE_IPADDR": "10.0.0.5", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert apply_slurm_env(env) and under_launcher(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "20123")
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}
    assert not apply_slurm_env(batch_script) and not under_launcher(batch_script)
    torchrun = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "WORLD_SIZE": "8", "RANK": "5"}
    assert not apply_slurm_env(torchrun) and torchrun["RANK"] == "5"  # a launcher's own variables win
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        apply_slurm_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"})


def test_fault_parsing():
    assert Fault.from_env({}) is None
    assert Fault.from_env({"ULYSSES_SP_TEST_FAULT": "exit:3:1"}) == Fault("exit", 3, 1)
    assert Fault.from_env({"ULYSSES_SP_TEST_FAULT": "pause:7"}) == Fault("pause", 7, 0)
    with pytest.raises(ValueError, match="KIND:STEP"):
        Fault.from_env({"ULYSSES_SP_TEST_FAULT": "explode:1"})


def test_metrics_log_drops_the_lost_steps_of_an_interrupted_run(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path, enabled=True)
    for step in range(1, 6):
        log.write({"event": "train", "step": step, "loss": 1.0 / step})
    with open(path, "a") as handle:
        handle.write('{"event": "train", "st')  # a line cut short by a kill
    MetricsLog(path, enabled=True, resume_step=3).write({"event": "train", "step": 4, "loss": 9.0})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in lines] == [("train", 1), ("train", 2), ("train", 3), ("resume", 3)] + [
        ("train", 4)
    ]
    assert lines[-1]["loss"] == 9.0
    # a run resumed from a checkpoint a SIGTERM saved before its held-out loss computes it again: a resume of that
    # resume (killed later) drops the one its first try logged at that step, so the step holds one held-out loss
    MetricsLog(path, enabled=True, resume_step=4).write({"event": "eval", "step": 4, "eval_loss": 8.0})
    MetricsLog(path, enabled=True, resume_step=4, redo_eval=True).write({"event": "eval", "step": 4, "eval_loss": 8.0})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in lines if r["step"] == 4] == ["train", "resume", "resume", "eval"]
    MetricsLog(path, enabled=True)  # a fresh run starts a new file
    assert path.read_text() == ""
    MetricsLog(tmp_path / "other.jsonl", enabled=False).write({"event": "train", "step": 1})
    assert not (tmp_path / "other.jsonl").exists()


def _tensorboard_run(tmp_path, resume_step, records, redo_eval=False) -> MetricsLog:
    """One run of the trainer's log with ``--report-to tensorboard`` under ``tmp_path``: its records, then closed."""
    where = {"output_dir": tmp_path, "tensorboard_dir": tmp_path / "tensorboard", "config": {}}
    reporter = make_reporter("tensorboard", **where, resume_step=resume_step)
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, enabled=True, resume_step=resume_step, reporter=reporter, redo_eval=redo_eval)
    for record in records:
        log.write(record)
    log.close()
    return log


def _scalars(tmp_path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_checkpoint_resumed_twice_logs_its_owed_held_out_loss_once_to_tensorboard(tmp_path):
    """A SIGTERM saved step 2 before its held-out loss; a resume computes it first, is killed after step 3, and the
    same checkpoint is resumed again: TensorBoard shows that loss once (the second resume logged it a second time,
    at the same step), and every step's training loss once."""
    pytest.importorskip("tensorboard")
    path = tmp_path / "metrics.jsonl"
    run = functools.partial(_tensorboard_run, tmp_path)
    run(None, [{"event": "train", "step": 1, "loss": 9.0}, {"event": "eval", "step": 1, "eval_loss": 9.5}])
    run(1, [{"event": "train", "step": 2, "loss": 8.0}, {"event": "stopped", "step": 2, "signal": "SIGTERM"}])
    for _ in range(2):
        run(2, [{"event": "eval", "step": 2, "eval_loss": 8.5}, {"event": "train", "step": 3, "loss": 7.0}], True)
    assert _scalars(tmp_path, "eval/loss") == [(1, 9.5), (2, 8.5)]
    assert _scalars(tmp_path, "train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0)]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [1, 2]  # metrics.jsonl: once each as well
    run(1, [])  # a resume from step 1 that logs nothing (killed before its first step) still purges steps 2 and 3
    assert _scalars(tmp_path, "train/loss") == [(1, 9.0)]


def test_a_resume_whose_metrics_file_was_deleted_says_so_and_keeps_tensorboard_at_that_step(tmp_path):
    """metrics.jsonl deleted before a resume that owes step 2's held-out loss: the resume says the file is missing
    and what that costs, and TensorBoard keeps step 2's training loss (purged before, with nothing to replay it
    from: train/loss held steps 1 and 3 only), adds the held-out loss there, and drops the lost step 3."""
    pytest.importorskip("tensorboard")
    path = tmp_path / "metrics.jsonl"
    run = functools.partial(_tensorboard_run, tmp_path)
    run(None, [{"event": "train", "step": 1, "loss": 9.0}, {"event": "train", "step": 2, "loss": 8.0}])
    run(2, [{"event": "stopped", "step": 2, "signal": "SIGTERM"}, {"event": "train", "step": 3, "loss": 6.0}])
    path.unlink()
    log = run(2, [{"event": "eval", "step": 2, "eval_loss": 8.5}, {"event": "train", "step": 3, "loss": 7.0}], True)
    assert log.missing is not None and str(path) in log.missing and "step 2" in log.missing, log.missing
    assert "--report-to keeps what it holds at step 2" in log.missing
    assert _scalars(tmp_path, "train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert _scalars(tmp_path, "eval/loss") == [(2, 8.5)]
    assert [r["event"] for r in map(json.loads, path.read_text().splitlines())] == ["resume", "eval", "train"]
    # a resume with the file there, or --resume that found no checkpoint (step 0), has nothing to say
    assert run(3, []).missing is None
    path.unlink()
    assert run(0, []).missing is None
    assert MetricsLog(tmp_path / "gone.jsonl", enabled=True, resume_step=4).missing.endswith("earlier steps' records")


def _strict_json(line: str) -> dict:
    """json.loads that refuses NaN / Infinity, as most JSON readers outside Python do."""

    def refuse(name: str) -> None:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_log_is_strict_json_and_names_the_non_finite_values(tmp_path, capsys):
    path, seen = tmp_path / "m.jsonl", []

    class Spy:
        def log(self, record):
            seen.append(record)

        def close(self):
            pass

    log = MetricsLog(path, enabled=True, reporter=Spy())
    train = {"event": "train", "step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "skipped": True}
    train |= {"tokens_per_sec": 512.0, "seq_len": 256, "step_time_s": 0.5}
    log.write(train)
    log.write({"event": "summary", "step": 1, "first_loss": -math.inf, "last_loss": 2.0, "extra": {"x": [math.nan]}})
    lines = [_strict_json(line) for line in path.read_text().splitlines()]
    assert lines[0]["loss"] is None and lines[0]["grad_norm"] is None and lines[0]["lr"] == 1e-3
    assert lines[0]["non_finite"] == {"loss": "nan", "grad_norm": "inf"}
    assert lines[1]["first_loss"] is None and lines[1]["extra"] == {"x": [None]}
    assert lines[1]["non_finite"] == {"first_loss": "-inf", "extra.x[0]": "nan"}
    assert math.isnan(seen[0]["loss"]) and math.isinf(seen[0]["grad_norm"])  # TensorBoard / W&B get the value
    Progress(enabled=True, total=2, initial=0, log_every=1).update(train)  # the progress line still says nan
    out = capsys.readouterr().out
    assert "step 1/2  loss nan" in out and "SKIPPED (not finite)" in out, out

    # a log of an earlier version (NaN in it) is read, and written again strictly when the run resumes
    with open(path, "a") as handle:
        handle.write('{"event": "train", "step": 2, "loss": NaN}\n{"event": "train", "step": 3, "loss": 1.0}\n')
    assert [r["step"] for r in read_metrics(path)] == [1, 1, 2, 3]
    MetricsLog(path, enabled=True, resume_step=2)
    lines = [_strict_json(line) for line in path.read_text().splitlines()]
    assert [(r["event"], r["step"]) for r in lines] == [("train", 1), ("summary", 1), ("train", 2), ("resume", 2)]
    assert lines[2]["loss"] is None and lines[2]["non_finite"] == {"loss": "nan"}

    # the loss curve reads null as a gap
    curve = MetricsLog(tmp_path / "curve.jsonl", enabled=True)
    for step, loss in enumerate([3.0, math.nan, 2.0], start=1):
        curve.write({"event": "train", "step": step, "loss": loss})
    assert write_loss_curve(curve.path, tmp_path / "curve.png") is None
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_tells_where_the_checkpoint_is():
    summary = {
        "step": 16, "total_steps": 16, "first_loss": 10.8, "last_loss": 6.5, "eval_loss": 6.9, "time_s": 200.0,
        "tokens_per_sec": 1310.0, "peak_mem_gib": 7.1, "data_exhausted": False, "epochs_completed": 0,
        "checkpoint": "runs/x/checkpoint-0000016",
    }  # fmt: skip
    text = format_summary(summary, "runs/x/metrics.jsonl")
    assert "loss 10.8000 -> 6.5000, held-out 6.9000" in text and "1.3k tokens/s" in text
    assert "peak memory 7.10 GiB (rank 0)" in text  # 2**30 bytes: GiB, not GB
    assert 'from_pretrained("runs/x/checkpoint-0000016")' in text and "runs/x/metrics.jsonl" in text
    # --resume with a --max-steps that ends before the checkpoint's step: say how to go back to an earlier one
    past = format_summary(summary | {"first_loss": None, "step": 4, "total_steps": 2}, "runs/x/metrics.jsonl")
    assert "nothing to train: already at step 4 of 2 (to train from an earlier checkpoint, name it: --resume" in past
    done = format_summary(summary | {"first_loss": None, "step": 2, "total_steps": 2}, "runs/x/metrics.jsonl")
    assert "already at step 2 of 2\n" in done and "an earlier checkpoint" not in done


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),  # was the L4's 121: "L4" is a substring of "L40"
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 70.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H800", 989.0),
        ("NVIDIA H800 PCIe", None),
        ("NVIDIA B200", 2250.0),
        ("Tesla V100-SXM2-16GB", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA A40", None),
    ],
)
def test_peak_tflops_matches_whole_model_names(monkeypatch, name, tflops):
    """MFU's peak: the model in the device name as whole words (an L40 is not an L4), unknown GPUs None."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda", 0)) == tflops
    assert peak_tflops(torch.device("cpu")) is None


def test_an_fp32_step_has_no_peak_and_so_no_mfu(monkeypatch):
    """MFU against the bf16 peak for an fp32 step read 2x (TF32) to 15x too low on an H100 (its fp32 peak is TF32's or
    plain fp32's, as torch's matmul precision says): no peak, so no MFU; 16-bit dtypes share the bf16 peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert peak_tflops(gpu, torch.float32) is None
    assert peak_tflops(gpu, torch.bfloat16) == peak_tflops(gpu, torch.float16) == 989.0


def test_builtin_models_and_the_sp_check():
    config = TrainConfig()
    assert tokenizer_source(config) is None and tokenizer_source(TrainConfig(model="org/model")) == "org/model"
    hf_config = hf_model_config(config)
    assert (hf_config.hidden_size, hf_config.num_attention_heads, hf_config.vocab_size) == (64, 4, 50257)
    assert hf_config.tie_word_embeddings and hf_config.max_position_embeddings >= config.seq_len
    for name in SHAPES:
        resolve_ring(TrainConfig(model=name, sp=2))
    resolve_ring(TrainConfig(sp=3, nproc=3))  # 3 does not split 4 heads: ulysses 1 x ring 3
    with pytest.raises(ValueError, match=r"--sp 3 --ring 1 does not fit --model 'llama-tiny'.*ulysses 1 x ring 3"):
        resolve_ring(TrainConfig(sp=3, ring=1, nproc=3))
    with pytest.raises(ValueError, match="--model"):
        hf_model_config(TrainConfig(model="./no/such/model"))
    # a benchmark shape's 512-token vocabulary cannot hold the GPT-2 BPE: named with the shapes that fit, not
    # "use the model's own tokenizer" (a built-in shape has none) after two transformers warnings
    bench = TrainConfig(model="llama-bench-tiny")
    with pytest.raises(ValueError, match=r"'llama-bench-tiny' is a built-in shape with a vocabulary of 512.*llama-t"):
        hf_model_config(bench, load_tokenizer())


def test_flops_per_token_counts_matmul_parameters_and_causal_attention():
    from transformers import AutoModelForCausalLM

    hf_config = hf_model_config(TrainConfig())
    model = AutoModelForCausalLM.from_config(hf_config)
    params = sum(p.numel() for p in model.parameters())  # tied: the table counts once, as the lm_head
    layers, heads, head_dim = 2, 4, 16
    assert training_flops_per_token(model, 1024) == 6 * params + 6 * layers * heads * head_dim * 1024


def test_the_default_lr_depends_on_the_model():
    assert TrainConfig().peak_lr() == 1e-2  # the tiny demo model learns fast at a high rate
    assert TrainConfig(model="org/real-model").peak_lr() == 3e-4
    assert TrainConfig(model="org/real-model", lr=1e-5).peak_lr() == 1e-5


def test_expandable_segments_unless_the_user_configured_the_allocator():
    from ulysses_sp.cli import use_expandable_segments

    environ: dict[str, str] = {}
    assert use_expandable_segments(environ) and environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        mine = {name: "max_split_size_mb:128"}
        assert not use_expandable_segments(mine) and mine == {name: "max_split_size_mb:128"}


def test_ring_degree_from_the_heads_or_the_flag():
    from ulysses_sp.train.model_factory import resolve_ring

    assert resolve_ring(TrainConfig(sp=2)) == 1  # llama-tiny: 4 heads, 2 kv heads split over 2 ranks
    assert resolve_ring(TrainConfig(sp=8, nproc=8)) == 2  # 8 > 4 heads: ulysses 4 x ring 2
    assert resolve_ring(TrainConfig(sp=4, ring=4, nproc=4)) == 4
    with pytest.raises(ValueError, match=r"--sp 8 --ring 1 does not fit --model 'llama-tiny'.*ulysses 4 x ring 2"):
        resolve_ring(TrainConfig(sp=8, ring=1, nproc=8))


def test_a_ring_with_a_core_that_cannot_run_in_it_is_refused_before_any_rank_starts():
    from ulysses_sp.train.model_factory import resolve_ring

    for core in ("flex", "flash"):
        with pytest.raises(ValueError, match=rf"--attn-core {core}: .*cannot run inside a ring \(ring degree 2"):
            resolve_ring(TrainConfig(sp=8, nproc=8, attn_core=core))  # 8 > 4 heads: the ring is automatic
    assert resolve_ring(TrainConfig(sp=2, attn_core="flex")) == 1  # no ring: any core


def test_the_automatic_ring_keeps_the_all_to_alls_inside_a_node():
    from ulysses_sp.train.model_factory import choose_run_layout

    # llama-tiny: 4 query / 2 kv heads; sp=4 splits them, but nodes of 2 ranks keep ulysses at 2 (ring 2 across)
    assert choose_run_layout(TrainConfig(sp=4, nproc=4))[0] == 1
    ring, reason = choose_run_layout(TrainConfig(sp=4, nproc=4), gpus_per_node=2)
    assert ring == 2 and "ulysses 2 x ring 2" in reason and "crosses nodes" in reason
    assert choose_run_layout(TrainConfig(sp=4, nproc=4, gpus_per_node=4), gpus_per_node=2)[0] == 1  # the flag wins


def test_a_config_whose_heads_vary_per_layer_is_planned_and_launched_not_a_traceback():
    """Gemma-4's config varies head_dim and num_key_value_heads per layer (its global layers: wider heads, fewer kv
    heads, k = v), and reading either globally raises transformers' AmbiguousGlobalPerLayerAttributeError: plan,
    the launcher's layout check and the FLOP count crashed on it. Each now reads the layers' own values."""
    from tests.helpers.models import build
    from ulysses_sp.features import Features
    from ulysses_sp.hf import config_size_problem, layer_values
    from ulysses_sp.plan import plan_memory
    from ulysses_sp.plan.shape import ModelShape
    from ulysses_sp.train.model_factory import choose_run_layout

    model = build("gemma4_per_layer_kv", kv_heads=2)
    config = model.config
    assert layer_values(config, "head_dim") == [8, 16] and layer_values(config, "num_key_value_heads") == [2, 1]
    assert config_size_problem(config) is None
    shape = ModelShape.from_config(config)
    assert (shape.head_dim, shape.num_kv_heads) == (16, 2)  # the widest layer's, for memory
    assert shape.counted_params == sum(p.numel() for p in model.parameters())
    assert any("vary per layer" in note for note in shape.notes)
    assert choose_run_layout(TrainConfig(sp=2), hf_config=config)[0] == 1
    # layers of several kv head counts run unchunked: the plan predicts that C, and C > 1 is refused before any rank
    assert shape.layer_kv_heads == (1, 2)
    assert plan_memory(shape, seq_len=1 << 20, sp=1, features=Features(head_chunks=None)).head_chunks == 1
    with pytest.raises(ValueError, match=r"head_chunks=2: the model's layers hold different numbers of kv heads"):
        plan_memory(shape, seq_len=1 << 20, sp=1, features=Features(head_chunks=2))
    with pytest.raises(ValueError, match=r"--head-chunks 2 with --sp 2: head_chunks=2: the model's layers hold"):
        choose_run_layout(TrainConfig(sp=2, head_chunks=2), hf_config=config)
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel() * (
        not config.get_text_config().tie_word_embeddings
    )
    assert training_flops_per_token(model, 64) == 6 * params + 6 * 4 * (8 + 16) * 64
