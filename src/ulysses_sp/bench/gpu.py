"""GPU mode: the planner's longest sequence for real model shapes, measured where it says the limit is.

For each published shape (:data:`~ulysses_sp.shapes.PUBLISHED_SHAPES`, random weights, bf16) and each sp, with the
memory features ``ulysses-sp train`` runs on a GPU (:class:`~ulysses_sp.features.Features`' defaults, optimizer
states in host memory), :func:`~ulysses_sp.plan.max_seq_len` predicts the longest sequence for a GPU of
``gpu_memory_bytes`` and this host's memory; then one training step (:func:`ulysses_sp.simulate.simulate_step`:
forward, loss, backward, AdamW, as rank 0 of the layout with torch's fake process group for sp > 1) runs at that
length and at 10% more, with the allocator capped at ``gpu_memory_bytes``. The first should fit and the second
should not; both give the planner's error (predicted / measured peak). No search: each point is one step.

Long sequences cost quadratic attention time (Llama-3.1-8B at 1M tokens: about 8e17 model FLOPs a step, over half
an hour at 400 TFLOP/s; an estimate, not a measurement),
so a smaller ``gpu_memory_bytes`` than the card has moves the limit to lengths a lease can run, and a point whose
step would take longer than ``step_budget_s`` (estimated from a first step at ``throughput_seq_len`` tokens and the
model FLOPs per token) is recorded as skipped, naming the estimate. The first step also gives tokens/s, TFLOPs and
MFU at that length.

A stand-in rank gets this machine's host memory: the plan is for a node of sp such GPUs each with that much.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import torch

from ulysses_sp.features import Features
from ulysses_sp.plan import max_seq_len
from ulysses_sp.shapes import PUBLISHED_SHAPES, random_model, shape_config
from ulysses_sp.simulate import planned_gpu_bytes, simulate_step
from ulysses_sp.train.model_factory import training_flops_per_token

__all__ = ["GPU_POINTS", "run_gpu"]

GPU_POINTS = ("throughput", "max", "over")  # the step at throughput_seq_len, at the planned maximum, 10% above it


def _round_up(length: int, unit: int) -> int:
    return -(-length // unit) * unit


def run_gpu(
    *,
    models: tuple[str, ...] = PUBLISHED_SHAPES,
    sp_sizes: tuple[int, ...] = (1, 8),
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int = 120 << 30,
    over: float = 0.10,
    throughput_seq_len: int = 65536,
    granularity: int = 8192,
    step_budget_s: float = 300.0,
    features: Features | None = None,
    device: torch.device | str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the GPU mode; returns ``{"skipped": reason}`` without CUDA (``device`` None).

    ``gpu_memory_bytes``: the GPU planned for and the allocator's cap (default: the device's memory);
    ``host_memory_bytes``: this host's memory for offloaded checkpoints and optimizer states (default 120 GiB, a
    128 GiB host); ``granularity``: the planned lengths are multiples of ``granularity x sp``; ``features``:
    default ``Features(cpu_offload_optimizer=True)``; ``device``: default ``cuda:0`` (a CPU runs it too, where
    ``fits`` is the measured peak within the planned memory: the tests use it).
    """
    if device is None:
        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device"}
        device = torch.device("cuda", 0)
    device = torch.device(device)
    gpu_memory_bytes = planned_gpu_bytes(device, gpu_memory_bytes)
    features = features or Features(cpu_offload_optimizer=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results: dict[str, Any] = {
        "device": name,
        "gpu_memory_bytes": gpu_memory_bytes,
        "host_memory_bytes": host_memory_bytes,
        "over": over,
        "step_budget_s": step_budget_s,
        "models": {},
    }
    for model in models:
        config = shape_config(model, use_cache=False)
        meta = random_model(config, device="meta")
        layouts: dict[str, Any] = {}
        for sp in sp_sizes:
            settings = dict(
                sp=sp,
                gpus_per_node=sp,
                gpu_memory_bytes=gpu_memory_bytes,
                host_memory_bytes=host_memory_bytes * sp,
                features=features,
            )
            unit = granularity * sp
            longest = max_seq_len(config, granularity=granularity, device=device.type, **settings)
            row: dict[str, Any] = {"predicted_max_seq_len": longest, "points": {}}
            layouts[str(sp)] = row
            if not longest:
                log(f"gpu: {model} sp={sp}: the plan fits no sequence in {gpu_memory_bytes / 2**30:.1f} GiB")
                continue
            lengths = {
                "throughput": min(_round_up(throughput_seq_len, unit), longest),
                "max": longest,
                "over": _round_up(int(longest * (1 + over)), unit),
            }
            first: dict[str, Any] | None = None
            for point in GPU_POINTS:
                seq_len = lengths[point]
                if point == "max" and first is not None and first["seq_len"] == seq_len:  # measured already
                    row["points"][point] = row["points"]["throughput"]
                    continue
                estimate = None if first is None else _estimate_s(meta, first, seq_len)
                if estimate is not None and estimate > step_budget_s:
                    row["points"][point] = {"seq_len": seq_len, "skipped": f"estimated {estimate:.0f} s a step"}
                    log(f"gpu: {model} sp={sp} {point} {seq_len:,}: skipped (estimated {estimate:.0f} s a step)")
                    continue
                start = time.monotonic()
                result = simulate_step(config, seq_len=seq_len, device=device, **settings)
                result = {k: v for k, v in result.items() if k != "plan"} | {"phase": result["plan"]["phase"]}
                row["points"][point] = result | {"wall_s": time.monotonic() - start}
                first = first or (result if not result["out_of_memory"] else None)
                verdict = "out of memory" if result["out_of_memory"] else ("fits" if result["fits"] else "over")
                if result["out_of_memory"]:
                    verdict += _out_of_memory_summary(result["out_of_memory_message"] or "")
                ratio = f", predicted / measured {result['ratio']:.3f}" if result["ratio"] else ""
                log(f"gpu: {model} sp={sp} {point} {seq_len:,}: {verdict}{ratio}")
        results["models"][model] = {"layouts": layouts, "features": features.describe()}
    return results


def _out_of_memory_summary(message: str) -> str:
    """`` (tried to allocate 2.00 GiB; 8.61 GiB allocated by PyTorch; 344.00 MiB reserved but unallocated)`` from
    torch's message, the parts it says."""
    size = r"([\d.]+ (?:[KMGT]iB|bytes))"
    found = [
        (re.search(pattern, message), words)
        for pattern, words in (
            (rf"Tried to allocate {size}", "tried to allocate {}"),
            (rf"Of the allocated memory {size} is allocated by PyTorch", "{} allocated by PyTorch"),
            (rf"{size} is reserved by PyTorch but unallocated", "{} reserved but unallocated"),
        )
    ]
    parts = [words.format(match.group(1)) for match, words in found if match]
    return f" ({'; '.join(parts)})" if parts else ""


def _estimate_s(meta: torch.nn.Module, measured: dict[str, Any], seq_len: int) -> float | None:
    """A step's time at ``seq_len`` from one measured at another length, scaled by the model FLOPs of the step."""
    if not measured.get("step_s"):
        return None

    def flops(length: int) -> float:
        return training_flops_per_token(meta, length) * length

    return measured["step_s"] * flops(seq_len) / flops(measured["seq_len"])
