"""One real training step as ONE rank of a large layout, on one device, next to the planner's prediction.

:func:`simulate_step` stands in for rank 0 of ``dp x sp`` ranks (:class:`~ulysses_sp.standin.StandIn`), builds
the model the way ``ulysses-sp train`` does (on the ``meta`` device, parallelized, the memory features the plan
resolved on, where it chose the checkpoints' place and stride from the host memory too, FSDP2 over the world),
allocates only this rank's shards, and measures the second of two steps (when the AdamW states exist, as in every
later step). It answers whether the step fits a GPU of the planned memory: on CUDA the allocator is capped at that
memory while the step runs (``torch.cuda.set_per_process_memory_fraction``), so a larger GPU can stand in for a
smaller one, and running out of memory is a result (``fits: False``), not an error; on any device the measured peak
must also be within the plan's usable memory. :func:`sharded_step_peak` is that build-and-measure in an already
initialised world (gloo ranks, or the stand-in's fake one), which the tests compare against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .features import Features, apply_features, cli_switch
from .layout import ParallelLayout
from .plan import load_model_config, plan_memory
from .standin import StandIn, measure_step, random_batch

__all__ = [
    "allocator_settings",
    "available_host_bytes",
    "memory_cap",
    "planned_gpu_bytes",
    "sharded_step_peak",
    "simulate_step",
]


def _materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate this rank's shards on ``device`` and fill them (normal(0, 0.02); ones for 1-D weights);
    recompute the non-persistent buffers (RoPE frequencies) that meta construction left empty."""
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.dim() >= 2:
                local.normal_(0.0, 0.02, generator=generator)
            else:
                local.fill_(1.0)
        for module in model.modules():
            if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
                fresh = type(module)(config=module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    setattr(module, name, buffer.to(device))


def _storage_bytes(tensors: list[torch.Tensor], device: torch.device) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type == device.type and local.numel():
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def sharded_step_peak(
    model_config: Any,
    layout: ParallelLayout,
    shard: dict[str, torch.Tensor],
    *,
    features: Features | None = None,
    mesh: Any = None,
    core: str = "sdpa",
    seed: int = 0,
) -> dict[str, Any]:
    """Build the model sharded over the world (FSDP2) as ``ulysses-sp train`` does, run two steps on ``shard``,
    return the second one's peak.

    Runs in an initialised world whose ranks all call it. ``mesh`` is the 1-D FSDP2 mesh over all ranks
    (built when None). Returns ``{"peak_bytes", "resident_bytes", "step_peak_bytes", "loss"}``: the peak is
    the bytes held on ``layout.device`` before the step (parameter shards, buffers, AdamW states) plus the
    step's own peak.
    """
    from .fsdp import fully_shard_layers
    from .model import parallelize
    from .shapes import random_model

    device = layout.device
    features = (features or Features()).resolve(device)
    if features.parallel != "fsdp2":
        raise ValueError(f"simulating parallel={features.parallel!r} is not supported; simulate models FSDP2 only")
    config, _ = load_model_config(model_config)
    compute = features.torch_dtype(device)
    model = random_model(config, device="meta")
    model.config.use_cache = False
    parallelize(model, layout, core=core, head_chunks=features.head_chunks)
    apply_features(model, features, device.type, switch=cli_switch)
    offload = features.cpu_offload_optimizer and device.type == "cuda"
    fully_shard_layers(model, device, layout.world_size, compute_dtype=compute, offload_to_cpu=offload, mesh=mesh)
    _materialise(model, torch.device("cpu") if offload else device, seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    measure_step(model, shard, layout, optimizer=optimizer, dtype=compute)  # allocates the AdamW states
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
    else:
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        resident = _storage_bytes([*model.parameters(), *model.buffers(), *states], device)
    start = time.perf_counter()
    step = measure_step(model, shard, layout, optimizer=optimizer, dtype=compute)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "peak_bytes": resident + step["peak_bytes"],
        "resident_bytes": resident,
        "step_peak_bytes": step["peak_bytes"],
        "loss": step["loss"],
        "step_s": time.perf_counter() - start,  # the measured step, optimizer included (its tracker slows the CPU)
    }


@contextlib.contextmanager
def memory_cap(device: torch.device, gpu_memory_bytes: int) -> Iterator[None]:
    """On CUDA, cap the caching allocator at ``gpu_memory_bytes`` (where that is less than the device has) while the
    block runs, so that a step that would not fit a GPU of that memory runs out of memory here too; no-op elsewhere.
    """
    if device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def allocator_settings() -> str:
    """The CUDA caching allocator's settings from the environment (``ulysses-sp train`` and ``bench`` ask for
    expandable segments, as the planner assumes; a bare Python process has none of them)."""
    from .cli import ALLOCATOR_ENV

    return ";".join(f"{name}={os.environ[name]}" for name in ALLOCATOR_ENV if name in os.environ) or "default"


def available_host_bytes() -> int | None:
    """The host memory this machine can still give (Linux's ``MemAvailable``); None where it cannot tell."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024  # kB
    except (OSError, KeyError, ValueError):
        return None


def planned_gpu_bytes(device: torch.device, gpu_memory_bytes: int | None) -> int:
    """The GPU memory a simulated step is planned for: ``gpu_memory_bytes``, else the CUDA device's, else 80 GiB."""
    if gpu_memory_bytes is not None:
        return gpu_memory_bytes
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 << 30


def simulate_step(
    model_config: Any,
    *,
    seq_len: int,
    sp: int = 1,
    dp: int = 1,
    ring: int | None = None,
    device: torch.device | str = "cpu",
    features: Features | None = None,
    micro_batch: int = 1,
    gpu_memory_bytes: int | None = None,
    host_memory_bytes: int = 0,
    gpus_per_node: int | None = None,
    core: str = "sdpa",
    seed: int = 0,
) -> dict[str, Any]:
    """Run one training step as rank 0 of ``dp x sp`` ranks on ``device`` and measure its peak memory.

    ``ring``: the ring degree inside ``sp`` (None: chosen from the heads, as :func:`plan_memory` does).
    ``gpu_memory_bytes``: the GPU planned for (default: the CUDA device's memory, else 80 GiB); on CUDA the step
    runs capped at it (:func:`memory_cap`). ``host_memory_bytes`` / ``gpus_per_node``: as :func:`plan_memory`'s;
    with host memory given (on CUDA) the plan chooses where the checkpoints live, and the step runs that choice.

    Returns ``{"fits", "out_of_memory", "measured_peak_bytes", "predicted_peak_bytes", "ratio", "step_s",
    "tokens_per_s", "tflops", "plan", "loss", "device", ...}``: ``plan`` is :func:`ulysses_sp.plan.plan_memory`'s
    prediction for the same settings (as a dict), ``ratio`` = predicted / measured, ``fits`` whether the step ran
    without running out of memory and within the plan's usable memory (measured figures are None where it ran
    out); ``tokens_per_s`` is the whole sequence's over the measured step, as if every rank of the SP group took as
    long, and ``tflops`` / ``mfu`` are per GPU: the sequence's model FLOPs (``6 N + 6 L H d T``, recomputation not
    counted) over the step and the sp GPUs that share it.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from .shapes import random_model
    from .train.metrics import peak_tflops
    from .train.model_factory import training_flops_per_token

    features = features or Features()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    features.check_dtype(device)  # the plan and the step in the dtype this GPU runs: 'auto' is fp32 without bf16
    features = dataclasses.replace(features, dtype=features.resolve(device).dtype)
    if seq_len % sp:
        raise ValueError(f"simulate needs seq_len divisible by sp, got seq_len={seq_len}, sp={sp}")
    gpu_memory_bytes = planned_gpu_bytes(device, gpu_memory_bytes)
    config, name = load_model_config(model_config)
    plan = plan_memory(
        config,
        seq_len=seq_len,
        sp=sp,
        dp=dp,
        features=features,
        micro_batch=micro_batch,
        gpu_memory_bytes=gpu_memory_bytes,
        host_memory_bytes=host_memory_bytes,
        gpus_per_node=gpus_per_node,
        device=device.type,
        ring=ring,
    )
    available = available_host_bytes() if device.type == "cpu" else None
    if available is not None and plan.peak_bytes > available:  # the step would swap or be killed, not measured
        raise ValueError(
            f"a step of {seq_len:,} tokens on the CPU needs about {plan.peak_bytes / 2**30:.1f} GiB (its plan), more "
            f"than the {available / 2**30:.1f} GiB of memory available here; simulate a shorter sequence, a larger "
            "sp or a smaller model, or on a GPU"
        )
    batch = random_batch(config.get_text_config().vocab_size, seq_len, batch=micro_batch, seed=seed)
    measured: dict[str, Any] | None = None
    out_of_memory = ""
    with StandIn(sp=sp, dp=dp, ring=plan.ring, sp_rank=0, device=device) as rank:
        mesh = init_device_mesh(device.type, (sp * dp,), mesh_dim_names=("world",))
        try:
            with memory_cap(device, gpu_memory_bytes):
                measured = sharded_step_peak(
                    config, rank.layout, rank.shard(batch), features=plan.features, mesh=mesh, core=core, seed=seed
                )
        except torch.OutOfMemoryError as error:  # the allocator's account says by how much, and what was reserved
            measured, out_of_memory = None, " ".join(str(error).split())[:700]
    if device.type == "cuda":  # what the step (or its traceback) held goes back to the device and the host
        gc.collect()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)  # a CUDA build's: the cached pinned blocks
        if empty_host is not None:  # else a later step of another length would find this one's blocks still held
            empty_host()
    predicted = plan.peak_bytes
    result: dict[str, Any] = {
        "model": name,
        "seq_len": seq_len,
        "sp": sp,
        "ring": plan.ring,
        "dp": dp,
        "device": str(device),
        "gpu_memory_bytes": gpu_memory_bytes,
        "fits": measured is not None and measured["peak_bytes"] <= plan.usable_bytes,
        "out_of_memory": measured is None,
        "out_of_memory_message": out_of_memory or None,
        "allocator": allocator_settings() if device.type == "cuda" else None,
        "predicted_peak_bytes": predicted,
        "predicted_fits": plan.fits,
        "plan": plan.to_dict(),
    }
    if measured is None:
        keys = ("measured_peak_bytes", "resident_bytes", "ratio", "loss", "step_s", "tokens_per_s", "tflops", "mfu")
        return {**result, **dict.fromkeys(keys)}
    flops = training_flops_per_token(random_model(config, device="meta"), seq_len) * seq_len * micro_batch
    tflops = flops / measured["step_s"] / sp / 1e12  # per GPU: each of the sp ranks does 1/sp of the step's work
    peak = peak_tflops(device, features.torch_dtype(device))
    return {
        **result,
        "measured_peak_bytes": measured["peak_bytes"],
        "resident_bytes": measured["resident_bytes"],
        "ratio": predicted / max(1, measured["peak_bytes"]),
        "loss": measured["loss"],
        "step_s": measured["step_s"],
        "tokens_per_s": seq_len * micro_batch / measured["step_s"],
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
    }
