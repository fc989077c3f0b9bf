"""Checkpoint checksums: every file is in the manifest, any damaged file is named, with the newest intact
checkpoint to resume from; a damaged file in a checkpoint without a manifest is one line, not a traceback."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from ulysses_sp.train.checkpoint import STATE_FILE, load_checkpoint, save_checkpoint
from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.integrity import MANIFEST, newest_intact_checkpoint, verify_checkpoint
from ulysses_sp.train.runspec import resume_point


def _save(output_dir: Path, step: int) -> Path:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return save_checkpoint(
        output_dir,
        step,
        model_state={"w": torch.full((64,), float(step))},
        config=TrainConfig(seq_len=128, sp=1, nproc=1),
        optimizer_state=optimizer.state_dict(),
        scheduler_state=scheduler.state_dict(),
        data_state={"epoch": 0, "token_index": 17 * step, "micro_step": step},
        write_sharded=lambda directory: (
            (directory / "optimizer").mkdir() or (directory / "optimizer" / "x").write_text("s")
        ),
    )


def _flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_manifest_covers_every_file_in_sha256sum_format(tmp_path):
    path = _save(tmp_path, 1)
    lines = (path / MANIFEST).read_text().splitlines()
    listed = {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(listed) == on_disk and STATE_FILE in listed and "optimizer/x" in listed
    for name, digest in listed.items():  # what `sha256sum -c checksums.sha256` checks
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == digest
    assert verify_checkpoint(path) is None


@pytest.mark.parametrize(
    "name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rank-00000.pt", STATE_FILE, "optimizer/x"]
)
def test_a_damaged_file_is_named_with_the_newest_intact_checkpoint(tmp_path, name):
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    _flip(newer / name, offset=len((newer / name).read_bytes()) // 2)
    damage = verify_checkpoint(newer)
    assert damage is not None and damage.file == name and "checksum" in damage.problem
    assert newest_intact_checkpoint([older, newer], exclude=newer) == older
    with pytest.raises(ValueError) as error:
        resume_point(TrainConfig(output_dir=str(tmp_path), resume=True))
    message = str(error.value)
    assert name in message and f"--resume {older}" in message and "\n" not in message
    with pytest.raises(ValueError, match=f"--resume {older}"):  # an explicit path is verified too
        resume_point(TrainConfig(output_dir=str(tmp_path), resume=str(newer)))
    assert resume_point(TrainConfig(output_dir=str(tmp_path), resume=str(older))) == older


def test_missing_files_and_a_broken_manifest_are_named(tmp_path):
    path = _save(tmp_path, 3)
    (path / "scheduler.pt").unlink()
    assert verify_checkpoint(path) == ("scheduler.pt", "is missing")
    (path / MANIFEST).write_text("not a manifest\n")
    assert verify_checkpoint(path).file == MANIFEST
    with pytest.raises(ValueError, match="no intact checkpoint is left"):
        resume_point(TrainConfig(output_dir=str(tmp_path), resume=True))


def test_a_manifest_cut_short_names_the_unlisted_file_and_none_warns(tmp_path, capsys):
    """A manifest cut at a line boundary verified the files it still listed, and the others (here the weights,
    bits flipped) were loaded unverified; a checkpoint without one resumed without a word."""
    path = _save(tmp_path, 5)
    lines = (path / MANIFEST).read_text().splitlines()
    kept = [line for line in lines if not line.endswith("model.safetensors")]
    (path / MANIFEST).write_text("".join(f"{line}\n" for line in kept))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    assert verify_checkpoint(path) == ("model.safetensors", f"is not listed in {MANIFEST} (the manifest is cut "
                                       "short): it cannot be verified")  # fmt: skip
    (path / MANIFEST).unlink()
    assert resume_point(TrainConfig(output_dir=str(tmp_path), resume=True)) == path
    assert f"checkpoint {path} has no {MANIFEST}" in capsys.readouterr().err


def test_without_a_manifest_a_damaged_state_is_one_line_naming_the_file(tmp_path):
    path = _save(tmp_path, 4)
    (path / MANIFEST).unlink()  # a checkpoint written before checksums existed: nothing to verify against
    assert verify_checkpoint(path) is None
    (path / "optimizer.pt").write_bytes(b"\x00" * 4096)
    with pytest.raises(ValueError, match=r"optimizer\.pt cannot be read .* damaged") as error:
        load_checkpoint(path)
    assert "weights_only" not in str(error.value)
    (path / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=STATE_FILE):
        load_checkpoint(path)
