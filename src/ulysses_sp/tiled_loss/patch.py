"""The model side of the tiled loss: a transformers causal LM computes its loss with the tiled kernel.

:func:`enable_tiled_loss` replaces the model's ``forward`` on the instance (not the class;
:func:`disable_tiled_loss` restores it) by one that runs the decoder and, when ``labels`` or ``shift_labels``
are passed, returns the tiled loss with the semantics of transformers' causal-LM loss and ``logits=None``.
Without labels the original forward runs. The loss is computed inside a call of the lm_head module, so DDP
and FSDP2 see it as part of the model (FSDP2 gathers the weight once per forward and once per backward).

Logit post-processing: known scalings are read from the config (:meth:`LogitsHead.from_config`); on its
first forward the model checks, with a few random hidden states pushed through its own forward, that the
tiled head reproduces its logits, and raises ValueError naming the model if not.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..compile_boundary import run_eagerly
from ..hf import attention_modules, decoder_module, find_causal_lm, in_mode
from ..validation import IGNORE_INDEX, as_ignored
from .head_calls import Weights, head_calls, vocab_rows
from .kernel import DEFAULT_LOSS_BUDGET_BYTES, LogitsHead, loss_chunk_tokens, tiled_cross_entropy_sum

__all__ = [
    "LABEL_SMOOTHING",
    "ROUTER_LOGITS_TO_CALLER",
    "disable_tiled_loss",
    "enable_tiled_loss",
    "tiled_loss_enabled",
]

_STATE_ATTR = "_ulysses_tiled_loss"
# A keyword ulysses_sp.causal_lm_loss passes to the tiled forward: return the router logits with the cross-entropy
# (it adds the load-balancing loss of the whole sequence itself) instead of refusing them.
ROUTER_LOGITS_TO_CALLER = "ulysses_sp_router_logits_to_caller"
# A keyword the Trainer integration passes for label_smoothing_factor: the tiled loss smooths the targets as
# transformers' LabelSmoother does (tiled_cross_entropy_sum's label_smoothing).
LABEL_SMOOTHING = "ulysses_sp_label_smoothing"
_PROBE_TOKENS = 4


@dataclass
class _TiledLossState:
    original_forward: object  # the forward the instance had: the class's, or a wrapper set on the instance
    head: LogitsHead
    chunk_tokens: int | None
    budget_bytes: int
    verified: bool = False
    instance_forward: object = None  # ``forward`` in the instance's __dict__ before enabling (restored after)
    # wrappers that call the causal LM's forward they kept as their own (PEFT's AdaptionPromptModel sets
    # ``self.forward = model.forward``): pointed at the tiled forward too, and back after
    wrappers: list[nn.Module] = field(default_factory=list)

    def __getstate__(self) -> dict[str, object]:  # pickle / torch.save: a file saved would not load
        raise TypeError(
            "cannot pickle a model with the tiled loss enabled: its forward is set on the instance, and torch.load "
            "of the file fails. To save the model, save its weights (torch.save(model.state_dict(), path) or "
            "model.save_pretrained(path)), or call ulysses_sp.disable_tiled_loss(model) first"
        )

    def __deepcopy__(self, memo: dict) -> _TiledLossState:  # copy.deepcopy of the model: a state of its own
        return dataclasses.replace(self, **{f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self)})


def tiled_loss_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable_tiled_loss` is in effect on ``model`` (or the causal LM inside it)."""
    try:
        return getattr(find_causal_lm(model), _STATE_ATTR, None) is not None
    except TypeError:
        return False


def enable_tiled_loss(
    model: nn.Module, *, chunk_tokens: int | None = None, budget_bytes: int = DEFAULT_LOSS_BUDGET_BYTES
) -> nn.Module:
    """Make the causal LM compute its loss with :func:`tiled_cross_entropy_sum` (in place; returns ``model``).

    Args:
        model: a transformers causal LM, or a wrapper around one (PEFT, DDP, FSDP2-sharded).
        chunk_tokens: tokens per chunk; default: as many as fit ``budget_bytes`` of logits working set.
        budget_bytes: the logits working set one chunk may use (default 1 GiB).

    With ``labels`` or ``shift_labels``, ``model(...)`` returns ``loss`` and ``logits=None``: the loss is
    transformers' (shifted targets; ``num_items_in_batch`` -> sum / num_items_in_batch, else the mean over
    valid targets, 0 when there is none). Without them the original forward runs. Raises ValueError if the
    output embedding is not a plain ``nn.Linear`` (e.g. DoRA on lm_head) or the model is already tiled; the
    first forward raises ValueError if the model post-processes logits in a way the tiled head cannot copy.
    """
    causal_lm = find_causal_lm(model)
    if getattr(causal_lm, _STATE_ATTR, None) is not None:
        raise ValueError("the tiled loss is already enabled on this model; call disable_tiled_loss(model) first")
    output = causal_lm.get_output_embeddings()
    if head_calls(output) is None:
        raise ValueError(
            f"the tiled loss needs the output embedding to be a plain torch.nn.Linear (or PEFT's modules_to_save, "
            f"trainable tokens or plain LoRA on one), but {type(causal_lm).__name__}'s is {type(output).__name__} "
            "(e.g. DoRA or another LoRA variant on lm_head, a dropout other than nn.Dropout, fan_in_fan_out or a "
            "quantized base layer); use plain LoRA there or leave lm_head out of the adapters, or disable the "
            "tiled loss"
        )
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    prefix = causal_lm.base_model_prefix
    if not isinstance(getattr(causal_lm, prefix, None), nn.Module):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder at .{prefix}; the tiled loss cannot run it")
    parameters = inspect.signature(causal_lm.forward).parameters
    if "labels" not in parameters and not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        raise ValueError(f"{type(causal_lm).__name__}.forward takes no labels; it is not a causal LM")
    state = _TiledLossState(
        causal_lm.forward,
        LogitsHead.from_config(causal_lm.config),
        chunk_tokens,
        budget_bytes,
        instance_forward=causal_lm.__dict__.get("forward"),
        wrappers=[m for m in model.modules() if m is not causal_lm and m.__dict__.get("forward") == causal_lm.forward],
    )
    setattr(causal_lm, _STATE_ATTR, state)
    causal_lm.forward = types.MethodType(_tiled_forward, causal_lm)
    for wrapper in state.wrappers:  # else they would bypass it: the model's own loss (or none) and whole logits
        wrapper.forward = causal_lm.forward
    return model


def disable_tiled_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_loss`: the model's own forward and loss again."""
    causal_lm = find_causal_lm(model)
    if getattr(causal_lm, _STATE_ATTR, None) is None:
        return model
    state: _TiledLossState = getattr(causal_lm, _STATE_ATTR)
    for wrapper in state.wrappers:
        wrapper.forward = state.original_forward
    if state.instance_forward is not None:  # e.g. Accelerate's autocast wrapper, installed before enabling
        causal_lm.forward = state.instance_forward
    else:
        del causal_lm.forward  # the instance attribute; the class's forward shows through again
    delattr(causal_lm, _STATE_ATTR)
    return model


class _ProbeOutputs:
    """The decoder's output during the probe: ``hidden`` as its last hidden state, None for every other field
    (past_key_values, cross_attentions, router_logits, ... whatever the causal LM reads from it)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def to_tuple(self) -> tuple[torch.Tensor]:
        return (self.last_hidden_state,)


@contextlib.contextmanager
def _decoder_returning(causal_lm: nn.Module, hidden: torch.Tensor) -> Iterator[None]:
    """Temporarily replace the decoder the causal LM calls (the innermost module holding every attention layer
    and taking position ids: ``model`` for Llama, ``model.decoder`` for OPT; else the base model) by one that
    returns ``hidden``."""

    class _Fixed(nn.Module):
        def forward(self, *args, **kwargs):
            return _ProbeOutputs(hidden)

        def __getattr__(self, name: str):  # the decoder's own attributes (Fuyu embeds through get_input_embeddings)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(decoder, name)

    try:
        decoder = decoder_module(causal_lm, attention_modules(causal_lm))
    except ValueError:  # no module holding the attention layers takes position ids: the base model, then
        decoder = getattr(causal_lm, causal_lm.base_model_prefix)
    name = next(n for n, m in causal_lm.named_modules() if m is decoder)
    parent_name, _, attr = name.rpartition(".")
    parent = causal_lm.get_submodule(parent_name)
    setattr(parent, attr, _Fixed())
    try:
        yield
    finally:
        setattr(parent, attr, decoder)


def _probe_tolerance(dtype: torch.dtype) -> float:
    """How far the tiled head may be from the model's own logits (relative): fp32 rounding of the same arithmetic
    in fp32, a few roundings where the model post-processes in 16 bits and the tiled head in fp32."""
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps


@run_eagerly("checks once, on a probe, that the tiled loss reproduces the model's logits")
def _verify_head(causal_lm: nn.Module, state: _TiledLossState, like: torch.Tensor) -> None:
    """Push a few random hidden states through the model's own forward and compare with the tiled head (once:
    the check is here, not at the call, so that a compiled forward does not depend on it and compile again)."""
    if state.verified:
        return
    output = causal_lm.get_output_embeddings()
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(1, _PROBE_TOKENS, like.shape[-1], generator=generator).to(like.device, like.dtype)
    ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=like.device)
    with torch.no_grad(), torch.autocast(like.device.type, enabled=False), in_mode(output, training=False):
        try:
            with _decoder_returning(causal_lm, probe):
                theirs = state.original_forward(input_ids=ids, use_cache=False).logits
        except Exception as err:  # the model's forward does something with its decoder's output we cannot fake
            raise ValueError(
                f"the tiled loss cannot check how {type(causal_lm).__name__} turns hidden states into logits (its "
                f"forward failed on a probe: {type(err).__name__}: {err}); disable the tiled loss for this model "
                "(tiled_loss=False / --no-tiled-loss)"
            ) from err
        ours = state.head.apply(output(probe).float())  # the module call: FSDP2 gathers a sharded lm_head
    tol = _probe_tolerance(like.dtype)
    close = theirs is not None and theirs.shape == ours.shape
    if not close or not torch.allclose(theirs.float(), ours, rtol=tol, atol=tol * float(ours.abs().max())):
        if theirs is None:
            found = "its forward returns no logits"
        elif not close:
            found = f"its logits {tuple(theirs.shape)} vs the head's {tuple(ours.shape)}"
        else:  # same shape: say by how much (the shapes alone read as if nothing differed)
            gap = float((theirs.float() - ours).abs().max())
            found = f"on a probe its logits differ from the head's by up to {gap:.3g}"
        raise ValueError(
            f"the tiled loss cannot reproduce {type(causal_lm).__name__}'s logits (its forward post-processes them "
            f"in a way the tiled head {state.head} does not: {found}); disable the tiled loss for this model "
            "(tiled_loss=False / --no-tiled-loss)"
        )
    state.verified = True


# What a head module called on hidden states multiplies them by: (weight, bias, low-rank adapters)
@run_eagerly("runs the tiled loss eagerly (it swaps the head's forward for the call, which dynamo cannot trace)")
def _head_loss(
    output: nn.Module, calls: list[tuple[nn.Module, Weights]], hidden: torch.Tensor, targets: torch.Tensor, **kwargs
) -> torch.Tensor:
    """The tiled loss computed INSIDE a call of the lm_head module, so that whatever wraps that module sees
    a normal call: FSDP2 (when lm_head is its own FSDP unit) gathers the weight before and registers its
    gradient hooks after, exactly as for ``lm_head(hidden)``; PEFT's wrappers pick which of ``calls`` (from
    :func:`head_calls`, with whose weight) the call runs in."""

    def forward(module: nn.Module, hidden_states: torch.Tensor, weights: Weights) -> torch.Tensor:
        weight, bias, adapters = weights(module, hidden_states)
        return tiled_cross_entropy_sum(hidden_states, weight, targets, bias=bias, adapters=adapters, **kwargs)

    def one_adapter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("adapter_names") is not None:  # set by PEFT's hooks for a batch of mixed adapters
            raise ValueError(
                "adapter_names (PEFT's batch of mixed adapters) with labels: the tiled loss runs one adapter per "
                "call; compute the loss without adapter_names, or call disable_tiled_loss(model) first"
            )

    for module, weights in calls:
        module.forward = types.MethodType(functools.partial(forward, weights=weights), module)
    handle = output.register_forward_pre_hook(one_adapter, with_kwargs=True)  # after PEFT's: sees what they set
    try:
        return output(hidden)
    finally:
        handle.remove()
        for module, _ in calls:
            del module.forward


def _shifted_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    if shift_labels is not None:
        return shift_labels
    assert labels is not None
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def _tiled_forward(
    self: nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
):
    """The forward :func:`enable_tiled_loss` installs (transformers' causal-LM signature)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    state: _TiledLossState = getattr(self, _STATE_ATTR)
    shift_labels = kwargs.pop("shift_labels", None)
    wants_loss = labels is not None or shift_labels is not None
    # TRL's fused LM head (`fused_lm_head=True`, a forward it installs before this one) scores the targets in
    # tiles itself and returns per-token log-probabilities: it gets the forward it asked for.
    fused_by_caller = bool(kwargs.get("fused_lm_head", False))
    smoothing = kwargs.pop(LABEL_SMOOTHING, 0.0)
    if fused_by_caller or not wants_loss or not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        if smoothing:
            raise ValueError("label smoothing needs the tiled loss: labels or shift_labels, and no fused_lm_head")
        if shift_labels is not None:
            kwargs["shift_labels"] = shift_labels
        return state.original_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    to_caller = kwargs.pop(ROUTER_LOGITS_TO_CALLER, False)
    router = kwargs.get("output_router_logits")
    if not to_caller and (router or (router is None and getattr(self.config, "output_router_logits", False))):
        raise ValueError(
            "output_router_logits=True: the tiled loss returns the cross-entropy only and would drop the MoE "
            "load-balancing loss; train with ulysses_sp.causal_lm_loss (which adds it, over the whole sequence), "
            "set model.config.output_router_logits = False, or call disable_tiled_loss(model) to use the model's "
            "own loss"
        )
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    outputs = getattr(self, self.base_model_prefix)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden = outputs.last_hidden_state  # [b, n, h]
    _verify_head(self, state, hidden)
    targets = as_ignored(_shifted_targets(labels, shift_labels, IGNORE_INDEX), ignore_index).to(hidden.device)
    output = self.get_output_embeddings()
    calls = head_calls(output)
    if calls is None:
        raise ValueError(
            f"the output embedding became a {type(output).__name__} after the tiled loss was enabled; "
            "call disable_tiled_loss(model) before adding adapters to lm_head"
        )
    chunk = state.chunk_tokens or loss_chunk_tokens(vocab_rows(*calls[0]), state.budget_bytes)
    options = dict(head=state.head, chunk_tokens=chunk, ignore_index=IGNORE_INDEX, label_smoothing=smoothing)
    total = _head_loss(output, calls, hidden, targets, **options)
    if num_items is not None:  # at least 1: a step of no targets (0 of them) is 0 with zero gradients, not NaN
        loss = total / torch.as_tensor(num_items, device=total.device).clamp(min=1)
    else:
        loss = total / (targets != IGNORE_INDEX).sum().clamp(min=1)
    return MoeCausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        router_logits=getattr(outputs, "router_logits", None) if to_caller else None,
    )
