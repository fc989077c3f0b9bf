"""Checkpoints: contents round trip, atomicity under failure and SIGKILL, pruning, discovery, ranks."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ulysses_sp.train.checkpoint import (
    checkpoint_name,
    clean_incomplete_checkpoints,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ulysses_sp.train.config import TrainConfig, config_to_dict
from ulysses_sp.train.rng import capture_rng_state, restore_rng_state

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _train_one_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def _plain_save(output_dir, step, **kwargs):
    weights = {"w": torch.full((3,), float(step))}
    return save_checkpoint(
        output_dir,
        step,
        model_state=weights,
        data_state={"epoch": 0, "step": step},
        metrics={"loss": 1.0 / (step + 1)},
        **kwargs,
    )


def test_round_trip_of_all_contents(tmp_path, tiny_model):
    from transformers import LlamaForCausalLM

    from ulysses_sp.train.documents import load_tokenizer

    optimizer, scheduler = _train_one_step(tiny_model)
    config = TrainConfig(seq_len=128, sp=1, nproc=1)
    tokenizer = load_tokenizer()
    rng_before = capture_rng_state()
    path = save_checkpoint(
        tmp_path,
        20,
        model=tiny_model,
        model_state=tiny_model.state_dict,
        tokenizer=tokenizer,
        config=config,
        optimizer_state=optimizer.state_dict(),
        scheduler_state=scheduler.state_dict,
        data_state={"epoch": 1, "token_index": 4096, "micro_step": 40},
        metrics={"loss": 2.5, "tokens": 123},
        rank_state={"extra": torch.arange(3)},
    )
    assert path == tmp_path / "checkpoint-0000020" and path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-0000020"]  # no temporary leftovers

    loaded = load_checkpoint(tmp_path)  # an output dir resolves to its newest checkpoint
    assert loaded.path == path and loaded.step == 20 and loaded.world_size == 1
    assert loaded.data_state == {"epoch": 1, "token_index": 4096, "micro_step": 40}
    assert loaded.metrics == {"loss": 2.5, "tokens": 123}
    assert loaded.config == config_to_dict(config)
    assert torch.equal(loaded.rank_state["extra"], torch.arange(3))

    # model in HF format, identical weights
    reloaded = LlamaForCausalLM.from_pretrained(path)
    for name, tensor in tiny_model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    weights = loaded.model_state_dict()
    torch.testing.assert_close(weights["model.embed_tokens.weight"], tiny_model.model.embed_tokens.weight)

    # tokenizer, optimizer and scheduler load back
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(path)("In the beginning")["input_ids"] == [818, 262, 3726]
    fresh_optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    fresh_optimizer.load_state_dict(loaded.optimizer_state)
    for key, value in optimizer.state_dict()["state"][0].items():
        torch.testing.assert_close(fresh_optimizer.state_dict()["state"][0][key], value)
    assert loaded.scheduler_state["last_epoch"] == scheduler.state_dict()["last_epoch"]

    # RNG states: restoring reproduces the same draws in python, numpy and torch
    def draws():
        return random.random(), float(np.random.rand()), torch.rand(2)

    assert loaded.restore_rng()
    restored = draws()
    draws()  # move every generator on
    restore_rng_state(rng_before)  # the state captured just before saving
    expected = draws()
    assert restored[:2] == expected[:2] and torch.equal(restored[2], expected[2])


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path):
    first = _plain_save(tmp_path, 10)

    class ExplodingTokenizer:
        def save_pretrained(self, directory):
            (Path(directory) / "tokenizer.json").write_text("{partial")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        _plain_save(tmp_path, 20, tokenizer=ExplodingTokenizer())
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == [".tmp-checkpoint-0000020"]
    assert find_latest_checkpoint(tmp_path) == first
    loaded = load_checkpoint(tmp_path)
    assert loaded.step == 10 and torch.equal(loaded.model_state_dict()["w"], torch.full((3,), 10.0))

    third = _plain_save(tmp_path, 30)  # the next save cleans the incomplete directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000010", "checkpoint-0000030"]
    assert find_latest_checkpoint(tmp_path) == third


def test_sigkill_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {SRC!r})
        from ulysses_sp.train.checkpoint import save_checkpoint

        class KillDuringSave:
            def save_pretrained(self, directory):
                open(os.path.join(directory, "tokenizer.json"), "w").write("{{partial")
                os.kill(os.getpid(), signal.SIGKILL)

        out = sys.argv[1]
        save_checkpoint(out, 1, model_state={{"w": torch.ones(2)}}, data_state={{"epoch": 0}})
        save_checkpoint(out, 2, model_state={{"w": torch.zeros(2)}}, tokenizer=KillDuringSave())
        """
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    assert (tmp_path / ".tmp-checkpoint-0000002").is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-0000001"]
    loaded = load_checkpoint(tmp_path)
    assert loaded.step == 1 and loaded.data_state == {"epoch": 0}
    assert torch.equal(loaded.model_state_dict()["w"], torch.ones(2))
    assert clean_incomplete_checkpoints(tmp_path) == [tmp_path / ".tmp-checkpoint-0000002"]


def test_sharded_writer_runs_inside_the_uncommitted_directory(tmp_path):
    seen = []

    def write_sharded(directory):
        seen.append(directory.name)
        (directory / "optimizer").mkdir()
        (directory / "optimizer" / "shard-0").write_bytes(b"state")

    path = _plain_save(tmp_path, 5, write_sharded=write_sharded)
    assert seen == [".tmp-checkpoint-0000005"]
    assert (path / "optimizer" / "shard-0").read_bytes() == b"state"


def test_keep_last_deletes_older_ones_after_the_new_one(tmp_path):
    for step in (5, 10, 15, 20):
        _plain_save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000015", "checkpoint-0000020"]
    _plain_save(tmp_path, 25, keep_last=0)  # 0 keeps everything
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "checkpoint-0000015",
        "checkpoint-0000020",
        "checkpoint-0000025",
    ]
    _plain_save(tmp_path, 30, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-0000030"]


def test_discovery_ignores_incomplete_and_foreign_directories(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load_checkpoint(tmp_path)
    _plain_save(tmp_path, 3)
    (tmp_path / "checkpoint-0000099").mkdir()  # no trainer_state.json: not complete
    (tmp_path / ".tmp-checkpoint-0000100").mkdir()
    (tmp_path / "checkpoint-latest").mkdir()
    _plain_save(tmp_path, 12)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-0000003", "checkpoint-0000012"]
    assert load_checkpoint(tmp_path / "checkpoint-0000003").step == 3  # a checkpoint path loads directly
    assert not (tmp_path / ".tmp-checkpoint-0000100").exists()
    assert checkpoint_name(12_345_678) == "checkpoint-12345678"
    _plain_save(tmp_path, 12_345_678)
    assert find_latest_checkpoint(tmp_path).name == "checkpoint-12345678"  # numeric, not lexical order


def test_same_step_saved_twice_and_interrupted_overwrite(tmp_path):
    _plain_save(tmp_path, 7)
    save_checkpoint(tmp_path, 7, model_state={"w": torch.full((3,), 70.0)}, metrics={"v": 2})
    loaded = load_checkpoint(tmp_path)
    assert loaded.metrics == {"v": 2} and torch.equal(loaded.model_state_dict()["w"], torch.full((3,), 70.0))
    # a kill after moving the old copy aside but before the rename: the old copy comes back
    os.replace(tmp_path / "checkpoint-0000007", tmp_path / ".old-checkpoint-0000007")
    clean_incomplete_checkpoints(tmp_path)
    assert load_checkpoint(tmp_path).metrics == {"v": 2}


def test_bad_inputs_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, 1, data_state={"array": torch.zeros(1)})
    with pytest.raises(ValueError, match="keep-last"):
        save_checkpoint(tmp_path, 1, keep_last=-1)
    assert list(tmp_path.iterdir()) == []


def test_every_rank_writes_its_own_rng_and_state(tmp_path):
    world_size = 2
    barrier = threading.Barrier(world_size)
    errors = []

    def rank_main(rank: int) -> None:
        try:
            save_checkpoint(
                tmp_path,
                4,
                model_state={"w": torch.ones(1)},
                rank_state={"rank": rank},
                optimizer_state=lambda: {"from_rank": rank},
                rank=rank,
                world_size=world_size,
                barrier=barrier.wait,
            )
        except Exception as error:  # surfaced below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    for rank in range(world_size):
        loaded = load_checkpoint(tmp_path, rank=rank)
        assert loaded.world_size == 2 and loaded.rank_state == {"rank": rank}
        assert loaded.rng_state is not None
        assert loaded.optimizer_state == {"from_rank": 0}  # only rank 0 writes the shared files
    assert load_checkpoint(tmp_path, rank=5).rng_state is None  # more ranks than saved: nothing to restore


def test_two_rewinds_in_the_same_second_keep_both_abandoned_checkpoints(tmp_path):
    """Each rewind renames the newer checkpoints abandoned-checkpoint-N-<time>; a second one in the same second
    crashed on the name the first one took (os.replace onto a folder that is not empty)."""
    from ulysses_sp.train.checkpoint import STATE_FILE, set_aside_newer

    def checkpoint(step: int) -> None:
        folder = tmp_path / f"checkpoint-{step:07d}"
        folder.mkdir()
        (folder / STATE_FILE).write_text(str(step))

    checkpoint(4)
    checkpoint(8)
    first = set_aside_newer(tmp_path, 4, stamp=1700000000)
    checkpoint(8)
    second = set_aside_newer(tmp_path, 4, stamp=1700000000)
    assert [p.name for p in first + second] == [
        "abandoned-checkpoint-0000008-1700000000",
        "abandoned-checkpoint-0000008-1700000000-2",
    ]
    assert all((p / STATE_FILE).is_file() for p in first + second)
