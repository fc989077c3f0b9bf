"""Per-rank memory of a training step: saved-activation bytes and peak bytes, for any sp on one device.

* :class:`SavedActivations` counts the bytes autograd keeps for backward (``saved_tensors_hooks``), each
  storage once (views share their base's storage), parameters excluded.
* :func:`standin_rank` stands in for one rank of an ``sp``-rank group in this one process, with torch's fake
  process group (collectives run as shape-correct no-ops: an all-to-all hands back its input, an
  all-gather copies of it). Memory depends on shapes only, so one process measures what one rank of a
  large layout holds. The gathered position_ids are copies of this rank's positions, which would read as
  ``sp`` documents; :func:`dense_core` makes the local core see the dense rows every real rank sees.
* :func:`measure_step` runs forward + backward of one step and returns both numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.cores import Core, Segments, get_core
from ulysses_sp.layout import ParallelLayout
from ulysses_sp.loss import causal_lm_loss
from ulysses_sp.memory import PeakMemory
from ulysses_sp.sharding import shard_batch

__all__ = ["SavedActivations", "dense_core", "measure_step", "random_batch", "standin_rank"]


class SavedActivations:
    """``with SavedActivations(model) as saved: loss = ...`` then ``saved.bytes``: what backward will read.

    Counts every tensor autograd saves inside the block, one storage once, leaving out the storages of
    ``model``'s parameters (weights are not activations; a cast copy of a weight, e.g. under autocast, is
    counted because it is allocated for this step).
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self._params and key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)


@contextlib.contextmanager
def standin_rank(sp: int, rank: int = 0, device: torch.device | str = "cpu") -> Iterator[ParallelLayout]:
    """A layout for rank ``rank`` of an ``sp``-rank SP group, backed by torch's fake process group.

    ``sp == 1`` gives the one-process layout. Refuses to run when a process group already exists in this
    process (the fake group becomes the default group for the duration of the block).
    """
    if sp == 1:
        yield ParallelLayout.single(device)
        return
    if dist.is_initialized():
        raise ValueError("standin_rank needs a process without a process group (it creates the fake one)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=sp, store=FakeStore())
    try:
        yield ParallelLayout.from_groups(dist.group.WORLD, device=device)
    finally:
        dist.destroy_process_group()


def dense_core(name: str = "sdpa") -> Core:
    """The core ``name`` fed with dense rows (one document per row, no padding) whatever it is handed.

    Under :func:`standin_rank` the gathered positions are copies of one shard, which would read as one
    document per shard; the benchmark batches are dense, so this is the segmentation a real rank computes.
    """
    core = get_core(name)

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, **kwargs) -> torch.Tensor:
        full = Segments(
            batch=segments.batch,
            seq_len=segments.seq_len,
            spans=[[(0, segments.seq_len)]] * segments.batch,
            device=segments.device,
        )
        return core(q, k, v, full, **kwargs)

    dense.__name__ = f"dense_{name}"
    return dense


def random_batch(vocab_size: int, seq_len: int, *, batch: int = 1, seed: int = 1) -> dict[str, torch.Tensor]:
    """A dense batch of random tokens: ``input_ids`` and ``labels`` ``[batch, seq_len]``."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (batch, seq_len), generator=gen)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def measure_step(model: nn.Module, batch: dict[str, torch.Tensor], layout: ParallelLayout) -> dict[str, int]:
    """Forward + backward of one step on this rank's shard of ``batch``.

    Returns ``saved_bytes`` (activations kept for backward) and ``peak_bytes`` (the step's peak above what
    was allocated before it: activations, gradients, temporaries). Gradients are freed afterwards.
    """
    device = layout.device
    shard = {k: v.to(device) for k, v in shard_batch(batch, layout).items()}
    model.zero_grad(set_to_none=True)
    with PeakMemory(device) as peak:
        with SavedActivations(model) as saved:
            loss = causal_lm_loss(model, shard, layout)
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return {"saved_bytes": saved.bytes, "peak_bytes": peak.peak_bytes}
