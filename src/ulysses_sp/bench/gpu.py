"""GPU mode: the longest sequence one GPU trains, for real model shapes, and per-rank memory of SP layouts.

For each model of :data:`~ulysses_sp.bench.models.GPU_MODELS` (random weights, bf16 on the GPU) with the
library's long-sequence memory features on (:func:`enable_memory_features`), :func:`search_max_seq` finds the
longest sequence for which one training step (forward, loss, backward) fits: doubling until
``torch.cuda.OutOfMemoryError``, then bisection to ``granularity`` tokens. At that length it times a few
steps: tokens/s, model TFLOPs (``6 N + 6 L H d T`` per token,
:func:`ulysses_sp.train.model_factory.training_flops_per_token`, recomputation not counted) and MFU against
the device's bf16 peak.

Layouts with sp = 4 and 8 are measured on the same GPU by standing in for one rank
(:func:`~ulysses_sp.bench.rankmem.standin_rank`, torch's fake process group): the search then finds the
longest FULL sequence whose per-rank share fits, and the peak memory of that rank.

Weights and gradients live on the GPU in bf16; optimizer states are not allocated (the HF blog's and the
ALST runs offload them to the CPU or shard them with ZeRO-3), so the numbers are for the activations,
weights and gradients of one replica.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.layout import ParallelLayout
from ulysses_sp.model import parallelize, unparallelize
from ulysses_sp.offload import enable_activation_checkpointing
from ulysses_sp.tiled_loss import enable_tiled_loss
from ulysses_sp.tiling import enable_tiled_mlp

from .models import GPU_MODELS, build_gpu_model
from .rankmem import dense_core, measure_step, random_batch, standin_rank

__all__ = ["enable_memory_features", "run_gpu", "search_max_seq"]


def search_max_seq(
    fits: Callable[[int], bool | None], *, start: int, limit: int, granularity: int
) -> tuple[int, list[tuple[int, bool]], bool]:
    """The largest multiple of ``granularity`` up to ``limit`` for which ``fits`` is True (0 if none).

    Doubles from ``start`` while it fits, then bisects between the last length that fit and the first
    that did not. Assumes ``fits`` is monotone (a longer sequence never fits where a shorter one did not).
    ``fits`` may return None to stop the search (time budget spent): the longest length that fit so far
    is returned. Returns the length, the ``(length, fits)`` trials in the order they ran, and whether the
    search finished (False when ``fits`` stopped it).
    """
    if start % granularity or start <= 0:
        raise ValueError(f"start {start} must be a positive multiple of granularity {granularity}")
    trials: list[tuple[int, bool]] = []

    def trial(length: int) -> bool | None:
        ok = fits(length)
        if ok is not None:
            trials.append((length, ok))
        return ok

    low, bad = 0, None
    length = start
    while length <= limit:
        ok = trial(length)
        if ok is None:
            return low, trials, False
        if not ok:
            bad = length
            break
        low = length
        length *= 2
    if bad is None:
        return low, trials, True
    while bad - low > granularity:
        middle = (low + bad) // 2 // granularity * granularity
        if middle <= low:
            break
        ok = trial(middle)
        if ok is None:
            return low, trials, False
        if ok:
            low = middle
        else:
            bad = middle
    return low, trials, True


def enable_memory_features(model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Turn on the long-sequence memory features; returns which ones are on.

    The tiled lm_head + loss, the tiled MLP, and activation checkpointing with the layer inputs offloaded to
    host memory on CUDA (kept on the device elsewhere): what ``ulysses-sp train`` runs on a GPU.
    """
    mode = "offload" if device.type == "cuda" else "checkpoint"
    enable_tiled_loss(model)
    enable_tiled_mlp(model)
    enable_activation_checkpointing(model, mode)
    features: dict[str, Any] = {"tiled_loss": True, "tiled_mlp": True, "activation_checkpointing": mode}
    model.train()
    return features


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _fits(
    model: nn.Module, layout: ParallelLayout, vocab: int, device: torch.device, budget_s: float
) -> Callable[[int], bool | None]:
    deadline = time.monotonic() + budget_s

    def fits(seq_len: int) -> bool | None:
        if time.monotonic() > deadline:
            return None
        try:
            measure_step(model, random_batch(vocab, seq_len), layout)
            return True
        except torch.cuda.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            return False
        finally:
            _release(device)

    return fits


def _throughput(model: nn.Module, layout: ParallelLayout, vocab: int, seq_len: int, steps: int) -> dict[str, float]:
    from ulysses_sp.loss import causal_lm_loss
    from ulysses_sp.sharding import shard_batch
    from ulysses_sp.train.metrics import peak_tflops
    from ulysses_sp.train.model_factory import training_flops_per_token

    device = layout.device
    shard = {k: v.to(device) for k, v in shard_batch(random_batch(vocab, seq_len), layout).items()}
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
    models: list[str] | None = None,
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
    for name in models or list(GPU_MODELS):
        model = build_gpu_model(name, dtype=torch.bfloat16, device=device)
        vocab = model.config.vocab_size
        entry: dict[str, Any] = {"layouts": {}}
        for sp in sp_sizes:
            with standin_rank(sp, rank=sp - 1, device=device) as layout:
                parallelize(model, layout, core=dense_core() if sp > 1 else "sdpa")
                if "features" not in entry:
                    entry["features"] = enable_memory_features(model, device)
                found, trials, complete = search_max_seq(
                    _fits(model, layout, vocab, device, budget_s),
                    start=start * sp,
                    limit=limit * sp,
                    granularity=granularity * sp,
                )
                row: dict[str, Any] = {"max_seq_len": found, "trials": trials, "search_complete": complete}
                if found:
                    row.update(measure_step(model, random_batch(vocab, found), layout))
                    if sp == 1:
                        row.update(_throughput(model, layout, vocab, found, steps))
                log(f"gpu: {name} sp={sp}: max sequence {found} tokens ({len(trials)} trials)")
                entry["layouts"][str(sp)] = row
                unparallelize(model)
                _release(device)
        results["models"][name] = entry
        del model
        _release(device)
    return results
