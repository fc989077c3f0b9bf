"""The head-chunk benchmark: train-step time with the attention heads in C = 4 chunks over C = 1, same world.

Runs on every rank of a gloo world (``run_world(world, "ulysses_sp.bench.headchunks:worker", params)``). The same
attention-heavy model (``llama-bench-heads``: 16 heads, so 4 chunks split over 4 ranks) is built from one seed and
parallelized with sp = world, with ``head_chunks=1`` (today's path) and ``head_chunks=4``, each without and with
activation checkpointing of the decoder layers (four models); train steps are timed interleaved
(:func:`ulysses_sp.bench.steptime.time_interleaved`), and the ratio is taken repetition by repetition. With C = 4
every layer issues 4x the all-to-alls (each about a quarter of the size) and projects q/k/v again in backward (the
core's backward runs from its saved output and lse, :mod:`ulysses_sp.chunk_core`); the exchange of chunk c+1 runs
(asynchronously, in gloo's threads on the CPU) while chunk c's core computes, which is what is to pay for the
chunking.

Also measured, in one C = 4 step: how long the ranks waited on exchanges inside the chunked layers during one step
(:attr:`ulysses_sp.CommStats.wait_s`: the exchange time that was not hidden behind a core); and, in the calling
process (:func:`compute_alone`), the same four models' steps with no real exchange (one process standing in for
rank 0): the chunking's own compute (q/k/v projected again, the output projection added chunk by chunk, the chunks'
own code), which the overlap has to pay for. And every rank's CPU time in each step (all its threads, gloo's
included): where the ranks outnumber the cores, no core is free to run an exchange while another computes, the step
takes about the ranks' CPU time over the cores, and the overlap cannot pay; the CPU ratio then shows what C = 4
costs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.comm import CommStats
from ulysses_sp.layout import ParallelLayout
from ulysses_sp.model import parallelize
from ulysses_sp.offload import enable_activation_checkpointing
from ulysses_sp.shapes import SHAPES
from ulysses_sp.sharding import shard_batch
from ulysses_sp.standin import StandIn, random_batch

from .models import bench_model
from .steptime import Variant, time_interleaved

__all__ = [
    "COMPUTE_ALONE",
    "CPU_OVER_RANKS",
    "HEAD_CHUNKS",
    "HEAD_CHUNK_MODEL",
    "compute_alone",
    "variant_name",
    "worker",
]

HEAD_CHUNK_MODEL = "llama-bench-heads"
HEAD_CHUNKS = (1, 4)  # the baseline, and the chunk count whose step time is compared with it
COMPUTE_ALONE = ", compute alone"  # the ratios of compute_alone's step times are named with this after them
CPU_OVER_RANKS = ", CPU over the ranks"  # the ratios of the world's CPU time per step, summed over its ranks


def variant_name(chunks: int, checkpointed: bool) -> str:
    return f"C={chunks}" + (" checkpointed" if checkpointed else "")


def _variants(layout: ParallelLayout, shard: dict[str, Any], seq_len: int, stats: CommStats) -> dict[str, Variant]:
    """The four models (C = 1 and 4, without and with checkpointed layers) from one seed, on ``layout``."""
    variants = {}
    for checkpointed, chunks in itertools.product((False, True), HEAD_CHUNKS):
        model = parallelize(bench_model(HEAD_CHUNK_MODEL, seq_len, seed=0), layout, head_chunks=chunks, stats=stats)
        if checkpointed:
            enable_activation_checkpointing(model, "checkpoint")
        variants[variant_name(chunks, checkpointed)] = Variant(model, layout, shard)
    return variants


def worker(params: dict[str, Any]) -> dict[str, Any]:
    """One rank of the head-chunk world; returns its step times (rank 0's are reported) and the CPU time this
    process spent in each step (``cpu_s``: summed over the ranks in the report)."""
    world = dist.get_world_size()
    seq_len = params["seq_len"]
    layout = ParallelLayout.from_env(sp=world)
    batch = random_batch(SHAPES[HEAD_CHUNK_MODEL]["vocab_size"], seq_len, seed=1)
    stats = CommStats()
    variants = _variants(layout, shard_batch(batch, layout), seq_len, stats)
    losses = {name: v.loss_and_grads()[0].item() for name, v in variants.items()}
    times = time_interleaved(variants, params.get("reps", 5), params.get("warmup", 1))
    cpu = {name: v.cpu_times for name, v in variants.items()}
    stats.reset()  # shared by the variants; only the chunked ones wait on asynchronous exchanges
    variants[variant_name(HEAD_CHUNKS[-1], False)].train_step()
    exposed = stats.wait_s
    return {
        "world": world,
        "seq_len": seq_len,
        "model": HEAD_CHUNK_MODEL,
        "losses": losses,
        "step_times_s": times,
        "cpu_s": cpu,
        "exposed_wait_s": exposed,
    }


def compute_alone(world: int, seq_len: int, reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """The four variants' train-step times in this process standing in for rank 0 of sp = ``world``
    (:class:`~ulysses_sp.standin.StandIn`: a fake process group, each exchange a local copy), on one thread as each
    rank of the world has: what the chunking costs in compute alone, with no exchange to wait on or to hide."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with StandIn(sp=world, sp_rank=0) as rank:
            batch = random_batch(SHAPES[HEAD_CHUNK_MODEL]["vocab_size"], seq_len, seed=1)
            variants = _variants(rank.layout, rank.shard(batch), seq_len, CommStats())
            return time_interleaved(variants, reps, warmup)
    finally:
        torch.set_num_threads(threads)
