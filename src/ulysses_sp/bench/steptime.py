"""The multi-rank benchmark: step time, collectives and loss/gradient agreement, measured side by side.

Runs on every rank of a gloo world (``run_world(world, "ulysses_sp.bench.steptime:worker", params)``).
In ONE world it builds, from the same seed, the same model four (or five) times:

* ``ulysses-sp``: :func:`ulysses_sp.parallelize` with sp = world, each rank a shard of the same rows;
* ``ulysses-sp ring``: the same with ulysses-sp's ring attention (ring = world, zigzag shards);
* ``deepspeed``: DeepSpeed's ``UlyssesSPAttentionHF`` with sp = world, same shards (when installed);
* ``no-sp``: plain transformers sdpa with dp = world: every rank its own rows of ``N / world`` tokens,
  i.e. the same tokens per rank as under SP;
* ``reference`` (rank 0 only, for agreement): one process, plain attention, the full batch.

First, from identical weights, one forward + backward of each SP variant: loss and gradients (averaged
over the world, the library's convention) are compared with each other and with the reference, and the
collectives of that step are counted (:class:`~ulysses_sp.bench.collectives.CollectiveCounter`, the same
counter for every implementation). Then training steps (forward, loss, backward, gradient all-reduce,
AdamW) are timed interleaved: in every repetition each variant runs once, in a rotating order, between
barriers, so machine noise hits all of them alike; the results are per-repetition times whose ratios
are taken repetition by repetition.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.layout import ParallelLayout
from ulysses_sp.loss import causal_lm_loss, sync_gradients
from ulysses_sp.model import parallelize
from ulysses_sp.shapes import SHAPES
from ulysses_sp.sharding import shard_batch
from ulysses_sp.standin import measure_step, random_batch

from .collectives import CollectiveCounter
from .deepspeed_ref import DeepSpeedUlysses, deepspeed_available
from .models import bench_model

__all__ = ["RING", "Variant", "time_interleaved", "worker"]

RING = "ulysses-sp ring"  # the variant running ulysses-sp's ring attention (ring degree = world)
_SP_VARIANTS = ("ulysses-sp", "deepspeed", RING)


@dataclass
class Variant:
    model: nn.Module
    layout: ParallelLayout
    shard: dict[str, torch.Tensor]
    active: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    optimizer: torch.optim.Optimizer | None = None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # this process's CPU seconds per timed step (all threads)

    def loss_and_grads(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        self.model.zero_grad(set_to_none=True)
        with self.active():
            loss = causal_lm_loss(self.model, self.shard, self.layout)
            loss.backward()
        sync_gradients(self.model, self.layout)
        grads = {name: p.grad.detach().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    def train_step(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        with self.active():
            loss = causal_lm_loss(self.model, self.shard, self.layout)
            loss.backward()
        sync_gradients(self.model, self.layout)
        self.optimizer.step()


def _agreement(loss_a, grads_a, loss_b, grads_b) -> dict[str, float]:
    """Loss difference, and the largest gradient difference relative to that parameter's largest entry."""
    worst_abs, worst_rel = 0.0, 0.0
    for name, grad in grads_b.items():
        diff = (grads_a[name] - grad).abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / max(grad.abs().max().item(), 1e-30))
    return {
        "loss_abs_diff": abs(loss_a.item() - loss_b.item()),
        "grad_max_abs_diff": worst_abs,
        "grad_max_rel_diff": worst_rel,
        "params_compared": len(grads_b),
    }


def _count(variant: Variant) -> dict[str, dict[str, int]]:
    variant.model.zero_grad(set_to_none=True)
    with CollectiveCounter() as counter, variant.active():
        loss = causal_lm_loss(variant.model, variant.shard, variant.layout)
        loss.backward()
    variant.model.zero_grad(set_to_none=True)
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes)}


def time_interleaved(variants: dict[str, Variant], reps: int, warmup: int) -> dict[str, list[float]]:
    """Train-step times of every variant: each once per repetition, in a rotating order, between barriers (the
    first ``warmup`` repetitions untimed); ``{name: [seconds per repetition]}``. Each variant's
    :attr:`Variant.cpu_times` gets the CPU time this process spent in the step (its threads all: gloo's too; the
    barriers not)."""
    names = list(variants)
    for variant in variants.values():
        variant.optimizer = torch.optim.AdamW(variant.model.parameters(), lr=1e-4)
    for rep in range(warmup + reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            variants[name].train_step()
            cpu = time.process_time() - cpu
            dist.barrier()
            if rep >= warmup:
                variants[name].times.append(time.perf_counter() - start)
                variants[name].cpu_times.append(cpu)
    return {name: v.times for name, v in variants.items()}


def worker(params: dict[str, Any]) -> dict[str, Any]:
    """One rank of the benchmark world; returns rank 0's measurements (other ranks: their timings)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = SHAPES[params["model"]]
    seq_len = params["seq_len"]
    if seq_len % world:
        raise ValueError(f"seq_len {seq_len} must be divisible by the world size {world}")
    sp_layout = ParallelLayout.from_env(sp=world)
    dp_layout = ParallelLayout.from_env(sp=1)  # dp = world
    batch = random_batch(shape["vocab_size"], seq_len, seed=1)  # the same rows on every rank

    def fresh() -> nn.Module:
        return bench_model(params["model"], seq_len, seed=0)

    variants: dict[str, Variant] = {}
    model = parallelize(fresh(), sp_layout)
    variants["ulysses-sp"] = Variant(model, sp_layout, shard_batch(batch, sp_layout))
    ds_error = None
    if params.get("deepspeed", True) and deepspeed_available():
        model = fresh()
        try:
            ds = DeepSpeedUlysses(model, sp=world, seq_len=seq_len)
            variants["deepspeed"] = Variant(model, sp_layout, shard_batch(batch, sp_layout), active=ds.active)
        except Exception as error:  # recorded in the report, with the exact message
            ds_error = f"{type(error).__name__}: {error}"
    # The ring core of ulysses-sp over the same ranks (pure ring: ulysses 1 x ring P, zigzag shards).
    ring_layout = ParallelLayout.from_env(sp=world, ring=world)
    ring_model = parallelize(fresh(), ring_layout)
    variants[RING] = Variant(ring_model, ring_layout, shard_batch(batch, ring_layout))
    own_rows = random_batch(shape["vocab_size"], seq_len // world, seed=100 + rank)
    variants["no-sp"] = Variant(fresh(), dp_layout, shard_batch(own_rows, dp_layout))

    out: dict[str, Any] = {"world": world, "seq_len": seq_len, "model": params["model"], "deepspeed_error": ds_error}

    # Agreement, from identical weights, before any optimizer step.
    results = {name: variants[name].loss_and_grads() for name in _SP_VARIANTS if name in variants}
    reference = None
    if rank == 0:
        ref_model, single = fresh(), ParallelLayout.single()
        reference = Variant(ref_model, single, shard_batch(batch, single)).loss_and_grads()
    agreement = {}
    for name, (loss, grads) in results.items():
        if reference is not None:
            agreement[f"{name} vs one process"] = _agreement(loss, grads, *reference)
    if "deepspeed" in results:
        agreement["ulysses-sp vs deepspeed"] = _agreement(*results["ulysses-sp"], *results["deepspeed"])
    out["agreement"] = agreement
    out["losses"] = {name: loss.item() for name, (loss, _) in results.items()}

    # Collectives of one forward + backward, counted the same way for every implementation.
    out["collectives"] = {name: _count(variants[name]) for name in _SP_VARIANTS if name in variants}
    out["num_layers"] = shape["num_hidden_layers"]

    # This rank's activation memory, to check the one-process stand-in measurement against.
    out["rank_memory"] = measure_step(variants["ulysses-sp"].model, shard_batch(batch, sp_layout), sp_layout)

    out["step_times_s"] = time_interleaved(variants, params.get("reps", 5), params.get("warmup", 1))
    out["tokens_per_rank"] = seq_len // world
    return out
