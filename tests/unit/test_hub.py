"""An id the Hub must serve is refused in seconds when the Hub cannot be reached (not after ~50 s of retries)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from huggingface_hub import constants

from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.documents import load_tokenizer
from ulysses_sp.train.hub import hub_unreachable
from ulysses_sp.train.model_factory import hf_model_config

CLOSED = "http://127.0.0.1:1"  # nothing listens on port 1: the connection is refused at once


@pytest.fixture
def closed_hub(monkeypatch, tmp_path):
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    for name in ("http_proxy", "https_proxy", "all_proxy"):  # a direct connection, as on a machine without proxy
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    return tmp_path / "hub"


def test_an_uncached_id_is_refused_at_once_when_the_hub_cannot_be_reached(closed_hub):
    start = time.monotonic()
    reason = hub_unreachable("some-org/not-here")
    assert reason is not None and "'some-org/not-here' is not a local directory nor in the Hugging Face cache" in reason
    assert CLOSED in reason
    with pytest.raises(ValueError, match=r"--model: 'some-org/not-here' is not a local directory .* built-in name"):
        hf_model_config(TrainConfig(model="some-org/not-here"))
    with pytest.raises(ValueError, match=r"--tokenizer: 'some-org/not-here' .* or --tokenizer gpt2-bpe"):
        load_tokenizer("some-org/not-here")
    assert time.monotonic() - start < 10


def test_a_model_that_cannot_be_reached_is_named_as_the_model_not_its_tokenizer(closed_hub, tmp_path):
    """`ulysses-sp train --model Qwen/Qwen3-4B` without network was refused for its tokenizer, with the fix
    '--tokenizer gpt2-bpe'; a user who took it met the model's refusal next. The model is named first."""
    from ulysses_sp.train.runspec import resolve_run

    config = TrainConfig(model="some-org/not-here", output_dir=str(tmp_path / "run"), seq_len=256)
    with pytest.raises(ValueError, match=r"^--model: 'some-org/not-here' is not a local directory .* built-in name"):
        resolve_run(config, world_size=2)
    with pytest.raises(ValueError, match=r"^--model '\./missing': no such directory"):
        resolve_run(TrainConfig(model="./missing", output_dir=str(tmp_path / "run"), seq_len=256), world_size=2)


def test_local_cached_and_offline_ids_are_left_to_transformers(closed_hub, tmp_path, monkeypatch):
    assert hub_unreachable(str(tmp_path)) is None  # a local directory
    snapshot = closed_hub / "models--some-org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (closed_hub / "models--some-org--cached" / "refs").mkdir()
    (closed_hub / "models--some-org--cached" / "refs" / "main").write_text("abc123")
    assert hub_unreachable("some-org/cached") is None
    assert hub_unreachable("not/a/valid/id") is None  # the hub's validators name that problem
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # the hub client's route: not probed directly
    assert hub_unreachable("some-org/not-here") is None
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # ... unless the endpoint bypasses the proxy
    assert hub_unreachable("some-org/not-here") is not None
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_unreachable("some-org/not-here") is None  # transformers fails at once offline


def test_a_hub_dataset_is_refused_at_once_when_the_hub_cannot_be_reached(closed_hub, tmp_path, monkeypatch):
    """`--dataset wikitext` without network spent about 25 s in datasets' retries, printing six lines of them, before
    its one line; it is now refused in seconds, as a model id is. A dataset in the hub's cache or datasets' own is
    left to datasets (which falls back to its cache)."""
    import datasets.config

    from ulysses_sp.train.dataset_checks import check_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"--dataset 'some-org/not-here': 'some-org/not-here' is not a local dir"):
        check_dataset("some-org/not-here")
    assert time.monotonic() - start < 10
    assert hub_unreachable("some-org/not-here", repo_type="dataset") is not None
    (closed_hub / "datasets--some-org--in-hub-cache").mkdir(parents=True)
    assert hub_unreachable("some-org/in-hub-cache", repo_type="dataset") is None
    (tmp_path / "datasets" / "some-org___built").mkdir(parents=True)
    assert hub_unreachable("some-org/built", repo_type="dataset") is None
    (tmp_path / "datasets" / "Some-Org___camel_case").mkdir(parents=True)  # datasets snake-cases the name alone
    assert hub_unreachable("Some-Org/CamelCase", repo_type="dataset") is None


def test_a_name_lookup_that_blocks_gives_up_after_the_timeout(closed_hub, monkeypatch):
    """A broken resolver blocks socket.getaddrinfo, which takes no timeout: the probe stops waiting after its own."""
    release = threading.Event()

    def blocked(*args, **kwargs):
        release.wait(15)  # a resolver that answers late (a real broken one: minutes); released at the end
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    start = time.monotonic()
    try:
        reason = hub_unreachable("some-org/not-here", timeout_s=0.5)
    finally:
        release.set()
    assert time.monotonic() - start < 3
    assert reason is not None and "the name lookup of hub.invalid took more than 0.5 s" in reason, reason


def test_a_run_probes_the_hub_once_for_its_model_its_tokenizer_and_its_config(closed_hub, tmp_path, monkeypatch):
    """`ulysses-sp train --model org/name` (not cached) probed the Hub three times before any rank started: for the
    model, for its own tokenizer and for its config, each probe up to PROBE_TIMEOUT_S on a slow network. The run
    asks once and reuses the answer; with a tokenizer and a hub dataset of other names too (they were probed once
    each more: 3 probes). (transformers' and datasets' loaders stand in for the download: nothing is cached.)"""
    import datasets
    from transformers import AutoConfig, AutoTokenizer

    from ulysses_sp.shapes import shape_config
    from ulysses_sp.train import hub
    from ulysses_sp.train.runspec import resolve_run

    probes = []
    monkeypatch.setattr(hub, "_connect", lambda host, port, timeout_s: probes.append((host, port)))  # reachable
    embedded = load_tokenizer()
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kwargs: embedded)
    sized = shape_config("llama-tiny", vocab_size=len(embedded))
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, **kwargs: sized)
    spec = resolve_run(TrainConfig(model="some-org/served", output_dir=str(tmp_path / "run"), seq_len=256), 2)
    assert (spec.model_source, spec.config.tokenizer) == ("some-org/served", "some-org/served")
    assert probes == [("127.0.0.1", 1)]
    probes.clear()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda name, **kwargs: None)
    names = dict(model="some-org/served", tokenizer="some-org/tok", dataset="some-org/data")
    spec = resolve_run(TrainConfig(**names, output_dir=str(tmp_path / "r2"), seq_len=256), 2)
    assert (spec.model_source, spec.config.tokenizer, spec.config.dataset) == (
        "some-org/served", "some-org/tok", "some-org/data"
    )  # fmt: skip
    assert probes == [("127.0.0.1", 1)]
