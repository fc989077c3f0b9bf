"""Head-chunked ("untied") Ulysses attention: an attention layer runs its heads in C chunks.

Why: at long sequences the attention block's working set after the exchange (q/k/v of H/P heads over the whole
sequence, the exchange buffers, the core's output and gradients) is one of the largest tensors of a step. In C
chunks of heads it exists for one or two chunks at a time (Untied Ulysses, arXiv 2602.21196).

How: :func:`ulysses_sp.parallelize` sets each attention module's ``forward`` to a :class:`HeadChunkedAttention`
(an instance attribute, like the tiled MLP; :func:`ulysses_sp.unparallelize` removes it, the module tree and
``state_dict`` stay as they were). For one chunk it runs the module's OWN forward with its q/k/v projections
sliced to the chunk's heads, up to the call of the attention function, where it takes q/k/v (so per-head q/k
norms, RoPE variants, scaling and windows are the model's own code); the exchange, core and output projection
are :mod:`ulysses_sp.head_chunk_pipeline`'s. Each rank's heads go to chunks in order (a chunk's heads are strided
over the ranks, :class:`~ulysses_sp.head_split.ChunkHeads`); a chunk holds whole kv groups, or part of the query
heads that read one kv head, so every chunk is a smaller attention of the same kind.

Which modules: children ``q_proj`` (or ``q_b_proj``), ``k_proj`` + ``v_proj`` (or ``kv_b_proj``, MLA) and
``o_proj``, all plain ``nn.Linear`` (or PEFT LoRA layers around one: :mod:`ulysses_sp.head_chunk_lora`) whose rows
split by heads (:func:`split_problem`). On its first chunked call
a module is probed: its own forward and the chunked one run on a few random tokens with one local core, and
must agree (:meth:`HeadChunkedAttention.verify`). A module that fails either check is refused with a ValueError
when C > 1 was asked for, and keeps the unchunked path when C is automatic.

C: ``head_chunks`` of :func:`ulysses_sp.parallelize` (``--head-chunks``); None or 0 = automatic: the fewest
chunks whose q/k/v after the exchange fit ``budget_bytes`` per rank, else the planner's lowest attention peak in the
decoder layer as it runs (:func:`ulysses_sp.plan.attention.choose_head_chunks`, which the planner calls too, given
the layer by :mod:`ulysses_sp.head_chunk_choice`); 1 = the unchunked path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .attention import UlyssesAttention, intercepting
from .compile_boundary import run_eagerly
from .deferred_input import Absent, NormRemake
from .grad_sums import cast
from .head_chunk_choice import LayerSlot, layer_memory
from .head_chunk_fit import Projections, norm_problem, projection_names
from .head_chunk_grads import ProjectionCut
from .head_chunk_lora import (
    Adapter,
    InputLows,
    active_adapters,
    as_in_forward,
    base_linear,
    call_problem,
    is_lora,
    lora_linear,
    lora_problem,
)
from .head_chunk_parts import Blank
from .head_chunk_pipeline import ChunkRun, placer
from .head_chunk_probe import probe_problem
from .head_split import (
    DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
    ChunkHeads,
    check_head_chunks,
    head_chunk_choices,
)
from .hf import decoder_layers, first_argument
from .instance_forward import install_forward, installed_forward, restore_forward
from .norm_projections import NormProjection
from .plan.attention import choose_head_chunks
from .replay import Replay
from .tiling import compute_dtype

__all__ = [
    "HeadChunkedAttention",
    "HeadChunkedFunction",
    "Projections",
    "head_chunk_targets",
    "install_head_chunks",
    "remove_head_chunks",
    "split_problem",
]


# ---------------------------------------------------------------------------------------------- which modules
def split_problem(module: nn.Module, num_heads: int, num_kv_heads: int) -> str | None:
    """Why ``module`` cannot run in head chunks (None: it may; its first chunked call still probes it)."""
    if "forward" in module.__dict__:
        return "its forward is already replaced on the instance (by another library)"
    if getattr(module, "store_full_length_kv", False):  # transformers' KV sharing (Gemma3n, Gemma-4)
        return "it stores its k/v for later layers to reuse (KV sharing), which would get one chunk's kv heads only"
    names = projection_names(module)
    if isinstance(names, str):
        return names
    if (problem := norm_problem(module)) is not None:
        return problem
    for name in (*names.query, *names.kv, names.out):
        wrapper = module._modules[name]
        if is_lora(wrapper):
            problem = lora_problem(wrapper)
            if problem is not None:
                return f"{name}: {problem}"
        child = base_linear(wrapper)
        if not isinstance(child, nn.Linear) or type(child).forward is not nn.Linear.forward:
            kind = f"{type(child).__module__}.{type(child).__qualname__}"  # (PEFT's IA3 layer is a "Linear" too)
            return f"{name} is a {kind}, not a plain torch.nn.Linear or a LoRA layer around one"
        if any(m._forward_hooks or m._forward_pre_hooks for m in {wrapper, child}):
            return f"{name} has forward hooks, which a sliced projection would skip"
        heads = num_heads if name in names.query or name == names.out else num_kv_heads
        size = child.in_features if name == names.out else child.out_features
        if size % heads:
            return f"{name} has {size} {'inputs' if name == names.out else 'outputs'}, not a multiple of {heads} heads"
    return None


def head_chunk_targets(
    modules: list[nn.Module], num_heads: int, num_kv_heads: int, ulysses: int, requested: int | None
) -> list[tuple[nn.Module, Projections]]:
    """The attention modules to run in head chunks (checks only, nothing changed). ``requested`` > 1: every
    module must split (ValueError naming the one that does not); None / 0 (automatic): those that can; 1: none."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 0):
        raise ValueError(f"head_chunks must be None or an int >= 0 (0 / None: automatic), got {requested!r}")
    check_head_chunks(requested, num_heads, num_kv_heads, ulysses)
    if requested == 1 or head_chunk_choices(num_heads, num_kv_heads, ulysses) == [1]:
        return []
    targets = []
    for module in modules:
        problem = split_problem(module, num_heads, num_kv_heads)
        if problem is None:
            targets.append((module, projection_names(module)))
        elif requested:
            raise ValueError(
                f"{type(module).__name__} cannot run its heads in chunks: {problem}; use head_chunks=1 "
                "(--head-chunks 1) or leave it automatic (0 / None)"
            )
    return targets


def install_head_chunks(targets: list[tuple[nn.Module, Projections]], ctx: UlyssesAttention, **options: Any) -> None:
    """Set each target's ``forward`` to a :class:`HeadChunkedAttention` (``options``: its keyword arguments but the
    decoder layer it is in and the count of layers whose attention runs in chunks, found here; a model's other
    ``_no_split_modules`` blocks, Qwen2-VL's vision blocks, are not counted: the planner counts its text layers)."""
    pretrained = options["pretrained"]
    found = {id(module): layer for layer in decoder_layers(pretrained) for module in layer.modules()}
    layers = max(len({id(found[id(module)]) for module, _ in targets if id(module) in found}), 1)
    for module, names in targets:
        layer = found.get(id(module))
        slot = None if layer is None else LayerSlot.find(pretrained, layer)
        install_forward(module, HeadChunkedAttention(module, ctx, names, layer=slot, layers=layers, **options))


def remove_head_chunks(modules: list[nn.Module]) -> None:
    """Undo :func:`install_head_chunks` (modules without one are left as they are)."""
    for module in modules:
        if isinstance(installed_forward(module), HeadChunkedAttention):
            restore_forward(module, None)


# ---------------------------------------------------------------------------------------------- the forward
class _Stop(Exception):
    """Raised inside the module's own forward at its attention call (which :meth:`capture` has recorded)."""


@dataclass
class Captured:
    """The arguments of one attention call: q/k/v, the mask and the keyword arguments."""

    qkv: tuple[torch.Tensor, ...]
    mask: Any
    kwargs: dict[str, Any]


class _Slice:
    """A projection's chunk (weight and bias views), standing in for the ``nn.Linear`` during one capture;
    ``blank``: one the capture does not compute (zeros, see :class:`~ulysses_sp.head_chunk_parts.Blank`)."""

    def __init__(
        self,
        name: str,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        cut: ProjectionCut | None,
        blank: Blank | None = None,
        adapters: tuple[Adapter, ...] = (),
        inputs: InputLows | None = None,
    ) -> None:
        self.name, self.weight, self.bias, self.cut, self.blank = name, weight, bias, cut, blank
        # LoRA (head_chunk_lora): the adapters with B's rows of the chunk; what their input makes once per call
        self.adapters, self.inputs = adapters, inputs
        self.out_features, self.in_features = (blank.rows, weight.shape[1]) if blank else weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blank is not None:
            return self.blank(x, self.weight)
        lows = None
        if self.adapters and self.inputs is not None and x is self.inputs.x:  # the block's input: made once
            lows = [self.inputs.low(self.name, i, adapter) for i, adapter in enumerate(self.adapters)]
        if self.cut is None or x is not self.cut.x:
            return lora_linear(x, self.weight, self.bias, self.adapters, lows=lows)
        # without a graph, under autocast still (the same casts as the forward's)
        return self.cut.tap(self.name, self.cut.project(self.weight, self.bias, self.adapters, lows))


class HeadChunkedAttention:
    """The ``forward`` installed on one attention module (see the module docstring).

    Args:
        module: the attention module; ctx: its model's :class:`UlyssesAttention`; names: its projections.
        pretrained / impl_name: the model and the attention implementation name under which it is active
            (under :func:`ulysses_sp.plain_attention` the module's own forward runs).
        requested: C (> 1), or None for automatic; budget_bytes: the automatic choice's budget.
        layer / layers: the decoder layer it is in and its slot (None: not found) and the count of the model's
            layers whose attention runs in chunks.
    """

    def __init__(
        self,
        module: nn.Module,
        ctx: UlyssesAttention,
        names: Projections,
        *,
        pretrained: nn.Module,
        impl_name: str,
        num_heads: int,
        num_kv_heads: int,
        requested: int | None = None,
        budget_bytes: int = DEFAULT_HEAD_CHUNK_BUDGET_BYTES,
        layer: LayerSlot | None = None,
        layers: int = 1,
    ) -> None:
        self.module, self.ctx, self.names = module, ctx, names
        self.layer, self.layers = layer, layers  # its decoder layer, one of the model's layers (C reads them)
        self.pretrained, self.impl_name = pretrained, impl_name
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.requested, self.budget_bytes = requested or None, budget_bytes
        self.verified: bool | None = None  # None: not probed yet; False: failed (automatic C: unchunked)
        self.remakeable = False  # reads its input only through the sliced projections (set by the probe)
        self.extra_outputs = 1
        self.hidden_name = first_argument(module)
        # the rows of each sliced projection a stage uses, by split and (projection, stage, device): made at the first
        # call of each, then read (ulysses_sp.head_chunk_parts.ChunkParts.index)
        self.row_indices: dict[ChunkHeads, dict[tuple, slice | torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------- parts
    def projection(self, name: str) -> nn.Linear:
        """The linear layer whose weight ``name`` slices (a LoRA layer's base layer). Looked up at each call, not
        kept: PEFT may wrap or unwrap it between calls, and a write here while a compiled layer traces the unchunked
        path (which asks for the head dim) is a side effect that breaks its graph inside a checkpointed region."""
        return base_linear(self.module._modules[name])  # type: ignore[return-value]

    def adapters(self, name: str) -> tuple[Adapter, ...]:
        """The LoRA adapters that projection ``name`` adds in this call (:mod:`ulysses_sp.head_chunk_lora`)."""
        return active_adapters(self.module._modules[name])

    def dropout_seed(self) -> int:
        """A seed drawn from torch's generator for a call's LoRA input dropout (as a dropout would draw; activation
        checkpointing's recompute restores the generator, so draws it again)."""
        return int(torch.randint(-(1 << 62), 1 << 62, ()).item())

    def trainable_parameters(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def sliced_parameters(self) -> set[int]:
        """ids of the projections' weights and biases (their gradients are assembled chunk by chunk)."""
        names = (*self.names.query, *self.names.kv, self.names.out)
        return {id(p) for name in names for p in self.projection(name).parameters(recurse=False)}

    def capture(
        self,
        args: tuple,
        kwargs: dict,
        weights: dict[str, tuple],
        heads: tuple[int, int],
        cut: ProjectionCut | None = None,
        inputs: InputLows | None = None,
    ) -> Captured:
        """Run the module's own forward with its projections replaced by ``weights`` (the chunk's ``heads``: query
        and kv head counts) up to its attention call; ``cut``: record the projections of its input there
        (:class:`ProjectionCut`); ``inputs``: the LoRA adapters' work on the block's input, made once per call.

        The call's arguments are recorded and the forward stopped by an exception, which is dropped at once: its
        traceback holds the forward's frames (and their tensors) until it is freed. Head counts the module keeps
        as attributes (``self.num_heads`` in its reshapes) read the chunk's during the call.
        """
        found: list[Captured] = []

        def stop(module, query, key, value, attention_mask, **call_kwargs):
            found.append(Captured((query, key, value), attention_mask, call_kwargs))
            raise _Stop

        saved = {name: self.module._modules[name] for name in weights}
        counts = self._head_counts(*heads)
        kept = {name: self.module.__dict__[name] for name in counts}
        try:
            for name, (weight, bias, adapters) in weights.items():
                if isinstance(weight, Blank):
                    stand_in = _Slice(name, weight.weight, None, cut, weight)
                else:
                    stand_in = _Slice(name, weight, bias, cut, adapters=adapters, inputs=inputs)
                self.module._modules[name] = stand_in  # type: ignore[assignment]
            self.module.__dict__.update(counts)
            with intercepting(self.module, stop):
                type(self.module).forward(self.module, *args, **kwargs)
        except _Stop:
            pass
        finally:
            self.module._modules.update(saved)
            self.module.__dict__.update(kept)
        if found:
            return found[0]
        raise ValueError(
            f"{type(self.module).__name__}.forward returned without calling its attention function, so its heads "
            "cannot be run in chunks; use head_chunks=1 (--head-chunks 1)"
        )

    def _head_counts(self, heads: int, kv_heads: int) -> dict[str, int]:
        """The module's head-count attributes that hold the whole layer's counts, set to one chunk's."""
        full = {
            "num_heads": (self.num_heads, heads),
            "num_attention_heads": (self.num_heads, heads),
            "num_key_value_heads": (self.num_kv_heads, kv_heads),
            "num_kv_heads": (self.num_kv_heads, kv_heads),
        }
        attrs = self.module.__dict__
        counts = {name: chunk for name, (whole, chunk) in full.items() if attrs.get(name) == whole}
        if "num_key_value_groups" in attrs and counts:
            counts["num_key_value_groups"] = heads // kv_heads
        return counts

    # ------------------------------------------------------------------------------------------- calls
    def active(self) -> bool:
        return self.pretrained.config._attn_implementation == self.impl_name

    def chunks_for(self, x: torch.Tensor) -> int:
        """C for hidden states ``x [b, n, h]`` (this rank's tokens) by the planner's rule, in the decoder layer as it
        is at this call (:mod:`ulysses_sp.head_chunk_choice`)."""
        layout, query = self.ctx.layout, self.projection(self.names.query[0])
        return choose_head_chunks(
            self.num_heads, self.num_kv_heads, layout.ulysses, tokens=x.shape[0] * x.shape[1] * layout.ulysses,
            head_dim=query.out_features // self.num_heads, element_size=compute_dtype(x).itemsize, hidden=x.shape[-1],
            ring=layout.ring, device="cuda" if x.is_cuda else "cpu", requested=self.requested,
            budget_bytes=self.budget_bytes, layer=lambda: layer_memory(self.layer, self.layers, query),
        )  # fmt: skip

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        x = kwargs.get(self.hidden_name, args[0] if args else None)
        if (
            not isinstance(x, torch.Tensor)
            or x.dim() != 3
            or not self.active()
            or kwargs.get("past_key_values") is not None
        ):
            return type(module).forward(module, *args, **kwargs)
        chunks = self.chunks_for(x)
        if chunks == 1:
            return type(module).forward(module, *args, **kwargs)
        return self.chunked(x, chunks, args, kwargs)

    @run_eagerly("runs attention heads in chunks eagerly (its exchanges overlap the other chunk's core by hand)")
    def chunked(self, x: torch.Tensor, chunks: int, args: tuple, kwargs: dict) -> Any:
        """The module's forward with its heads in ``chunks`` chunks (or its own where they cannot be)."""
        module, place = self.module, placer(self.hidden_name, args, kwargs)
        if self.verified is False:  # (read here, not in __call__: a compiled layer would compile again once it is set)
            return type(module).forward(module, *args, **kwargs)
        problem = call_problem(module, (*self.names.query, *self.names.kv, self.names.out))  # (head_chunk_lora)
        if problem is not None:
            if problem[1] and self.requested:
                raise ValueError(
                    f"{type(module).__name__} cannot run its heads in chunks: {problem[0]}; use head_chunks=1 "
                    "(--head-chunks 1) or leave it automatic (0 / None)"
                )
            return type(module).forward(module, *args, **kwargs)
        split = ChunkHeads(self.num_heads, self.num_kv_heads, chunks, self.ctx.layout.ulysses)
        if self.verified is None:
            self.verify(x, args, kwargs, split)
            if not self.verified:
                return type(module).forward(module, *args, **kwargs)
        layout = self.ctx.layout
        group = layout.ulysses_group if layout.ulysses > 1 else None
        run = ChunkRun(self, place, split, prepare=self.ctx.prepare, attend=self.ctx.core_for, group=group, fused=True)
        run.params = params = self.trainable_parameters()
        if torch.is_grad_enabled() and (x.requires_grad or params):
            found = self.made_by_norm(x)
            if found is not None:  # save the norm's input, not x (ulysses_sp.deferred_input)
                run.remake, run.source = found
            out = HeadChunkedFunction.apply(run, x, *params)
        else:
            with torch.no_grad():
                out = run.forward(x)
        return (out, *[None] * self.extra_outputs)

    def made_by_norm(self, x: torch.Tensor) -> tuple[NormRemake, torch.Tensor] | None:
        """How to remake ``x`` tile by tile and from what, where a tiled norm of the layer has just made it (seen by
        the :class:`~ulysses_sp.norm_projections.NormProjection` installed on the query projection) and this
        module reads its input only through its sliced projections (:attr:`remakeable`); else None."""
        installed = installed_forward(self.projection(self.names.query[0]))
        if not self.remakeable or not isinstance(installed, NormProjection):
            return None
        found = installed.made_by_norm(x)
        if found is None:
            return None
        made, source = found
        return NormRemake(made.norm.call_module, made.norm.chunk_size(source), made.replay), source

    # ------------------------------------------------------------------------------------------- the probe
    def verify(self, x: torch.Tensor, args: tuple, kwargs: dict, split: ChunkHeads) -> None:
        """Run the module's own forward and the chunked one on a few random tokens with one local core; they must
        agree. Sets :attr:`verified` (and :attr:`remakeable`); raises ValueError when C > 1 was asked for and they
        do not."""
        problem = probe_problem(self, x, args, kwargs, split)  # in training mode, LoRA input dropouts off
        self.verified = problem is None
        if problem is not None and self.requested:
            raise ValueError(
                f"{type(self.module).__name__} cannot run its heads in chunks: {problem}; use head_chunks=1 "
                "(--head-chunks 1) or leave it automatic (0 / None)"
            )


class HeadChunkedFunction(torch.autograd.Function):
    """``out = attention block(x)`` in head chunks; saves ``x`` and, for the chunks whose core ran through a
    kernel, its output after the exchange back and its lse (through ``save_for_backward``, so activation
    checkpointing and offloading treat them as any saved tensor); backward works chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, run: ChunkRun, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.replay, ctx.x_meta = run, Replay(x.device), (x.shape, x.dtype, x.device)
        out = run.forward(x, save=True)
        # ``x``, or the input of the tiled norm that made it (run.source: backward remakes x from it by tiles)
        ctx.save_for_backward(x if run.source is None else run.source, *run.local, *run.lse, *run.out_low)
        run.local, run.lse, run.source = [None] * run.split.chunks, [None] * run.split.chunks, None  # ctx's alone
        run.out_low = []
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept, *saved = ctx.saved_tensors
        chunks = ctx.run.split.chunks
        # run.backward drops each output once it has read it; then the output projection's LoRA y A^T
        local, lse, out_low = saved[:chunks], tuple(saved[chunks : 2 * chunks]), tuple(saved[2 * chunks :])
        del saved
        x, source = (kept, None) if ctx.run.remake is None else (Absent(*ctx.x_meta), kept)
        with ctx.replay(), as_in_forward(ctx.run.owner.module, ctx.run.parts.unsliced):  # (LoRA layers run again)
            needs = tuple(ctx.needs_input_grad[1:])
            grad_x, *grads = ctx.run.backward(x, grad_out, needs, local, lse, source, out_low)
        for hook in ctx.run.owner.ctx.backward_hooks:  # every chunk's backward is done (UlyssesAttention)
            hook()
        return (None, None if grad_x is None else cast(grad_x, ctx.x_meta[1]), *grads)
