"""Data plumbing shared by the Trainer and Accelerate integrations.

Two rules make the Hugging Face data pipeline right under sequence parallelism:

1. Every rank of one SP group gets the SAME full batch, and different SP groups get different samples:
   :func:`~ulysses_sp.integrations.dealing.deal_batches_over_dp` turns an Accelerate-prepared dataloader (which
   deals batches over every rank of the world) into one that deals them over the ``dp`` SP groups only. Epoch
   length and the samples consumed per optimizer step then match ``dp`` ordinary data-parallel ranks.
2. Each rank keeps only its slice of the sequence: :class:`SequenceParallelCollator` wraps the user's
   collator, collates the full batch and hands on :func:`ulysses_sp.shard_batch`'s output (padded to a
   multiple of ``sp``, ``shift_labels`` shifted before slicing, global ``position_ids``, ``labels`` kept).

A batch refused on one rank raises on every rank: the collator's checks agree over the ranks (in a dataloader
worker, which has no process group, the verdict rides with the batch and :func:`agree_on_batch` shares it in the
main process).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..batch_checks import SHARDED_KEYS, BatchCheck, batch_tokens, check_batch
from ..features import Features
from ..layout import ParallelLayout
from ..sharding import shard_batch

__all__ = [
    "BATCH_CHECK_KEY",
    "FULL_SEQUENCE_KEYS",
    "TOKEN_COUNT_KEY",
    "SequenceParallelCollator",
    "agree_on_batch",
    "agree_on_worker_batches",
    "check_world_size",
    "layout_for_model",
    "replace_collator",
    "resolve_core",
    "shard_full_batch",
]

logger = logging.getLogger(__name__)

# Keys some collators add (TRL's padding-free collator) that describe the FULL packed row for varlen kernels.
# They are stale for a shard; the Ulysses attention derives documents from the global position_ids instead.
FULL_SEQUENCE_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

# Where SequenceParallelCollator(token_counts=True) puts the full batch's token counts for the Trainer, which
# removes the key before the model sees the batch (UlyssesTrainerMixin._prepare_inputs).
TOKEN_COUNT_KEY = "ulysses_sp_token_counts"

# Where SequenceParallelCollator(defer_checks=True), collating in a dataloader worker, puts its checks' verdict (a
# BatchCheck) for the main process of each rank to agree on and remove (agree_on_batch).
BATCH_CHECK_KEY = "ulysses_sp_batch_check"


def full_batch_token_counts(batch: Mapping[str, Any], layout: ParallelLayout) -> torch.Tensor:
    """``[all, attention_mask ones, length, has position_ids]`` of a collated full batch (-1: no attention_mask):
    the counts on SP rank 0, zero on the others (summed over the world, each SP group's batch counts once, with the
    tokens one process counts: a shard's ``input_ids`` also hold the tokens added to make the length divisible by
    ``sp``); on every rank the batch's sequence length (what gathered whole sequences are cut back to) and 1 if the
    collator gave ``position_ids`` (a shard always has them), else 0."""
    mask = batch.get("attention_mask")
    counted = layout.sp_rank == 0
    masked = -1 if mask is None else int(mask.sum()) * counted
    rows, seq_len = batch_tokens(batch)[1].shape[:2]  # (inputs_embeds: not the hidden dim)
    return torch.tensor([rows * seq_len * counted, masked, seq_len, int("position_ids" in batch)])


def shard_full_batch(
    batch: Mapping[str, Any],
    layout: ParallelLayout,
    *,
    pad_token_id: int = 0,
    check_same_batch: bool = True,
    require_labels: bool = True,
) -> dict[str, torch.Tensor]:
    """Check a collated full batch (``input_ids``, or ``inputs_embeds [b, N, hidden]`` instead) and return this rank's
    shard (see :func:`ulysses_sp.shard_batch`).

    Raises ValueError when the batch has no ``labels`` (the loss could not be computed; with ``require_labels=False``
    such a batch is sharded without ``shift_labels``, for logits alone) or carries another ``[batch, seq_len]`` tensor
    that would have to be sliced too; drops :data:`FULL_SEQUENCE_KEYS`. With ``check_same_batch``, the SP group
    compares fingerprints of its full batches (one tiny all-gather).
    """
    if require_labels and batch.get("labels") is None:
        raise ValueError(
            f"the collated batch has no 'labels' (keys: {sorted(batch)}); under sequence parallelism the labels "
            "are shifted before the sequence is split, so the collator must emit them: use e.g. "
            "transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False) or TRL's collator, or add a "
            "'labels' column (-100 where no loss is wanted)"
        )
    if "shift_labels" in batch:
        raise ValueError(
            "the collated batch already has 'shift_labels'; pass unshifted 'labels' only: ulysses-sp shifts them "
            "before splitting the sequence"
        )
    seq_len = batch_tokens(batch)[1].shape[1]
    kept = {}
    for key, value in batch.items():
        if key in FULL_SEQUENCE_KEYS or (key == "labels" and value is None):
            continue
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len
        if per_token and key not in SHARDED_KEYS:
            raise ValueError(
                f"the batch has a per-token tensor {key!r} of shape {tuple(value.shape)} that ulysses-sp does "
                f"not know how to split over the sequence; remove it from the batch (supported per-token keys: "
                f"{', '.join(SHARDED_KEYS[:4])})"
            )
        kept[key] = value
    return shard_batch(kept, layout, pad_token_id=pad_token_id, check_same_batch=check_same_batch)


class SequenceParallelCollator:
    """Wrap a collator: collate the full batch as before, then keep this rank's shard of the sequence.

    Every rank of an SP group must receive the same samples (see :func:`deal_batches_over_dp`); each then
    returns its own slice with ``input_ids``, ``position_ids`` (global; derived as ``0..N-1`` when the
    collator emits none, and restarting per document when it emits packed positions), ``attention_mask``
    (when given), ``labels`` (local slice) and ``shift_labels`` (targets shifted before slicing). The
    sequence is padded to a multiple of ``sp``; no token is dropped.

    Args:
        collator: the collator to wrap (any callable from a list of features to a dict of tensors).
        layout: the parallel layout of this rank.
        pad_token_id: id used for the few tokens added to make the length divisible by ``sp``.
        check_same_batch: when collating in the main process (``num_workers=0``), compare a fingerprint of
            the full batch across the SP group and raise ValueError on every rank if the ranks hold different
            batches or any rank's batch is refused (shared with the other dp replicas, see ``shard_batch``).
            Dataloader worker processes have no process group: there the check is skipped, unless
            ``defer_checks``.
        token_counts: add :data:`TOKEN_COUNT_KEY` (:func:`full_batch_token_counts`) for a consumer that
            removes it before the model (the Trainer integration, for ``include_num_input_tokens_seen``).
        require_labels: refuse a batch without ``labels`` (True, for training); False passes it on without
            ``shift_labels``, for a model that then returns logits alone (the Trainer's eval and test batches).
        defer_checks: in a dataloader worker, put the checks' verdict (a :class:`~ulysses_sp.batch_checks.BatchCheck`)
            into the batch under :data:`BATCH_CHECK_KEY` instead of raising a refusal there (a refused batch is
            then the verdict alone), for the main process of each rank to share with :func:`agree_on_batch`, so
            every rank raises the same ValueError. For a consumer that does so: the Trainer and Accelerate
            integrations turn it on.
    """

    def __init__(
        self,
        collator: Callable[[list[Any]], Mapping[str, Any]],
        layout: ParallelLayout,
        *,
        pad_token_id: int = 0,
        check_same_batch: bool = True,
        token_counts: bool = False,
        defer_checks: bool = False,
        require_labels: bool = True,
    ) -> None:
        if isinstance(collator, SequenceParallelCollator):
            raise ValueError("this collator is already a SequenceParallelCollator; wrap the original collator once")
        self.collator = collator
        self.layout = layout
        self.pad_token_id = pad_token_id
        self.check_same_batch = check_same_batch
        self.token_counts = token_counts
        self.defer_checks = defer_checks
        self.require_labels = require_labels

    def replaced(self, **changes: Any) -> SequenceParallelCollator:
        """A new collator over the same collator and layout with ``changes`` to the other arguments (``copy.copy``
        would go through :meth:`__getstate__`, which swaps the layout for a rank view)."""
        names = ("pad_token_id", "check_same_batch", "token_counts", "defer_checks", "require_labels")
        return SequenceParallelCollator(
            self.collator, self.layout, **{**{n: getattr(self, n) for n in names}, **changes}
        )

    def _shard(self, batch: Mapping[str, Any], check: bool) -> dict[str, Any]:
        options = {"pad_token_id": self.pad_token_id, "require_labels": self.require_labels}
        return shard_full_batch(batch, self.layout, check_same_batch=check, **options)

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        in_main_process = torch.utils.data.get_worker_info() is None
        if not in_main_process and self.defer_checks and self.check_same_batch:
            return self._with_verdict(features)
        batch = self.collator(features)
        check = self.check_same_batch and in_main_process
        shard = self._shard(batch, check)
        if self.token_counts:
            shard[TOKEN_COUNT_KEY] = full_batch_token_counts(batch, self.layout)
        return shard

    def _with_verdict(self, features: list[Any]) -> dict[str, Any]:
        """In a dataloader worker: the shard with its checks' verdict, or the verdict alone for a refused batch."""
        try:
            batch = self.collator(features)
            shard = self._shard(batch, False)
        except ValueError as error:  # a refusal, shared by the main process of every rank (agree_on_batch)
            return {BATCH_CHECK_KEY: BatchCheck.refused(str(error))}
        if self.token_counts:
            shard[TOKEN_COUNT_KEY] = full_batch_token_counts(batch, self.layout)
        shard[BATCH_CHECK_KEY] = check_batch(batch)  # for the same-batch comparison over the SP group
        return shard

    def __getstate__(self) -> dict[str, Any]:
        """What a dataloader worker started by spawn or forkserver receives (process groups do not pickle): the
        layout as a rank view, which cuts the same shard (no group there: a worker leaves the same-batch check to
        the main process with ``defer_checks``, else skips it)."""
        layout = self.layout
        view = ParallelLayout.rank_view(
            layout.sp, layout.sp_rank, dp=layout.dp, dp_rank=layout.dp_rank, ring=layout.ring, device=layout.device
        )
        return {**self.__dict__, "layout": view}

    def __repr__(self) -> str:
        return f"SequenceParallelCollator({self.collator!r}, sp={self.layout.sp}, sp_rank={self.layout.sp_rank})"


def agree_on_batch(batch: Any, layout: ParallelLayout) -> Any:
    """``batch`` without :data:`BATCH_CHECK_KEY`, once every rank has agreed on the verdict a dataloader worker put
    there (:meth:`~ulysses_sp.batch_checks.BatchCheck.agree`: a collective; a batch refused on any rank, or batches
    that differ inside an SP group, raise the same kind of ValueError on every rank). A batch without the key is
    returned as it is (collated in the main process, where the collator agreed already). Every rank must call it
    on each batch of the same dataloader."""
    if not isinstance(batch, Mapping) or BATCH_CHECK_KEY not in batch:
        return batch
    batch[BATCH_CHECK_KEY].agree(layout)
    return {key: value for key, value in batch.items() if key != BATCH_CHECK_KEY}


def agree_on_worker_batches(dataloader: Any, layout: ParallelLayout) -> Any:
    """Make a prepared dataloader whose :class:`SequenceParallelCollator` (``defer_checks``) runs in worker
    processes agree on each batch as it comes out of them (:func:`agree_on_batch`; in place), so that a loop over
    it gets batches without :data:`BATCH_CHECK_KEY` and a refusal raises on every rank. Anything else is left alone.
    Returns the same dataloader."""
    base = getattr(dataloader, "base_dataloader", dataloader)  # accelerate's DataLoaderShard wraps a DataLoader
    collate = _find_collator(base)[2]
    if isinstance(collate, SequenceParallelCollator) and collate.defer_checks and getattr(base, "num_workers", 0):
        base.__class__ = _agreeing_class(type(base))
        base.sp_layout = layout
    return dataloader


def _find_collator(loader: Any) -> tuple[Any, str, Any]:
    """(holder, attribute, collator): where ``loader``'s SequenceParallelCollator sits, inside the wrappers that
    keep it as ``data_collator`` (the Trainer's RemoveColumnsCollator); else its collate_fn."""
    holder, name, collate = loader, "collate_fn", getattr(loader, "collate_fn", None)
    while not isinstance(collate, SequenceParallelCollator) and hasattr(collate, "data_collator"):
        holder, name, collate = collate, "data_collator", collate.data_collator
    return holder, name, collate


@functools.cache
def _agreeing_class(loader_class: type) -> type:
    class AgreeingLoader(loader_class):
        """A dataloader that agrees on the verdict of every batch its workers collate (see agree_on_worker_batches)."""

        def __iter__(self) -> Any:
            for batch in super().__iter__():
                yield agree_on_batch(batch, self.sp_layout)

    return AgreeingLoader


def replace_collator(dataloader: Any, **changes: Any) -> Any:
    """Give a (prepared) dataloader whose collator is a :class:`SequenceParallelCollator` a new one with ``changes``
    (:meth:`SequenceParallelCollator.replaced`; in place, before its workers start); anything else is left alone.
    Returns the same dataloader."""
    holder, name, collate = _find_collator(getattr(dataloader, "base_dataloader", dataloader))
    if isinstance(collate, SequenceParallelCollator):
        setattr(holder, name, collate.replaced(**changes))
    return dataloader


def layout_for_model(model: torch.nn.Module, sp_size: int, device: Any, ring: int | None = None) -> ParallelLayout:
    """The layout for ``sp_size`` ranks per sequence: ``ring`` if given, else pure Ulysses when the model's heads
    split over them and the ranks fit in a node, else hybrid Ulysses x Ring with the smallest ring that makes them
    split and keeps each Ulysses group inside a node (see ``ulysses_sp.layout.choose_layout``)."""
    from ..hf import find_pretrained, head_counts

    heads, kv_heads = head_counts(find_pretrained(model))
    return ParallelLayout.from_env(sp_size, ring=ring, num_heads=heads, num_kv_heads=kv_heads, device=device)


def resolve_core(model: torch.nn.Module, core: str | None, argument: str = "sp_core") -> str:
    """The local attention core: ``core`` if given, else the model's own ``attn_implementation``.

    Raises ValueError when the model's implementation has no Ulysses core (e.g. a kernel-hub or paged one), naming
    ``argument`` (``sp_core``, ``core``) as the way to choose one.
    """
    from ..cores import CORES
    from ..hf import find_pretrained

    if core is not None:
        return core
    impl = find_pretrained(model).config._attn_implementation or "sdpa"
    if impl.startswith("ulysses_"):
        raise ValueError("the model is already parallelized; pass the original model (or unparallelize it first)")
    if impl not in CORES:
        raise ValueError(
            f"the model's attn_implementation={impl!r} has no Ulysses core; load the model with "
            f"attn_implementation set to one of {sorted(CORES)}, or pass {argument}=<one of them>"
        )
    return impl


def integration_features(
    model: torch.nn.Module,
    *,
    tiled_loss: bool,
    tiled_mlp: bool | None,
    tiled_norms: bool | None,
    mlp_chunk_tokens: int | None,
    switch: Callable[[str], str],
) -> Features:
    """The memory features the integrations switch on: the tiled loss, MLP and norms, as in ``ulysses-sp
    train``. ``tiled_mlp`` / ``tiled_norms`` None: on where the model's decoder layers have an MLP / a norm that
    they recognise (else off, with a warning naming ``switch(name)``, the argument that says so). Activation
    checkpointing is the framework's own (``TrainingArguments(gradient_checkpointing=...)``, or the user's)."""
    from ..hf import decoder_layers, find_pretrained, mlp_modules
    from ..tiled_norms import is_norm

    pretrained = find_pretrained(model)
    if tiled_mlp is None:
        try:
            tiled_mlp = bool(mlp_modules(pretrained))  # it raises when it finds none
        except ValueError as error:
            logger.warning("the tiled MLP stays off: %s (pass %s to say so)", error, switch("tiled_mlp"))
            tiled_mlp = False
    if tiled_norms is None:
        tiled_norms = any(is_norm(m) for layer in decoder_layers(pretrained) for m in layer.children())
        if not tiled_norms:
            logger.warning("the tiled norms stay off: no norm in the decoder layers (pass %s)", switch("tiled_norms"))
    return Features(
        tiled_loss=tiled_loss,
        tiled_mlp=tiled_mlp,
        tiled_norms=tiled_norms,
        mlp_chunk_tokens=mlp_chunk_tokens,
        activation_checkpointing="none",
    )


def check_sp_options(
    prefix: str, sp_size: Any, mlp_chunk_tokens: Any, tiled_mlp: bool | None = None, tiled_norms: bool | None = None
) -> None:
    """ValueError naming the argument (``prefix`` + its name) unless ``sp_size`` is a positive int and
    ``mlp_chunk_tokens`` one or None, and used (not with the tiled MLP and norms both turned off); called before
    the model is touched."""
    for name, value, optional in (("sp_size", sp_size, False), (f"{prefix}mlp_chunk_tokens", mlp_chunk_tokens, True)):
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")
    if mlp_chunk_tokens is not None and tiled_mlp is False and tiled_norms is False:
        raise ValueError(
            f"{prefix}mlp_chunk_tokens={mlp_chunk_tokens} has no effect with {prefix}tiled_mlp=False and "
            f"{prefix}tiled_norms=False: drop one of them"
        )


def check_world_size(framework_world: int, layout: ParallelLayout, fix: str) -> None:
    """Raise ValueError unless the Trainer/Accelerator counts as many processes as torch.distributed does.

    On a CPU-only machine, Transformers and Accelerate treat ``torchrun``-launched processes as independent
    single processes unless told to use the CPU; each would then train alone on duplicated data.
    """
    if framework_world != layout.world_size:
        raise ValueError(
            f"{layout.world_size} processes were launched, but the trainer/accelerator runs as {framework_world} "
            f"process(es), so data would not be split and gradients not averaged; {fix}"
        )
