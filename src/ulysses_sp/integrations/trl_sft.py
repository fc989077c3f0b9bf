"""Ulysses sequence parallelism for TRL's ``SFTTrainer``: ``UlyssesSFTTrainer(..., sp_size=4)``.

TRL's padding-free packing (``SFTConfig(packing=True)`` or ``padding_free=True``) emits one packed row per
batch with ``position_ids`` that restart at 0 for every document; the wrapped collator keeps them (made
global only where the sequence is padded) so attention never crosses a document, and drops the full-row
``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` keys, which would be stale for a shard. TRL's fused LM head
scores the pre-shifted ``shift_labels`` as they are, so its loss, entropy and token-accuracy metrics come out
right over the shards. With TRL's MoE load-balancing term on (``router_aux_loss_coef``, the model's by
default), that term comes from the router statistics of every shard of the SP group (:func:`whole_sequence_aux`),
as TRL computes it in one process on the dp replica's micro-batch, not from each shard alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from trl import SFTTrainer

from ..comm import all_reduce_sum
from ..hf import find_pretrained
from ..layout import ParallelLayout
from ..model import ulysses_context
from ..moe import router_aux_loss
from .hf_trainer import UlyssesTrainerMixin, logits_forward

__all__ = ["UlyssesSFTTrainer"]


class UlyssesSFTTrainer(UlyssesTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with Ulysses sequence parallelism; extra arguments ``sp_size`` and ``sp_core``.

    See :class:`~ulysses_sp.integrations.hf_trainer.UlyssesTrainerMixin`. ``SFTConfig.pad_to_multiple_of`` is
    not needed: the sequence is padded to a multiple of ``sp_size`` when it is split. TRL's own fused LM head
    computes the loss without the full logits, so the library's tiled loss stays off here.
    """

    sp_tiled_loss_default = False
    sp_label_smoothing = False  # TRL's compute_loss calls the Trainer's LabelSmoother on the shard's labels

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """TRL's loss, its MoE load-balancing term (when on) over the SP group's whole sequence. With
        ``return_outputs``, the outputs of a forward of the shard without its targets (TRL's: the logits, with
        which it is asked for the outputs), not with them: under the tiled loss they would make a loss instead."""
        self._sp_loss_check.reached()
        loss = self._trl_loss(model, inputs, num_items_in_batch)
        if not return_outputs:
            return loss
        with torch.no_grad():
            return loss, logits_forward(model, inputs)

    def _only_logits(self, outputs: Any, ignore_keys: list[str] | None) -> None:
        """Nothing to refuse: TRL's evaluation hands ``compute_metrics`` the logits alone, whatever else the model
        returns (an MoE's ``aux_loss`` and ``router_logits``)."""

    def _trl_loss(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """TRL's loss at :meth:`sp_loss_scale`: TRL scales its cross-entropy by the world size with
        ``average_tokens_across_devices``, else not at all; here then by ``sp`` (its load-balancing term, added
        unscaled, stays so)."""
        loss = SFTTrainer.compute_loss  # TRL's, not the mixin's (which serves the plain Trainer's convention)
        scale = self._sp_count_scale(num_items_in_batch)
        if not getattr(self, "aux_loss_enabled", False) or self.sp_layout.sp == 1:
            return loss(self, model, inputs, False, num_items_in_batch) * scale
        if self.model.training or num_items_in_batch is None:
            with whole_sequence_aux(model, self.sp_layout) as given:
                out = loss(self, model, inputs, False, num_items_in_batch)
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1  # TRL's
            return _cross_entropy_scaled(out, self.router_aux_loss_coef * sum(given) / steps, scale)
        # evaluation (prediction_step: this loss / sp_loss_scale(), summed over the SP group; one process's eval adds
        # the term whole): TRL divides it by current_gradient_accumulation_steps (unset before any training step),
        # pinned to 1 here, and it is added sp_loss_scale() / sp - 1 times more (dp - 1, or 0 without
        # average_tokens_across_devices)
        before = self.__dict__.get("current_gradient_accumulation_steps")
        self.current_gradient_accumulation_steps = 1
        try:
            with whole_sequence_aux(model, self.sp_layout, self._sp_rows_kept) as given:
                out = loss(self, model, inputs, False, num_items_in_batch)
        finally:
            if before is None:
                del self.current_gradient_accumulation_steps
            else:
                self.current_gradient_accumulation_steps = before
        term = self.router_aux_loss_coef * given[0]
        return _cross_entropy_scaled(out, term, scale) + term * (self.sp_loss_scale() // self.sp_layout.sp - 1)


def _cross_entropy_scaled(loss: torch.Tensor, term: torch.Tensor | float, scale: int) -> torch.Tensor:
    """TRL's ``loss`` (its cross-entropy plus the load-balancing ``term``) with the cross-entropy ``scale`` times."""
    return loss if scale == 1 else (loss - term) * scale + term


@contextlib.contextmanager
def whole_sequence_aux(
    model: torch.nn.Module, layout: ParallelLayout, rows_kept: torch.Tensor | None = None
) -> Iterator[list[torch.Tensor]]:
    """Inside the block a call of ``model`` (wrapped or not) returns as ``aux_loss`` the load-balancing loss of
    the whole sequence of the SP group (:mod:`ulysses_sp.moe`: its shards' router sums added, in an all-reduce
    whose backward adds the gradients over the group too), not the one its shard alone gives; the model may be
    given labels with router logits meanwhile. TRL adds ``coef * aux_loss`` to each rank's loss without the
    world-size scale of its cross-entropy, so that value on every rank of the group, with that gradient, is what
    one process gives once DDP averages the gradients over dp x sp. Yields the list of the values given.
    ``rows_kept``: as in :meth:`~ulysses_sp.moe.RouterAuxLoss.statistics` (an eval batch's rows that repeat no
    sample)."""
    aux = router_aux_loss(model)
    ctx = ulysses_context(model)
    found: list[torch.Tensor] = []
    given: list[torch.Tensor] = []

    def take(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        router_logits = getattr(output, "router_logits", None)
        if not router_logits:
            raise ValueError(
                "TRL asked for router logits but the model returned none, so its load-balancing loss cannot be "
                "computed over the whole sequence; pass router_aux_loss_coef=0.0 in the SFTConfig"
            )
        sums = aux.statistics(tuple(router_logits), kwargs.get("attention_mask"), rows_kept).double()  # [2E + 1]
        found.append(aux.loss(all_reduce_sum(sums, layout.sp_group)).to(torch.float32))

    def give(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if getattr(output, "aux_loss", None) is not None:
            output.aux_loss = found.pop()
            given.append(output.aux_loss)
        found.clear()

    handles = [
        find_pretrained(model).base_model.register_forward_hook(take, with_kwargs=True),
        model.register_forward_hook(give),
    ]
    ctx.router_aux_by_caller = True
    try:
        yield given
    finally:
        ctx.router_aux_by_caller = False
        for handle in handles:
            handle.remove()
