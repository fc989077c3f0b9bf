"""Tiled lm_head + cross-entropy: the causal-LM loss without ever holding ``[tokens, vocab]`` logits.

The plain path materialises the fp32 logits of every token, their log-softmax and, in backward, their
gradient: for Qwen3-4B (vocab 151,936) that is about 1.7 MiB per token, 63 GiB at 36K tokens. Here the
tokens are cut into chunks of ``chunk_tokens``; for each chunk the logits are computed, reduced to the
token losses and dropped. Backward recomputes each chunk's logits from the saved hidden states and the
lm_head weight (one extra lm_head matmul) and writes the chunk's hidden-state gradient into one buffer
while adding the weight gradient into one fp32 accumulator. What is held: the hidden states (already
held by the model) and, transiently, one chunk of logits. Exact: it is the same arithmetic in the same
dtypes as ``lm_head`` + ``F.cross_entropy(logits.float())`` (under autocast the matmul runs in the
autocast dtype, the softmax in fp32), only summed in a different order.

:func:`tiled_cross_entropy_sum` is the kernel. :func:`enable_tiled_loss` makes a transformers causal LM use
it: the model's own ``forward`` is replaced on the instance (not the class; :func:`disable_tiled_loss`
restores it) by one that runs the decoder and, when ``labels`` or ``shift_labels`` are passed, returns the
tiled loss with the semantics of transformers' causal-LM loss (``num_items_in_batch`` -> sum / that,
else the mean) and ``logits=None``. Without labels it calls the original forward (full logits, e.g. for
generation). Because the loss is computed inside the model's forward, DDP and FSDP2 see it as part of the
model: FSDP2 gathers the lm_head weight once per forward and once per backward, not once per chunk.

Models post-process logits in many ways (Granite divides by ``logits_scaling``, Cohere multiplies by
``logit_scale``, Gemma soft-caps with ``final_logit_softcapping``, some slice the vocabulary). The known
scalings are read from the config; on its first forward the tiled model checks, with a few random hidden
states pushed through the model's own forward, that the tiled head reproduces the model's logits, and
raises ValueError naming the model if it does not — never a silently different loss.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .sharding import IGNORE_INDEX

__all__ = [
    "DEFAULT_LOSS_BUDGET_BYTES",
    "LogitsHead",
    "disable_tiled_loss",
    "enable_tiled_loss",
    "loss_chunk_tokens",
    "tiled_cross_entropy_sum",
    "tiled_loss_enabled",
]

DEFAULT_LOSS_BUDGET_BYTES = 1 << 30
# Bytes per logit held while a chunk is live, forward or backward: the fp32 logits (4) and one fp32 tensor of
# the same shape (logsumexp's temporary; the softmax that becomes the gradient). Everything else is in place.
_BYTES_PER_LOGIT = 8


def loss_chunk_tokens(vocab_size: int, budget_bytes: int = DEFAULT_LOSS_BUDGET_BYTES) -> int:
    """Tokens per chunk so that one chunk's logits working set stays within ``budget_bytes``."""
    if vocab_size < 1 or budget_bytes < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and budget_bytes ({budget_bytes}) must be positive")
    return max(1, budget_bytes // (vocab_size * _BYTES_PER_LOGIT))


@dataclass(frozen=True)
class LogitsHead:
    """How hidden states become logits: ``softcap(scale * (h @ W^T + b))`` (softcap: ``c * tanh(x / c)``)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config) -> LogitsHead:
        """The scalings transformers applies after ``lm_head`` for this config (text config of a VLM)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = 1.0
        if getattr(text, "logits_scaling", None):  # Granite: logits / logits_scaling
            scale /= float(text.logits_scaling)
        if getattr(text, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
            scale *= float(text.logit_scale)
        softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3
        return cls(scale=scale, softcap=float(softcap) if softcap else None)

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 raw logits -> fp32 logits."""
        out = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def apply_(self, raw: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` in place on ``raw`` (a temporary the caller owns); returns ``raw``."""
        if self.scale != 1.0:
            raw.mul_(self.scale)
        if self.softcap is not None:
            raw.div_(self.softcap).tanh_().mul_(self.softcap)
        return raw

    def softcap_grad_(self, logits: torch.Tensor) -> torch.Tensor:
        """d softcap(x) / d x at the softcapped ``logits`` (``1 - tanh^2``), written over them; the whole
        d logits / d raw is this times :attr:`scale`. Only with a softcap."""
        assert self.softcap is not None
        return logits.div_(self.softcap).square_().neg_().add_(1.0)


def _chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


def _accumulate_weight_grad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += grad^T @ h`` with a transient no larger than half the chunk's ``grad``.

    acc [V, h] fp32; grad [c, V], h [c, h] in the compute dtype. In fp32 the product goes straight into the
    accumulator. Otherwise it is made in blocks of vocabulary rows, each added to the fp32 accumulator in place
    (the reduction over tokens is the same, so the sums are those of one [V, h] product), so that the
    product never costs a [V, h] tensor in the compute dtype and its fp32 copy (a vocabulary of 152K and a
    hidden size of 2560 would make those 2.3 GB).
    """
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h)
        return
    rows = max(1, grad.numel() // (2 * max(1, h.shape[1])))  # block [rows, h] <= half of grad's elements
    for v0 in range(0, acc.shape[0], rows):
        acc[v0 : v0 + rows] += grad[:, v0 : v0 + rows].t() @ h


class _TiledHeadLoss(torch.autograd.Function):
    """sum over valid tokens of CE(head(hidden @ W^T + b), target); see :func:`tiled_cross_entropy_sum`."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk, head, ignore_index, compute_dtype):  # type: ignore[override]
        # hidden [T, h]; weight [V, h]; bias [V] or None; targets [T]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start, end in _chunks(hidden.shape[0], chunk):
                logits = head.apply_(F.linear(hidden[start:end].to(compute_dtype), w, b).float())  # [c, V]
                target = targets[start:end]
                valid = target != ignore_index
                picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)  # [c]
                total += torch.where(valid, torch.logsumexp(logits, dim=1) - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk, ctx.head, ctx.ignore_index, ctx.compute_dtype = chunk, head, ignore_index, compute_dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, bias, targets = ctx.saved_tensors
        head, dtype = ctx.head, ctx.compute_dtype
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_hidden = torch.empty_like(hidden) if needs_hidden else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
            grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
            scale = grad_total.float()
            for start, end in _chunks(hidden.shape[0], ctx.chunk):
                h = hidden[start:end].to(dtype)  # [c, h]
                logits = head.apply_(F.linear(h, w, b).float())  # [c, V] fp32
                target = targets[start:end]
                valid = (target != ctx.ignore_index).unsqueeze(1)  # [c, 1]
                grad = torch.softmax(logits, dim=1)  # d CE / d logits = softmax - onehot(target)
                grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
                if head.softcap is not None:
                    grad.mul_(head.softcap_grad_(logits))  # the logits are overwritten
                del logits
                grad = grad.mul_(valid * (scale * head.scale)).to(dtype)  # d loss / d raw [c, V]
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad @ w
                if grad_weight is not None:
                    _accumulate_weight_grad(grad_weight, grad, h)
                if grad_bias is not None:
                    grad_bias += grad.sum(0, dtype=torch.float32)
                del grad  # before the next chunk's logits exist
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def tiled_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    head: LogitsHead | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum over valid targets of ``cross_entropy(head(hidden @ weight^T + bias), target)``, in chunks.

    Args:
        hidden: ``[..., h]`` final hidden states (after the model's last norm).
        weight: ``[V, h]`` the output embedding (``lm_head.weight``); ``bias``: ``[V]`` or None.
        targets: ``[...]`` target ids, already shifted (``shift_labels``); ``ignore_index`` = no target.
        head: scaling / soft-capping applied to the logits (default: none).
        chunk_tokens: tokens per chunk (default: :func:`loss_chunk_tokens` for a 1 GiB budget).

    Returns an fp32 scalar. Under autocast the matmuls run in the autocast dtype (as ``lm_head`` would).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; expected hidden "
            "[..., hidden_size] for targets [...]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    chunk = chunk_tokens if chunk_tokens is not None else loss_chunk_tokens(weight.shape[0])
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
    flat_targets = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)  # [T]
    dtype = _compute_dtype(hidden, weight)
    return _TiledHeadLoss.apply(
        flat_hidden, weight, bias, flat_targets, chunk, head or LogitsHead(), ignore_index, dtype
    )


# --------------------------------------------------------------------------------------------- the model side
_STATE_ATTR = "_ulysses_tiled_loss"
_PROBE_TOKENS = 4


@dataclass
class _TiledLossState:
    original_forward: object  # the forward the instance had: the class's, or a wrapper set on the instance
    head: LogitsHead
    chunk_tokens: int | None
    budget_bytes: int
    verified: bool = False
    instance_forward: object = None  # ``forward`` in the instance's __dict__ before enabling (restored after)


def _find_causal_lm(model: nn.Module) -> nn.Module:
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    raise TypeError(
        f"enable_tiled_loss expects a transformers causal LM with an output embedding (lm_head), or a wrapper "
        f"around one (PEFT, DDP); got {type(model).__name__}"
    )


def tiled_loss_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable_tiled_loss` is in effect on ``model`` (or the causal LM inside it)."""
    try:
        return getattr(_find_causal_lm(model), _STATE_ATTR, None) is not None
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
    output embedding is not a plain ``nn.Linear`` (e.g. LoRA on lm_head) or the model is already tiled; the
    first forward raises ValueError if the model post-processes logits in a way the tiled head cannot copy.
    """
    causal_lm = _find_causal_lm(model)
    if getattr(causal_lm, _STATE_ATTR, None) is not None:
        raise ValueError("the tiled loss is already enabled on this model; call disable_tiled_loss(model) first")
    output = causal_lm.get_output_embeddings()
    if not isinstance(output, nn.Linear) or type(output).forward is not nn.Linear.forward:
        raise ValueError(
            f"the tiled loss needs the output embedding to be a plain torch.nn.Linear, but "
            f"{type(causal_lm).__name__}'s is {type(output).__name__} (e.g. LoRA on lm_head); leave lm_head out "
            "of the adapters or disable the tiled loss"
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
    )
    setattr(causal_lm, _STATE_ATTR, state)
    causal_lm.forward = types.MethodType(_tiled_forward, causal_lm)
    return model


def disable_tiled_loss(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_loss`: the model's own forward and loss again."""
    causal_lm = _find_causal_lm(model)
    if getattr(causal_lm, _STATE_ATTR, None) is None:
        return model
    state: _TiledLossState = getattr(causal_lm, _STATE_ATTR)
    if state.instance_forward is not None:  # e.g. Accelerate's autocast wrapper, installed before enabling
        causal_lm.forward = state.instance_forward
    else:
        del causal_lm.forward  # the instance attribute; the class's forward shows through again
    delattr(causal_lm, _STATE_ATTR)
    return model


@contextlib.contextmanager
def _decoder_returning(causal_lm: nn.Module, hidden: torch.Tensor) -> Iterator[None]:
    """Temporarily replace the decoder by a module that returns ``hidden`` as its last hidden state.

    The output is the MoE variant (``router_logits=None`` besides the dense fields): MoE causal LMs read it
    from their decoder's output even when no router logits were asked for.
    """
    from transformers.modeling_outputs import MoeModelOutputWithPast

    class _Fixed(nn.Module):
        def forward(self, *args, **kwargs):
            return MoeModelOutputWithPast(last_hidden_state=hidden)

    prefix = causal_lm.base_model_prefix
    decoder = getattr(causal_lm, prefix)
    setattr(causal_lm, prefix, _Fixed())
    try:
        yield
    finally:
        setattr(causal_lm, prefix, decoder)


def _verify_head(causal_lm: nn.Module, state: _TiledLossState, like: torch.Tensor) -> None:
    """Push a few random hidden states through the model's own forward and compare with the tiled head."""
    output = causal_lm.get_output_embeddings()
    generator = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(1, _PROBE_TOKENS, like.shape[-1], generator=generator).to(like.device, like.dtype)
    ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device=like.device)
    with torch.no_grad(), torch.autocast(like.device.type, enabled=False), _decoder_returning(causal_lm, probe):
        theirs = state.original_forward(input_ids=ids, use_cache=False).logits
        ours = state.head.apply(output(probe).float())  # the module call: FSDP2 gathers a sharded lm_head
    # fp32: the same arithmetic; 16-bit: the model post-processes in 16 bits, the tiled head in fp32
    tol = 1e-3 if like.dtype == torch.float32 else 3e-2
    close = theirs is not None and theirs.shape == ours.shape
    if not close or not torch.allclose(theirs.float(), ours, rtol=tol, atol=tol * float(ours.abs().max())):
        got = "no logits" if theirs is None else f"logits {tuple(theirs.shape)}"
        raise ValueError(
            f"the tiled loss cannot reproduce {type(causal_lm).__name__}'s logits (its forward post-processes them "
            f"in a way the tiled head {state.head} does not: {got} vs {tuple(ours.shape)}); disable the tiled loss "
            "for this model (tiled_loss=False / --no-tiled-loss)"
        )
    state.verified = True


def _head_loss(output: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    """The tiled loss computed INSIDE a call of the lm_head module, so that whatever wraps that module sees
    a normal call: FSDP2 (when lm_head is its own FSDP unit) gathers the weight before and registers its
    gradient hooks after, exactly as for ``lm_head(hidden)``."""

    def forward(module: nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
        return tiled_cross_entropy_sum(hidden_states, module.weight, targets, bias=module.bias, **kwargs)

    output.forward = types.MethodType(forward, output)
    try:
        return output(hidden)
    finally:
        del output.forward


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
    from transformers.modeling_outputs import CausalLMOutputWithPast

    state: _TiledLossState = getattr(self, _STATE_ATTR)
    shift_labels = kwargs.pop("shift_labels", None)
    wants_loss = labels is not None or shift_labels is not None
    if not wants_loss or not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
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
    router = kwargs.get("output_router_logits")
    if router or (router is None and getattr(self.config, "output_router_logits", False)):
        raise ValueError(
            "output_router_logits=True: the tiled loss returns the cross-entropy only and would drop the MoE "
            "load-balancing loss; set model.config.output_router_logits = False, or call disable_tiled_loss(model) "
            "to use the model's own loss"
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
    if not state.verified:
        _verify_head(self, state, hidden)
    targets = _shifted_targets(labels, shift_labels, ignore_index).to(hidden.device)
    output = self.get_output_embeddings()
    chunk = state.chunk_tokens or loss_chunk_tokens(output.weight.shape[0], state.budget_bytes)
    total = _head_loss(output, hidden, targets, head=state.head, chunk_tokens=chunk, ignore_index=ignore_index)
    if num_items is not None:
        loss = total / torch.as_tensor(num_items, device=total.device)
    else:
        loss = total / (targets != ignore_index).sum().clamp(min=1)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
