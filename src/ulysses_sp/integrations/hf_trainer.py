"""Ulysses sequence parallelism for ``transformers.Trainer`` (and subclasses such as TRL's ``SFTTrainer``).

Add ``sp_size`` and swap the class; everything else in the script stays::

    trainer = UlyssesTrainer(model=model, args=args, train_dataset=..., data_collator=..., sp_size=4)
    trainer.train()

What the mixin changes, and why (the Trainer's own DDP / FSDP2 wrapping over the whole world is kept):

* ``__init__``: checks the options that cannot work under SP (ValueError before training), then
  :func:`ulysses_sp.parallelize` on the model (PEFT models too) and wraps the collator in
  :class:`~ulysses_sp.integrations.data.SequenceParallelCollator`, so every batch - train and eval - reaches
  the model as this rank's shard with ``shift_labels``, ``labels`` and global ``position_ids``.
* dataloaders deal batches over the ``dp`` SP groups, not over all ranks
  (:func:`~ulysses_sp.integrations.dealing.deal_batches_over_dp`): DP=1/SP=2/GAS=2 consumes the same samples
  per optimizer step as DP=2/SP=1/GAS=1, and epochs have the right number of steps.
* the model computes its loss with the tiled lm_head + cross-entropy (:func:`ulysses_sp.enable_tiled_loss`;
  ``sp_tiled_loss=False`` turns it off), so no rank ever holds ``[tokens, vocab]`` logits, and runs its MLPs
  and norms over chunks of tokens (``sp_tiled_mlp`` / ``sp_tiled_norms``), as ``ulysses-sp train`` does;
* the loss is the model's own: the Trainer counts ``num_items_in_batch`` from ``shift_labels`` - now the
  local shards, which partition the tokens - summed over the world, so the count is exact; the model divides
  its shard's loss sum by it and the Trainer multiplies by the world size, which is what DDP/FSDP's gradient
  average over dp x sp expects (with ``average_tokens_across_devices=False``: each dp replica's count, over its SP
  group, and ``sp``: :meth:`sp_loss_scale`). The logged loss (mean over ranks) is the true token-weighted loss.
  Only an MoE model's load-balancing term (``output_router_logits``) is computed here (:meth:`compute_loss`), over the
  router sums of the SP group's shards, as one process computes it on the dp replica's micro-batch.
* token counts and metrics are those of one process: ``include_num_input_tokens_seen`` from the full batches'
  counts (:meth:`_track_num_input_tokens`), and scalars gathered for metrics (TRL's token count, entropy and
  accuracy) keep every shard's part at the end of an epoch too, and evaluation counts its steps per dp group
  (:mod:`.speed`);
* NEFTune's noise (``neftune_noise_alpha``), which transformers scales by the length of the batch the embedding
  layer sees, is scaled by the whole batch's, as one process scales it, not by the shard's (:meth:`_prepare_inputs`);
* evaluation runs sharded too (:meth:`prediction_step`): per batch, the loss sums of the SP group's shards
  over its valid-token count - equal to the one-process batch loss - and no rank ever holds the full
  sequence's activations. Logits are gathered only for ``compute_metrics`` and ``predict()``: whole sequences
  (:func:`ulysses_sp.gather_sequence`), each sample once, as one process would pass them.
* a rank that saves or ends training out of step with the others raises a clear ValueError (:mod:`.flos`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_pt_utils import find_batch_size

from ..features import apply_features
from ..hf import find_pretrained, text_config
from ..loss import MODEL_INPUTS, causal_lm_loss
from ..model import parallelize
from ..moe import router_aux_loss
from ..sharding import gather_sequence
from ..validation import IGNORE_INDEX
from .accelerate import check_split_batches
from .data import (
    TOKEN_COUNT_KEY,
    SequenceParallelCollator,
    agree_on_batch,
    check_sp_options,
    check_world_size,
    integration_features,
    layout_for_model,
    resolve_core,
)
from .flos import CheckedFlos
from .label_smoothing import smoothed_loss
from .loss_override import LossOverrideCheck
from .metrics import (
    drop_repeats,
    gather_over_dp,
    only_logits,
    repeated_rows,
    sequence_parallel_gather,
    whole_eval_batch,
    without_repeats,
)
from .speed import StepCountedMetrics
from .trainer_checks import check_supported, ddp_for_reentrant_checkpointing, refuse_deepspeed, refuse_sharded_before
from .trainer_data import DealtDataloaders

__all__ = ["UlyssesTrainer", "UlyssesTrainerMixin", "logits_forward", "resolve_core"]


def logits_forward(model: torch.nn.Module, inputs: dict[str, Any]) -> Any:
    """The model's outputs on the shard without its targets (``labels``, ``shift_labels``): logits, not a loss (the
    tiled loss would make one from them)."""
    return model(**{key: value for key, value in inputs.items() if key not in ("labels", "shift_labels")})


logger = logging.getLogger(__name__)


class UlyssesTrainerMixin(DealtDataloaders, CheckedFlos):
    """Mix into a ``transformers.Trainer`` subclass (before it) to train with Ulysses SP of degree ``sp_size``.

    ``class MyTrainer(UlyssesTrainerMixin, SomeTrainer)``; :class:`UlyssesTrainer` and
    :class:`~ulysses_sp.integrations.trl_sft.UlyssesSFTTrainer` are the two ready-made classes.

    Extra keyword arguments:
        sp_size: ranks that split each sequence; the world size (``torchrun --nproc-per-node``, ``accelerate
            launch``) must be a multiple of it, and ``dp = world // sp_size`` SP groups see different samples.
        sp_core: local attention core (``"sdpa"``, ``"eager"``, ``"flex_attention"``, ``"flash_attention_2"``,
            ...); by default the model's own ``attn_implementation``.
        sp_ring: ring degree inside ``sp_size`` (hybrid Ulysses x Ring); default: pure Ulysses when the model's heads
            split over ``sp_size``, else the smallest ring that makes them split.
        sp_tiled_loss: compute the loss with the tiled lm_head + cross-entropy (default: on, except under TRL's
            SFTTrainer, whose own fused LM head already never builds the logits).
        sp_head_chunks: run each attention layer's heads in this many chunks (``parallelize(head_chunks=)``);
            default None: automatic, as ``ulysses-sp train``.
        sp_tiled_mlp: run each decoder layer's MLP over chunks of tokens, recomputed in backward
            (:func:`ulysses_sp.enable_tiled_mlp`; exact); default None: on, as ``ulysses-sp train``, where the
            decoder layers have an MLP it recognises.
        sp_tiled_norms: run the decoder layers' norms over chunks of tokens, the norm before a tiled MLP fused
            into its chunks (:func:`ulysses_sp.enable_tiled_norms`; exact); default None: on where they have
            norms.
        sp_mlp_chunk_tokens: tokens per chunk of the tiled MLP and norms; default None: max(1024, hidden size).

    Attributes set: ``sp_layout`` (the :class:`~ulysses_sp.ParallelLayout`).
    """

    sp_tiled_loss_default = True
    sp_label_smoothing = True  # label_smoothing_factor (its compute_loss; TRL's SFTTrainer has its own)
    _sp_predicting = False
    _sp_batch_rows: int | None = None  # the rows of the eval batch in prediction_step
    _sp_rows_kept: torch.Tensor | None = None  # [b] bool: its rows that are no repeated sample (None: all)

    def __init__(
        self,
        *args: Any,
        sp_size: int = 1,
        sp_core: str | None = None,
        sp_tiled_loss: bool | None = None,
        sp_ring: int | None = None,
        sp_head_chunks: int | None = None,
        sp_tiled_mlp: bool | None = None,
        sp_tiled_norms: bool | None = None,
        sp_mlp_chunk_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_sp_options("sp_", sp_size, sp_mlp_chunk_tokens, sp_tiled_mlp, sp_tiled_norms)
        given_args = kwargs.get("args", args[1] if len(args) > 1 else None)  # Trainer(model, args, ...) or by keyword
        refuse_deepspeed(given_args)
        refuse_sharded_before(kwargs.get("model", args[0] if args else None), given_args)
        super().__init__(*args, **kwargs)
        check_supported(self, sp_size)
        core = resolve_core(self.model, sp_core)
        self.sp_layout = layout_for_model(self.model, sp_size, self.args.device, ring=sp_ring)
        check_world_size(
            self.args.world_size, self.sp_layout, "on a CPU-only machine pass TrainingArguments(use_cpu=True)"
        )
        sizes = [self._batch_size("train")] + ([self._batch_size("eval")] if self.eval_dataset is not None else [])
        check_split_batches(self.accelerator, self.sp_layout, sizes)  # refused before training
        parallelize(self.model, self.sp_layout, core=core, head_chunks=sp_head_chunks)
        tiled = self.sp_tiled_loss_default if sp_tiled_loss is None else sp_tiled_loss
        switch = lambda name: f"sp_{name}=False"  # noqa: E731 (how a feature is turned off, named in errors)
        features = integration_features(
            self.model,
            tiled_loss=tiled,
            tiled_mlp=sp_tiled_mlp,
            tiled_norms=sp_tiled_norms,
            mlp_chunk_tokens=sp_mlp_chunk_tokens,
            switch=switch,
        )
        apply_features(self.model, features, self.sp_layout.device.type, switch=switch)
        self._sp_loss_check = LossOverrideCheck(self)
        self.data_collator = SequenceParallelCollator(  # a refusal in a dataloader worker: see get_batch_samples
            self.data_collator, self.sp_layout, pad_token_id=self._pad_token_id(), token_counts=True, defer_checks=True
        )
        if self.sp_layout.sp > 1:  # TRL's metrics (a shard's part of a sum) from every rank, no sample twice
            self.accelerator.gather_for_metrics = sequence_parallel_gather(self.accelerator, self.sp_layout)
        if self.args.fsdp and not self.is_fsdp_enabled:
            logger.warning(
                "TrainingArguments.fsdp is set but Accelerate did not enable FSDP (it does so on accelerator "
                "devices only, not on CPU): training runs with DDP over dp x sp instead"
            )

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's, with DDP's search for unused parameters off under torch's reentrant checkpoint (unless the
        arguments set it): :func:`~ulysses_sp.integrations.trainer_checks.ddp_for_reentrant_checkpointing`."""
        return ddp_for_reentrant_checkpointing(super()._build_accelerator_args(**kwargs), self.args)

    # ------------------------------------------------------------------------------------- loss
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's; a subclass's own ``compute_loss`` is checked on its first call (:mod:`.loss_override`)."""
        with self._sp_loss_check.watch():
            return super().training_step(*args, **kwargs)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """The Trainer's loss; for an MoE model with ``output_router_logits``, its load-balancing term over the
        whole sequence of this dp replica's batch (the router sums of every shard of its SP group,
        :mod:`ulysses_sp.moe`), as one process adds it to the loss of that micro-batch, not from this shard alone
        (then ``return_outputs`` gives ``(loss, None)``: the model's outputs are not kept). With
        ``label_smoothing_factor``: transformers' label-smoothed loss over the whole sequence's targets
        (:mod:`~ulysses_sp.integrations.label_smoothing`), without an MoE's term, as one process computes it."""
        self._sp_loss_check.reached()
        if self.label_smoother is not None:  # the targets of the whole sequence, not the shard's labels shifted
            loss, outputs = smoothed_loss(model, inputs, self.label_smoother.epsilon, num_items_in_batch)
            if num_items_in_batch is not None:
                loss = loss * self.sp_loss_scale()
            return (loss, outputs) if return_outputs else loss
        if router_aux_loss(self.model) is None:
            got = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
            scale = self._sp_count_scale(num_items_in_batch)  # (the Trainer scaled it by the world size, or not)
            return (got[0] * scale, got[1]) if return_outputs else got * scale
        extra = sorted(set(inputs) - {*MODEL_INPUTS, "labels", "shift_labels"})
        if extra:
            raise ValueError(
                f"the batch has {extra}, which the MoE load-balancing loss path does not pass to the model (it takes "
                f"{list(MODEL_INPUTS)}); drop them in the collator, or set model.config.output_router_logits = False"
            )
        layout = dataclasses.replace(self.sp_layout, loss_group=self.sp_layout.sp_group)
        # the dp replica's loss (equal on its SP group, gradients right once averaged over it) x dp: the scale of
        # the Trainer's own (its shard's sum / the world's count, x the world size; gradients averaged over dp x sp);
        # without average_tokens_across_devices x 1 (plain DDP's rank loss is its own tokens' mean, unscaled)
        kept = self._sp_rows_kept  # in evaluation: the term without the rows that repeat samples, as one process
        loss = causal_lm_loss(model, inputs, layout, num_items_in_batch=num_items_in_batch, rows_kept=kept)
        loss = loss * (self.sp_loss_scale() // layout.sp)
        return (loss, None) if return_outputs else loss

    def sp_loss_scale(self) -> int:
        """What a loss divided by ``num_items_in_batch`` is multiplied by for DDP's gradient average over dp x sp: the
        world size (the Trainer's own scale, the count being the world's) with ``average_tokens_across_devices``,
        else ``sp`` (the count is the dp replica's, summed over its SP group in :meth:`get_batch_samples`, as plain
        DDP divides each rank's loss by its own tokens)."""
        return self.accelerator.num_processes if self.args.average_tokens_across_devices else self.sp_layout.sp

    def _sp_count_scale(self, num_items_in_batch: Any) -> int:
        """What a loss that the Trainer's (or TRL's) own code divided by ``num_items_in_batch`` and scaled by its own
        convention (the world size with ``average_tokens_across_devices``, else 1) is multiplied by to reach
        :meth:`sp_loss_scale`: ``sp`` without ``average_tokens_across_devices`` when a count was given, else 1."""
        return 1 if num_items_in_batch is None or self.args.average_tokens_across_devices else self.sp_layout.sp

    def _pad_token_id(self) -> int:
        pad = getattr(self.processing_class, "pad_token_id", None)
        if pad is None:
            pad = getattr(text_config(find_pretrained(self.model)), "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _prepare_inputs(self, inputs: Any) -> Any:
        """The Trainer's device placement of a batch (agreed on first, as in :meth:`get_batch_samples`, for an eval
        batch from a dataloader worker), without the full batch's token counts (not a model input)."""
        prepared = super()._prepare_inputs(agree_on_batch(inputs, self.sp_layout))
        counts = prepared.get(TOKEN_COUNT_KEY)
        if self.neftune_noise_alpha is not None and counts is not None and "input_ids" in prepared:  # (embeds: none)
            self._scale_neftune(prepared["input_ids"].shape[-1], int(counts[2]))
        return {key: value for key, value in prepared.items() if key != TOKEN_COUNT_KEY}

    def _scale_neftune(self, shard_length: int, batch_length: int) -> None:
        """transformers' NEFTune hook adds noise of ``alpha / sqrt(length x hidden)`` with the length its embedding
        layer sees, here a shard's: while the hook is on (in ``train()``), give it the alpha that makes that the whole
        batch's, as one process adds it (not ``sqrt(sp)`` times as much)."""
        embeddings = find_pretrained(self.model).get_input_embeddings()
        if hasattr(embeddings, "neftune_noise_alpha"):
            embeddings.neftune_noise_alpha = self.neftune_noise_alpha * math.sqrt(shard_length / batch_length)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """``include_num_input_tokens_seen`` as one process counts it: from the full batch's counts (a shard also
        holds the padding that makes the length divisible by ``sp``), summed over the dp SP groups."""
        counts = inputs.get(TOKEN_COUNT_KEY)
        mode = self.args.include_num_input_tokens_seen
        name = getattr(self.model, "main_input_name", "input_ids")
        if counts is None or mode == "no" or name != "input_ids" or name not in inputs:  # (inputs_embeds: as there)
            return super()._track_num_input_tokens({k: v for k, v in inputs.items() if k != TOKEN_COUNT_KEY})
        tokens = counts[0]  # "all", and "non_padding" with neither an attention_mask nor a pad token (HF's rule)
        pad = getattr(self.processing_class, "pad_token_id", None)
        if mode == "non_padding" and counts[1] >= 0:
            tokens = counts[1]
        elif mode == "non_padding" and pad is not None:  # the SP padding is this pad token: the shards add up
            tokens = (inputs["input_ids"] != pad).sum()
        tokens = torch.as_tensor(tokens, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()

    # ------------------------------------------------------------------------------------- evaluation
    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The Trainer's loop, gathering each batch loss once per SP group (the Trainer resets it afterwards); its
        metrics take the steps of the dp groups, not of the world, for ``{prefix}_steps_per_second`` (:mod:`.speed`)."""
        self.gather_function = self._gather_over_dp_groups
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        # transformers' count of the steps, ceil(samples / (batch x world)), with the dp groups in place of the world
        steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.sp_layout.dp))
        return output._replace(metrics=StepCountedMetrics(output.metrics, metric_key_prefix, steps))

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``predict``; its predictions are the whole sequences' logits (:meth:`prediction_step`)."""
        self._sp_predicting = True
        try:
            return super().predict(*args, **kwargs)
        finally:
            self._sp_predicting = False

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The loss of one eval batch, computed on this rank's shard and reduced over its SP group.

        Returns ``(loss, logits, labels)``: the loss is the token-weighted mean over the whole batch (all shards; not
        the samples accelerate repeats to even out a last batch over dp groups, :func:`.metrics.without_repeats`),
        the value one process computes on the full batch (None without labels, as there). Only for
        ``compute_metrics`` or ``predict()`` (and not ``prediction_loss_only``), the logits ``[b, N, vocab]`` and
        labels ``[b, N]`` of the whole sequences, gathered from the SP group's shards and cut back to the collated
        batch's length ``N``; else None, and the full sequence is never gathered. Under the tiled loss (which makes
        no logits) the logits cost a second forward of the shard without labels. With ``include_for_metrics=
        ["inputs"]`` the batch becomes the collated one after the forward (:func:`.metrics.whole_eval_batch`).
        """
        batch, inputs = inputs, self._prepare_inputs(inputs)
        layout, self._sp_batch_rows = self.sp_layout, find_batch_size(inputs)  # (rows: see _gather_over_dp_groups)
        labelled = "shift_labels" in inputs  # else (a dataset without labels) logits alone, as in one process
        predict = not prediction_loss_only and (self.compute_metrics is not None or self._sp_predicting)
        if not labelled and not predict:
            return None, None, None
        loss = outputs = logits = None
        with torch.no_grad(), self.compute_loss_context_manager():
            if labelled:
                repeated = repeated_rows(self.accelerator, layout, inputs["shift_labels"].shape[0])
                scored = without_repeats(inputs, repeated)  # no loss from samples accelerate repeated
                # nor an MoE's load-balancing term, unless every row repeats (that batch's loss is dropped; TRL's
                # aux_loss metric, a mean over the ranks, then gets a sample's term as under plain DDP, not 0)
                kept = None if repeated is None or repeated.all() else ~repeated
                count = (scored["shift_labels"] != IGNORE_INDEX).sum()
                if layout.sp > 1:
                    dist.all_reduce(count, group=layout.sp_group)
                # the outputs only for the logits: TRL's SFTTrainer makes them in a forward of its own
                with self._sp_loss_check.watch():
                    kwargs = dict(return_outputs=predict, num_items_in_batch=count.clamp(min=1))  # by keyword
                    try:
                        self._sp_rows_kept = kept
                        got = self.compute_loss(model, scored, **kwargs)  # (an override may take **kwargs)
                    finally:
                        self._sp_rows_kept = None
                loss, outputs = got if predict else (got, None)
                logits = getattr(outputs, "logits", None)
            if predict and logits is None:  # the tiled loss (or the MoE path) returned no logits: the shard's
                outputs = logits_forward(model, inputs)
                logits = outputs.logits
        if predict:
            self._only_logits(outputs, ignore_keys)
        if labelled:
            # A loss normalised by num_items_in_batch comes back multiplied by sp_loss_scale() (the Trainer's
            # convention for DDP's gradient average); undo it, then add the shards' parts.
            loss = loss.detach().float() / self.sp_loss_scale()
            if layout.sp > 1:
                dist.all_reduce(loss, group=layout.sp_group)
            # a batch of no targets: NaN, as one process's mean over none, which the evaluation loop leaves out
            # of eval_loss (it was 0 here and pulled the mean down)
            loss = torch.where(count > 0, loss, torch.full_like(loss, float("nan")))
        if not predict:
            return loss, None, None
        counts = batch.get(TOKEN_COUNT_KEY)
        length = int(counts[2]) if counts is not None else None  # the collated batch's: drop the padding for sp

        def whole(shard: torch.Tensor) -> torch.Tensor:  # [b, n, ...] -> [b, length, ...]
            return gather_sequence(shard, layout)[:, :length]

        if "inputs" in self.args.include_for_metrics and counts is not None:
            whole_eval_batch(batch, layout)  # the evaluation loop reads the inputs for compute_metrics from it
        labels = inputs.get("labels")
        return loss, whole(logits), None if labels is None else whole(labels)

    def _only_logits(self, outputs: Any, ignore_keys: list[str] | None) -> None:
        """:func:`.metrics.only_logits`: outputs beside the logits refused (TRL's subclass refuses none)."""
        only_logits(outputs, ignore_keys, self.model)

    def _gather_over_dp_groups(self, data: Any) -> Any:
        """The Trainer's ``gather_function`` under SP: the eval losses, logits, labels and inputs (tensors or tuples
        of them, alike on the ranks of an SP group) gathered over the dp groups only, then the samples accelerate
        repeated to even out the last batch dropped (gather_for_metrics' rule, over dp), and with one dp group those of
        a stream's last batch (:func:`.metrics.drop_repeats`)."""
        rows = self._sp_batch_rows if self.sp_layout.dp == 1 else None
        return drop_repeats(self.accelerator, gather_over_dp(data, self.sp_layout), rows)


class UlyssesTrainer(UlyssesTrainerMixin, Trainer):
    """``transformers.Trainer`` with Ulysses sequence parallelism: ``UlyssesTrainer(..., sp_size=4)``; see
    :class:`UlyssesTrainerMixin` for the extra arguments and the module docstring for what changes."""
