"""Ulysses sequence parallelism for ``accelerate launch`` users with their own training loop.

The counterpart of Accelerate's ``ParallelismConfig(sp_size=...)`` (which needs DeepSpeed), on DDP or FSDP2::

    accelerator = Accelerator()
    sp = SequenceParallelConfig(sp_size=2)
    model, optimizer, loader, loss_fn = sp.prepare(accelerator, model, optimizer, loader)
    for batch in loader:                      # this rank's shard of the batch of its SP group
        loss = loss_fn(model, batch)          # tiled lm_head + loss: no [tokens, vocab] logits
        accelerator.backward(loss)

``prepare`` parallelizes the model (before any DDP/FSDP wrapping), wraps each dataloader's collate function
so batches arrive sharded (:class:`~ulysses_sp.integrations.data.SequenceParallelCollator`), calls
``accelerator.prepare`` on everything, and makes the dataloaders deal batches over the dp SP groups
(:func:`~ulysses_sp.integrations.dealing.deal_batches_over_dp`). A model you sharded yourself with FSDP2's
``fully_shard`` over the world (its parameters are DTensors) is not wrapped in DDP again (tested on CPU).
Accelerate's own FSDP2 plugin (``accelerate launch --use_fsdp --fsdp_version 2``) is only enabled by
Accelerate on accelerator devices; it goes through the same ``accelerator.prepare`` call but is not covered by
the CPU test suite. DDP and FSDP2 over the world both average gradients over dp x sp, as the loss expects.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..features import apply_features
from ..layout import ParallelLayout
from ..loss import causal_lm_loss, count_valid_tokens, sequence_parallel_cross_entropy
from ..model import parallelize
from ..validation import check_label_smoothing
from .data import (
    SequenceParallelCollator,
    agree_on_batch,
    agree_on_worker_batches,
    check_sp_options,
    check_world_size,
    integration_features,
    layout_for_model,
    resolve_core,
)
from .dealing import deal_batches_over_dp, shared_stream
from .metrics import gather_for_metrics, sequence_parallel_gather

__all__ = ["SequenceParallelConfig", "SequenceParallelLoss"]


class SequenceParallelLoss:
    """Token-weighted cross-entropy over every shard and replica (see ``sequence_parallel_cross_entropy``).

    ``loss_fn(model, batch)`` runs the model on the batch's shard and returns the loss (with the tiled
    lm_head + loss when enabled, so no ``[tokens, vocab]`` logits are held); ``loss_fn(logits, shift_labels)``
    scores logits you computed yourself. Either is the loss of the whole global batch, the same value on every rank;
    its gradients are exact once averaged over dp x sp (DDP / FSDP2 do it). For exact token weighting under
    gradient accumulation, pass ``num_items_in_batch=loss_fn.count(...)`` summed over the step's micro-batches
    (fetched first) and accumulate with ``accelerator.no_sync(model)`` on all but the step's last micro-batch, on an
    Accelerator with ``gradient_accumulation_steps=1``: ``accelerator.accumulate`` sees the end of the dataloader
    once its last batch is fetched and would step the optimizer on every micro-batch of the last step
    (docs/integrations.md). ``label_smoothing``: as ``torch.nn.CrossEntropyLoss``'s, over the whole sequence's
    targets (in the tiled loss too).
    """

    def __init__(self, layout: ParallelLayout, *, label_smoothing: float = 0.0) -> None:
        self.layout = layout
        self.label_smoothing = check_label_smoothing(label_smoothing)  # checked here, not at the first step

    def __call__(
        self,
        logits_or_model: torch.Tensor | torch.nn.Module,
        shift_labels_or_batch: torch.Tensor | Mapping[str, torch.Tensor],
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        options = {"label_smoothing": self.label_smoothing}
        if isinstance(logits_or_model, torch.nn.Module):  # (a batch from accelerator.skip_first_batches: agreed here)
            batch = dict(agree_on_batch(shift_labels_or_batch, self.layout))
            return causal_lm_loss(logits_or_model, batch, self.layout, num_items_in_batch=num_items_in_batch, **options)
        return sequence_parallel_cross_entropy(
            logits_or_model, shift_labels_or_batch, self.layout, num_items_in_batch=num_items_in_batch, **options
        )

    def count(self, shift_labels: torch.Tensor) -> int:
        """Valid target tokens of this micro-batch over all ranks (dp x sp)."""
        return count_valid_tokens(shift_labels, self.layout)

    def gather_for_metrics(
        self, accelerator: Any, input_data: Any, *, sequence_dim: int | None = None, pad_index: int | float = -100
    ) -> Any:
        """``accelerator.gather_for_metrics`` for the shards: every sample of the global batch once (Accelerate's
        own would return each SP group's batch ``sp`` times), whole sequences with ``sequence_dim=1``, e.g.
        ``loss_fn.gather_for_metrics(accelerator, (logits.argmax(-1), batch["shift_labels"]), sequence_dim=1)``.
        See :func:`ulysses_sp.integrations.metrics.gather_for_metrics`."""
        return gather_for_metrics(accelerator, input_data, self.layout, sequence_dim=sequence_dim, pad_index=pad_index)


@dataclass(frozen=True, kw_only=True)
class SequenceParallelConfig:
    """Ulysses SP for an ``Accelerator`` loop; make it once, then call :meth:`prepare` once.

    Attributes:
        sp_size: ranks that split each sequence; the world size must be a multiple of it.
        core: local attention core (``"sdpa"``, ``"eager"``, ``"flex_attention"``, ``"flash_attention_2"``, ...);
            default None: the model's own ``attn_implementation``, as ``UlyssesTrainer(sp_core=)``.
        pad_token_id: id of the tokens added to make a sequence length divisible by ``sp_size``.
        comm_dtype: dtype of the all-to-all payload (default: the activations' dtype).
        ring: ring degree inside ``sp_size`` (hybrid Ulysses x Ring); default: chosen from the model's heads.
        tiled_loss: compute the loss with the tiled lm_head + cross-entropy when the loss function is called as
            ``loss_fn(model, batch)`` (default True).
        head_chunks: run each attention layer's heads in this many chunks (``parallelize(head_chunks=)``);
            default None: automatic, as ``ulysses-sp train``.
        tiled_mlp: run each decoder layer's MLP over chunks of tokens, recomputed in backward (exact); default
            None: on, as ``ulysses-sp train``, where the decoder layers have an MLP it recognises.
        tiled_norms: run the decoder layers' norms over chunks of tokens (exact); default None: on where the
            decoder layers have norms.
        mlp_chunk_tokens: tokens per chunk of the tiled MLP and norms; default None: max(1024, hidden size).
        label_smoothing: the loss function's, as ``torch.nn.CrossEntropyLoss(label_smoothing=)`` (default 0).
    """

    sp_size: int
    core: str | None = None
    pad_token_id: int = 0
    comm_dtype: torch.dtype | None = field(default=None)
    tiled_loss: bool = True
    ring: int | None = None
    head_chunks: int | None = None
    tiled_mlp: bool | None = None
    tiled_norms: bool | None = None
    mlp_chunk_tokens: int | None = None
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        check_sp_options("", self.sp_size, self.mlp_chunk_tokens, self.tiled_mlp, self.tiled_norms)
        check_label_smoothing(self.label_smoothing)

    def prepare(self, accelerator: Any, model: torch.nn.Module, *objects: Any) -> tuple[Any, ...]:
        """Parallelize ``model`` and prepare it with ``objects`` (optimizer, dataloaders, scheduler).

        Returns ``(model, *objects, loss_fn)`` in the order given, each prepared by ``accelerator``, and a
        :class:`SequenceParallelLoss`. Dataloaders must be plain ``torch.utils.data.DataLoader`` objects (over a
        map-style dataset, or an iterable one with ``dispatch_batches=False``); they are copied, not changed.
        Raises ValueError before any training for heads that do not split over ``sp_size``, an unknown core,
        or a world size that is not a multiple of ``sp_size``. With ``sp_size > 1`` the accelerator's
        ``gather_for_metrics`` is replaced by :func:`~ulysses_sp.integrations.metrics.sequence_parallel_gather`.
        """
        if getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None) is not None:
            raise ValueError(
                "an Accelerator with a DeepSpeed plugin is not supported by SequenceParallelConfig, which runs on DDP "
                "or FSDP2 (untested under DeepSpeed, whose ZeRO-3 gathers weights only inside module calls); use "
                "fully_shard or Accelerate's FSDP2 plugin to shard"
            )
        layout = layout_for_model(model, self.sp_size, accelerator.device, ring=self.ring)
        check_world_size(accelerator.num_processes, layout, "on a CPU-only machine create Accelerator(cpu=True)")
        core = resolve_core(model, self.core, "core")
        parallelize(model, layout, core=core, comm_dtype=self.comm_dtype, head_chunks=self.head_chunks)
        switch = lambda name: f"SequenceParallelConfig({name}=False)"  # noqa: E731 (named in errors)
        features = integration_features(
            model,
            tiled_loss=self.tiled_loss,
            tiled_mlp=self.tiled_mlp,
            tiled_norms=self.tiled_norms,
            mlp_chunk_tokens=self.mlp_chunk_tokens,
            switch=switch,
        )
        apply_features(model, features, layout.device.type, switch=switch)
        objects = tuple(self._shard_loader(obj, layout) if isinstance(obj, DataLoader) else obj for obj in objects)
        from accelerate.utils import model_has_dtensor

        loaders = [obj for obj in objects if isinstance(obj, DataLoader)]
        sizes = [(obj.batch_size or getattr(obj.batch_sampler, "batch_size", None)) for obj in loaders]
        split = check_split_batches(accelerator, layout, [("a dataloader's batch_size", size) for size in sizes])
        with split_over_dp_groups(accelerator, split):
            if model_has_dtensor(model):
                # Sharded with fully_shard already: Accelerate would wrap it in DDP (and refuses DTensors there).
                model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
                prepared = _as_tuple(accelerator.prepare(*objects)) if objects else ()
            else:
                model, *rest = _as_tuple(accelerator.prepare(model, *objects))
                prepared = tuple(rest)
        for original, obj in zip(objects, prepared, strict=True):
            if isinstance(original, DataLoader):
                deal_batches_over_dp(obj, layout, split_batches=split)
                agree_on_worker_batches(obj, layout)  # a refusal in a dataloader worker raises on every rank
            step_scheduler_per_dp_group(obj, layout.dp, split_batches=split)
        if layout.sp > 1:  # Accelerate's own would take each SP group's batch for sp batches
            accelerator.gather_for_metrics = sequence_parallel_gather(accelerator, layout)
        return (model, *prepared, SequenceParallelLoss(layout, label_smoothing=self.label_smoothing))

    def _shard_loader(self, loader: DataLoader, layout: ParallelLayout) -> DataLoader:
        collate = loader.collate_fn
        if isinstance(collate, SequenceParallelCollator):
            raise ValueError("this dataloader already yields sequence shards; pass the original dataloader")
        sharded = copy.copy(loader)
        sharded.collate_fn = SequenceParallelCollator(
            collate, layout, pad_token_id=self.pad_token_id, defer_checks=True
        )
        # a datasets.IterableDataset as a stream accelerate splits by batches (shared_stream); set past the guard
        # DataLoader keeps for a dataset with samplers of its own (an iterable one has none; this copy is ours)
        vars(sharded)["dataset"] = shared_stream(loader.dataset, layout)
        return sharded


def check_split_batches(accelerator: Any, layout: ParallelLayout, batch_sizes: list[tuple[str, Any]] = ()) -> bool:
    """Whether ``accelerator`` splits each batch (``split_batches``) and SP makes the dp groups, not the processes,
    split it (:func:`split_over_dp_groups`); then each of ``batch_sizes`` (how the user sets it, the size) must be a
    multiple of dp: ValueError otherwise."""
    split = bool(getattr(accelerator, "split_batches", False)) and layout.sp > 1
    for name, size in batch_sizes if split else ():
        if not isinstance(size, int) or size % layout.dp:
            raise ValueError(
                f"with split_batches=True each batch is split over the {layout.dp} data-parallel SP group(s) (not "
                f"over every rank), so {name} must be a multiple of {layout.dp}, got {size!r}"
            )
    return split


@contextlib.contextmanager
def split_over_dp_groups(accelerator: Any, split: bool) -> Iterator[None]:
    """Under ``split_batches`` (``split``: :func:`check_split_batches`) and SP, let ``accelerator.prepare`` shard
    dataloaders by whole batches: accelerate would split each batch over all ``dp x sp`` processes, refusing a batch
    size that is not a multiple of the world size; under SP only the ``dp`` groups split it
    (:func:`deal_batches_over_dp` re-points the shards)."""
    if not split:
        yield
        return
    config = accelerator.dataloader_config
    accelerator.dataloader_config = dataclasses.replace(config, split_batches=False)
    try:
        yield
    finally:
        accelerator.dataloader_config = config


def step_scheduler_per_dp_group(scheduler: Any, dp: int, *, split_batches: bool = False) -> None:
    """Make an Accelerate-prepared scheduler step ``dp`` times per optimizer step, not once per process (in place;
    anything else is left alone); under ``split_batches`` once per optimizer step, as Accelerate steps it.

    Without ``split_batches`` accelerate steps a prepared scheduler ``num_processes`` times per optimizer step: each
    process then reads its own batch, so one step consumes that many of the dataloader's batches. Under sequence
    parallelism the ``sp`` ranks of a group read the same batch (:func:`deal_batches_over_dp`), so a step consumes
    ``dp`` batches, and a schedule written for the unprepared dataloader's length must advance ``dp`` times. With
    ``split_batches`` a step consumes one batch (split over the dp groups), so the schedule advances once.
    """
    from accelerate.scheduler import AcceleratedScheduler

    if type(scheduler) is AcceleratedScheduler:  # not a subclass of its own (DeepSpeed's wrapper)
        scheduler.__class__ = _per_dp_group_class()  # in place: the accelerator holds this object (save_state)
        scheduler.dp_groups = dp
        scheduler.split_batches = scheduler.split_batches or split_batches  # prepared with it off (see prepare)


@functools.cache
def _per_dp_group_class() -> type:
    from accelerate.scheduler import AcceleratedScheduler

    class PerDataParallelGroupScheduler(AcceleratedScheduler):
        """An AcceleratedScheduler that steps ``dp_groups`` times per optimizer step (see
        :func:`step_scheduler_per_dp_group`)."""

        dp_groups = 1

        def step(self, *args: Any, **kwargs: Any) -> None:
            if self.split_batches or not self.step_with_optimizer or not self.gradient_state.sync_gradients:
                super().step(*args, **kwargs)  # one step, or none (accelerate's own bookkeeping)
                return
            self.split_batches = True  # accelerate's step, one scheduler step per call
            try:
                for _ in range(self.dp_groups):
                    total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR: not past its end
                    if total is None or self.scheduler._step_count <= total:
                        super().step(*args, **kwargs)
            finally:
                self.split_batches = False

    return PerDataParallelGroupScheduler


def _as_tuple(result: Any) -> tuple[Any, ...]:
    return result if isinstance(result, tuple) else (result,)
