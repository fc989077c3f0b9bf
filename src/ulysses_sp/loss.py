"""The token-weighted loss across shards and replicas, and the gradient reduction that goes with it.

Shards hold different numbers of valid tokens, so the mean of per-rank means is wrong. Here every rank
computes the SUM of its token losses; one all-reduce over ``layout.loss_group`` (dp x sp) adds the sums and
the valid-token counts, and the loss is ``global_sum / global_count`` — the same value on every rank,
equal to the one-process loss over the full batch. A shard (or the whole batch) with no valid token gives
0, never NaN.

The backward of that all-reduce hands every rank ``world_size / global_count`` as the weight of its local
sum, so the gradients that come out are exactly right once they are AVERAGED over dp x sp — which is what
DDP and FSDP2 do when they wrap the whole world, and what :func:`sync_gradients` does in a plain loop.

For gradient accumulation, pass ``num_items_in_batch`` = the valid tokens of the whole optimizer step (all
micro-batches, all ranks; see :func:`count_valid_tokens`), and the micro-batch losses add up to the loss
of the full step.

:func:`causal_lm_loss` runs the model on a shard and returns that loss; when the model has the tiled loss
(:func:`ulysses_sp.enable_tiled_loss`) the token-loss sum comes from the model's forward without any
``[tokens, vocab]`` logits, else from the logits.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import CommStats, all_reduce_sum
from .layout import ParallelLayout
from .validation import IGNORE_INDEX, as_ignored, carry_cut, check_label_smoothing, first_bad_id, peers_join

__all__ = [
    "causal_lm_loss",
    "count_valid_tokens",
    "reduce_token_loss",
    "sequence_parallel_cross_entropy",
    "sync_gradients",
]


def count_valid_tokens(shift_labels: torch.Tensor, layout: ParallelLayout, ignore_index: int = IGNORE_INDEX) -> int:
    """The number of target tokens (neither ``ignore_index`` nor -100) in this shard summed over dp x sp."""
    count = (as_ignored(shift_labels, ignore_index) != IGNORE_INDEX).sum().to(torch.float64)
    if layout.loss_group is not None and dist.get_world_size(layout.loss_group) > 1:
        dist.all_reduce(count, group=layout.loss_group)
    return int(count.item())


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    layout: ParallelLayout,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    label_smoothing: float = 0.0,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """Token-weighted mean cross-entropy over every valid token of every shard of every replica.

    Args:
        logits: ``[b, n, V]`` this shard's logits (any dtype; computed in fp32).
        shift_labels: ``[b, n]`` targets from :func:`ulysses_sp.shard_batch` (already shifted).
        layout: the parallel layout; the reduction runs over ``layout.loss_group``.
        num_items_in_batch: divide by this instead of the batch's own global valid-token count (for
            gradient accumulation: the count of the whole optimizer step).
        label_smoothing: e in [0, 1), as in ``torch.nn.functional.cross_entropy``: each target's loss is
            ``(1 - e) x`` its cross-entropy ``+ e x`` the mean of ``-log softmax`` over the vocabulary.

    Returns a scalar equal on every rank (see the module docstring for the gradient convention).
    """
    if shift_labels.is_floating_point() or shift_labels.is_complex() or shift_labels.dtype == torch.bool:
        raise ValueError(f"shift_labels must hold integer token ids, got dtype {shift_labels.dtype}")
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree; expected "
            "logits [b, n, vocab] for shift_labels [b, n]"
        )
    options = dict(num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, stats=stats)
    return _cross_entropy_mean(
        logits, shift_labels, layout, label_smoothing=check_label_smoothing(label_smoothing), **options
    )[0]


def _cross_entropy_mean(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    layout: ParallelLayout,
    *,
    extra: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_parallel_cross_entropy`, plus ``extra`` sums reduced in the same all-reduce.

    A target outside ``[0, vocab)`` (not ``ignore_index``) would make the cross-entropy fail on its rank alone
    (IndexError on CPU, a device assert on CUDA) while the others wait in the all-reduce: such targets are
    ignored in the local sum and counted in the all-reduce instead, so every rank of dp x sp raises.
    """
    shift_labels = as_ignored(shift_labels, kwargs.get("ignore_index", IGNORE_INDEX))
    vocab_size = logits.shape[-1]
    bad = (shift_labels >= vocab_size) | ((shift_labels < 0) & (shift_labels != IGNORE_INDEX))  # [b, n]
    targets = shift_labels.masked_fill(bad, IGNORE_INDEX).long()  # int32 ids too: cross-entropy takes int64
    token_loss_sum = F.cross_entropy(
        logits.flatten(0, -2).float(),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return _token_mean(token_loss_sum, targets, layout, bad=(bad, shift_labels, vocab_size), extra=extra, **kwargs)


def reduce_token_loss(
    token_loss_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    layout: ParallelLayout,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    stats: CommStats | None = None,
) -> torch.Tensor:
    """This shard's summed token losses -> the token-weighted mean over dp x sp (see the module docstring).

    ``token_loss_sum`` is the sum of the token losses of the targets in ``shift_labels`` (this shard).
    """
    return _token_mean(
        token_loss_sum,
        shift_labels,
        layout,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        stats=stats,
    )[0]


def _token_mean(
    token_loss_sum: torch.Tensor,
    shift_labels: torch.Tensor,
    layout: ParallelLayout,
    *,
    bad: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    extra: torch.Tensor | None = None,
    **options,  # num_items_in_batch, ignore_index, stats: as in reduce_token_loss
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`reduce_token_loss` in ONE all-reduce of ``[sum, count, bad targets, *extra]`` over dp x sp; returns
    the mean and the reduced ``extra``. ``bad``: (``[b, n]`` flags of targets outside the vocabulary, the targets,
    vocab size): any flagged on any rank is a ValueError on every rank."""
    ignore_index = options.get("ignore_index", IGNORE_INDEX)
    num_items_in_batch = options.get("num_items_in_batch")
    local_count = (as_ignored(shift_labels, ignore_index) != IGNORE_INDEX).sum().to(token_loss_sum.device)
    flagged = bad[0].sum() if bad is not None else torch.zeros((), dtype=torch.long)
    head = torch.stack([token_loss_sum.double(), local_count.double(), flagged.to(local_count.device).double()])
    parts = [head] if extra is None else [head, extra.to(head.device).double()]
    with peers_join("reducing the loss over dp x sp (causal_lm_loss, sequence_parallel_cross_entropy)"):
        totals = all_reduce_sum(torch.cat(parts), layout.loss_group, options.get("stats"))  # [3 + len(extra)]
    if bad is not None and bool(totals[2] > 0):
        _, targets, vocab_size = bad
        here = first_bad_id(as_ignored(targets, ignore_index), vocab_size, IGNORE_INDEX)
        raise ValueError(
            f"{int(totals[2])} target id(s) of this step (summed over the dp x sp ranks) lie outside the vocabulary "
            f"of {vocab_size} logits{'' if here is None else f' (this rank holds id {here})'}: ids must be in "
            f"[0, {vocab_size}) or {ignore_index}{'' if ignore_index == IGNORE_INDEX else f' / {IGNORE_INDEX}'} "
            "(ignored); check the tokenizer and vocab_size, or pass "
            "vocab_size=model.config.vocab_size to shard_batch to catch them there"
        )
    denominator = totals[1] if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).double()
    mean = (totals[0] / denominator.clamp(min=1)).to(torch.float32)
    return mean, (totals[3:] if extra is not None else None)


MODEL_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask")


def causal_lm_loss(
    model: torch.nn.Module,
    shard: dict[str, torch.Tensor],
    layout: ParallelLayout,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    stats: CommStats | None = None,
    rows_kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``model`` on this rank's shard and return the token-weighted loss over dp x sp.

    Args:
        model: the parallelized model (DDP / FSDP2 wrapped or not); with the tiled loss enabled the logits
            are never materialised.
        shard: :func:`ulysses_sp.shard_batch`'s output (``input_ids`` or ``inputs_embeds``, ``position_ids``,
            ``shift_labels``, optionally ``attention_mask``).
        num_items_in_batch, label_smoothing: as in :func:`sequence_parallel_cross_entropy` (the smoothing inside
            the tiled loss too).
        rows_kept: ``[b]`` bool, the rows an MoE model's load-balancing term counts (None: all): leave out the rows
            that repeat samples to even out a last eval batch over dp groups (their targets -100 too), as one
            process never sees them.

    Returns the same scalar on every rank, equal to the one-process loss (gradient convention as above). A MoE
    model with ``config.output_router_logits`` gets its load-balancing loss added as transformers adds it
    (``router_aux_loss_coef * aux``), computed over the whole batch of every shard and replica
    (:mod:`ulysses_sp.moe`), in the same all-reduce; with ``label_smoothing`` too (added to the smoothed loss).
    """
    from .moe import router_aux_loss
    from .tiled_loss import LABEL_SMOOTHING, ROUTER_LOGITS_TO_CALLER, tiled_loss_enabled

    smoothing = check_label_smoothing(label_smoothing)
    _check_parallelized(model, layout)
    _check_reduction(model, layout)
    device = layout.device
    unshifted = unshifted_own_loss(model) if shard.get("labels") is not None else None
    if unshifted is not None:  # the same model and batch keys on every rank: every rank raises here
        raise ValueError(
            f"{unshifted}'s own loss scores the logits of token t against labels[t] (it reads labels shifted "
            "already, as Whisper's processor makes them), but shard_batch shifted the labels it was given (token t "
            "against labels[t + 1]), so the loss would differ from one process; give shard_batch the targets as "
            "the model reads them: shift_labels=labels, and no labels"
        )
    if shard.get("shift_labels") is None:
        raise ValueError(
            f"the shard has no shift_labels (keys: {sorted(shard)}); pass ulysses_sp.shard_batch's output for a batch "
            "with labels (unshifted; -100 where no loss is wanted)"
        )
    # (position_ids moved keep the mark of the layout shard_batch cut them for: the model checks it)
    inputs = {key: carry_cut(shard[key], shard[key].to(device)) for key in MODEL_INPUTS if shard.get(key) is not None}
    targets = shard["shift_labels"].to(device)
    aux = router_aux_loss(model)
    common = dict(num_items_in_batch=num_items_in_batch, stats=stats)
    if tiled_loss_enabled(model):
        # num_items_in_batch=1: transformers' convention for "return the sum of the token losses"
        extra = {ROUTER_LOGITS_TO_CALLER: True} if aux is not None else {}
        if smoothing:
            extra[LABEL_SMOOTHING] = smoothing
        out = model(**inputs, shift_labels=targets, num_items_in_batch=1, **extra)
        statistics = _router_statistics(aux, out, inputs, rows_kept)
        mean, sums = _token_mean(out.loss, targets, layout, extra=statistics, **common)
    else:
        out = model(**inputs)
        statistics = _router_statistics(aux, out, inputs, rows_kept)
        # logits [b, n, V]
        mean, sums = _cross_entropy_mean(
            out.logits, targets, layout, extra=statistics, label_smoothing=smoothing, **common
        )
    if aux is None:
        return mean
    return (mean.double() + aux.coef * aux.loss(sums)).to(torch.float32)


def _check_parallelized(model: torch.nn.Module, layout: ParallelLayout) -> None:
    """ValueError (the same on every rank) when ``layout`` splits the sequence but ``model`` is a transformers model
    that runs no sequence-parallel attention (never parallelized, or unparallelized since: its attention is one of
    transformers' own), so each rank's attention would see its own shard alone, or a PEFT model with a prompt-learning
    adapter (its virtual tokens would go to each shard). Another library's attention
    registered under the model's implementation (DeepSpeed's Ulysses in ``ulysses-sp bench``) passes."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .hf import find_pretrained, refuse_prompt_learning
    from .model import ulysses_context

    if layout.sp == 1:
        return
    refuse_prompt_learning(model)  # a PEFT prompt-learning wrapper put around the model after parallelize
    try:
        ulysses_context(model)
        return  # parallelized (a shard inside plain_attention is refused by the model)
    except TypeError:  # not a transformers model: nothing to tell
        return
    except ValueError:
        pass
    impl = getattr(find_pretrained(model).config, "_attn_implementation", None)
    attend = ALL_ATTENTION_FUNCTIONS.get(impl)  # None: the model's own eager attention
    if attend is None or getattr(attend, "__module__", "").startswith("transformers."):
        raise ValueError(
            f"causal_lm_loss was given a layout with sp={layout.sp}, but the model is not parallelized (never, or "
            "unparallelized since), so each rank's attention would see its own shard alone and the loss would be "
            "silently wrong; call ulysses_sp.parallelize(model, layout) first (to generate in between, use `with "
            "ulysses_sp.plain_attention(model):` rather than unparallelize)"
        )


def _check_reduction(model: torch.nn.Module, layout: ParallelLayout) -> None:
    """ValueError (the same on every rank) when ``model`` is wrapped in DDP, or its parameters sharded by FSDP2, over
    ranks that leave out some of those its loss is reduced over (``layout.loss_group``, dp x sp) or of its SP group:
    their shares of every gradient would be missing from the average (e.g. a wrapper over ``layout.dp_group``)."""
    from .fsdp import sharded_mesh

    if layout.loss_group is None or not dist.is_initialized():  # one process, or a rank view: no group
        return
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        wrapper, ranks = "DistributedDataParallel", _ranks(model.process_group)
    else:
        mesh = sharded_mesh(model)  # (a ValueError when FSDP2 shards some trainable parameters only)
        if mesh is None:
            return
        wrapper, ranks = "FSDP2 (its device mesh)", set(mesh.mesh.flatten().tolist())
    wanted = _ranks(layout.loss_group)
    if layout.sp > 1 and wanted is not None:
        wanted = None if (sp := _ranks(layout.sp_group)) is None else wanted | sp
    if ranks is not None and wanted is not None and not wanted <= ranks:
        raise ValueError(
            f"the model's {wrapper} averages gradients over ranks {sorted(ranks)}, but causal_lm_loss's gradients are "
            f"exact once averaged over dp x sp: ranks {sorted(wanted)} (layout.loss_group); wrap it over the whole "
            "world (DDP's default process group, FSDP2 on a mesh of every rank), not over layout.dp_group"
        )


def _ranks(group: object) -> set[int] | None:
    """The global ranks of ``group``; None for one that torch.distributed does not know (a simulated group)."""
    try:
        return set(dist.get_process_group_ranks(group))
    except (KeyError, ValueError, RuntimeError):
        return None


def unshifted_own_loss(model: torch.nn.Module) -> str | None:
    """The class name of the causal LM in ``model`` when its own loss does not shift the labels (logits of token
    t against ``labels[t]``: Whisper's and the BART family's decoders), else None; read from its forward's code:
    a cross-entropy with no ``[..., :-1]`` / ``[..., 1:]`` slice and no ``self.loss_function`` (which shifts)."""
    from .hf import find_causal_lm, own_class

    try:
        return _unshifted(own_class(find_causal_lm(model, "causal_lm_loss")))
    except TypeError:  # no transformers causal LM in it: nothing to read
        return None


@functools.cache
def _unshifted(cls: type) -> str | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
    called = {f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "") for f in calls}
    cross_entropy = bool(called & {"CrossEntropyLoss", "cross_entropy"})
    shifted = "loss_function" in {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} or any(
        isinstance(n, ast.Slice)
        and (
            (isinstance(n.upper, ast.UnaryOp) and isinstance(n.upper.op, ast.USub))  # [..., :-1]
            or (isinstance(n.lower, ast.Constant) and n.lower.value == 1)  # [..., 1:]
        )
        for n in ast.walk(tree)
    )
    return cls.__name__ if cross_entropy and not shifted else None


def _router_statistics(
    aux, out, inputs: dict[str, torch.Tensor], rows_kept: torch.Tensor | None
) -> torch.Tensor | None:
    """This shard's load-balancing sums (:meth:`ulysses_sp.moe.RouterAuxLoss.statistics`), or None without aux."""
    if aux is None:
        return None
    router_logits = getattr(out, "router_logits", None)
    if not router_logits:
        raise ValueError(
            "config.output_router_logits is set but the model returned no router_logits, so its load-balancing "
            "loss cannot be added; set model.config.output_router_logits = False"
        )
    return aux.statistics(tuple(router_logits), inputs.get("attention_mask"), rows_kept)


def sync_gradients(model: torch.nn.Module, layout: ParallelLayout, *, bucket_numel: int = 1 << 25) -> None:
    """Average parameter gradients over dp x sp, for plain loops without DDP/FSDP (which do it themselves).

    Gradients are flattened into buckets of at most ``bucket_numel`` elements per all-reduce (per dtype). A
    parameter that has a gradient on some ranks only (experts that no token of this rank's shard picked, e.g.
    LongCat-Flash's layers whose tokens all went to its zero experts) gets zeros on the others first: the ranks
    agree on which parameters have one (one small all-reduce), so every rank reduces the same tensors in the same
    order. A parameter no rank reached keeps ``grad`` None. A model that FSDP2 shards (it averages its gradients
    itself) is a ValueError on every rank, before any collective.
    """
    from torch.distributed.fsdp import FSDPModule

    group = layout.loss_group
    if group is None or dist.get_world_size(group) == 1:
        return
    unit = next((module for module in model.modules() if isinstance(module, FSDPModule)), None)
    if unit is not None:
        raise ValueError(
            f"sync_gradients averages plain tensors' gradients, but FSDP2 (fully_shard) shards {type(unit).__name__} "
            "in this model and averages its gradients itself: drop the sync_gradients call (with fully_shard on the "
            "whole model, FSDP2 averages every gradient)"
        )
    world = dist.get_world_size(group)
    params = list(model.parameters())
    if params:
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=layout.device)
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=group)
        for param, anywhere in zip(params, present.tolist(), strict=True):
            if anywhere and param.grad is None:
                param.grad = torch.zeros_like(param)
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if bucket and (grad.dtype != bucket[0].dtype or sum(g.numel() for g in bucket) + grad.numel() > bucket_numel):
            flush()
        bucket.append(grad)
    flush()
