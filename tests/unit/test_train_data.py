"""Data pipeline: documents, tokenizer, packing/windows, dp sharding, resumption, schedules."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.data import SequenceLoader, build_data
from ulysses_sp.train.dataset_checks import check_dataset
from ulysses_sp.train.documents import (
    TokenizedCorpus,
    load_bible,
    load_documents,
    load_tokenizer,
    split_documents,
    tokenize_documents,
)
from ulysses_sp.train.schedule import SeqLenSchedule
from ulysses_sp.validation import IGNORE_INDEX

KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def bible_corpus(tokenizer):
    return tokenize_documents(load_bible(), tokenizer)


def _synthetic_corpus(seed: int = 0, num_docs: int = 23, max_len: int = 40) -> TokenizedCorpus:
    """Documents of varied lengths whose tokens are all distinct (token id = global token number)."""
    lengths = np.random.default_rng(seed).integers(1, max_len, size=num_docs)
    lengths[3] = 3 * max_len  # one document longer than several rows
    start = np.concatenate([[0], np.cumsum(lengths)])
    return TokenizedCorpus.from_token_lists([list(range(start[d], start[d + 1])) for d in range(num_docs)])


def _drain(loader: SequenceLoader, limit: int = 10_000) -> list[dict[str, torch.Tensor]]:
    batches = []
    for batch in loader:
        batches.append(batch)
        assert len(batches) < limit
    return batches


def _real_tokens(batches) -> list[int]:
    return [int(t) for b in batches for t in b["input_ids"][b["attention_mask"].bool()]]


def _assert_each_token_once(tokens: list[int], corpus: TokenizedCorpus, pack: bool, epochs: int = 1) -> None:
    """Every token lies in a row once per epoch, except a lone last token (of a document under --no-pack, of
    the epoch's stream when packed): a row of one token would have nothing to predict."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=corpus.num_tokens)
    assert counts.max() <= epochs
    missing = np.flatnonzero(counts < epochs)
    assert np.isin(missing, corpus.offsets[1:] - 1).all(), missing  # only last tokens of documents
    if pack:
        assert int((epochs - counts).sum()) <= epochs  # at most the stream's last token, once per epoch


def _check_rows(batches, corpus: TokenizedCorpus, seq_len: int | None, pack: bool) -> None:
    """Shapes, dtypes, labels, padding and the position-id rule, using the distinct token ids."""
    doc_of = np.repeat(np.arange(corpus.num_docs), corpus.doc_lengths)
    doc_start = corpus.offsets[doc_of]
    for batch in batches:
        assert set(batch) == set(KEYS)
        for key in KEYS:
            assert batch[key].dtype == torch.int64 and batch[key].shape == batch["input_ids"].shape
        if seq_len is not None:
            assert batch["input_ids"].shape[1] == seq_len
        for ids, labels, pos, mask in zip(*(batch[k] for k in KEYS), strict=True):
            real = int(mask.sum())
            assert torch.all(mask[:real] == 1) and torch.all(mask[real:] == 0)  # padding only at the end
            assert torch.equal(labels[:real], ids[:real]) and torch.all(labels[real:] == IGNORE_INDEX)
            assert torch.equal(pos[real:], torch.arange(len(pos) - real))  # padding: own segment from 0
            tokens = ids[:real].numpy()
            docs = doc_of[tokens]
            if not pack:
                assert len(set(docs.tolist())) <= 1  # a window never crosses documents
            for j in range(real):
                starts_segment = j == 0 or tokens[j] == doc_start[tokens[j]]
                expected = 0 if starts_segment else int(pos[j - 1]) + 1
                assert int(pos[j]) == expected, (j, tokens[j])
                if j:
                    # within a row the stream is contiguous inside a document
                    assert starts_segment or tokens[j] == tokens[j - 1] + 1


def test_bible_loads_as_66_documents_and_tokenizes(tokenizer, bible_corpus):
    documents = load_bible()
    assert len(documents) == 66
    assert documents[0].startswith("Genesis") and "In the beginning God created" in documents[0]
    assert documents[-1].startswith("Revelation")
    ids = tokenizer("In the beginning God created the heaven and the earth.")["input_ids"]
    assert ids == [818, 262, 3726, 1793, 2727, 262, 9538, 290, 262, 4534, 13]  # the real GPT-2 BPE ids
    assert len(tokenizer) == 50257
    assert bible_corpus.num_docs == 66 and 900_000 < bible_corpus.num_tokens < 1_200_000
    assert len(np.unique(bible_corpus.tokens)) > 10_000
    # every document ends with EOS (GPT-2 has no distinct BOS, so none is prepended)
    last_tokens = bible_corpus.tokens[bible_corpus.offsets[1:] - 1]
    assert np.all(last_tokens == tokenizer.eos_token_id)
    assert tokenizer.decode(bible_corpus.document(0)[:4]).startswith("Genesis")


def test_bible_rows_have_expected_format(bible_corpus):
    loader = SequenceLoader(bible_corpus, schedule=16384, seed=1, epochs=1, pad_token_id=50256)
    batch = next(loader)
    assert all(batch[k].shape == (1, 16384) for k in KEYS)
    starts = int((batch["position_ids"] == 0).sum())
    assert starts >= 1 and batch["position_ids"][0, 0] == 0
    assert int(batch["attention_mask"].sum()) == 16384
    assert loader.micro_batches_per_epoch(16384) == -(-bible_corpus.num_tokens // 16384)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_packing_keeps_every_token_once_and_restarts_positions(batch_size):
    corpus = _synthetic_corpus()
    loader = SequenceLoader(corpus, schedule=16, batch_size=batch_size, seed=3, epochs=1)
    batches = _drain(loader)
    _assert_each_token_once(_real_tokens(batches), corpus, pack=True)
    _check_rows(batches, corpus, seq_len=16, pack=True)
    assert len(batches) == loader.micro_batches_per_epoch(16)
    # packing: only the very last row of the epoch may be padded
    masks = torch.cat([b["attention_mask"] for b in batches])
    assert int((masks.sum(dim=1) < 16).sum()) <= batch_size


def test_windows_keep_every_token_and_pad_last_window():
    corpus = _synthetic_corpus()
    loader = SequenceLoader(corpus, schedule=16, batch_size=2, pack=False, seed=3, epochs=1)
    batches = _drain(loader)
    _assert_each_token_once(_real_tokens(batches), corpus, pack=False)
    _check_rows(batches, corpus, seq_len=16, pack=False)
    rows = sum(n // 16 + (n % 16 >= 2) for n in corpus.doc_lengths)  # a lone last token makes no window
    real_rows = sum(int((b["attention_mask"].sum(dim=1) > 0).sum()) for b in batches)
    assert real_rows == rows
    assert len(batches) == loader.micro_batches_per_epoch(16)
    # windows start at multiples of seq_len inside each document
    for batch in batches:
        first = batch["input_ids"][:, 0][batch["attention_mask"][:, 0] == 1].numpy()
        doc_of = np.repeat(np.arange(corpus.num_docs), corpus.doc_lengths)
        assert np.all((first - corpus.offsets[doc_of[first]]) % 16 == 0)


@pytest.mark.parametrize("pack", [True, False])
def test_dp_ranks_get_disjoint_rows_covering_everything(pack):
    corpus = _synthetic_corpus(seed=5)
    per_rank = [
        _drain(SequenceLoader(corpus, schedule=12, batch_size=2, dp_rank=r, dp_size=2, seed=9, epochs=1, pack=pack))
        for r in range(2)
    ]
    assert len(per_rank[0]) == len(per_rank[1])  # same number of steps on every rank: no hang
    tokens = [set(_real_tokens(batches)) for batches in per_rank]
    assert not tokens[0] & tokens[1]
    _assert_each_token_once(_real_tokens(per_rank[0]) + _real_tokens(per_rank[1]), corpus, pack=pack)


def test_order_is_deterministic_per_seed_and_epoch():
    corpus = _synthetic_corpus()

    def first_epoch_tokens(seed: int, epochs: int = 1) -> list[list[int]]:
        loader = SequenceLoader(corpus, schedule=16, seed=seed, epochs=epochs)
        return [b["input_ids"][0].tolist() for b in _drain(loader)]

    assert first_epoch_tokens(1) == first_epoch_tokens(1)
    assert first_epoch_tokens(1) != first_epoch_tokens(2)
    two = first_epoch_tokens(1, epochs=2)
    half = len(two) // 2
    assert two[:half] == first_epoch_tokens(1) and two[half:] != two[:half]  # reshuffled each epoch
    assert sorted(t for row in two[half:] for t in row) == sorted(t for row in two[:half] for t in row)


@pytest.mark.parametrize("pack", [True, False])
def test_resume_from_state_dict_gives_exactly_the_same_rows(pack):
    corpus = _synthetic_corpus(seed=7)
    schedule = SeqLenSchedule.parse("8:3,16:7,32", default_seq_len=32)

    def make() -> SequenceLoader:
        return SequenceLoader(
            corpus, schedule=schedule, batch_size=2, dp_rank=1, dp_size=2, pack=pack, seed=11, epochs=None, grad_accum=2
        )

    reference = make()
    reference_batches = [next(reference) for _ in range(60)]  # crosses schedule changes and epochs
    assert reference.epoch >= 2
    for stop in (1, 5, 6, 13, 27, 41):
        original = make()
        for _ in range(stop):
            next(original)
        state = json.loads(json.dumps(original.state_dict()))  # survives a JSON checkpoint
        resumed = make()
        resumed.load_state_dict(state)
        for expected in reference_batches[stop:]:
            got = next(resumed)
            assert all(torch.equal(got[k], expected[k]) for k in KEYS), stop


def test_resume_rejects_a_different_dataset_or_seed():
    corpus = _synthetic_corpus()
    state = SequenceLoader(corpus, schedule=16, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        SequenceLoader(corpus, schedule=16, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_docs"):
        SequenceLoader(_synthetic_corpus(num_docs=5), schedule=16, seed=1).load_state_dict(state)
    # as many documents and tokens, in another order or with one token edited: resumed silently before
    reordered = corpus.subset(np.arange(corpus.num_docs)[::-1])
    edited = TokenizedCorpus(corpus.tokens.copy(), corpus.offsets)
    edited.tokens[3] += 1
    for other in (reordered, edited):
        assert (other.num_docs, other.num_tokens) == (corpus.num_docs, corpus.num_tokens)
        with pytest.raises(ValueError, match="documents differ from the checkpoint's"):
            SequenceLoader(other, schedule=16, seed=1).load_state_dict(state)
    del state["fingerprint"]  # a checkpoint saved before fingerprints: resumes on the counts alone
    SequenceLoader(edited, schedule=16, seed=1).load_state_dict(state)


@pytest.mark.parametrize("pack", [True, False])
def test_schedule_repacks_without_losing_tokens(pack):
    corpus = _synthetic_corpus(seed=2)
    schedule = SeqLenSchedule.parse("8:4,24", default_seq_len=24)
    loader = SequenceLoader(corpus, schedule=schedule, batch_size=1, pack=pack, seed=0, epochs=2, grad_accum=2)
    batches = _drain(loader)
    lengths = [b["input_ids"].shape[1] for b in batches]
    assert lengths[:8] == [8] * 8 and set(lengths[8:]) == {24}  # 4 optimizer steps x 2 micro-batches at 8
    assert len(batches) == loader.total_micro_batches(epochs=2)
    _assert_each_token_once(_real_tokens(batches), corpus, pack=pack, epochs=2)
    with pytest.raises(StopIteration):
        next(loader)


@pytest.mark.parametrize("pack", [True, False])
def test_every_micro_batch_has_a_target(pack):
    """A document of seq_len + 1 tokens (--no-pack), or a stream of seq_len + 1 (packed), used to end in a row of
    one token: a micro-batch without any target, logged as loss 0.0, on which AdamW still stepped."""
    corpus = TokenizedCorpus.from_token_lists([list(range(9)), [9, 10], [11], list(range(12, 20))])  # 9, 2, 1, 8
    for dp_size in (1, 2, 3):
        loaders = [
            SequenceLoader(corpus, schedule=8, dp_rank=r, dp_size=dp_size, pack=pack, seed=1, epochs=3)
            for r in range(dp_size)
        ]
        per_rank = [_drain(loader) for loader in loaders]
        assert len(per_rank[0]) == loaders[0].total_micro_batches(3) == len(per_rank[-1])
        for micro_batches in zip(*per_rank, strict=True):  # the targets of one micro-batch over the dp ranks
            rows = torch.cat([b["attention_mask"].sum(dim=1) for b in micro_batches])
            assert int(rows.max()) >= 2, rows  # at least one token with a next token to predict
        _assert_each_token_once(sum((_real_tokens(b) for b in per_rank), []), corpus, pack=pack, epochs=3)
    with pytest.raises(ValueError, match="sequence lengths must be >= 2"):
        SequenceLoader(corpus, schedule=1)
    with pytest.raises(ValueError, match="no document of two tokens"):
        SequenceLoader(TokenizedCorpus.from_token_lists([[1], [2]]), schedule=8, pack=False)


def test_split_documents_is_deterministic_and_disjoint():
    corpus = _synthetic_corpus(num_docs=40)
    train, held = split_documents(corpus, 0.1, seed=4)
    train2, held2 = split_documents(corpus, 0.1, seed=4)
    assert held.num_docs == 4 and train.num_docs == 36
    assert np.array_equal(held.tokens, held2.tokens) and np.array_equal(train.tokens, train2.tokens)
    assert sorted(np.concatenate([train.tokens, held.tokens]).tolist()) == list(range(corpus.num_tokens))
    _, other = split_documents(corpus, 0.1, seed=5)
    assert not np.array_equal(held.tokens, other.tokens)
    assert split_documents(corpus, 0.0, seed=4) == (corpus, None)
    assert split_documents(corpus, 0.001, seed=4)[1].num_docs == 1  # at least one held-out document


def test_one_text_file_with_a_held_out_fraction_is_refused_before_the_ranks(tmp_path):
    """A .txt file is one document: the default --eval-fraction has nothing to hold out. This was found only on
    the ranks, and the fix it named (--eval-fraction 0) was refused next for the default --eval-every."""
    book = tmp_path / "book.txt"
    book.write_text("In the beginning God created the heaven and the earth.\n" * 20)
    with pytest.raises(ValueError, match=r"--eval-fraction 0\.05 needs at least 2 documents.*--eval-every 0"):
        check_dataset(str(book), eval_fraction=0.05)
    check_dataset(str(book), eval_fraction=0.0)
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="weights.txt is not UTF-8"):  # the file's own problem is named first
        check_dataset(str(binary), eval_fraction=0.05)
    binary.unlink()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="each text file is one document"):
        check_dataset(str(tmp_path), eval_fraction=0.05)  # an empty file is no document
    (tmp_path / "other.txt").write_text("And the earth was without form, and void.")
    check_dataset(str(tmp_path), eval_fraction=0.05)
    one = TokenizedCorpus.from_token_lists([[1, 2, 3]])
    with pytest.raises(ValueError, match="--eval-fraction 0 --eval-every 0"):
        split_documents(one, 0.05, seed=0)


_ROWS = [{"body": f"document {i} " * 3, "n": i} for i in range(4)]
_LONG_ROWS = [{"body": "a long document " * 6000, "n": i} for i in range(2)]  # each row over the 64 KiB read
_OBJECT = "top-level object"  # one JSON object over several lines: its keys are the columns


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("lines.jsonl", "".join(json.dumps(r) + "\n" for r in _ROWS), "line 1"),
        ("lines.json", "".join(json.dumps(r) + "\n" for r in _ROWS), "line 1"),  # JSON lines in a .json file
        ("array.json", json.dumps(_ROWS), "row 1"),
        ("pretty.json", json.dumps(_ROWS, indent=2), "row 1"),
        ("object.json", json.dumps({"body": {str(i): r["body"] for i, r in enumerate(_ROWS)}}, indent=2), _OBJECT),
        ("long.jsonl", "".join(json.dumps(r) + "\n" for r in _LONG_ROWS), "line 1"),
        ("long.json", json.dumps(_LONG_ROWS), "row 1"),
    ],
)
def test_a_wrong_text_field_is_refused_before_the_ranks_naming_the_fields(name, text, where, tmp_path):
    """--text-field names no field of a .json / .jsonl file: check_dataset (the launcher, before any rank starts)
    refuses it with the fields the file has, as the ranks would (they still check the loaded columns)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"{name} {where}.* has no --text-field 'text' \(it holds \['body'"):
        check_dataset(str(path))
    with pytest.raises(ValueError, match="--text-field 'text' is not a column"):  # the ranks' own check stays
        load_documents(str(path))
    check_dataset(str(path), text_field="body")


@pytest.mark.parametrize(("value", "kind"), [(5, "int 5"), (["a", "b"], "list"), ({"x": 1}, "dict"), (1.5, "float")])
def test_a_row_whose_text_field_is_not_a_string_is_refused_naming_it(value, kind, tmp_path):
    """A number, a list or an object where the text should be is refused, naming the row: by the launcher when it
    is in the file's head, by the ranks' load anywhere (it used to be dropped in silence, as an empty row is)."""
    rows = [{"text": "a first document"}, {"text": None}, {"text": ""}, {"text": value}, {"text": "the last"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"rows.jsonl line 4: its --text-field 'text' holds {kind}.*, not text"):
        check_dataset(str(path))
    with pytest.raises(ValueError, match=rf"--dataset '.*rows.jsonl' row 4: its --text-field 'text' holds {kind}"):
        load_documents(str(path))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:3] + rows[4:]))  # null and empty: skipped
    check_dataset(str(path))
    assert load_documents(str(path)) == ["a first document", "the last"]


def test_a_parquet_file_without_the_text_field_or_unreadable_is_refused_before_the_ranks(tmp_path):
    """A parquet file's columns come from its footer alone: a --text-field it lacks is refused by check_dataset,
    naming the columns, as is a file that starts as parquet but has no readable footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"body": [r["body"] for r in _ROWS], "n": [r["n"] for r in _ROWS]}), path)
    with pytest.raises(ValueError, match=r"rows.parquet has no --text-field column 'text' \(it holds \['body', 'n'\]"):
        check_dataset(str(path))
    with pytest.raises(ValueError, match="--text-field 'text' is not a column"):  # the ranks' own check stays
        load_documents(str(path))
    check_dataset(str(path), text_field="body")
    assert load_documents(str(path), text_field="body") == [r["body"] for r in _ROWS]
    for values, kind in (([1, 2], "int64"), ([["a"], ["b"]], r"list<\w+: string>"), ([b"a", b"b"], "binary")):
        other = tmp_path / "typed.parquet"
        pq.write_table(pa.table({"text": values}), other)
        with pytest.raises(ValueError, match=rf"typed.parquet: its --text-field column 'text' holds {kind}, not text"):
            check_dataset(str(other))
    for text in (pa.array(["a", "b"]).dictionary_encode(), pa.array(["a", "b"], pa.large_string()), pa.nulls(2)):
        pq.write_table(pa.table({"text": text}), tmp_path / "typed.parquet")
        check_dataset(str(tmp_path / "typed.parquet"))  # text (or an empty shard's nulls): the ranks read it
    path.write_bytes(path.read_bytes()[:40])  # cut: the magic number, no footer
    with pytest.raises(ValueError, match="rows.parquet is not a readable parquet file"):
        check_dataset(str(path), text_field="body")


@pytest.mark.parametrize(
    "text", ['[{"body": "a"}, {"body": }]', '[{"body": "a"}, {"body": "b"]', '[{"body": "a"}, oops']
)
def test_a_malformed_json_array_read_whole_is_refused_before_the_ranks(text, tmp_path):
    """A .json array that the first read holds whole but does not parse: refused naming the row, not left to the
    ranks (an array longer than the read is checked as far as it goes)."""
    path = tmp_path / "rows.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"rows.json row 2 is not JSON"):
        check_dataset(str(path), text_field="body")
    path.write_text('[{"body": "a"}, {"body": "b"}]\n')
    check_dataset(str(path), text_field="body")
    path.write_text('[{"body": "a\tb\nc"}, {"body": "d"}]')  # raw control characters: datasets reads them
    check_dataset(str(path), text_field="body")
    assert load_documents(str(path), text_field="body") == ["a\tb\nc", "d"]
    long = [{"body": "x" * 1000}] * 100  # over the 64 KiB read: the rows read so far are checked
    path.write_text(json.dumps(long)[:-1] + ', {"body": }]')
    check_dataset(str(path), text_field="body")


def test_an_array_of_strings_is_the_column_text(tmp_path):
    strings = tmp_path / "strings.json"
    strings.write_text(json.dumps([f"document {i}" for i in range(3)]))
    check_dataset(str(strings))
    assert load_documents(str(strings)) == [f"document {i}" for i in range(3)]  # datasets names the column text
    with pytest.raises(ValueError, match=r"row 1 has no --text-field 'body' \(it holds \['text'\]\)"):
        check_dataset(str(strings), text_field="body")


def test_load_local_files(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"body": f"document {i}", "n": i}) for i in range(5))
        + "\n"
        + json.dumps({"body": "   ", "n": 5})
    )
    assert load_documents(str(jsonl), text_field="body") == [f"document {i}" for i in range(5)]
    with pytest.raises(ValueError, match="--text-field 'text' is not a column"):
        load_documents(str(jsonl))
    text_dir = tmp_path / "books"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text("line one\nline two\n")
    (text_dir / "b.txt").write_text("other book")
    assert load_documents(str(text_dir)) == ["line one\nline two\n", "other book"]  # one file = one document
    assert load_documents(str(text_dir / "*.txt")) == ["line one\nline two\n", "other book"]
    with pytest.raises(ValueError, match="no such file"):
        load_documents(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="matches no"):
        load_documents(str(tmp_path / "*.parquet"))


def test_build_data_for_a_config(tmp_path, tokenizer):
    data_file = tmp_path / "docs.jsonl"
    data_file.write_text("\n".join(json.dumps({"text": f"Document number {i}. " * (20 + i)}) for i in range(30)))
    config = TrainConfig(dataset=str(data_file), seq_len=64, sp=2, eval_fraction=0.1, seed=3)
    data = build_data(config, tokenizer, dp_rank=0, dp_size=2)
    assert data.train.corpus.num_docs == 27 and data.eval_corpus.num_docs == 3
    batch = next(data.train)
    assert all(batch[k].shape == (1, 64) for k in KEYS)
    eval_batches = _drain(data.eval_loader(seq_len=64))
    other = _drain(build_data(config, tokenizer, dp_rank=1, dp_size=2).eval_loader(seq_len=64))
    assert len(eval_batches) == len(other) > 0
    held = _real_tokens(eval_batches) + _real_tokens(other)
    assert len(held) == data.eval_corpus.num_tokens
