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
called when tiling is turned on. Alike modules (the layers of one model) share one probe: :func:`facts_key`.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ForwardFacts", "facts_key", "forward_facts", "runs_foreign_code"]

_PROBE_TOKENS = 2


@dataclass(frozen=True)
class ForwardFacts:
    """A tiled module's forward, as fake tensors show it (nothing known: the defaults)."""

    unused: tuple[str, ...] = ()  # module.named_parameters() names no output depends on
    # (device type, input dtype, autocast dtype or None, output dtype)
    out_dtypes: tuple[tuple[str, torch.dtype, torch.dtype | None, torch.dtype], ...] = ()

    def out_dtype(self, x: torch.Tensor, autocast: torch.dtype | None) -> torch.dtype | None:
        """The dtype the forward returns for ``x`` under ``autocast`` (None: off) on ``x``'s device, if known."""
        for device_type, x_dtype, autocast_dtype, out_dtype in self.out_dtypes:
            if device_type == x.device.type and x_dtype == x.dtype and autocast_dtype == autocast:
                return out_dtype
        return None


def forward_facts(
    module: nn.Module,
    call: Callable[[torch.Tensor], torch.Tensor],
    hidden_size: int | None,
    pre: nn.Module | None = None,
) -> ForwardFacts:
    """The facts of ``call`` (``module``'s forward on one chunk ``[1, c, hidden_size]``, after ``pre``'s if a norm is
    fused in), probed on fake tensors on the device type of ``module``'s parameters (the CPU for meta ones: a model
    made on the meta device) and on CUDA where it is available; empty where it cannot run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    like = next((p for p in module.parameters() if p.is_floating_point()), None)
    if hidden_size is None or like is None:
        return ForwardFacts()
    here = like.device if like.device.type != "meta" else torch.device("cpu")
    devices = [here] + ([torch.device("cuda")] if torch.cuda.is_available() and here.type != "cuda" else [])
    # the input in the parameters' dtype, with and without autocast; an fp32 input under autocast too
    low = (torch.bfloat16, torch.float16)
    states = [(like.dtype, None)] + [(x, a) for x in dict.fromkeys((like.dtype, torch.float32)) for a in low]
    unused: tuple[str, ...] | None = None
    out_dtypes = []
    for device in devices:
        with _quiet(), FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as swapped:
            leaves = {}
            for owner in [module] + ([pre] if pre is not None else []):
                fakes = _fakes(owner, device)
                swapped.enter_context(_reparametrize_module(owner, fakes))
                leaves = leaves or {n: fakes[n] for n, _ in owner.named_parameters() if fakes[n].requires_grad}
            for x_dtype, autocast in states:
                x = torch.empty(1, _PROBE_TOKENS, hidden_size, dtype=x_dtype, device=device)
                try:
                    with torch.set_grad_enabled(unused is None):
                        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                            out = call(x)
                        if unused is None:  # the first state: which parameters the output depends on
                            grads = torch.autograd.grad(out, list(leaves.values()), out, allow_unused=True)
                            unused = tuple(n for n, g in zip(leaves, grads, strict=True) if g is None)
                except Exception:  # noqa: BLE001 - a forward fake tensors cannot run: nothing known of it
                    continue
                out_dtypes.append((device.type, x_dtype, autocast, out.dtype))
    return ForwardFacts(unused, tuple(out_dtypes)) if unused is not None else ForwardFacts()


def facts_key(modules: list[nn.Module], hidden_size: int | None) -> tuple:
    """What :func:`forward_facts` of ``modules`` (a module, then the ``pre`` fused in, if any) depends on: for each
    module under them its name, type, instance forward's type (below the roots), plain attributes (numbers, strings,
    functions), its parameters' and buffers' names, shapes, dtypes, device types and ``requires_grad``. Modules with
    equal keys (the layers of one model) have equal facts, so they are probed once."""
    key: list = [hidden_size]
    for root in modules:
        for name, module in root.named_modules(remove_duplicate=False):
            plain = (bool, int, float, str, type(None), types.FunctionType, types.BuiltinFunctionType)
            attrs = tuple((k, v) for k, v in vars(module).items() if not k.startswith("_") and isinstance(v, plain))
            forward = type(vars(module).get("forward")) if module is not root else None  # a root's: tiling's
            tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            shapes = tuple((n, t.shape, t.dtype, t.device.type, t.requires_grad) for n, t in tensors)
            key.append((name, type(module), forward, attrs, shapes))
        key.append(None)  # between the module and ``pre``
    return tuple(key)


def _fakes(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """A fake tensor on ``device`` for each parameter and buffer of ``module`` under every name it has (one per
    tensor; float parameters, frozen ones too, as leaves that need a gradient; a DTensor's of its global shape)."""
    made: dict[int, torch.Tensor] = {}
    fakes = {}
    for named, is_param in ((module.named_parameters(remove_duplicate=False), True), (module.named_buffers(), False)):
        for name, tensor in named:
            if id(tensor) not in made:
                fake = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                made[id(tensor)] = fake.requires_grad_() if is_param and tensor.is_floating_point() else fake
            fakes[name] = made[id(tensor)]
    return fakes


def runs_foreign_code(modules: list[nn.Module]) -> bool:
    """Whether calling ``modules`` (by their class's forward) runs another library's code: module hooks anywhere
    under them, or an instance forward below them that is not this library's plain linear on a chunk."""
    from .gated_tile import foreign_forward, hooked

    for root in modules:
        for module in root.modules():
            if hooked(module) or (module is not root and foreign_forward(module)):
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
