"""One rank of a large layout, stood in for by this one process: a fake world, a simulated SP group, one step.

Memory and compute of a rank depend on shapes, so one process can measure what one rank of ``dp x sp``
ranks holds. :class:`StandIn` starts torch's fake process group (backend ``"fake"``: collectives are
shape-correct no-ops) as that rank, and gives it an SP group (:class:`SimulatedGroup`) that answers what
the real peers would send where it matters: the positions (and padding mask) Ulysses gathers once per
forward. Everything else a peer sends is metadata every rank shares (shapes, the batch's fingerprint) or
payload whose values do not matter for memory (the all-to-alls hand back this rank's own tensor).

:func:`measure_step` runs one forward + backward (and an optimizer step when given one) and returns its
peak and saved-activation bytes; :func:`random_batch` is the batch every measurement uses. ``ulysses-sp
plan --simulate``, ``ulysses-sp bench`` and the tests all measure through these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layout import ParallelLayout
from .memory import PeakMemory, SavedActivations

__all__ = ["SimulatedGroup", "StandIn", "fake_world", "measure_step", "random_batch"]


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

    ``set_shards`` gives, for each SP rank, the tensors it would send that differ from this rank's (its
    ``position_ids`` / ``attention_mask`` shard), keyed by name: an all-gathered row equal to one of this
    rank's is answered with each peer's; anything else with a copy.
    """

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]

    def set_shards(self, shards: list[dict[str, torch.Tensor]]) -> None:
        if len(shards) != self.size():
            raise ValueError(f"need one shard per rank: {len(shards)} shards for {self.size()} ranks")
        self._shards = shards

    def getBackendName(self) -> str:  # noqa: N802 (the ProcessGroup method name)
        return "simulated"

    def _sent_by(self, peer: int, mine: torch.Tensor) -> torch.Tensor:
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


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group as rank ``rank`` of a fake world of ``world_size``; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ValueError(
            "a stand-in rank needs a process without a default process group (it starts a fake one); run it in a "
            "fresh process, e.g. `ulysses-sp plan --simulate`"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class StandIn:
    """``with StandIn(sp=8, sp_rank=7) as rank:`` this process is that rank of ``dp x sp`` ranks.

    ``rank.layout`` is its :class:`~ulysses_sp.ParallelLayout` in a fake world of ``dp x sp`` ranks (also for
    one rank, so that FSDP2 finds a default group); ``rank.shard(batch)`` cuts its shard of a full batch and
    tells the simulated SP group every peer's.
    """

    def __init__(self, *, sp: int, dp: int = 1, sp_rank: int = 0, device: torch.device | str = "cpu") -> None:
        if not 0 <= sp_rank < sp:
            raise ValueError(f"sp_rank must be in [0, {sp}), got {sp_rank}")
        self.sp, self.dp, self.sp_rank, self.device = sp, dp, sp_rank, torch.device(device)
        self._world: contextlib.AbstractContextManager | None = None
        self.layout = ParallelLayout.single(self.device)  # until the fake world exists

    def __enter__(self) -> StandIn:
        from torch.distributed.device_mesh import init_device_mesh

        self._world = fake_world(self.sp * self.dp, rank=self.sp_rank)
        self._world.__enter__()
        dp_group = None
        if self.dp > 1:
            dp_group = init_device_mesh(self.device.type, (self.dp, self.sp), mesh_dim_names=("dp", "sp")).get_group(
                "dp"
            )
        self.layout = ParallelLayout(
            dp=self.dp,
            sp=self.sp,
            rank=self.sp_rank,
            sp_rank=self.sp_rank,
            sp_group=SimulatedGroup(self.sp_rank, self.sp) if self.sp > 1 else None,
            dp_group=dp_group,
            loss_group=dist.group.WORLD,
            device=self.device,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._world is not None:
            self._world.__exit__(*exc)
            self._world = None

    def shard(self, batch: dict[str, torch.Tensor], **kwargs: Any) -> dict[str, torch.Tensor]:
        """This rank's shard of ``batch`` (``shard_batch``'s keyword arguments pass through), on its device."""
        from .sharding import shard_batch

        views = [ParallelLayout.rank_view(self.sp, r, device=self.device) for r in range(self.sp)]
        shards = [shard_batch(batch, view, **kwargs) for view in views]
        group = self.layout.sp_group
        if isinstance(group, SimulatedGroup):
            keys = ("position_ids", "attention_mask")
            group.set_shards([{k: s[k].to(self.device) for k in keys if k in s} for s in shards])
        return {k: v.to(self.device) for k, v in shards[self.sp_rank].items()}


def random_batch(vocab_size: int, seq_len: int, *, batch: int = 1, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random token ids (>= 2: clear of special ids) as ``input_ids`` and ``labels``, ``[batch, seq_len]``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def measure_step(
    model: nn.Module,
    shard: dict[str, torch.Tensor],
    layout: ParallelLayout,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Forward, loss and backward of one step on ``shard`` (then ``optimizer.step()`` when given), measured.

    Returns ``peak_bytes`` (the step's peak above what was allocated before it: activations, gradients,
    temporaries), ``saved_bytes`` (activations kept for backward, weights excluded) and ``loss``. Runs under
    autocast when ``dtype`` is not fp32. Gradients are freed afterwards.
    """
    from .loss import causal_lm_loss

    device = layout.device
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    with PeakMemory(device) as peak:
        with SavedActivations(model) as saved, autocast:
            loss = causal_lm_loss(model, shard, layout)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)
        value = float(loss.detach())
        del loss
    return {"peak_bytes": peak.peak_bytes, "saved_bytes": saved.bytes, "loss": value}
