"""What the compiled graph must know of a tiled module's forward before it runs: the parameters it never reaches and the
dtype it returns.

Why: under torch.compile the tiled MLP and norms are opaque operators (:mod:`ulysses_sp.tiled_op`), so their outputs'
dtypes and which parameters get a gradient are fixed when the graph is traced, without running the module. Eagerly a
parameter the forward never reaches gets no gradient (None, which AdamW leaves alone, where a zero gradient would decay
it), and under autocast an MLP returns the autocast dtype (bf16 where its input is fp32). These facts are found once,
when tiling is turned on, by running the module on fake tensors (no memory, no compute, no random numbers drawn), its
input in its parameters' dtype with and without autocast. None are known (the operators then give every trainable
parameter a gradient and return the input's dtype) of a forward that cannot run on fake tensors (data-dependent control
flow: a MoE block's routing) or that runs another library's code (module hooks, an instance forward), which is not
called when tiling is turned on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ForwardFacts", "forward_facts", "runs_foreign_code"]

_PROBE_TOKENS = 2


@dataclass(frozen=True)
class ForwardFacts:
    """A tiled module's forward, as fake tensors show it (``device_type``: where it was probed; "" if it was not)."""

    device_type: str = ""
    unused: tuple[str, ...] = ()  # module.named_parameters() names no output depends on
    out_dtypes: tuple[tuple[torch.dtype, torch.dtype | None, torch.dtype], ...] = ()  # (input, autocast, output)

    def out_dtype(self, x: torch.Tensor, autocast: torch.dtype | None) -> torch.dtype | None:
        """The dtype the forward returns for ``x`` under ``autocast`` (None: off) on ``x``'s device, if known."""
        if x.device.type != self.device_type:
            return None
        for x_dtype, autocast_dtype, out_dtype in self.out_dtypes:
            if x_dtype == x.dtype and autocast_dtype == autocast:
                return out_dtype
        return None


def forward_facts(
    module: nn.Module, call: Callable[[torch.Tensor], torch.Tensor], hidden_size: int | None
) -> ForwardFacts:
    """The facts of ``call`` (``module``'s forward on one chunk ``[1, c, hidden_size]``, perhaps after a fused norm),
    probed on fake tensors on the device of ``module``'s parameters; empty where it cannot run there."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    params = dict(module.named_parameters())  # (a parameter under two names: once)
    like = next((p for p in params.values() if p.is_floating_point()), None)
    if hidden_size is None or like is None or like.device.type == "meta":  # meta: autocast does not act there
        return ForwardFacts()
    # the input in the parameters' dtype, with and without autocast; an fp32 input under autocast too
    low = (torch.bfloat16, torch.float16)
    states = [(like.dtype, None)] + [(x, a) for x in dict.fromkeys((like.dtype, torch.float32)) for a in low]
    unused: tuple[str, ...] | None = None
    out_dtypes = []
    with _quiet(), FakeTensorMode(allow_non_fake_inputs=True):
        # fake leaves for every float parameter (frozen ones too; plain tensors of the global shape for a DTensor),
        # one per parameter under each of its names
        leaves = {n: _leaf(p) for n, p in params.items()}
        by_id = {id(p): leaves[n] for n, p in params.items()}
        every = {n: by_id[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
        wanted = [n for n, leaf in leaves.items() if leaf.requires_grad]
        with _reparametrize_module(module, every):
            for x_dtype, autocast in states:
                x = torch.empty(1, _PROBE_TOKENS, hidden_size, dtype=x_dtype, device=like.device)
                try:
                    with torch.set_grad_enabled(unused is None):
                        with torch.autocast(like.device.type, dtype=autocast, enabled=autocast is not None):
                            out = call(x)
                        if unused is None:  # the first state: which parameters the output depends on
                            grads = torch.autograd.grad(out, [leaves[n] for n in wanted], out, allow_unused=True)
                            unused = tuple(n for n, g in zip(wanted, grads, strict=True) if g is None)
                except Exception:  # noqa: BLE001 - a forward fake tensors cannot run: nothing known of it
                    continue
                out_dtypes.append((x_dtype, autocast, out.dtype))
    return ForwardFacts(like.device.type, unused or (), tuple(out_dtypes)) if unused is not None else ForwardFacts()


def _leaf(param: torch.Tensor) -> torch.Tensor:
    leaf = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    return leaf.requires_grad_() if param.is_floating_point() else leaf


def runs_foreign_code(modules: list[nn.Module]) -> bool:
    """Whether calling ``modules`` (by their class's forward) runs another library's code: module hooks anywhere
    under them, or an instance forward below them that is not this library's plain linear on a chunk."""
    from .gated_tile import hooked
    from .instance_forward import installed_forward

    for root in modules:
        for module in root.modules():
            installed = installed_forward(module) if module is not root else None
            if hooked(module) or (installed is not None and not getattr(installed, "plain_on_chunks", False)):
                return True
    return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Fake tensors log every kernel that raises (a dtype the module refuses is an expected answer here)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled
