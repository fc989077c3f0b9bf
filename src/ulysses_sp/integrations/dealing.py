"""How prepared dataloaders deal batches over the ``dp`` SP groups (the ``sp`` ranks of a group read one batch).

``accelerator.prepare`` splits a dataloader over every rank of the world; :func:`deal_batches_over_dp` re-points
its split at the dp groups. A ``datasets.IterableDataset`` is split by accelerate over the ranks by its shards
(files) when it has as many, each rank reading other samples, with nothing to re-point: :func:`shared_stream`
hands it to ``prepare`` as a plain stream, which accelerate splits by batches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ..layout import ParallelLayout
from .data import replace_collator

__all__ = ["SharedStream", "deal_batches_over_dp", "shared_stream", "shared_streams"]


def deal_batches_over_dp(dataloader: Any, layout: ParallelLayout, *, split_batches: bool = False) -> Any:
    """Make an Accelerate-prepared dataloader deal its batches over the ``dp`` SP groups (in place).

    ``accelerator.prepare`` splits a dataloader over all ``dp x sp`` ranks; under sequence parallelism the
    ``sp`` ranks of a group must see the same batch. This re-points accelerate's shard (a
    ``BatchSamplerShard`` or an ``IterableDatasetShard``) at ``num_processes=dp``, ``process_index=dp_rank``,
    which keeps the sample order (synchronised across ranks by accelerate), the epoch length and the
    remainder accounting of ``gather_for_metrics`` consistent (with ``sp == 1`` that split is already the right
    one; a dispatcher, which collates on process 0 alone, then gets a collator that runs no collective). With
    ``dp == 1`` the batches are exactly those of one process (the last one may be partial). ``split_batches``: the
    dataloader was prepared with whole batches per process (see ``SequenceParallelConfig.prepare``) and each batch
    is now split over the dp groups, as ``Accelerator(split_batches=True)`` splits it over processes (its batch
    size must be a multiple of ``dp``).
    Returns the same dataloader.
    """
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    if layout.sp == 1:  # world = dp: accelerate's split is already the right one
        if isinstance(dataloader, DataLoaderDispatcher):
            # it collates on process 0 alone (and sends the others slices of every tensor): no collective there,
            # and no full-batch counts (not per row: a slice of them would be read as counts)
            replace_collator(dataloader, check_same_batch=False, defer_checks=False, token_counts=False)
        return dataloader
    if isinstance(dataloader, DataLoaderDispatcher):
        raise ValueError(
            "the dataloader dispatches slices of one batch from rank 0 (accelerate's dispatch_batches=True, the "
            "default for iterable datasets), which cannot give the ranks of an SP group the same batch; set "
            "dispatch_batches=False (TrainingArguments(accelerator_config={'dispatch_batches': False}) or "
            "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False)))"
        )
    shards = [
        obj
        for obj in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None))
        if isinstance(obj, BatchSamplerShard)
    ]
    dataset = getattr(dataloader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        shards.append(dataset)
    if not shards:
        world = layout.world_size
        if shared_stream(dataset, layout) is not dataset:  # (split by its shards: each rank reads other samples)
            raise ValueError(
                f"accelerate split the datasets.IterableDataset of this dataloader over the {world} ranks by its "
                f"{dataset.n_shards} shards, so the ranks of an SP group read different samples; give the DataLoader "
                "ulysses_sp.integrations.dealing.shared_stream(dataset, layout) before accelerator.prepare "
                "(SequenceParallelConfig.prepare and the Ulysses trainers do)"
            )
        raise ValueError(
            f"cannot find how {type(dataloader).__name__} splits batches over the {world} ranks; pass a dataloader "
            "prepared by accelerate (accelerator.prepare) over a map-style dataset or a torch IterableDataset"
        )
    for shard in shards:
        shard.num_processes = layout.dp
        shard.process_index = layout.dp_rank
        shard.split_batches = shard.split_batches or split_batches
        if isinstance(shard, IterableDatasetShard) and shard.split_batches:
            # the DataLoader batches what the shard yields: the group's slice of each batch (accelerate sized it
            # for a slice per process)
            dataloader.batch_sampler.batch_size = shard.batch_size // layout.dp
        if layout.dp == 1:
            # One SP group sees every batch, as one process would: no samples repeated to even out a last
            # partial batch (with dp > 1 accelerate repeats a few, exactly as under plain DDP).
            if isinstance(shard, BatchSamplerShard):
                shard.even_batches = False
            else:
                shard.__class__ = _whole_stream_class()
    return dataloader


@functools.cache
def _whole_stream_class() -> type:
    from accelerate.data_loader import IterableDatasetShard

    class WholeStreamShard(IterableDatasetShard):
        """accelerate's shard of an iterable dataset for the one dp group: every sample once, in order, as in one
        process (accelerate's would complete a partial last batch with samples from the start)."""

        def __iter__(self) -> Any:
            generator = getattr(self.dataset, "generator", None)
            if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
                generator.manual_seed(getattr(self, "epoch", 0))  # as accelerate's shard seeds it
            return iter(self.dataset)

        def __reduce__(self) -> tuple[Any, ...]:  # a class made here does not pickle by name (spawned workers)
            return _whole_stream_shard, (self.__dict__,)

    return WholeStreamShard


def _whole_stream_shard(state: dict[str, Any]) -> Any:
    """A ``WholeStreamShard`` with ``state``, as a dataloader worker started by spawn or forkserver unpickles it."""
    shard_class = _whole_stream_class()
    shard = shard_class.__new__(shard_class)
    shard.__dict__.update(state)
    return shard


class SharedStream(torch.utils.data.IterableDataset):
    """A ``datasets.IterableDataset`` as a plain torch stream (see :func:`shared_stream`): every sample of it in its
    order, its epoch set through :meth:`set_epoch` (its shuffling), split over dataloader workers as it splits."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def __repr__(self) -> str:
        return f"SharedStream({self.dataset!r})"


def shared_stream(dataset: Any, layout: ParallelLayout) -> Any:
    """``dataset`` as :class:`SharedStream` when it is a ``datasets.IterableDataset`` and ``layout.sp > 1``; else
    ``dataset``. Accelerate gives each rank its own of such a dataset's shards (files) when it has as many as the
    world has ranks, so the ranks of an SP group read different samples; a plain stream it splits by batches, and
    :func:`deal_batches_over_dp` then deals them over the dp groups (every rank reads the stream, as accelerate has
    every rank read one of fewer shards)."""
    if layout.sp == 1 or isinstance(dataset, SharedStream):
        return dataset
    try:
        from datasets import IterableDataset
    except ImportError:
        return dataset
    return SharedStream(dataset) if isinstance(dataset, IterableDataset) else dataset


@contextlib.contextmanager
def shared_streams(
    holder: Any, layout: ParallelLayout, names: tuple[str, ...] = ("train_dataset", "eval_dataset")
) -> Iterator[None]:
    """Within: each attribute ``names`` of ``holder`` (a dataset, or a dict of them) through :func:`shared_stream`
    (for a Trainer, whose dataloaders read its datasets); restored after."""
    saved = {name: getattr(holder, name, None) for name in names}
    try:
        for name, value in saved.items():
            if isinstance(value, dict):
                setattr(holder, name, {key: shared_stream(data, layout) for key, data in value.items()})
            elif value is not None:
                setattr(holder, name, shared_stream(value, layout))
        yield
    finally:
        for name, value in saved.items():
            setattr(holder, name, value)
