"""One real training step as ONE rank of a large layout, on one device, to measure its peak memory.

:func:`simulate_step` starts torch's fake process group (backend ``"fake"``: collectives are shape-correct
no-ops) as rank 0 of ``dp x sp`` ranks, builds the model on the ``meta`` device, applies
:func:`ulysses_sp.parallelize` and FSDP2 ``fully_shard`` over the fake world, allocates only this rank's
shards (``to_empty`` + a random init), and runs two forward + backward + AdamW steps on a random batch of
``seq_len`` tokens (this rank holds ``seq_len / sp`` of them). The peak of the second step (when the AdamW
states exist, as in every later step) is measured with :class:`ulysses_sp.memory.PeakMemory` and returned
next to :func:`ulysses_sp.plan.plan_memory`'s prediction. The process group is destroyed afterwards.

Ulysses reads metadata from its peers: the shape agreement and the batch fingerprint are the same on every
rank (a fake all-gather that copies this rank's tensor answers them right), but the positions gathered once
per forward differ per rank. The SP group is therefore a :class:`SimulatedGroup`, a small Python process
group that knows every rank's shard of the synthetic batch: an all-gathered row equal to this rank's
``position_ids`` (or ``attention_mask``) shard is answered with rank j's shard, anything else with a copy;
its all-to-all copies (shape-correct, like the fake backend). :func:`measure_step` is the same step in an
already initialised world (e.g. gloo ranks), which tests compare against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layout import ParallelLayout
from .memory import PeakMemory
from .plan import Features, load_model_config, plan_memory

__all__ = ["SimulatedGroup", "measure_step", "simulate_step"]


class _DoneWork(dist._Work):
    """A collective that completed when it was issued."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


class SimulatedGroup(dist.ProcessGroup):
    """An SP group of ``size`` ranks simulated by its rank ``rank``, which knows every rank's batch shard.

    Args:
        shards: for each SP rank, the tensors it would send that differ from this rank's (its
            ``position_ids`` / ``attention_mask`` shard), keyed by name.
    """

    def __init__(self, rank: int, size: int, shards: list[dict[str, torch.Tensor]]) -> None:
        super().__init__(rank, size)
        if len(shards) != size:
            raise ValueError(f"need one shard per rank: {len(shards)} shards for {size} ranks")
        self._shards = shards

    def getBackendName(self) -> str:  # noqa: N802 (the ProcessGroup method name)
        return "simulated"

    def _sent_by(self, peer: int, mine: torch.Tensor) -> torch.Tensor:
        # Rows (along dim 0) equal to one of this rank's shard tensors become the peer's; the rest is
        # metadata every rank of the group shares (shapes, the full batch's fingerprint).
        if mine.dim() == 0:
            return mine
        rows = []
        for row in mine.unbind(0):
            for key, own in self._shards[self.rank()].items():
                if own.shape == row.shape and torch.equal(own.to(row.device, row.dtype), row):
                    row = self._shards[peer][key].to(row.device, row.dtype)
                    break
            rows.append(row)
        return torch.stack(rows)

    def allgather(self, output_tensors, input_tensors, opts=None):  # type: ignore[override]
        for peer, out in enumerate(output_tensors[0]):
            out.copy_(self._sent_by(peer, input_tensors[0]))
        return _DoneWork()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # type: ignore[override]
        output.copy_(input)  # shape-correct; the values are this rank's own
        return _DoneWork()

    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        return _DoneWork()

    def barrier(self, opts=None):  # type: ignore[override]
        return _DoneWork()


# ---------------------------------------------------------------------------------------------- the step
def _synthetic_batch(vocab: int, seq_len: int, micro_batch: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _apply_features(model: nn.Module, features: Features) -> None:
    """Turn on the requested features through their modules, as ``ulysses-sp train`` does."""
    from .offload import enable_activation_checkpointing
    from .tiled_loss import enable_tiled_loss
    from .tiling import enable_tiled_mlp

    if features.tiled_loss:
        enable_tiled_loss(model, chunk_tokens=features.loss_chunk_tokens, budget_bytes=features.loss_budget_bytes)
    if features.tiled_mlp:
        enable_tiled_mlp(model, chunk_tokens=features.mlp_chunk_tokens)
    if features.activation_checkpointing != "none":
        enable_activation_checkpointing(model, mode=features.activation_checkpointing)


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


def measure_step(
    model_config: Any,
    layout: ParallelLayout,
    *,
    seq_len: int,
    features: Features | None = None,
    micro_batch: int = 1,
    mesh: Any = None,
    core: str = "sdpa",
    seed: int = 0,
) -> dict[str, Any]:
    """Build the model sharded over the world (FSDP2), run two steps, return the second step's peak.

    Runs in an initialised world whose ranks all call it (gloo / NCCL ranks, or the fake world of
    :func:`simulate_step`). ``mesh`` is the 1-D FSDP2 mesh over all ranks (built when None). Returns
    ``{"peak_bytes", "resident_bytes", "step_peak_bytes", "loss"}``: the peak is the bytes held on
    ``layout.device`` before the step (parameter shards, buffers, AdamW states) plus the step's own peak.
    """
    from transformers import AutoModelForCausalLM

    from .fsdp import fully_shard_layers
    from .loss import causal_lm_loss
    from .model import parallelize
    from .sharding import shard_batch

    features = features or Features()
    if features.parallel != "fsdp2":
        raise ValueError(f"simulating parallel={features.parallel!r} is not supported; simulate models FSDP2 only")
    config, _ = load_model_config(model_config)
    device = layout.device
    compute = torch.bfloat16 if features.dtype == "bf16" else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    parallelize(model, layout, core=core)
    _apply_features(model, features)
    offload = features.cpu_offload_optimizer and device.type == "cuda"
    fully_shard_layers(model, device, layout.world_size, compute_dtype=compute, offload_to_cpu=offload, mesh=mesh)
    _materialise(model, torch.device("cpu") if offload else device, seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = _synthetic_batch(config.get_text_config().vocab_size, seq_len, micro_batch, seed)
    shard = shard_batch(batch, layout)

    def step() -> float:
        with torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32):
            loss = causal_lm_loss(model, shard, layout)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()  # allocates the AdamW states; the second step is what every later step looks like
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        resident = torch.cuda.memory_allocated(device)
    else:
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        resident = _storage_bytes([*model.parameters(), *model.buffers(), *states], device)
    with PeakMemory(device) as peak:
        loss = step()
    return {
        "peak_bytes": resident + peak.peak_bytes,
        "resident_bytes": resident,
        "step_peak_bytes": peak.peak_bytes,
        "loss": loss,
    }


@contextlib.contextmanager
def _fake_world(world_size: int) -> Iterator[None]:
    """The default process group as rank 0 of a fake world; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ValueError(
            "simulate_step needs a process without a default process group (it starts a fake one); run it "
            "in a fresh process, e.g. `ulysses-sp plan --simulate`"
        )
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def simulate_step(
    model_config: Any,
    *,
    seq_len: int,
    sp: int = 1,
    dp: int = 1,
    device: torch.device | str = "cpu",
    features: Features | None = None,
    micro_batch: int = 1,
    gpu_memory_bytes: int | None = None,
    core: str = "sdpa",
    seed: int = 0,
) -> dict[str, Any]:
    """Run one training step as rank 0 of ``dp x sp`` ranks on ``device`` and measure its peak memory.

    Returns ``{"measured_peak_bytes", "predicted_peak_bytes", "ratio", "plan", "loss", "device", ...}``
    where ``plan`` is :func:`ulysses_sp.plan.plan_memory`'s prediction for the same settings (as a dict)
    and ``ratio`` = predicted / measured.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from .sharding import shard_batch

    features = features or Features()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config, name = load_model_config(model_config)
    plan = plan_memory(
        config,
        seq_len=seq_len,
        sp=sp,
        dp=dp,
        features=features,
        micro_batch=micro_batch,
        gpu_memory_bytes=gpu_memory_bytes or 80 * (1 << 30),
        device=device.type,
    )
    world = sp * dp
    # Every SP rank's shard of the synthetic batch: what the simulated group answers for its peers.
    batch = _synthetic_batch(config.get_text_config().vocab_size, seq_len, micro_batch, seed)
    with _fake_world(world):
        peers = []
        for sp_rank in range(sp):
            view = ParallelLayout(dp=1, sp=1, sp_rank=0, device=device)
            full = shard_batch(batch, view)  # sp=1: the whole row with its global positions
            n = -(-seq_len // sp)
            peers.append({"position_ids": full["position_ids"][:, sp_rank * n : (sp_rank + 1) * n].contiguous()})
            if n * sp != seq_len:  # padded tail: positions continue the row (as shard_batch pads)
                peers = []
                break
        if not peers:
            raise ValueError(f"simulate needs seq_len divisible by sp, got seq_len={seq_len}, sp={sp}")
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
        dp_mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
        layout = ParallelLayout(
            dp=dp,
            sp=sp,
            rank=0,
            sp_rank=0,
            dp_rank=0,
            sp_group=SimulatedGroup(0, sp, peers) if sp > 1 else None,
            dp_group=dp_mesh.get_group("dp") if dp > 1 else None,
            loss_group=dist.group.WORLD,
            device=device,
        )
        measured = measure_step(
            config, layout, seq_len=seq_len, features=features, micro_batch=micro_batch, mesh=mesh, core=core, seed=seed
        )
    predicted = plan.peak_bytes
    return {
        "model": name,
        "seq_len": seq_len,
        "sp": sp,
        "dp": dp,
        "device": str(device),
        "measured_peak_bytes": measured["peak_bytes"],
        "resident_bytes": measured["resident_bytes"],
        "predicted_peak_bytes": predicted,
        "ratio": predicted / max(1, measured["peak_bytes"]),
        "loss": measured["loss"],
        "plan": plan.to_dict(),
    }
