"""Each SP rank's own dropout stream, and torch's global generator left as one process leaves it; dropout masks
keyed by position, for what is computed in pieces.

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

A dropout that pieces of one call draw apart (the head chunks' LoRA input dropout: every chunk, and backward, tile by
tile) cannot follow a generator's stream: :class:`InputDropout`'s mask is a function of a seed and each element's
position (row, token, column) through a 32-bit integer hash. On a GPU the hash is that dropout's cost (kernel launches
and memory traffic, where ``nn.Dropout`` is one kernel): keys per (row, token) and per column are mixed once per call
(:class:`Drawn`), then each element costs 7 int32 kernels, in tiles of 8M elements (2M on the CPU).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .compile_boundary import run_eagerly

if TYPE_CHECKING:
    from .attention import UlyssesAttention

__all__ = ["Drawn", "DropoutStream", "InputDropout"]

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

    # the generators' state is set eagerly, around whatever compiled code runs between
    @run_eagerly("sets each SP rank's dropout seed (the generators' state) around the forward")
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

    @run_eagerly("puts the generators' state back after the forward")
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


# Wellons' lowbias32 multipliers and the golden ratio's 32 bits, as signed int32 (torch's integer arithmetic wraps,
# alike on the CPU and the GPU): int32 temporaries, half of int64's
_MIX1, _MIX2, _GOLDEN = 0x7FEB352D, 0x846CA68B - (1 << 32), 0x9E3779B1 - (1 << 32)
# A mask tile's elements. On a GPU 8M (two int32 temporaries of 32 MiB): a tile costs ~10 kernel launches whatever
# its size, the cost of small tiles (8 tiles a call at 32K tokens x 2048 columns). On the CPU 2M: temporaries past
# glibc's mmap threshold (32 MiB) page-fault on every tile, and out of the caches (8M tiles: 2-3x slower).
_TILE_ELEMENTS, _CPU_TILE_ELEMENTS = 1 << 23, 1 << 21


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 ``z``."""
    return (z >> bits) & ((1 << (32 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 16)) * _MIX1
    z = (z ^ _shr(z, 15)) * _MIX2
    return z ^ _shr(z, 16)


def _scramble(z: torch.Tensor) -> torch.Tensor:
    """``z`` (int32, in place) mixed so that its high bits depend on all of its bits: lowbias32 without its first
    and last xor-shift (its input is mixed keys already, and only the high bits are read); 5 kernels."""
    z.mul_(_MIX1)
    z.bitwise_xor_(torch.bitwise_right_shift(z, 16).bitwise_and_(0xFFFF))
    return z.mul_(_MIX2)


def _int32(value: int) -> int:
    """The low 32 bits of ``value`` as a signed int32."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


@dataclass(frozen=True)
class InputDropout:
    """Dropout on an input ``x [rows, n, w]`` that any piece of it, and backward, draws alike: element (row, token,
    column) is kept with probability ``1 - p`` and scaled by ``1 / (1 - p)``, a function of ``seed`` and its
    position only (``start``: the token of ``x``'s first; ``columns``: its columns' indices)."""

    p: float
    seed: int
    _keys: dict[tuple, Drawn] = field(default_factory=dict, compare=False, repr=False)

    def keys(self, rows: int, length: int, width: int, device: torch.device) -> Drawn:
        """The keys of an input of ``rows`` rows, tokens ``0..length`` and ``width`` columns, made once (small: kept
        while this dropout is, for one call's forward and backward)."""
        key = (rows, length, width, device)
        if key not in self._keys:
            self._keys[key] = Drawn(self, rows, 0, length, torch.arange(width, device=device))
        return self._keys[key]

    def mask(self, rows: int, start: int, length: int, columns: torch.Tensor) -> torch.Tensor:
        """``[rows, length, len(columns)]`` float32 of 0 and ``1 / (1 - p)``."""
        return Drawn(self, rows, start, length, columns).mask(start, length)

    def spans(self, rows: int, length: int, width: int, device: torch.device) -> Iterator[tuple[int, int]]:
        """Tiles of an ``[rows, length, width]`` input's tokens on ``device``, ``(start, length)`` (local), small
        enough for the mask's temporaries."""
        tile = _CPU_TILE_ELEMENTS if device.type == "cpu" else _TILE_ELEMENTS
        step = max(1, tile // max(1, rows * width))
        for start in range(0, length, step):
            yield start, min(step, length - start)


class Drawn:
    """One input's dropout keys (``rows`` rows, tokens ``start..start + length``, ``columns``): a key per (row,
    token) ``[rows, length]`` and per column ``[w]``, mixed from the seed and the index (lowbias32, twice for a
    token); an element is kept where its two keys' xor, scrambled (:func:`_scramble`), is at least a threshold: with
    probability ``1 - p`` in steps of 2^-32. Per element: 7 int32 kernels, and 2 to apply it (:meth:`apply`)."""

    def __init__(self, dropout: InputDropout, rows: int, start: int, length: int, columns: torch.Tensor) -> None:
        device, i32 = columns.device, torch.int32
        low, high = _int32(dropout.seed), _int32(dropout.seed >> 32)
        token = torch.arange(start, start + length, device=device, dtype=i32).view(1, -1)
        row = torch.arange(rows, device=device, dtype=i32).view(-1, 1)
        self.first, self.tokens = start, _mix(_mix(token ^ low) ^ (row * _GOLDEN + high))  # [rows, length]
        self.columns = _mix(_mix(columns.to(i32) ^ high) + low)  # [w]
        self.threshold = min(round(dropout.p * (1 << 32)) - (1 << 31), (1 << 31) - 1)
        self.scale = float(torch.tensor(1.0 / (1.0 - dropout.p), dtype=torch.float32))  # the mask's value (fp32)

    def select(self, columns: torch.Tensor) -> Drawn:
        """These keys for ``columns`` (indices into this one's) only."""
        found = copy.copy(self)
        found.columns = self.columns.index_select(0, columns)
        return found

    def keep(self, start: int, length: int) -> torch.Tensor:
        """Whether each element of tokens ``start..start + length`` is kept: ``[rows, length, w]`` bool."""
        z = torch.bitwise_xor(self.tokens.narrow(1, start - self.first, length).unsqueeze(-1), self.columns)
        return _scramble(z) >= self.threshold

    def mask(self, start: int, length: int) -> torch.Tensor:
        """:meth:`keep` as float32 of 0 and ``1 / (1 - p)``."""
        return self.keep(start, length).to(torch.float32).mul_(self.scale)

    def apply(self, x: torch.Tensor, start: int, keep: torch.Tensor | None = None) -> torch.Tensor:
        """``x [rows, length, w]`` (its first token token ``start``) dropped out: ``x * mask`` in ``x``'s dtype, the
        mask's value rounded to it (``keep``: :meth:`keep`'s, made already)."""
        keep = self.keep(start, x.shape[1]) if keep is None else keep
        return (x * keep).mul_(_rounded(self.scale, x.dtype))


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (once per value and dtype: no tensor op per tile)."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype))
