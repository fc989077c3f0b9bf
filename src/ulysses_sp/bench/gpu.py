"""GPU mode: the longest sequence one GPU trains, for real model shapes, and per-rank memory of SP layouts.

For each published shape (:data:`~ulysses_sp.shapes.PUBLISHED_SHAPES`, random weights, bf16 on the GPU)
with the memory features ``ulysses-sp train`` runs on a GPU (:class:`~ulysses_sp.features.Features`'
defaults), :func:`~ulysses_sp.plan.search_longest` finds the longest sequence for which one training step
(forward, loss, backward) fits: doubling until ``torch.cuda.OutOfMemoryError``, then bisection. At that
length it times a few steps: tokens/s, model TFLOPs (``6 N + 6 L H d T`` per token, recomputation not
counted) and MFU against the device's bf16 peak.

Layouts with sp = 4 and 8 are measured on the same GPU by standing in for their last rank
(:class:`~ulysses_sp.standin.StandIn`): the search then finds the longest FULL sequence whose per-rank share
fits, and that rank's peak memory. Optimizer states are not allocated (the HF blog's and the ALST runs
offload them or shard them with ZeRO-3): the numbers are for the activations, weights and gradients.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.features import Features, apply_features
from ulysses_sp.model import parallelize, unparallelize
from ulysses_sp.plan import search_longest
from ulysses_sp.shapes import PUBLISHED_SHAPES, random_model, shape_config
from ulysses_sp.standin import StandIn, measure_step, random_batch

__all__ = ["run_gpu"]


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fits(model: nn.Module, rank: StandIn, vocab: int, budget_s: float) -> Callable[[int], bool | None]:
    deadline = time.monotonic() + budget_s

    def fits(seq_len: int) -> bool | None:
        if time.monotonic() > deadline:
            return None
        try:
            measure_step(model, rank.shard(random_batch(vocab, seq_len)), rank.layout)
            return True
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            return False
        finally:
            _release(rank.device)

    return fits


def _throughput(model: nn.Module, rank: StandIn, vocab: int, seq_len: int, steps: int) -> dict[str, float]:
    from ulysses_sp.loss import causal_lm_loss
    from ulysses_sp.train.metrics import peak_tflops
    from ulysses_sp.train.model_factory import training_flops_per_token

    device, layout = rank.device, rank.layout
    shard = rank.shard(random_batch(vocab, seq_len))
    times = []
    for step in range(steps + 1):  # the first step warms up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        causal_lm_loss(model, shard, layout).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = seq_len / step_s
    tflops = training_flops_per_token(model, seq_len) * tokens_per_s / 1e12
    peak = peak_tflops(device)
    return {
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
    }


def run_gpu(
    *,
    models: tuple[str, ...] = PUBLISHED_SHAPES,
    sp_sizes: tuple[int, ...] = (1, 4, 8),
    start: int = 8192,
    limit: int = 4 << 20,
    granularity: int = 8192,
    steps: int = 3,
    budget_s: float = 900.0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the GPU mode on ``cuda:0``; returns ``{"skipped": reason}`` without CUDA.

    Each (model, sp) search stops starting new trials after ``budget_s`` seconds (long sequences take
    minutes per step); ``search_complete`` says whether it ended by itself.
    """
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    device = torch.device("cuda", 0)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "models": {}}
    for name in models:
        config = shape_config(name, use_cache=False)
        model = random_model(config, dtype=torch.bfloat16, device=device)
        vocab = config.vocab_size
        entry: dict[str, Any] = {"layouts": {}}
        for sp in sp_sizes:
            with StandIn(sp=sp, sp_rank=sp - 1, device=device) as rank:
                parallelize(model, rank.layout)
                if "features" not in entry:
                    entry["features"] = dataclasses.asdict(apply_features(model, Features(), device.type))
                found, trials, complete = search_longest(
                    _fits(model, rank, vocab, budget_s),
                    start=start * sp,
                    limit=limit * sp,
                    granularity=granularity * sp,
                )
                row: dict[str, Any] = {"max_seq_len": found, "trials": trials, "search_complete": complete}
                if found:
                    row.update(measure_step(model, rank.shard(random_batch(vocab, found)), rank.layout))
                    if sp == 1:
                        row.update(_throughput(model, rank, vocab, found, steps))
                log(f"gpu: {name} sp={sp}: max sequence {found} tokens ({len(trials)} trials)")
                entry["layouts"][str(sp)] = row
                unparallelize(model)
                _release(device)
        results["models"][name] = entry
        del model
        _release(device)
    return results
