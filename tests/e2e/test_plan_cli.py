"""``ulysses-sp plan``: the table, --json, and exit 2 naming the flag. The first run is the command as a
subprocess; the others run its ``main`` in this process (the same code, without a new interpreter's imports)."""

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.train_cli_helpers import main_in_process


def run(*args: str) -> subprocess.CompletedProcess:
    return main_in_process(["plan", *args])


def run_command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ulysses_sp", "plan", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_table_and_json():
    table = run_command(
        "--model", "qwen3-4b", "--seq-len", "262144", "--gpus-per-node", "8", "--sp", "8", "--host-memory", "1TiB"
    )
    assert table.returncode == 0, table.stderr
    for text in ("per-GPU memory at the peak", "all to all", "longest trainable sequence", "recommendation"):
        assert text in table.stdout
    out = run(
        "--model",
        "qwen3-4b",
        "--seq-len",
        "36864",
        "--gpus-per-node",
        "1",
        "--no-tiled-loss",  # the measured H100 baseline: plain loss and MLP, checkpoints on the GPU
        "--no-tiled-mlp",
        "--activation-checkpointing",
        "checkpoint",
        "--cpu-offload-optimizer",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["plan"]["fits"] and 36864 <= data["max_seq_len"] < 40960
    assert data["recommendation"]["reaches_target"]
    defaults = json.loads(run("--model", "qwen3-4b", "--seq-len", "65536", "--gpus-per-node", "1", "--json").stdout)
    features = defaults["plan"]["features"]  # the defaults are those of `ulysses-sp train` on a GPU
    assert features["tiled_loss"] and features["tiled_mlp"] and features["activation_checkpointing"] == "offload"
    assert features["loss_chunk_mib"] == 1024  # 1 GiB of logits per loss chunk


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--sp", "3"], "--sp"),
        (["--dp", "3"], "--dp"),
        (["--gpu-memory", "80XB"], "--gpu-memory"),
        (["--activation-checkpointing", "sometimes"], "--activation-checkpointing"),
        # what the simulated step cannot run: a ValueError's traceback from simulate_step, after the plan
        (["--sp", "8", "--seq-len", "8193", "--simulate"], "--simulate needs a --seq-len divisible by --sp 8"),
        (["--parallel", "ddp", "--simulate"], "--simulate measures FSDP2's step only; drop --parallel ddp"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, flag):
    result = run("--model", "qwen3-4b", "--seq-len", "8192", "--gpus-per-node", "8", *args)
    assert result.returncode == 2 and flag in result.stderr, result.stderr


def test_a_hybrid_layout_across_nodes():
    out = run("--model", "llama-3.1-8b", "--seq-len", "4194304", "--sp", "64", "--gpus-per-node", "8", "--nodes", "8")
    assert out.returncode == 0, out.stderr
    assert "layout: ulysses 8 x ring 8 for sp=64" in out.stdout and "ring p2p" in out.stdout
    data = json.loads(
        run("--model", "llama-3.1-8b", "--seq-len", "4194304", "--sp", "64", "--nodes", "8", "--json").stdout
    )
    assert (data["plan"]["ulysses"], data["plan"]["ring"]) == (8, 8)
    bad = run("--model", "llama-3.1-8b", "--seq-len", "65536", "--sp", "8", "--ring", "3")
    assert bad.returncode == 2 and "--ring 3" in bad.stderr


def test_a_simulated_step_the_host_cannot_hold_is_refused_not_run():
    """--simulate on the CPU of a step whose plan needs more memory than the machine has available: one line
    naming --simulate and both sizes, exit 2 (it used to run the step, which swaps or gets the process killed;
    here the machine stands in as one with 1 MiB available)."""
    from unittest import mock

    with mock.patch("ulysses_sp.simulate.available_host_bytes", return_value=1 << 20):
        result = run("--model", "llama-tiny", "--seq-len", "1024", "--sp", "2", "--gpus-per-node", "2", "--simulate")
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("ulysses-sp plan: error: --simulate: a step of 1,024 tokens on the CPU needs about"), line
    assert "0.0 GiB of memory available here" in line and "Traceback" not in result.stderr


def test_a_model_not_in_the_cache_is_one_line():
    """A hub id not in the local cache (offline): the error is the last line, whole (the hub client's message ran
    over two lines, the second one without the command's name)."""
    result = run("--model", "no-such-org/no-such-model", "--seq-len", "8192")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ulysses-sp plan: error: --model: model 'no-such-org/no-such-model' cannot be loaded"), last
    assert last.endswith("or a Hugging Face id that is in the local cache"), last
