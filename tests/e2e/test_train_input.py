"""End-to-end: bad input to ``ulysses-sp train`` is refused with one line naming the flag or the file and the
fix (exit 2), before any rank starts where it can be checked there. Such a refusal runs the command in this
process (its ``main``; starting a rank would fail the test); one that only the ranks can make (a file whose rows
hold no text), or that depends on settings read at import (the hub's offline mode), runs the real command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.train_cli_helpers import TINY, error_lines, refuse_in_process, run_cli

pytestmark = pytest.mark.slow


def _binary(tmp_path: Path) -> tuple[list[str], list[str]]:
    path = tmp_path / "weights.txt"
    path.write_bytes(bytes(range(256)) * 64)
    return ["--dataset", str(path)], ["--dataset", "weights.txt"]


def _malformed(tmp_path: Path) -> tuple[list[str], list[str]]:
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "In the beginning"}\n{"text": "unterminated\n')
    return ["--dataset", str(path)], ["--dataset", "broken.jsonl"]


def _parquet_field(tmp_path: Path) -> tuple[list[str], list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": ["In the beginning", "God created"]}), path)
    return ["--dataset", str(path)], ["rows.parquet", "--text-field column 'text'", "['body']"]


def _empty(tmp_path: Path) -> tuple[list[str], list[str]]:
    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("", "  ", "\n")))
    return ["--dataset", str(path)], ["--dataset", "no text"]


def _hub(tmp_path: Path) -> tuple[list[str], list[str]]:
    return ["--dataset", "no-such-org/no-such-dataset"], ["--dataset", "no-such-org/no-such-dataset"]


def _tokenizer(tmp_path: Path) -> tuple[list[str], list[str]]:
    return ["--tokenizer", str(tmp_path / "no-tokenizer")], ["--tokenizer", "no-tokenizer"]


def _no_tokenizer_files(tmp_path: Path) -> tuple[list[str], list[str]]:
    folder = tmp_path / "weights-only"  # a model folder without its tokenizer: the cause quoted used to be empty
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return ["--tokenizer", str(folder)], ["--tokenizer", "weights-only", "holds no tokenizer files", "gpt2-bpe"]


def _model_is_a_run_folder(tmp_path: Path) -> tuple[list[str], list[str]]:
    run = tmp_path / "earlier-run"  # its checkpoints are the models: the line used to say it held no tokenizer
    (run / "checkpoint-0000002").mkdir(parents=True)
    (run / "checkpoint-0000002" / "trainer_state.json").write_text("{}")
    return ["--model", str(run)], ["--model", "is a training run's --output-dir", "earlier-run/checkpoint-0000002"]


def _learned_positions(tmp_path: Path) -> tuple[list[str], list[str]]:
    from transformers import GPT2Config

    folder = tmp_path / "gpt2-128"  # a position table of 128 rows: 256 tokens was an IndexError on every rank
    GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128).save_pretrained(folder)
    return ["--model", str(folder), "--tokenizer", "gpt2-bpe"], ["--seq-len: sequences of 256 tokens", "128 positions"]


def _output_is_a_file(tmp_path: Path) -> tuple[list[str], list[str]]:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return ["--output-dir", str(path)], ["--output-dir", "a-file", "not a directory"]


@pytest.mark.parametrize(
    "case",
    [
        _binary,
        _malformed,
        _parquet_field,
        _empty,
        _hub,
        _tokenizer,
        _no_tokenizer_files,
        _model_is_a_run_folder,
        _learned_positions,
        _output_is_a_file,
    ],
)
def test_bad_data_tokenizer_or_output_dir_is_one_line(case, tmp_path):
    args, needles = case(tmp_path)
    if "--output-dir" not in args:
        args += ["--output-dir", str(tmp_path / "out")]
    args = [*TINY, "--max-steps", "1", *args]
    # the empty rows are refused on the ranks; the hub's offline settings are read when datasets is imported,
    # which this process did long ago: both run the real command
    result = run_cli(args, timeout=120) if case in (_empty, _hub) else refuse_in_process(args)
    assert result.returncode == 2, result.stdout + result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert "Traceback" not in result.stderr and len(error_lines(result)) <= 2, result.stderr
    assert "--eval-fraction" not in result.stderr


@pytest.mark.parametrize(
    ("args", "needle", "not_blamed"),
    [
        (["--lr", "inf"], "--lr", None),
        (["--max-grad-norm", "nan"], "--max-grad-norm", None),
        (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1)", None),
        (["--nproc", "0"], "--nproc", "--sp"),
        (["--nproc", "1000", "--sp", "2"], "--nproc 1000 is more than", None),  # (no rank started: refuse_in_process)
    ],
)
def test_non_finite_numbers_and_bad_nproc_name_their_flag(args, needle, not_blamed, tmp_path):
    result = refuse_in_process([*args, "--output-dir", str(tmp_path)])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    if not_blamed is not None:
        assert not_blamed not in error_lines(result)[-1], result.stderr
