"""Tiled MLP: each decoder layer's MLP runs over chunks of the sequence and keeps only its input for backward.

Why: at long sequences the MLP's intermediate activations dominate a layer's memory. A SwiGLU MLP keeps
about ``4 I`` values per token for backward (gate and up projections, the activation, their product) next
to the ``h`` values of its input, and its forward holds ``[b, n, I]`` tensors all at once. Tiled, the MLP
keeps only its input ``[b, n, h]``; forward and backward each hold the intermediates of ONE chunk of
``c`` tokens (``[b, c, I]``), whatever ``n`` is. Cost: one extra MLP forward per step.

How: :func:`enable_tiled_mlp` sets each MLP module's ``forward`` to a :class:`TiledMLP` (an instance
attribute, which ``nn.Module.__call__`` finds before the class's method). The module itself stays where it
was, so the module tree, parameter names, ``state_dict`` keys, module hooks, FSDP2 / DDP wrapping and PEFT
adapters inside the MLP are all untouched; :func:`disable_tiled_mlp` removes the attribute again.
:class:`TiledMLP` calls a custom autograd Function whose forward runs the chunks under ``no_grad`` into one
output buffer and saves only the input; its backward recomputes each chunk with grad enabled (same
autocast state and RNG state as the forward) and backpropagates it at once, writing the input gradient
into one buffer and summing the parameter gradients over the chunks (in fp32 for bf16/fp16 parameters).
A gated MLP's chunk is back-propagated by hand in row blocks (:mod:`ulysses_sp.gated_tile`: about one
``[b, c, I]`` tensor where autograd's backward of the chunk held six); other modules keep autograd's.
Each parameter is an input of the Function, so autograd sees ONE gradient per parameter per backward:
DDP's "mark a variable ready only once" and FSDP2's reduce-scatter see exactly what an untiled MLP gives.

Chunks: ``chunk_tokens`` tokens along the sequence (dim -2 of the MLP input); by default
:func:`default_chunk_tokens` ``= max(1024, hidden_size)``: a chunk's intermediate ``c x I`` is then about
one MLP weight matrix (the size of the fp32 gradient buffers the step holds anyway), and matmuls keep at
least 1024 rows. No collective runs per chunk (FSDP2 unshards a whole decoder layer around it), so ranks
with different sequence lengths, hence different numbers of chunks, cannot deadlock.

Mixture-of-experts blocks that route each token on its own and return a tensor (Mixtral, Qwen3-MoE in
transformers 5) are tiled exactly; their router logits for the load-balancing loss (``output_router_logits``)
are recorded whole and with gradient by :mod:`ulysses_sp.tiled_router`. Refused with a ValueError: blocks that
return anything but a tensor or change their input in place (Mixtral's ``router_jitter_noise`` in training).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .compile_boundary import TILED_OFF, run_eagerly
from .gated_tile import GatedChunk, gated_chunk
from .grad_sums import GradSums
from .hf import find_pretrained, mlp_modules, text_config
from .instance_forward import install_forward, installed_forward, restore_forward
from .replay import Replay
from .tiled_facts import ForwardFacts, facts_key, forward_facts, runs_foreign_code
from .tiled_op import apply_tiled, new_handle

__all__ = [
    "TiledForward",
    "TiledMLP",
    "check_chunk_tokens",
    "compute_dtype",
    "default_chunk_tokens",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
]

MIN_CHUNK_TOKENS = 1024


def default_chunk_tokens(hidden_size: int) -> int:
    """Tokens per chunk when none is given: ``max(1024, hidden_size)`` (see the module docstring)."""
    return max(MIN_CHUNK_TOKENS, hidden_size)


# How to turn each off, named in the errors (the library call, the integrations' argument, train's flag).
MLP_OFF = (
    "call ulysses_sp.disable_tiled_mlp(model) (UlyssesTrainer(sp_tiled_mlp=False), "
    "SequenceParallelConfig(tiled_mlp=False), or ulysses-sp train --no-tiled-mlp)"
)
NORMS_OFF = (
    "call ulysses_sp.disable_tiled_norms(model) (UlyssesTrainer(sp_tiled_norms=False), "
    "SequenceParallelConfig(tiled_norms=False), or ulysses-sp train --no-tiled-norms)"
)


def check_chunk_tokens(chunk_tokens: Any) -> None:
    """ValueError unless ``chunk_tokens`` is a positive int or None."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype work on ``x`` computes in here: autocast's where it is on for ``x``'s device, else ``x``'s own."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _spans(length: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, length - start)) for start in range(0, length, chunk)]


class _TiledFunction(torch.autograd.Function):
    """``out = tiled(x)`` chunk by chunk; saves only ``x``; backward recomputes chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, tiled: TiledForward, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.tiled = tiled
        ctx.replay = Replay(x.device)
        ctx.save_for_backward(x)
        return tiled.run_chunks(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        need_x, need_params = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        params = ctx.tiled.trainable_parameters()
        grad_x, param_grads = backward_chunks(ctx.tiled, x, grad_out, ctx.replay, need_x, need_params, params)
        return (None, grad_x, *param_grads)


def backward_chunks(
    tiled: TiledForward,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    replay: Replay,
    need_x: bool,
    need_params: tuple[bool, ...],
    params: list[torch.Tensor],
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The gradients of ``x`` (if ``need_x``) and of each of ``params`` (``tiled``'s trainable parameters, or
    :meth:`TiledForward.compiled_parameters`; where ``need_params`` says) of ``tiled`` over ``x [..., n, h]``, chunk
    by chunk, its forward recomputed under ``replay``."""
    if len(params) != len(need_params):
        raise RuntimeError(
            f"{type(tiled.module).__name__} had {len(need_params)} trainable parameters in forward and "
            f"{len(params)} in backward; do not change requires_grad between forward and backward"
        )
    wanted = [p for p, need in zip(params, need_params, strict=True) if need]
    spans = _spans(x.shape[-2], tiled.chunk_size(x))
    grad_x = torch.empty_like(x) if need_x and len(spans) > 1 else None
    by_hand = tiled.chunk_backward() if x.numel() else None
    sums = GradSums(wanted, wide=len(spans) > 1 or by_hand is not None)  # by hand: summed over row blocks
    pre = [p for p in wanted if any(p is q for q in tiled.pre_parameters())]  # the fused norm's, by hand
    with replay(), torch.enable_grad(), sums:
        for start, length in spans:
            chunk = x.narrow(-2, start, length).detach().contiguous().requires_grad_(need_x)  # [b, c, h]
            grad_part = grad_out.narrow(-2, start, length)
            if by_hand is not None:
                grads = [by_hand.backward(chunk, grad_part, sums, need_x, tiled.pre_forward, pre)]
            else:
                out = tiled.call_module(chunk)
                inputs = ([chunk] if need_x else []) + wanted
                grads = torch.autograd.grad(out, inputs, grad_part, allow_unused=True)
            sums.check_chunk()
            if need_x:
                grad_chunk = grads[0] if grads[0] is not None else torch.zeros_like(chunk)
                if grad_x is None:
                    grad_x = grad_chunk
                else:
                    grad_x.narrow(-2, start, length).copy_(grad_chunk)
            chunk = out = grads = grad_chunk = None  # freed before the next chunk's: [b, c, h] each
    cast = sums.cast()
    return grad_x, [next(cast) if need else None for need in need_params]


class TiledForward:
    """The ``forward`` installed on one token-wise module: the module over chunks of tokens, keeping only its input.

    Args:
        module: the module (an MLP, a MoE block, a norm, ... possibly holding PEFT adapters).
        chunk_tokens: tokens per chunk along dim -2, or None for :func:`default_chunk_tokens`.
        previous: the module's own instance-level ``forward`` if it had one (e.g. a hook of another
            library), called per chunk and restored when tiling is turned off.
        hidden_size: the size of the input's last dim (the model's hidden size), to probe the forward with for
            what a compiled graph must know of it (:mod:`ulysses_sp.tiled_facts`); None: nothing is known.
        facts_cache: the probes' answers by :func:`~ulysses_sp.tiled_facts.facts_key`, shared by the modules of one
            enable call (alike layers are probed once; unfusing a norm finds the module's own answer again).

    ``pre`` / ``pre_forward`` (None unless :mod:`ulysses_sp.tiled_norms` fuses a norm in): a token-wise module
    run on each chunk first, so the module computes ``module(pre(chunk))`` and ``pre``'s output is never held
    whole. Called with one tensor ``[..., n, h]``; returns ``[..., n, h_out]``.
    """

    hint = MLP_OFF  # how to turn it off, named in errors
    called_as = "module(hidden_states [b, n, h])"  # the one call it accepts, named in errors

    def __init__(
        self,
        module: nn.Module,
        chunk_tokens: int | None,
        previous: Callable | None = None,
        hidden_size: int | None = None,
        facts_cache: dict[tuple, ForwardFacts] | None = None,
    ) -> None:
        self.module = module
        self.chunk_tokens = chunk_tokens
        self.previous = previous
        self.hidden_size = hidden_size
        self.pre: nn.Module | None = None
        self.pre_forward: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.handed_over: Callable[[], torch.Tensor | None] | None = None  # weakref to what ``pre`` returned
        self.pre_previous: Callable | None = None  # ``pre``'s instance forward of another library, if any
        self.handle = new_handle(self)  # what the compiled graph's operators run (:mod:`ulysses_sp.tiled_op`)
        self.facts_cache = {} if facts_cache is None else facts_cache
        self.facts = self.probe()

    def probe(self) -> ForwardFacts:
        """What the compiled graph's operators must know of this forward: none where they are unavailable or where
        the forward runs another library's code (:mod:`ulysses_sp.tiled_facts`)."""
        modules = [self.module] + ([self.pre] if self.pre is not None else [])
        if self.handle is None or self.previous is not None or self.pre_previous is not None:
            return ForwardFacts()
        if runs_foreign_code(modules):
            return ForwardFacts()
        key = facts_key(modules, self.hidden_size)
        if key not in self.facts_cache:
            self.facts_cache[key] = forward_facts(self.module, self.call_module, self.hidden_size, self.pre)
        return self.facts_cache[key]

    def fuse(self, pre: nn.Module | None, previous: Callable | None = None) -> None:
        """Run ``pre`` on each chunk first (by ``previous``, its instance forward of another library, if it had
        one); None: no longer."""
        self.pre, self.pre_previous, self.handed_over = pre, previous, None
        own = functools.partial(type(pre).forward, pre) if pre is not None else None
        self.pre_forward = previous if previous is not None else own
        self.facts = self.probe()

    def __setstate__(self, state: dict[str, Any]) -> None:  # a deep copy or unpickled one: a key of its own
        self.__dict__.update(state)
        self.handle = new_handle(self)

    def chunk_size(self, x: torch.Tensor) -> int:
        return self.chunk_tokens if self.chunk_tokens is not None else default_chunk_tokens(x.shape[-1])

    def call_module(self, chunk: torch.Tensor) -> torch.Tensor:
        """The original forward on one chunk (``[..., c, h]``), after the fused ``pre`` module if any."""
        if self.pre_forward is not None:
            chunk = self.pre_forward(chunk)
        if self.previous is not None:
            return self.previous(chunk)
        return type(self.module).forward(self.module, chunk)

    def chunk_backward(self) -> GatedChunk | None:
        """The hand-written backward of one chunk, where this module has one (None: autograd's)."""
        return None

    def trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad] + self.pre_parameters()

    def compiled_parameters(self) -> list[torch.Tensor]:
        """The trainable parameters the compiled operators take: those the forward reaches (eagerly the others'
        gradient is None, under the operators it would be zero)."""
        unused = self.facts.unused
        own = [p for name, p in self.module.named_parameters() if p.requires_grad and name not in unused]
        return own + self.pre_parameters()

    def pre_parameters(self) -> list[torch.Tensor]:
        """The trainable parameters of the fused ``pre`` module (none without one)."""
        return [p for p in self.pre.parameters() if p.requires_grad] if self.pre is not None else []

    def run_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """The module over ``x [..., n, h]`` one chunk at a time, into one ``[..., n, h_out]`` buffer."""
        name = type(self.module).__name__
        out: torch.Tensor | None = None
        version = None if x.is_inference() else x._version  # an inference tensor has none (nothing to recompute)
        for start, length in _spans(x.shape[-2], self.chunk_size(x)):
            chunk = x.narrow(-2, start, length).contiguous()  # [b, c, h]; a copy when b > 1
            result = self.call_module(chunk)
            if not isinstance(result, torch.Tensor):
                raise ValueError(
                    f"{name}.forward returns {type(result).__name__}, not a tensor (e.g. router logits for an "
                    f"auxiliary loss), which tiling would split and detach; {self.hint}"
                )
            if result.shape[:-1] != chunk.shape[:-1]:
                raise ValueError(
                    f"{name} maps {tuple(chunk.shape)} to {tuple(result.shape)}: not token by token, so it cannot "
                    f"be tiled along the sequence; {self.hint}"
                )
            if version is not None and x._version != version:
                raise ValueError(
                    f"{name}.forward modifies its input in place (e.g. router_jitter_noise > 0 in training), "
                    f"which tiling cannot recompute; turn that off or {self.hint}"
                )
            if length == x.shape[-2]:
                return result
            if out is None:
                out = result.new_empty(*x.shape[:-1], result.shape[-1])
            out.narrow(-2, start, length).copy_(result)
        assert out is not None, "an empty sequence has no chunks"
        return out

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.compiles():
            return self.eager_call(hidden_states, *args, **kwargs)
        self.check_call(hidden_states, args, kwargs)
        return apply_tiled(self, hidden_states) if hidden_states.shape[-2] else self.call_module(hidden_states)

    def compiles(self) -> bool:
        """Whether this call is traced by dynamo and runs as the compiled graph's operators (else: eagerly)."""
        return self.handle is not None and torch.compiler.is_compiling()

    def check_call(self, hidden_states: Any, args: tuple, kwargs: dict) -> None:
        if args or kwargs or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
            raise ValueError(
                f"tiled {type(self.module).__name__} expects to be called as {self.called_as}; got "
                f"{len(args)} more positional and {sorted(kwargs)} keyword arguments; {self.hint} for this model"
            )

    @run_eagerly("runs the tiled MLP and norms eagerly (their chunks are recomputed in backward by hand)", TILED_OFF)
    def eager_call(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.check_call(hidden_states, args, kwargs)
        if hidden_states.shape[-2] == 0:
            return self.call_module(hidden_states)
        params = self.trainable_parameters()
        if not torch.is_grad_enabled() or not (hidden_states.requires_grad or params):
            with torch.no_grad():
                return self.run_chunks(hidden_states)
        return _TiledFunction.apply(self, hidden_states, *params)


class TiledMLP(TiledForward):
    """The ``forward`` that :func:`enable_tiled_mlp` installs on one MLP module (see :class:`TiledForward`).

    Called as ``mlp(hidden_states)`` with ``hidden_states [..., n, h]``; returns ``[..., n, h_out]``.
    """

    called_as = "mlp(hidden_states [b, n, h])"

    probed: tuple | None = None  # what gated_chunk found for this MLP, and for which of its structures
    recorders: dict = {}  # noqa: RUF012 (never mutated) the model's _can_record_outputs (ulysses_sp.tiled_router)
    config: Any = None  # the model's text config: output_router_logits

    def chunk_backward(self) -> GatedChunk | None:
        """A gated MLP's chunks back-propagated by hand in fewer ``[c, I]`` tensors (:mod:`ulysses_sp.gated_tile`)."""
        chunk, self.probed = gated_chunk(self.module, self.previous is not None, self.probed)
        return chunk

    def compiles(self) -> bool:
        """As :meth:`TiledForward.compiles`, but not for a block whose router logits are recorded (eagerly)."""
        routed = getattr(self.config, "output_router_logits", False) or any("router" in k for k in self.recorders)
        return not routed and super().compiles()

    @run_eagerly("runs the tiled MLP and norms eagerly (their chunks are recomputed in backward by hand)", TILED_OFF)
    def eager_call(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pre is not None:  # a norm fused in: it returned its input, which must be what arrives here
            handed = self.handed_over() if self.handed_over is not None else None
            self.handed_over = None
            if hidden_states is not handed:
                raise ValueError(
                    f"{type(self.pre).__name__} is fused into the tiled {type(self.module).__name__}, but the MLP "
                    "received something other than that norm's output: this decoder layer is not a pre-norm block "
                    f"whose norm feeds only its MLP; {NORMS_OFF}"
                )
        from .tiled_router import record_router_logits, router_collection

        collected = router_collection()  # router logits for the load-balancing loss: recorded whole, with grad
        routed = bool(getattr(self.config, "output_router_logits", False))
        if collected is not None and not routed:
            raise ValueError(
                "router logits are collected (output_router_logits=True passed to forward) while the config has "
                "output_router_logits=False: the tiled MLP reads the config, so that activation checkpointing "
                "recomputes what the forward ran; set model.config.output_router_logits = True instead"
            )
        before = {key: len(entries) for key, entries in (collected or {}).items()}
        out = super().eager_call(hidden_states, *args, **kwargs)
        if routed:
            record_router_logits(self, hidden_states, collected, before)
        return out


def _installed(module: nn.Module) -> TiledMLP | None:
    forward = installed_forward(module)
    return forward if isinstance(forward, TiledMLP) else None


def enable_tiled_mlp(model: nn.Module, *, chunk_tokens: int | None = None) -> nn.Module:
    """Tile the MLP of every decoder layer of ``model`` along the sequence (in place; returns ``model``).

    Args:
        model: a transformers causal LM or a wrapper around one (PEFT, DDP, ...); FSDP2 ``fully_shard``
            may come before or after.
        chunk_tokens: tokens per chunk, or None for ``max(1024, hidden_size)``.

    Loss and gradients equal the untiled model's (up to fp32 rounding of the summed chunk gradients).
    Raises ValueError if the model is already tiled, has no recognisable MLP, or ``chunk_tokens`` is not a
    positive int.
    """
    check_chunk_tokens(chunk_tokens)
    pretrained = find_pretrained(model, "enable_tiled_mlp")
    mlps = mlp_modules(pretrained)
    if any(_installed(m) is not None for m in mlps):
        raise ValueError("the MLPs of this model are already tiled; call ulysses_sp.disable_tiled_mlp(model) first")
    config = text_config(pretrained)
    facts_cache: dict[tuple, ForwardFacts] = {}  # alike MLPs (and MLP + norm pairs, once fused) probed once
    for mlp in mlps:
        tiled = TiledMLP(mlp, chunk_tokens, installed_forward(mlp), getattr(config, "hidden_size", None), facts_cache)
        tiled.recorders = dict(getattr(pretrained, "_can_record_outputs", None) or {})
        tiled.config = config
        install_forward(mlp, tiled)
    return model


def disable_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_mlp`: every MLP gets its own forward back (a no-op on an untiled model).

    Raises ValueError, changing nothing, while :func:`ulysses_sp.enable_tiled_norms` has a norm fused into one.
    """
    pretrained = find_pretrained(model, "disable_tiled_mlp")
    installed = [(m, t) for m in pretrained.modules() if (t := _installed(m)) is not None]
    if any(tiled.pre is not None for _, tiled in installed):
        raise ValueError(
            "a norm is fused into the tiled MLPs of this model; call ulysses_sp.disable_tiled_norms(model) before "
            "ulysses_sp.disable_tiled_mlp(model)"
        )
    for module, tiled in installed:
        restore_forward(module, tiled.previous)
    return model
