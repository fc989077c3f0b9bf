"""One chunk of a tiled gated MLP, ``down(act(gate(x)) * up(x))``, back-propagated by hand in row blocks.

Why: autograd's backward of a chunk of ``c`` tokens holds what the chunk's forward saved (gate, act(gate), up and
their product) and adds the gradients of the product, of act(gate) and of up: about six ``[c, I]`` tensors at
its peak (``I`` is 2.7x to 3.5x ``h``), and a fused norm's backward adds a few ``[c, h]``. Here the chunk's
rows are back-propagated in :data:`ROW_BLOCKS` blocks of at least :data:`MIN_BLOCK_ROWS` rows, each block from
its input: the fused norm (with autograd), gate and up, the down projection's input gradient, the activation
and its derivative (autograd's, so any token-wise ``act_fn`` works), with each gradient written over the tensor
whose values it no longer needs: about four ``[c / 4, I]`` tensors at once, so the chunk's backward holds about
one ``[c, I]`` tensor where autograd's held six (the forward's chunk holds about three). The weight gradients
are matmuls added into the tiled function's sums (in place where the dtypes allow;
:class:`ulysses_sp.grad_sums.GradSums`), one matmul per block. Matmuls keep at least ``MIN_BLOCK_ROWS`` rows: a
chunk that short is one block.

Used for an MLP whose ``gate_proj``, ``up_proj`` and ``down_proj`` are plain ``nn.Linear`` with plain parameters
and no hooks (this library's norm projection aside, the plain linear on a chunk), whose ``act_fn`` has no hooks,
that has no instance ``forward`` of another library, and whose own forward equals ``down(act(gate(x)) * up(x))``
bit for bit on a probe of a few random tokens (checked once per set of those modules and training modes), with
no trainable parameter outside the three linears and an activation that does not work in place. Anything else
(LoRA adapters, a fused ``gate_up_proj``, MoE blocks, dropout in training, a hooked projection, a learnable
activation): autograd per chunk, as before.
Loss and gradients are those of autograd's backward up to fp32 rounding (the same products, summed in blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .instance_forward import installed_forward

if TYPE_CHECKING:
    from .grad_sums import GradSums

__all__ = ["MIN_BLOCK_ROWS", "ROW_BLOCKS", "GatedChunk", "block_rows", "foreign_forward", "gated_chunk", "hooked"]

ROW_BLOCKS = 4  # blocks a chunk's rows are back-propagated in
MIN_BLOCK_ROWS = 256  # no smaller blocks: matmuls keep their rows, a short chunk is one block
_PROBE_TOKENS = 3


def block_rows(rows: int) -> int:
    """Rows per block of a chunk of ``rows`` rows: a quarter of it, at least ``MIN_BLOCK_ROWS``, at most all."""
    return min(rows, max(MIN_BLOCK_ROWS, -(-rows // ROW_BLOCKS)))


def hooked(module: Any) -> bool:
    """Whether ``module`` has module hooks of its own (another library's code runs in its calls)."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return isinstance(module, nn.Module) and any(getattr(module, name, None) for name in hooks)


def foreign_forward(module: nn.Module) -> bool:
    """Whether ``module`` has an instance ``forward`` of another library (this library's plain linear on a chunk,
    the norm projection, is not one)."""
    installed = installed_forward(module)
    return installed is not None and not getattr(installed, "plain_on_chunks", False)


def _plain_linear(module: Any) -> bool:
    if type(module) is not nn.Linear or hooked(module) or foreign_forward(module):
        return False
    params = [module.weight] + ([module.bias] if module.bias is not None else [])
    return all(type(p) is nn.Parameter for p in params)


def _structure(mlp: nn.Module) -> tuple | None:
    """What the probe's answer depends on (the projections, the activation, every module's training mode) if
    ``mlp`` is of the handled kind: three plain linears, an activation without hooks, no in-place flag and no
    trainable parameter anywhere else in ``mlp`` (this backward gives gradients to the linears' alone)."""
    names = ("gate_proj", "up_proj", "down_proj")
    linears = [getattr(mlp, name, None) for name in names]
    act = getattr(mlp, "act_fn", None)
    if not all(_plain_linear(m) for m in linears) or not callable(act) or hooked(act):
        return None
    if getattr(act, "inplace", False):
        return None
    own = {id(p) for m in linears for p in m.parameters()}
    if any(p.requires_grad and id(p) not in own for p in mlp.parameters()):
        return None
    modes = tuple(m.training for m in mlp.modules())
    return (*(id(m) for m in linears), id(act), *(id(m.weight) for m in linears), modes)


class GatedChunk:
    """The hand-written backward of one chunk of ``mlp`` (a gated MLP that passed :func:`gated_chunk`'s checks)."""

    def __init__(self, mlp: nn.Module) -> None:
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(act(gate(x)) * up(x))`` with the functional ops (what the probe compares with the module)."""
        hidden = self.act(F.linear(x, self.gate.weight, self.gate.bias)) * F.linear(x, self.up.weight, self.up.bias)
        return F.linear(hidden, self.down.weight, self.down.bias)

    def backward(
        self,
        x: torch.Tensor,
        grad: torch.Tensor,
        sums: GradSums,
        need_x: bool,
        pre: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pre_params: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Add the chunk's parameter gradients to ``sums``; return the gradient of ``x [..., c, h]`` if ``need_x``.

        ``grad``: the output's gradient ``[..., c, h_out]``. ``pre``: a norm fused in front (the MLP computes
        ``mlp(pre(x))``), run with autograd block by block; its parameters ``pre_params`` get their gradients
        through ``sums``' hooks. Runs under the forward's autocast state (the caller's
        :class:`ulysses_sp.replay.Replay`), so the projections compute in the dtype the forward's did.
        """
        x2, g2 = x.detach().reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])  # [c, h], [c, h_out]
        rows = x2.shape[0]
        block = block_rows(rows)
        grad_x = torch.empty_like(x2) if need_x else None
        for start in range(0, rows, block):
            part = slice(start, start + block)
            xb = x2[part].unsqueeze(0).requires_grad_(need_x)  # [1, r, h]
            with torch.enable_grad():
                normed = pre(xb) if pre is not None else xb
            inputs = ([xb] if need_x else []) + (pre_params or [])
            wanted = bool(inputs) and normed.requires_grad
            with torch.no_grad():
                grad_normed = self._block(normed[0].detach(), g2[part], sums, wanted)
            if grad_normed is None:
                continue
            if normed is not xb:
                grads = torch.autograd.grad(normed, inputs, grad_normed.view(normed.shape), allow_unused=True)
                sums.check_chunk()  # one gradient per parameter per block
                grad_normed = grads[0] if need_x else None
            if grad_x is not None:
                grad_x[part] = grad_normed.view(-1, x2.shape[-1]) if grad_normed is not None else 0
        return None if grad_x is None else grad_x.view(x.shape)

    def _block(self, x: torch.Tensor, g: torch.Tensor, sums: GradSums, need_x: bool) -> torch.Tensor | None:
        """One block of ``r`` rows: ``x [r, h]``, the output's gradient ``g [r, h_out]``. The weights enter the
        matmuls as they are: under autocast its cached casts (those the projections' forward made), no copies."""
        gate = F.linear(x, self.gate.weight, self.gate.bias)  # [r, I]
        up = F.linear(x, self.up.weight, self.up.bias)  # [r, I]
        g = g.to(gate.dtype)
        grad_up = g.mm(self.down.weight)  # [r, I]: the gradient of act(gate) * up, made up's below
        gate_in = gate.detach().requires_grad_()
        del gate
        with torch.enable_grad():
            act = self.act(gate_in)  # [r, I]
        activated = act.detach()
        sums.add_mm(self.down.weight, g.t(), activated * up)
        grad_act = grad_up * up
        del up
        grad_up.mul_(activated)
        del activated
        (grad_gate,) = torch.autograd.grad(act, gate_in, grad_act)
        del act, grad_act, gate_in
        xc = x.to(grad_gate.dtype)
        sums.add_mm(self.gate.weight, grad_gate.t(), xc)
        sums.add_mm(self.up.weight, grad_up.t(), xc)
        for linear, out_grad in ((self.gate, grad_gate), (self.up, grad_up), (self.down, g)):
            if linear.bias is not None:
                sums.add(linear.bias, out_grad.sum(0))
        if not need_x:
            return None
        return torch.addmm(grad_up.mm(self.up.weight), grad_gate, self.gate.weight)  # [r, h]


def gated_chunk(mlp: nn.Module, has_previous: bool, known: tuple | None) -> tuple[GatedChunk | None, tuple | None]:
    """The hand-written chunk backward for ``mlp`` (None where autograd's must run; see the module docstring) and
    what to pass as ``known`` next time: the probe runs again only when ``mlp``'s structure or modes changed.

    ``has_previous``: another library installed its own instance ``forward`` on ``mlp`` (never handled here).
    The probe runs under no autocast, in the weights' dtype.
    """
    structure = None if has_previous else _structure(mlp)
    if structure is None:
        return None, known
    if known is None or known[0] != structure:
        known = (structure, _probe(mlp))
    return (GatedChunk(mlp) if known[1] else None), known


def _probe(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s own forward equals :meth:`GatedChunk.forward` bit for bit on a few random tokens (drawn
    from their own generator; the global RNG state is restored after, so a random op in the forward draws nothing
    the training would), and its activation runs on a tensor that needs a gradient (not in place)."""
    weight = mlp.gate_proj.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    shape = (1, _PROBE_TOKENS, weight.shape[1])
    x = torch.randn(shape, generator=generator, device=weight.device, dtype=torch.float32).to(weight.dtype)
    devices = [weight.device] if weight.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autocast(weight.device.type, enabled=False):
        try:
            with torch.no_grad():
                want = type(mlp).forward(mlp, x)
                got = GatedChunk(mlp).forward(x)
            with torch.enable_grad():
                mlp.act_fn(x[..., :1].detach().requires_grad_())
        except Exception:  # noqa: BLE001 - a forward that cannot run on the probe is not the handled kind
            return False
    return isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(want, got)
