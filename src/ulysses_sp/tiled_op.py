"""The tiled MLP and norms as two operators that ``torch.compile`` keeps whole: the decoder layer traces around them.

Why: the tiled forward (:class:`ulysses_sp.tiling.TiledForward`) runs Python loops over chunks, and its backward
recomputes them by hand (gradient hooks, ``torch.autograd.grad``, the forward's RNG state). Dynamo cannot trace that,
and a graph break inside an activation-checkpointed layer (what ``apply_features`` turns on) makes dynamo run the whole
layer eagerly. Here the forward and the backward are each one ``torch.library.custom_op`` holding the eager code: dynamo
and AOTAutograd see two opaque nodes with known output shapes, the rest of the layer (attention, residuals, the
checkpoint's recompute) compiles into one graph, and the chunks inside run as they do eagerly: one chunk's intermediates
at a time in backward, the same numbers.

The module reaches the operators through a key: a CPU int64 scalar (a graph input, neither traced into nor guarded on,
so every layer shares one graph) that a weak table of this module maps to the tiled forward (:func:`new_handle`; a torch
opaque object would be the direct way, but torch 2.13's partitioner misorders one saved for backward in a checkpointed
region that draws random numbers). The table holds no model alive and is its only state; a deep copy or an unpickled
model takes new keys. What the graph must know before the module runs (the parameters it reaches, the dtype it returns)
comes from :mod:`ulysses_sp.tiled_facts`, read while dynamo traces. The autocast state the layer is traced under is
passed as two dtypes (inside an operator it is not in effect: the compiled graph casts explicitly), and the forward
returns the RNG state it ran under for the backward to recompute with (the operator is tagged as drawing random numbers,
so that a checkpoint's recompute of it in the compiled backward replays that state too). Used only while dynamo traces
(:func:`torch.compiler.is_compiling`); eagerly the tiled forward keeps its autograd Function. Needs torch's custom
operators and a dispatch-key guard to run autograd and autocast inside them (:data:`AVAILABLE`; without them the tiled
modules run eagerly under torch.compile, as before).
"""

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .replay import Replay, under_autocast

__all__ = ["AVAILABLE", "apply_tiled", "new_handle"]

AVAILABLE = hasattr(torch._C, "_ForceDispatchKeyGuard") and hasattr(torch.library, "custom_op")


@contextlib.contextmanager
def _as_eager() -> Iterator[None]:
    """Inside an operator the dispatcher leaves autograd and autocast out; the tiled code needs both (its backward
    runs autograd on each chunk, and the forward's autocast state is re-entered)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name, key in torch._C.DispatchKey.__members__.items():
        if name.startswith(("Autograd", "Autocast")) or name == "ADInplaceOrView":
            exclude = exclude - torch._C.DispatchKeySet(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _state(x: torch.Tensor, cpu: torch.dtype | None, device: torch.dtype | None) -> list:
    """The autocast state (:func:`ulysses_sp.replay.autocast_state`) that ``cpu`` / ``device`` (None: off) encode."""
    both = [("cpu", cpu)] + ([(x.device.type, device)] if x.device.type != "cpu" else [])
    return [(t, dtype is not None, dtype or torch.get_autocast_dtype(t)) for t, dtype in both]


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.empty(0, dtype=torch.uint8)
    return torch.get_rng_state(), cuda


_LIVE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # key -> tiled forward
_KEYS = itertools.count()


def new_handle(tiled: Any) -> torch.Tensor | None:
    """A key for ``tiled``: a CPU int64 scalar that the operators take (a graph input, saved for backward like
    any tensor) and look ``tiled`` up by. (An opaque object would be the direct way; torch 2.13's partitioner
    misorders one saved for backward in a checkpointed region that draws random numbers, as sdpa does.) None
    where this torch has no custom operators (the tiled modules then run eagerly under torch.compile)."""
    if not AVAILABLE:
        return None
    key = next(_KEYS)
    _LIVE[key] = tiled
    return torch.tensor(key, dtype=torch.int64)


def _tiled(key: torch.Tensor) -> Any:
    tiled = _LIVE.get(int(key.item()))
    assert tiled is not None, "a compiled graph ran a tiled module that no longer exists"
    return tiled


# Tagged as drawing random numbers (dropout inside the module): a checkpointed region's recompute of it in the compiled
# backward then runs under the forward's RNG state (the partitioner's run_with_rng_state), not the state it finds.
@torch.library.custom_op("ulysses_sp::tiled_forward", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _forward(
    key: torch.Tensor,
    x: torch.Tensor,
    params: list[torch.Tensor],
    cpu_autocast: torch.dtype | None,
    device_autocast: torch.dtype | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, cpu RNG state, cuda RNG state)``: the tiled module over ``x``, chunk by chunk, no graph; ``out`` in
    ``out_dtype``: the dtype it returns eagerly (:mod:`ulysses_sp.tiled_facts`), else ``x``'s (a 16-bit output under
    autocast is then widened exactly; a residual add gives the same numbers, a norm on it, e.g. Gemma's
    post_feedforward_layernorm, returns fp32 where eagerly it returns bf16)."""
    tiled = _tiled(key)
    with _as_eager(), torch.no_grad(), under_autocast(_state(x, cpu_autocast, device_autocast)):
        cpu_rng, cuda_rng = _rng_states(x.device)
        out = tiled.run_chunks(x)
    if out.shape != x.shape:
        raise ValueError(
            f"{type(tiled.module).__name__} maps {tuple(x.shape)} to {tuple(out.shape)}; under torch.compile a tiled "
            f"module keeps its input's shape; {tiled.hint}"
        )
    if out.dtype != out_dtype and out_dtype != x.dtype:  # (x's: not known, cast as before)
        raise RuntimeError(
            f"{type(tiled.module).__name__} returned {out.dtype} where its probe on fake tensors returned {out_dtype} "
            f"(input {x.dtype}); the compiled graph was traced for {out_dtype}; {tiled.hint} under torch.compile"
        )
    return out.to(out_dtype) if out is not x else out.clone(), cpu_rng, cuda_rng


@_forward.register_fake
def _(key, x, params, cpu_autocast, device_autocast, out_dtype):  # noqa: ANN001, ANN202
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        cpu_rng, cuda_rng = _rng_states(x.device)
    return (
        torch.empty_like(x, dtype=out_dtype),
        key.new_empty(cpu_rng.shape, dtype=torch.uint8),
        key.new_empty(cuda_rng.shape, dtype=torch.uint8, device=cuda_rng.device),
    )


def _wanted(x: Any, params: list, need_x: bool, need_params: list[bool]) -> list:
    return ([x] if need_x else []) + [p for p, need in zip(params, need_params, strict=True) if need]


@torch.library.custom_op("ulysses_sp::tiled_backward", mutates_args=())
def _backward(
    key: torch.Tensor,
    x: torch.Tensor,
    grad_out: torch.Tensor,
    params: list[torch.Tensor],
    cpu_rng: torch.Tensor,
    cuda_rng: torch.Tensor,
    cpu_autocast: torch.dtype | None,
    device_autocast: torch.dtype | None,
    need_x: bool,
    need_params: list[bool],
) -> list[torch.Tensor]:
    """The gradients wanted (``x``'s if ``need_x``, then each needed parameter's), the chunks recomputed."""
    from .tiling import backward_chunks

    state = _state(x, cpu_autocast, device_autocast)
    replay = Replay(x.device, state, cpu_rng, cuda_rng if cuda_rng.numel() else None)
    with _as_eager():
        tiled = _tiled(key)
        params_now = tiled.compiled_parameters()
        grad_x, grads = backward_chunks(tiled, x, grad_out, replay, need_x, tuple(need_params), params_now)
    made = ([grad_x] if need_x else []) + [g for g, need in zip(grads, need_params, strict=True) if need]
    likes = _wanted(x, params, need_x, need_params)
    return [torch.zeros_like(like) if g is None else g for g, like in zip(made, likes, strict=True)]


@_backward.register_fake
def _(key, x, grad_out, params, cpu_rng, cuda_rng, cpu_autocast, device_autocast, need_x, need_params):  # noqa: ANN001, ANN202
    return [torch.empty_like(t) for t in _wanted(x, params, need_x, need_params)]


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    key, x, params, cpu_autocast, device_autocast, out_dtype = inputs
    ctx.autocast, ctx.out_dtype = (cpu_autocast, device_autocast), out_dtype
    ctx.save_for_backward(key, x, output[1], output[2], *params)


def _gradients(ctx: Any, grad_out: torch.Tensor, *_: Any) -> tuple:
    key, x, cpu_rng, cuda_rng, *params = ctx.saved_tensors
    need_x, need_params = bool(ctx.needs_input_grad[1]), [bool(n) for n in ctx.needs_input_grad[2]]
    if not need_x and not any(need_params):
        return None, None, [None] * len(params), None, None, None
    made = iter(
        torch.ops.ulysses_sp.tiled_backward(
            key, x, grad_out.to(ctx.out_dtype), params, cpu_rng, cuda_rng, *ctx.autocast, need_x, need_params
        )
    )
    grad_x = next(made) if need_x else None
    return None, grad_x, [next(made) if need else None for need in need_params], None, None, None


_forward.register_autograd(_gradients, setup_context=_setup)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def apply_tiled(tiled: Any, x: torch.Tensor) -> torch.Tensor:
    """``tiled`` over ``x [..., n, h]`` as the forward operator (called while dynamo traces; ``tiled.handle`` set):
    it takes the parameters the forward reaches and returns the dtype it returns eagerly, where ``tiled.facts`` know
    them (:mod:`ulysses_sp.tiled_facts`)."""
    cpu, device = _autocast_dtype("cpu"), _autocast_dtype(x.device.type) if x.device.type != "cpu" else None
    out_dtype = tiled.facts.out_dtype(x, _autocast_dtype(x.device.type)) or x.dtype
    out, _, _ = torch.ops.ulysses_sp.tiled_forward(tiled.handle, x, tiled.compiled_parameters(), cpu, device, out_dtype)
    return out
