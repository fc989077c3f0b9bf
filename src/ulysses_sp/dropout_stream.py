"""Each SP rank's own dropout stream, and torch's global generator left as one process leaves it.

Under sp > 1 every rank of an SP group runs the decoder on tensors of the same shapes from the same generator
state: left alone, their dropout masks would repeat along the sequence. A pair of hooks on the decoder
(:class:`DropoutStream`) seeds the CPU and device generators for the decoder's forward with a number that
differs per sp_rank, and gives them their state back after it (also when it raised). Another pair does the same
around the whole model's forward, for what draws after the decoder (LoRA's dropout on lm_head); the decoder's
stream then starts from that one's state.

That number is what one draw of the global CPU generator would give, read from a copy of its state, so that the
global generator advances only when the decoder drew from its stream: once per forward, alike on every rank of
the group. A decoder that draws nothing (no dropout, or not in training) leaves it untouched, as one process's
does, so what draws from it afterwards (transformers' ``group_by_length`` sampler, a user's augmentation) draws
what it would have drawn in one process. Activation checkpointing and the tiled MLP replay the state each layer
started from, so a recomputed layer draws the masks it drew. Reproducible: the same run on the same layout
draws the same masks; they are not one process's masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .attention import UlyssesAttention

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: base + sp_rank * stride differs for every sp_rank (mod 2**63)


def _states(device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device is not None else None


def _next_number(state: torch.Tensor) -> int:
    """What ``torch.empty((), dtype=torch.int64).random_()`` would draw from a CPU generator in ``state``."""
    generator = torch.Generator()
    generator.set_state(state)
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


class DropoutStream:
    """Forward pre-hook (:meth:`before`) and hook (:meth:`after`) on the decoder (or the whole model), in training
    under sp > 1 while ``active()`` (the model's attention is the Ulysses one)."""

    def __init__(self, ctx: UlyssesAttention, active: Callable[[], bool]) -> None:
        self.ctx, self.active = ctx, active
        self.saved: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.seeded: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @torch.compiler.disable  # the generators' state is set eagerly, around whatever compiled code runs between
    def before(self, module, args, kwargs):
        layout = self.ctx.layout
        if not module.training or layout.sp == 1 or not self.active():
            return None
        device = layout.device if layout.device.type == "cuda" else None
        self.saved = _states(device)
        seed = (_next_number(self.saved[0]) + layout.sp_rank * _SEED_STRIDE) % 2**63
        torch.default_generator.manual_seed(seed)
        if device is not None:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        self.seeded = _states(device)
        return None

    @torch.compiler.disable
    def after(self, module, args, kwargs, output):
        if self.saved is None or self.seeded is None:
            return None
        (cpu, cuda), seeded = self.saved, self.seeded
        self.saved = self.seeded = None
        device = self.ctx.layout.device if cuda is not None else None
        drew = any(s is not None and not torch.equal(s, now) for s, now in zip(seeded, _states(device), strict=True))
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        if drew:  # the number the seed came from, drawn now: the next forward's streams differ from this one's
            torch.empty((), dtype=torch.int64).random_()
        return None
