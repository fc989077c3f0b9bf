"""Sequence-tiled norms: the token-wise norms of each decoder layer run over chunks of tokens, keeping only their input.

Why: in a decoder layer's recompute + backward, a norm keeps its input, the normalised tensor and (saved by
the projection after it) its output: three ``[tokens, hidden]`` tensors per norm (fp32 copies under bf16),
next to the attention's few. Tiled like the MLP (:class:`ulysses_sp.tiling.TiledForward`: chunks under
``no_grad`` in forward, recomputed chunk by chunk in backward), a norm keeps only its input, which is the
residual stream the layer holds anyway; the normalised tensor exists for one chunk at a time.

The norm that feeds a tiled MLP goes further: it is *fused* into the MLP's tiles. Its own forward then hands
its input through unchanged, and the tiled MLP computes ``mlp(norm(chunk))`` per chunk, so that norm's
output is never held whole either: the block ``norm -> MLP`` keeps one ``[tokens, hidden]`` tensor (its
input) where it kept four. Which norm feeds the MLP is read from the layer's child names, as transformers
writes them: ``pre_feedforward_layernorm`` / ``pre_mlp_layernorm`` (sandwich blocks: Gemma 2/3, AFMoE), else
``post_attention_layernorm`` unless the layer also has a ``post_feedforward_layernorm`` / ``post_mlp_layernorm``
(post-norm blocks such as OLMo 2/3 and EXAONE 4, where ``post_attention_layernorm`` normalises the attention
output; GLM-4 is counted with them and its MLP's norm is tiled on its own). The tiled MLP checks on every call that it
received exactly the tensor that norm handed through, and raises a ValueError otherwise; that check cannot see a
fused norm's output fed to something else too (GraniteMoeShared's shared MLP, which would get the unnormalised
input), so the layer's code is read: a norm whose output feeds anything but its MLP is tiled on its own.

Norms are the children of a decoder layer (or of a ModuleList / ModuleDict child: LongCat-Flash's) that are
``nn.LayerNorm`` / ``nn.RMSNorm`` or whose class name ends in ``RMSNorm`` / ``LayerNorm`` (token-wise by
construction; the tiled forward refuses one that maps ``[b, n, h]`` to another shape). Norms inside attention
(per-head q/k norms) are the attention's. Loss and gradients equal the untiled layer's; the cost is one more forward
of each norm per step.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .compile_boundary import TILED_OFF, run_eagerly
from .hf import MLP_NAMES, decoder_layers, find_pretrained, text_config
from .instance_forward import install_forward, installed_forward, restore_forward
from .norm_projections import install_norm_projections, record_output, remove_norm_projections
from .tiling import NORMS_OFF, TiledForward, TiledMLP, check_chunk_tokens

__all__ = ["TiledNorm", "disable_tiled_norms", "enable_tiled_norms", "is_norm", "mlp_norm_name"]

_NORM_SUFFIXES = ("RMSNorm", "LayerNorm")
_PRE_MLP_NAMES = ("pre_feedforward_layernorm", "pre_mlp_layernorm")  # sandwich blocks (Gemma 2/3, AFMoE)
_POST_MLP_NAMES = ("post_feedforward_layernorm", "post_mlp_layernorm")


def is_norm(module: nn.Module) -> bool:
    """True for a token-wise norm module (LayerNorm / RMSNorm, torch's or a model's own)."""
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith(_NORM_SUFFIXES)


def mlp_norm_name(layer: nn.Module) -> str | None:
    """The child name of the norm whose output feeds ``layer``'s MLP and nothing else, or None when the names do
    not say or the layer's code feeds that output to something else too (GraniteMoeShared: its shared MLP)."""
    children = layer._modules
    found = None
    for name in _PRE_MLP_NAMES:
        if found is None and is_norm(children.get(name) or nn.Identity()):
            found = name
    if found is None and any(name in children for name in _POST_MLP_NAMES):  # post-norm: follows attention
        return None
    if found is None and is_norm(children.get("post_attention_layernorm") or nn.Identity()):
        found = "post_attention_layernorm"
    mlp = next((name for name in MLP_NAMES if isinstance(children.get(name), nn.Module)), None)
    return found if found is not None and mlp is not None and _feeds_only(type(layer), found, mlp) else None


def _feeds_only(layer_class: type, norm: str, mlp: str) -> bool:
    """Whether ``layer_class.forward`` hands the output of ``self.<norm>(...)`` to ``self.<mlp>(...)`` alone: every
    read of the name it is assigned to, until a statement of the same block assigns that name again, is an argument
    of that call (False when the code cannot be read: the norm is then tiled on its own, which is always exact)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(layer_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return False

    def is_call(node: ast.AST, attr: str) -> bool:
        func = node.func if isinstance(node, ast.Call) else None
        return isinstance(func, ast.Attribute) and func.attr == attr and isinstance(func.value, ast.Name)

    def assigned(statement: ast.stmt) -> set[str]:
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}

    for block in (n.body for n in ast.walk(tree) if isinstance(getattr(n, "body", None), list)):
        for i, statement in enumerate(block):
            if not (isinstance(statement, ast.Assign) and is_call(statement.value, norm)):
                continue
            names = assigned(statement)
            for later in block[i + 1 :]:
                fed = {
                    id(a) for c in ast.walk(later) if is_call(c, mlp) for a in [*c.args, *(k.value for k in c.keywords)]
                }
                reads = [n for n in ast.walk(later) if isinstance(n, ast.Name) and n.id in names]
                if any(id(n) not in fed and isinstance(n.ctx, ast.Load) for n in reads):
                    return False
                if assigned(later) & names:
                    break
    return True


class TiledNorm(TiledForward):
    """The ``forward`` :func:`enable_tiled_norms` installs on one norm that is not fused into an MLP; it records
    what it made for the projections of its layer (:mod:`ulysses_sp.norm_projections`)."""

    hint = NORMS_OFF
    called_as = "norm(hidden_states [b, n, h])"

    @run_eagerly("runs the tiled MLP and norms eagerly (their chunks are recomputed in backward by hand)", TILED_OFF)
    def eager_call(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().eager_call(hidden_states, *args, **kwargs)
        record_output(self, hidden_states, out)
        return out

    def __getstate__(self) -> dict[str, Any]:  # torch.save / pickle: what it last made is not part of the model
        return {**self.__dict__, "made": None}


class _HandThrough:
    """The ``forward`` of a norm fused into the tiled MLP after it: returns its input, which the MLP normalises
    chunk by chunk (and records it, so that the MLP can check it receives exactly that tensor)."""

    def __init__(self, norm: nn.Module, mlp: TiledMLP, previous: Callable | None) -> None:
        self.norm, self.mlp, self.previous = norm, mlp, previous

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.mlp.compiles():
            return self.eager_call(hidden_states, *args, **kwargs)
        self.check_call(hidden_states, args, kwargs)
        return hidden_states  # (traced: the MLP's receiving it is not checked, see compile_boundary)

    def check_call(self, hidden_states: Any, args: tuple, kwargs: dict) -> None:
        if args or kwargs or not isinstance(hidden_states, torch.Tensor):
            raise ValueError(
                f"the fused {type(self.norm).__name__} expects norm(hidden_states [b, n, h]); got {len(args)} more "
                f"positional and {sorted(kwargs)} keyword arguments; {NORMS_OFF}"
            )

    @run_eagerly("runs the tiled MLP and norms eagerly (their chunks are recomputed in backward by hand)", TILED_OFF)
    def eager_call(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.check_call(hidden_states, args, kwargs)
        self.mlp.handed_over = weakref.ref(hidden_states)
        return hidden_states


def _installed(module: nn.Module) -> TiledNorm | _HandThrough | None:
    forward = installed_forward(module)
    return forward if isinstance(forward, TiledNorm | _HandThrough) else None


def enable_tiled_norms(model: nn.Module, *, chunk_tokens: int | None = None) -> nn.Module:
    """Tile the norms of every decoder layer of ``model`` along the sequence (in place; returns ``model``).

    Call it after :func:`ulysses_sp.enable_tiled_mlp` to fuse each MLP's norm into the MLP's tiles (without a
    tiled MLP every norm is tiled on its own). ``chunk_tokens``: tokens per chunk of a norm tiled on its own,
    or None for :func:`ulysses_sp.tiling.default_chunk_tokens` (a fused norm uses its MLP's chunks).
    Raises ValueError, changing nothing, if the norms are already tiled or ``chunk_tokens`` is not a positive
    int, or if no decoder layer has a norm.
    """
    check_chunk_tokens(chunk_tokens)
    pretrained = find_pretrained(model, "enable_tiled_norms")
    layers = decoder_layers(pretrained)
    norms = [(layer, name, m) for layer in layers for name, m in _layer_norms(layer)]
    if not norms:
        names = sorted({type(layer).__name__ for layer in layers}) or "none found"
        raise ValueError(f"{type(pretrained).__name__} has no norm in its decoder layers ({names}) to tile")
    if any(_installed(m) is not None for _, _, m in norms):
        raise ValueError("the norms of this model are already tiled; call ulysses_sp.disable_tiled_norms(model) first")
    tiled: dict[int, list[TiledNorm]] = {}  # per layer: its norms tiled on their own
    hidden_size = getattr(text_config(pretrained), "hidden_size", None)
    facts_cache: dict = {}  # alike norms probed once (tiling.TiledForward)
    for layer, name, norm in norms:
        previous = installed_forward(norm)
        mlp = _tiled_mlp(layer) if name == mlp_norm_name(layer) else None
        if mlp is not None:
            mlp.fuse(norm, previous)
            install_forward(norm, _HandThrough(norm, mlp, previous))
        else:
            own = TiledNorm(norm, chunk_tokens, previous, hidden_size, facts_cache)
            install_forward(norm, own)
            tiled.setdefault(id(layer), []).append(own)
    for layer in layers:  # the projections of a tiled norm's output save the norm's input instead
        if id(layer) in tiled:
            install_norm_projections(layer, tiled[id(layer)])
    return model


def _layer_norms(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``layer``'s norms: its norm children, and the norms held one level down in a ModuleList / ModuleDict child
    (LongCat-Flash keeps two of each norm in ``input_layernorm`` and ``post_attention_layernorm`` lists)."""
    found = []
    for name, child in layer.named_children():
        if is_norm(child):
            found.append((name, child))
        elif isinstance(child, nn.ModuleList | nn.ModuleDict):
            found.extend((f"{name}.{key}", item) for key, item in child.named_children() if is_norm(item))
    return found


def _tiled_mlp(layer: nn.Module) -> TiledMLP | None:
    """The tiled MLP directly under ``layer`` with no norm fused into it yet, if any."""
    for child in layer.children():
        forward = installed_forward(child)
        if isinstance(forward, TiledMLP) and forward.pre is None:
            return forward
    return None


def disable_tiled_norms(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_tiled_norms`: every norm gets its own forward back, every MLP its norm (a no-op on an
    untiled model)."""
    pretrained = find_pretrained(model, "disable_tiled_norms")
    remove_norm_projections(pretrained)
    for module in pretrained.modules():
        installed = _installed(module)
        if installed is None:
            continue
        if isinstance(installed, _HandThrough):
            installed.mlp.fuse(None, None)
        restore_forward(module, installed.previous)
    return model
