"""The probe of a head-chunked attention module's first chunked call (:meth:`HeadChunkedAttention.verify`).

The module's own forward and the chunked one run on a few random tokens with one local core and must agree; a tensor
argument other than the hidden states must not need a gradient (the chunks would not give it one). The probe runs
the module in training mode (its LoRA input dropouts off: the chunks draw their own), whatever mode the model is in,
and its own forward twice under two seeds: a forward that draws random numbers outside the attention core (a dropout
after its output projection, as Seed-OSS's ``residual_dropout``) would be left out by the chunks, so it is refused,
also when the first call is an evaluation (which would otherwise pass the probe and train without that dropout).
The probe also finds whether the module reads its input only through its sliced projections, so that backward may
hand it a data-less stand-in and remake the input from a tiled norm's (:mod:`ulysses_sp.deferred_input`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .attention import intercepting, pad_qkv
from .cores import AttentionCall, Segments, eager_core
from .deferred_input import Absent, InputTouched, NormRemake
from .head_chunk_fit import unsliced_parts
from .head_chunk_grads import ProjectionCut
from .head_chunk_lora import dropout_off
from .head_chunk_pipeline import ChunkRun, placer
from .hf import in_mode
from .masks import mask_window

if TYPE_CHECKING:
    from .head_chunks import HeadChunkedAttention
    from .head_split import ChunkHeads

__all__ = ["probe_problem"]

_PROBE_TOKENS = 6


def probe_problem(
    owner: HeadChunkedAttention, x: torch.Tensor, args: tuple, kwargs: dict, split: ChunkHeads
) -> str | None:
    """Why ``owner``'s module cannot run in ``split``'s chunks, found on a probe of its call ``(args, kwargs)``
    with hidden states ``x`` (None: it can). Sets ``owner.extra_outputs`` and ``owner.remakeable``."""
    problem = _grad_problem(args, kwargs, x)
    if problem is not None:
        return problem
    with in_mode(owner.module, training=True), dropout_off(owner.module):
        return _compare(owner, x, args, kwargs, split)


def _reads_input_by_projections(
    owner: HeadChunkedAttention, probe: torch.Tensor, place: Callable, run: ChunkRun
) -> bool:
    """Whether every chunk's q/k/v come out the same when the module's forward gets an :class:`Absent` input and
    its sliced projections read the probe tile by tile: it then uses its input's data only through them, and
    backward can remake the input from a tiled norm's (:mod:`ulysses_sp.deferred_input`)."""
    remake = NormRemake(lambda tile: tile, tile=max(1, probe.shape[-2] // 2 + 1))  # two tiles, the last short
    for stage in run.parts.stages:
        weights, heads = run.parts.weights(stage), run.parts.head_counts(stage)
        want = owner.capture(*place(probe), weights, heads).qkv
        absent = Absent(probe.shape, probe.dtype, probe.device)
        try:
            got = owner.capture(*place(absent), weights, heads, ProjectionCut(absent, remake, probe)).qkv
        except (InputTouched, RuntimeError, ValueError, TypeError, IndexError):
            return False
        if len(want) != len(got) or not all(_agree(w, g) for w, g in zip(want, got, strict=True)):
            return False
    return True


def _compare(owner: HeadChunkedAttention, x: torch.Tensor, args: tuple, kwargs: dict, split: ChunkHeads) -> str | None:
    batch, length = x.shape[:2]
    tokens = min(_PROBE_TOKENS, length)
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(1, tokens, x.shape[-1], generator=generator).to(x.device, x.dtype)
    place = placer(owner.hidden_name, _cut(args, batch, length, tokens), _cut(kwargs, batch, length, tokens))
    cut_args, cut_kwargs = place(probe)

    def reference(module, query, key, value, attention_mask, **call_kwargs):
        call = _local_prepare(module, query, key, value, attention_mask, **call_kwargs)
        return _local_attend(*pad_qkv(query, key, value, call.width), call).contiguous(), None

    def own_forward(seed: int) -> Any:  # under its own generator state: torch's is left as it was
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            torch.manual_seed(seed)
            with intercepting(owner.module, reference):
                return type(owner.module).forward(owner.module, *cut_args, **cut_kwargs)

    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        try:
            theirs, again = own_forward(0), own_forward(1)
            run = ChunkRun(owner, place, split, prepare=_local_prepare, attend=_local_attend, group=None)
            ours = run.forward(probe)
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            return f"the chunked forward failed on a probe ({type(err).__name__}: {err}){_unsliced(owner)}"
        owner.remakeable = _reads_input_by_projections(owner, probe, place, run)
    if not isinstance(theirs, tuple) or any(t is not None for t in theirs[1:]):
        return "its forward returns more than (output, None)"
    owner.extra_outputs = len(theirs) - 1
    if not _agree(theirs[0], again[0]):
        return (
            "its forward draws random numbers outside the attention core while training (a dropout after a "
            "projection, e.g. a residual_dropout in the config), which the chunks would leave out; set it to 0"
        )
    if not _agree(theirs[0], ours, _narrowest(owner.module, theirs[0].dtype)):
        return "its own forward and the chunked one differ on a probe" + (
            _unsliced(owner) or " (its projections do not split by heads)"
        )
    return None


def _unsliced(owner: HeadChunkedAttention) -> str:
    """What a failed probe names besides its error: the module's weights the chunks do not split by heads."""
    parts = unsliced_parts(owner.module, owner.names)
    return f"; it also computes with {parts}, which the chunks do not split by heads" if parts else ""


def _narrowest(module: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The least precise of ``dtype`` and the module's floating parameters: a 16-bit LoRA adapter of an fp32
    projection rounds its share of the output to 16 bits (PEFT casts the input to the adapter's dtype), which the
    chunks round in another order (or not: the output projection's adapters sum the chunks' shares in fp32)."""
    dtypes = {dtype} | {p.dtype for p in module.parameters() if p.is_floating_point()}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _agree(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Equal shapes and values up to rounding (another matmul blocking, another order of the chunks' sums) in
    ``dtype`` (default: ``want``'s)."""
    dtype = want.dtype if dtype is None else dtype
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    return want.shape == got.shape and torch.allclose(
        want.float(), got.float(), rtol=tol, atol=tol * float(want.abs().max())
    )


def _grad_problem(args: tuple, kwargs: dict, x: torch.Tensor) -> str | None:
    """A tensor argument other than the hidden states that needs a gradient, which the chunks would not give."""
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, tuple | list) else (value,):
            if isinstance(t, torch.Tensor) and t is not x and t.requires_grad:
                return "an argument other than the hidden states needs a gradient (e.g. learned position embeddings)"
    return None


def _cut(value: Any, batch: int, length: int, tokens: int) -> Any:
    """``value`` with every tensor of shape ``[batch, length, ...]`` cut to ``[1, tokens, ...]``."""
    if isinstance(value, torch.Tensor):
        return (
            value[:1, :tokens]
            if value.dim() >= 2 and value.shape[1] == length and value.shape[0] in (1, batch)
            else value
        )
    if isinstance(value, tuple | list):
        return type(value)(_cut(v, batch, length, tokens) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, batch, length, tokens) for k, v in value.items()}
    return value


def _local_prepare(module, query, key, value, attention_mask, *, scaling=None, softcap=None, **_: Any) -> AttentionCall:
    """The probe's attention call: one dense document of the probe's tokens, the layer's window, no dropout."""
    batch, _, tokens, d_qk = query.shape
    d_v = value.shape[-1]
    positions = torch.arange(tokens, device=query.device).expand(batch, tokens)
    if d_v > d_qk and scaling is None:
        scaling = d_qk**-0.5
    window = mask_window(module, attention_mask)
    return AttentionCall(Segments.from_positions(positions), window, scaling, softcap, 0.0, d_v, max(d_qk, d_v))


def _local_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
    out = eager_core(q, k, v, call.segments, scaling=call.scaling, sliding_window=call.window, softcap=call.softcap)
    return out[..., : call.d_v]
