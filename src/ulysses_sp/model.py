"""``parallelize(model, layout)``: the one place that touches a Hugging Face model.

It checks that the heads split over ``layout.sp`` ranks, registers the Ulysses attention function (and a
mask function that builds no dense mask) with transformers' public ``AttentionInterface`` /
``AttentionMaskInterface`` under ``ulysses_<core>``, switches the model to it with
``set_attn_implementation``, points each attention module at the model's :class:`UlyssesAttention`, and
adds one forward pre-hook on the decoder that works out documents once per forward pass. No model class is
patched; :func:`unparallelize` (or ``with plain_attention(model):``) undoes all of it, e.g. to generate.

Rotary embeddings whose frequencies depend on the sequence length (rope types ``dynamic`` and ``longrope``)
read the largest position id they are given. Under SP each rank holds a slice of the positions, so a pair of
hooks on such a rotary module appends the largest position of the FULL rows (gathered once per forward) to
the position_ids it receives and drops that extra column from its cos/sin: every rank picks the frequencies
one process would pick for the whole sequence.

In training under sp > 1 a pair of hooks on the model, and another on its decoder, give each SP rank its own
dropout stream (:class:`~ulysses_sp.dropout_stream.DropoutStream`), so masks do not repeat along the sequence: in
the decoder, and after it (LoRA's dropout on lm_head).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from .attention import MODULE_ATTR, UlyssesAttention, check_ring_core, ulysses_attention_forward
from .comm import CommStats
from .compile_boundary import run_eagerly
from .cores import CORES, Core, get_core
from .dropout_stream import DropoutStream
from .head_chunks import head_chunk_targets, install_head_chunks, remove_head_chunks
from .head_split import DEFAULT_HEAD_CHUNK_BUDGET_BYTES, layer_kv_chunks
from .hf import (
    attention_head_counts,
    attention_modules,
    decoder_module,
    find_pretrained,
    layer_kv_heads,
    refuse_prompt_learning,
    refuse_unswitched_attention,
    refuse_whole_sequence_head,
)
from .layout import ParallelLayout
from .masks import read_decoder_masks, ulysses_mask
from .moe import router_aux_loss
from .offload import offload_store
from .padding import lift_padding_ids
from .rope_length import rope_length_hooks
from .validation import carry_cut_to_outputs, check_kept_logits, check_whole_input

__all__ = ["parallelize", "plain_attention", "ulysses_context", "unparallelize"]

_STATE_ATTR = "_ulysses_sp_state"


@dataclass
class _State:
    ctx: UlyssesAttention
    name: str
    original_impl: str
    hooks: list[torch.utils.hooks.RemovableHandle]
    modules: list[torch.nn.Module]
    begin: _BeginForward  # its plain count: plain_attention's switch is the one allowed


class _BeginForward:
    """Forward pre-hook on the decoder: checks the shard and works out the documents once per forward pass.

    A second pre-hook on the whole model (:meth:`take_targets`) hands it the labels given to the model, so
    their ids are checked in the same agreement as the input's. Hooks are objects (not closures) so that
    ``copy.deepcopy`` of a parallelized model gives a copy whose hooks serve the copy.
    """

    def __init__(self, pretrained: PreTrainedModel, ctx: UlyssesAttention, name: str) -> None:
        self.pretrained, self.ctx, self.name = pretrained, ctx, name
        self.targets: torch.Tensor | None = None
        self.plain = 0  # inside how many plain_attention blocks

    def __getstate__(self) -> dict:
        # a copy (copy.deepcopy) made inside plain_attention is not inside it: its switch is checked again
        return {**self.__dict__, "plain": 0}

    def active(self) -> bool:
        return self.pretrained.config._attn_implementation == self.name  # False under plain_attention

    def check_active(self) -> bool:
        """:meth:`active`; a ValueError when the implementation was switched other than by plain_attention under
        sp > 1 (each attention would then see this rank's shard alone: silently wrong)."""
        impl = self.pretrained.config._attn_implementation
        if impl == self.name or self.plain or self.ctx.layout.sp == 1:
            return impl == self.name
        raise ValueError(
            f"{type(self.pretrained).__name__}'s attention implementation is {impl!r}, not {self.name!r} as "
            "parallelize set it: it was changed afterwards (set_attn_implementation or config._attn_implementation), "
            "so each attention would see this rank's shard of the sequence alone; for a forward on a whole input "
            "use `with ulysses_sp.plain_attention(model):`, to change the core ulysses_sp.unparallelize(model) and "
            f"parallelize(model, layout, core=...) again, or switch back: model.set_attn_implementation({self.name!r})"
        )

    def take_targets(self, module, args, kwargs):
        self.targets = None
        if self.check_active():
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
            check_kept_logits(bound.get("logits_to_keep"), self.ctx.layout.sp)  # generate() outside plain_attention
            labels = bound.get("labels")
            router = kwargs.get("output_router_logits")
            if router is None:
                router = getattr(self.pretrained.config.get_text_config(), "output_router_logits", False)
            if labels is not None and router and self.ctx.layout.sp > 1 and not self.ctx.router_aux_by_caller:
                raise ValueError(
                    f"{type(module).__name__} was given labels with output_router_logits=True: its own loss would add "
                    "a load-balancing loss computed from this shard's tokens alone; train with "
                    "ulysses_sp.causal_lm_loss(model, shard, layout), which adds it over the whole sequence, or set "
                    "model.config.output_router_logits = False"
                )
            targets = kwargs.get("shift_labels")
            targets = labels if targets is None else targets
            self.targets = targets if isinstance(targets, torch.Tensor) else None
        return None

    @run_eagerly("checks each forward's shard across the SP group (host-side collectives) and reads its documents")
    def __call__(self, module, args, kwargs):
        targets, self.targets = self.targets, None
        if not self.check_active():  # switched back to plain attention (plain_attention): whole inputs only
            return check_whole_input(kwargs.get("position_ids"))
        if kwargs.get("output_attentions"):  # (asked for in the call: a config's default is left as it was)
            raise ValueError(
                "output_attentions=True: Ulysses attention returns no attention weights (no rank holds a layer's "
                "whole attention matrix), so they would be missing; for attention maps run the model on the whole "
                "input inside `with ulysses_sp.plain_attention(model):` (its own implementation; eager returns them)"
            )
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        if bound.get("past_key_values") is not None:
            raise ValueError(
                "a KV cache (past_key_values) cannot be used under sequence parallelism; generate inside "
                "`with ulysses_sp.plain_attention(model):` or after ulysses_sp.unparallelize(model)"
            )
        input_ids = bound.get("input_ids")
        tokens = input_ids if input_ids is not None else bound.get("inputs_embeds")
        if tokens is None:
            raise ValueError("the model needs input_ids or inputs_embeds")
        if tokens.dim() < 2:
            raise ValueError(
                f"input_ids of shape {tuple(tokens.shape)}: a parallelized model takes [batch, tokens] (e.g. the "
                "output of ulysses_sp.shard_batch)"
            )
        vocab = getattr(self.pretrained.get_input_embeddings(), "num_embeddings", None)
        self.ctx.vocab_size = vocab or self.ctx.vocab_size  # now: resize_token_embeddings may have changed it
        self.ctx.begin_forward(
            bound.get("position_ids"),
            bound.get("attention_mask"),
            tokens.shape[0],
            tokens.shape[1],
            input_ids=input_ids,
            targets=targets,
        )
        segments = self.ctx.segments_for(bound.get("position_ids"))
        lifted = lift_padding_ids(self.pretrained, input_ids, bound.get("attention_mask"), segments, self.ctx.layout)
        if lifted is not None and "input_ids" in kwargs:  # right pads off the embedding's zero row (ulysses_sp.padding)
            kwargs = {**kwargs, "input_ids": lifted}
        elif lifted is not None:  # given positionally
            where = list(inspect.signature(module.forward).parameters).index("input_ids")
            args = (*args[:where], lifted, *args[where + 1 :])
        return args, {**kwargs, "use_cache": False}


_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
_TOKENWISE_LAYER_TYPES = {"mlp", "moe"}  # layers that mix no tokens (Nemotron-H's MLP and MoE blocks)


def _check_model_features(config, core: str | None) -> None:
    """Refuse, before training, model features that Ulysses would get silently wrong."""
    unsupported = set(getattr(config, "layer_types", None) or []) - _SUPPORTED_LAYER_TYPES - _TOKENWISE_LAYER_TYPES
    if unsupported:
        raise ValueError(
            f"layer types {sorted(unsupported)} are not supported by Ulysses attention (supported: "
            f"{sorted(_SUPPORTED_LAYER_TYPES)}): such layers (state-space, linear, convolutional, chunked or indexed "
            "attention) mix tokens along the sequence themselves, and each rank would see its own shard only"
        )
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"chunked attention (attention_chunk_size={config.attention_chunk_size}) is not supported by Ulysses "
            "attention: its chunk mask would be silently ignored"
        )
    if getattr(config, "layerdrop", 0.0):
        raise ValueError(
            f"LayerDrop (layerdrop={config.layerdrop}) draws in training whether to skip each layer; under Ulysses "
            "each rank of an SP group draws from its own dropout stream, so ranks would skip different layers; set "
            "layerdrop=0"
        )
    if getattr(config, "attn_temperature_tuning", False):
        raise ValueError(
            "attn_temperature_tuning scales queries by positions computed per shard; it is not supported under "
            "Ulysses (set attn_temperature_tuning=False if the model allows it)"
        )
    if core == "sdpa" and getattr(config, "attn_logit_softcapping", None):
        raise ValueError(
            f"the model uses attention logit softcapping (attn_logit_softcapping={config.attn_logit_softcapping}), "
            "which sdpa cannot apply; use core='eager' or core='flash_attention_2' (or flex_attention on GPU)"
        )


def _register(name: str) -> None:
    AttentionInterface.register(name, ulysses_attention_forward)
    AttentionMaskInterface.register(name, ulysses_mask)


def parallelize(
    model: torch.nn.Module,
    layout: ParallelLayout,
    *,
    core: str | Core = "sdpa",
    comm_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
    head_chunks: int | None = None,
    head_chunk_budget_bytes: int = DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
) -> torch.nn.Module:
    """Make ``model`` run Ulysses sequence-parallel attention over ``layout.sp`` ranks (in place).

    Args:
        model: a transformers causal LM (or a PEFT/other wrapper around one) whose attention goes through
            ``AttentionInterface`` (Llama, Mistral, Qwen2/3, Gemma2/3 and most current decoder models).
        layout: where this rank sits; see :class:`ParallelLayout`.
        core: the local attention core: ``"sdpa"`` (default), ``"eager"``, ``"flex_attention"``,
            ``"flash_attention_2"``, ``"flash_attention_3"``, or a callable with the signature of
            :func:`ulysses_sp.cores.sdpa_core`.
        comm_dtype: dtype of the all-to-all payload (default: the activations' dtype; ``torch.float32``
            for full-precision exchanges of bf16 activations). The Ulysses all-to-alls only: a ring's exchanges
            keep the activations' dtype (a ring-only layout, ``ulysses`` 1, is refused with one).
        stats: a :class:`CommStats` to count collectives and bytes into (one is made if omitted;
            reach it as ``ulysses_context(model).stats``).
        head_chunks: run each attention layer's heads in this many chunks, one or two at a time (see
            :mod:`ulysses_sp.head_chunks`); None or 0: automatic (chunks only where one chunk's q/k/v after the
            exchange would exceed ``head_chunk_budget_bytes`` per rank); 1: never.
        head_chunk_budget_bytes: the automatic C's budget, and that of the sdpa core's slices of heads (the
            unchunked core runs its heads in slices where a fused kernel's fp32 dq accumulator over all of them
            would exceed it, :mod:`ulysses_sp.sliced_core`).

    Returns the same model. Raises ValueError before any training if the heads do not split over
    ``layout.sp``, the core is unknown, or ``head_chunks`` > 1 does not split the heads or an attention module.
    """
    if not isinstance(layout, ParallelLayout):
        raise ValueError(f"layout must be a ulysses_sp.ParallelLayout, got {type(layout).__name__}")
    budget = head_chunk_budget_bytes
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"head_chunk_budget_bytes must be a positive int (bytes), got {budget!r}")
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
        # (an integer or bool wire truncated q/k/v and the output silently: the loss 1e-3 off one process)
        raise ValueError(f"comm_dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {comm_dtype!r}")
    if comm_dtype is not None and layout.ring > 1 and layout.ulysses == 1:  # (it changed nothing there, silently)
        raise ValueError(
            f"comm_dtype={comm_dtype} sets the dtype of the Ulysses all-to-alls, and this layout (ring {layout.ring}, "
            "ulysses 1) has none: its ring exchanges k/v in the activations' dtype; drop comm_dtype, or use a layout "
            "with ulysses > 1 (choose_layout)"
        )
    pretrained = find_pretrained(model)
    if layout.is_view:
        raise ValueError(
            "parallelize needs a layout with process groups; ParallelLayout.rank_view only describes where a "
            "rank sits (use ParallelLayout.from_env, from_groups or single)"
        )
    if getattr(pretrained, _STATE_ATTR, None) is not None:
        raise ValueError("this model is already parallelized; call ulysses_sp.unparallelize(model) first")
    text_config = pretrained.config.get_text_config()
    num_heads, num_kv_heads = attention_head_counts(text_config, attention_modules(pretrained))
    if num_heads is None:
        raise ValueError(f"{type(pretrained).__name__} config has no num_attention_heads; is it a decoder LM?")
    layout.check_heads(num_heads, num_kv_heads)
    if layout.sp > 1:
        refuse_prompt_learning(model)
        refuse_whole_sequence_head(pretrained)
    _check_model_features(text_config, core if isinstance(core, str) else None)
    if getattr(text_config, "output_router_logits", False):
        router_aux_loss(model)  # ValueError unless its load-balancing loss is the one causal_lm_loss computes

    if not callable(core) and not isinstance(core, str):
        raise ValueError(f"core must be one of {sorted(CORES)} or a callable, got {core!r}")
    core_name = core if isinstance(core, str) else getattr(core, "__name__", "custom")
    check_ring_core(core_name, layout.ring)  # before resolving it: whatever it is, it cannot run here
    core_fn = core if callable(core) else get_core(core)
    if not pretrained._can_set_attn_implementation():
        raise ValueError(
            f"{type(pretrained).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so Ulysses cannot be plugged in without patching it"
        )
    modules = attention_modules(pretrained)
    if not modules:
        raise ValueError(f"found no attention modules in {type(pretrained).__name__}")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in modules):
        raise ValueError(
            f"{type(pretrained).__name__} uses attention sinks, which Ulysses does not support yet (the sink "
            "logits would be silently dropped)"
        )
    requested = layer_kv_chunks(head_chunks, layout, num_heads, layer_kv_heads(text_config))  # (per-layer kv)
    chunked = head_chunk_targets(modules, num_heads, num_kv_heads or num_heads, layout.ulysses, requested)
    decoder = decoder_module(pretrained, modules)
    embeddings = pretrained.get_input_embeddings()
    vocab_size = getattr(embeddings, "num_embeddings", None) or getattr(text_config, "vocab_size", None)
    ctx = UlyssesAttention(
        layout,
        core_fn,
        core_name=core_name,
        comm_dtype=comm_dtype,
        stats=stats,
        vocab_size=vocab_size,
        masks=read_decoder_masks(decoder, pretrained.config._attn_implementation),
        slice_budget_bytes=head_chunk_budget_bytes,
    )
    ctx.head_chunks = head_chunks or None
    name = f"ulysses_{core_name}" if isinstance(core, str) else "ulysses_custom"
    rope_hooks = rope_length_hooks(pretrained, ctx, name, text_config)

    # All checks passed: from here on the model is changed.
    _register(name)
    original = pretrained.config._attn_implementation
    pretrained.set_attn_implementation(name)
    refuse_unswitched_attention(pretrained, modules, name, original, layout.sp)
    for module in modules:
        object.__setattr__(module, MODULE_ATTR, ctx)
    chunk_options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads or num_heads, requested=head_chunks)
    install_head_chunks(
        chunked, ctx, pretrained=pretrained, impl_name=name, budget_bytes=head_chunk_budget_bytes, **chunk_options
    )

    begin = _BeginForward(pretrained, ctx, name)
    # a stream around the whole model (the head: LoRA's dropout on lm_head) and one inside it around the decoder
    # (also when the decoder is called alone)
    outer, dropout = DropoutStream(ctx, begin.active), DropoutStream(ctx, begin.active)
    hooks = [
        pretrained.register_forward_pre_hook(begin.take_targets, with_kwargs=True),
        pretrained.register_forward_pre_hook(outer.before, with_kwargs=True),
        pretrained.register_forward_hook(outer.after, with_kwargs=True, always_call=True),
        pretrained.register_forward_hook(carry_cut_to_outputs, with_kwargs=True),  # for gather_sequence's check
        decoder.register_forward_pre_hook(begin, with_kwargs=True),
        decoder.register_forward_pre_hook(dropout.before, with_kwargs=True),  # after the shard's checks
        decoder.register_forward_hook(dropout.after, with_kwargs=True, always_call=True),
    ]
    for rotary, rope in rope_hooks:
        hooks.append(rotary.register_forward_pre_hook(rope.before, with_kwargs=True))
        hooks.append(rotary.register_forward_hook(rope.after, with_kwargs=True))
    store = offload_store(pretrained)
    if store is not None:  # offload enabled first: its prefetch waits for each attention's backward from now on
        store.wait_for(ctx)
    setattr(pretrained, _STATE_ATTR, _State(ctx, name, original, hooks, modules, begin))
    return model


def ulysses_context(model: torch.nn.Module) -> UlyssesAttention:
    """The :class:`UlyssesAttention` of a parallelized model (layout, core, ``stats``)."""
    state = getattr(find_pretrained(model), _STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not parallelized; call ulysses_sp.parallelize(model, layout) first")
    return state.ctx


def unparallelize(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`parallelize`: the original attention implementation, no hook, no module attributes."""
    pretrained = find_pretrained(model)
    state: _State | None = getattr(pretrained, _STATE_ATTR, None)
    if state is None:
        return model
    for hook in state.hooks:
        hook.remove()
    store = offload_store(pretrained)
    if store is not None:  # nothing calls its fetch_pending any more: prefetch at once again
        store.late = False
    remove_head_chunks(state.modules)
    for module in state.modules:
        if MODULE_ATTR in module.__dict__:
            object.__delattr__(module, MODULE_ATTR)
    pretrained.set_attn_implementation(state.original_impl)
    delattr(pretrained, _STATE_ATTR)
    return model


@contextlib.contextmanager
def plain_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Temporarily run the model's original attention (e.g. to ``generate`` on one rank's full input)."""
    pretrained = find_pretrained(model)
    state: _State | None = getattr(pretrained, _STATE_ATTR, None)
    if state is None:
        yield model
        return
    pretrained.set_attn_implementation(state.original_impl)
    state.begin.plain += 1
    try:
        yield model
    finally:
        state.begin.plain -= 1
        if not state.begin.plain:  # the outermost block: back to Ulysses
            pretrained.set_attn_implementation(state.name)
