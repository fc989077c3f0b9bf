"""The bench's GPU mode on a real GPU at a small budget (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from ulysses_sp.bench.gpu import run_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_gpu_mode_finds_a_length_and_measures_throughput():
    results = run_gpu(models=("qwen3-4b",), sp_sizes=(1, 4), start=4096, limit=16384, granularity=4096, budget_s=300)
    entry = results["models"]["qwen3-4b"]
    assert entry["features"]["tiled_loss"] is True
    one = entry["layouts"]["1"]
    assert one["max_seq_len"] >= 4096 and one["tokens_per_s"] > 0 and one["tflops"] > 0
    if one["mfu"] is not None:
        assert 0 < one["mfu"] < 1
    four = entry["layouts"]["4"]
    # a quarter of the tokens per rank: at least as long a full sequence fits
    assert four["max_seq_len"] >= one["max_seq_len"]
    assert four["peak_bytes"] > 0
