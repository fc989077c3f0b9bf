"""A resume refuses changed held-out documents, as it refuses changed training documents, naming the document."""

from __future__ import annotations

import json

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
    with pytest.raises(ValueError, match=rf"held-out document '.*d{held}\.txt' differs from the checkpoint's"):
        _data(folder, tokenizer).load_state_dict(state)
    _data(folder, tokenizer).load_state_dict({k: v for k, v in state.items() if k != "held_out"})  # older checkpoint
    trained = next(n for n in range(6) if n not in data.eval_indices)
    _books(folder, edited=trained)
    with pytest.raises(ValueError, match="saved num_tokens=.* but this run has"):
        _data(folder, tokenizer).load_state_dict(state)


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
