"""A resume refuses changed held-out documents, as it refuses changed training documents, naming the document."""

from __future__ import annotations

import json
import re

import pytest

from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.data import build_data
from ulysses_sp.train.documents import load_named_documents, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _books(folder, edited: int | None = None) -> None:
    folder.mkdir(exist_ok=True)
    for number in range(6):
        text = f"Book {number}. " + "And the earth was without form, and void. " * (10 + number)
        (folder / f"d{number}.txt").write_text(text + ("A verse rewritten." if number == edited else ""))


def _data(folder, tokenizer):
    config = TrainConfig(dataset=str(folder), seq_len=64, sp=1, eval_fraction=0.2, seed=1234)
    return build_data(config, tokenizer, dp_rank=0, dp_size=1)


def test_a_changed_held_out_document_is_refused_on_resume_naming_it(tmp_path, tokenizer):
    """A resume with a held-out document rewritten resumed with a note that the --dataset path changed (found by a
    fresh-user trial: the held-out loss moved from 7.2147 to 7.2163): the checkpoint recorded a fingerprint of the
    training documents only."""
    folder = tmp_path / "books"
    _books(folder)
    data = _data(folder, tokenizer)
    state = json.loads(json.dumps(data.state_dict()))  # as trainer_state.json keeps it
    held = data.eval_indices[0]
    assert data.eval_names[0] == repr(str(folder / f"d{held}.txt"))
    _data(folder, tokenizer).load_state_dict(state)  # the same documents resume
    _books(folder, edited=held)
    with pytest.raises(ValueError, match=rf"the held-out document '.*d{held}\.txt' differs \(\d+ tokens at the"):
        _data(folder, tokenizer).load_state_dict(state)
    unrecorded = {k: v for k, v in state.items() if k != "dataset"}  # saved before the dataset's record existed
    with pytest.raises(ValueError, match=rf"held-out document '.*d{held}\.txt' differs from the checkpoint's"):
        _data(folder, tokenizer).load_state_dict(unrecorded)
    older = {k: v for k, v in state.items() if k not in ("held_out", "dataset")}  # saved before either existed
    _data(folder, tokenizer).load_state_dict(older)
    trained = next(n for n in range(6) if n not in data.eval_indices)
    _books(folder, edited=trained)
    with pytest.raises(ValueError, match="saved num_tokens=.* but this run has"):
        _data(folder, tokenizer).load_state_dict(older)


def test_a_changed_added_or_removed_document_is_named_on_resume(tmp_path, tokenizer):
    """A training document edited since the checkpoint was refused as 'saved num_tokens=5975 but this run has 5983'
    (or, at the same count, 'the training documents differ'), naming no file (found by a fresh-user trial): the
    refusal now names each changed, added or removed file, and what changed."""
    folder = tmp_path / "books"
    _books(folder)
    data = _data(folder, tokenizer)
    state = json.loads(json.dumps(data.state_dict()))
    trained = next(n for n in range(6) if n not in data.eval_indices)
    name = repr(str(folder / f"d{trained}.txt"))
    before = data.record.tokens[trained]
    _books(folder, edited=trained)
    after = _data(folder, tokenizer).record.tokens[trained]
    with pytest.raises(ValueError) as refused:
        _data(folder, tokenizer).load_state_dict(state)
    message = str(refused.value)
    assert f"the training document {name} differs ({before} tokens at the checkpoint, {after} now)" in message
    assert f"--dataset {str(folder)!r} changed since the checkpoint" in message
    _books(folder)  # as saved: resumes
    _data(folder, tokenizer).load_state_dict(state)
    (folder / "d2b.txt").write_text("A new book. " * 5)
    with pytest.raises(ValueError, match=r"document '.*d2b\.txt' is new \(\d+ tokens\) \(6 documents then, 7 now\)"):
        _data(folder, tokenizer).load_state_dict(state)
    (folder / "d2b.txt").unlink()
    (folder / "d4.txt").unlink()
    with pytest.raises(ValueError, match=rf"the checkpoint's '.*d4\.txt' is gone \({data.record.tokens[4]} tokens\)"):
        _data(folder, tokenizer).load_state_dict(state)


def test_a_large_dataset_names_the_block_that_changed(tmp_path, tokenizer, monkeypatch):
    """Past MAX_ENTRIES documents a record keeps one entry per block of consecutive rows (it stays small), and a
    change names the block's first and last row; another tokenizer changes every document."""
    monkeypatch.setattr("ulysses_sp.train.dataset_record.MAX_ENTRIES", 4)
    rows = tmp_path / "rows.jsonl"
    texts = [f"Row {n}: " + "and it was so. " * (3 + n) for n in range(10)]
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    config = TrainConfig(dataset=str(rows), seq_len=64, sp=1, eval_fraction=0.0, eval_every=0, seed=1)
    data = build_data(config, tokenizer, dp_rank=0, dp_size=1)
    assert (data.record.block, len(data.record.tokens)) == (3, 4)
    state = json.loads(json.dumps(data.state_dict()))
    texts[4] = texts[4].replace("so", "good")
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    where = f"row 4 of --dataset {str(rows)!r} .. row 6 of --dataset {str(rows)!r}"
    with pytest.raises(ValueError, match=re.escape(f"one of the documents {where} differs")):
        build_data(config, tokenizer, dp_rank=0, dp_size=1).load_state_dict(state)
    state["dataset"]["digests"] = "0" * len(state["dataset"]["digests"])  # as under another tokenizer
    with pytest.raises(ValueError, match="every document of --dataset differs from the checkpoint's"):
        build_data(config, tokenizer, dp_rank=0, dp_size=1).load_state_dict(state)


def test_documents_are_named_by_file_or_row(tmp_path):
    folder = tmp_path / "books"
    folder.mkdir()
    for name, text in (("a.txt", "one"), ("b.txt", " \n"), ("c.txt", "three")):
        (folder / name).write_text(text)
    assert load_named_documents(str(folder)) == (
        ["one", "three"],
        [repr(str(folder / "a.txt")), repr(str(folder / "c.txt"))],
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "one"}\n{"text": ""}\n{"text": "three"}\n')
    assert load_named_documents(str(rows))[1] == [f"row {n} of --dataset {str(rows)!r}" for n in (1, 3)]
