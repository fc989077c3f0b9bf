"""Which rows of each sliced projection a stage of the head-chunked block uses, and how it reads and adds to them.

A stage is a chunk c: its query heads, and its kv heads; where the chunks share the kv heads
(:attr:`~ulysses_sp.head_split.ChunkHeads.shared_kv`), chunk 0 projects all of them and the others none, and their
gradients' sum goes back as :data:`KV`, the layer's kv heads, once. A chunk's heads are
strided over the ranks (:class:`~ulysses_sp.head_split.ChunkHeads`), so its rows of a weight are in general not one
run: a read gathers them (a copy of a chunk's weights: small next to the activations) and an addition scatters
into them (``index_add_``); a stage whose rows are one run reads a view and adds in place. A projection a stage does
not compute is :class:`Blank` there (the module's own forward still runs it, on zeros, and its result is dropped).
What a stage sends: q/k/v in the core's dtype (:func:`core_inputs`), their head counts after the exchange
(:func:`exchanged_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from .grad_sums import cast
from .head_chunk_lora import Adapter, InputDropout, adapter_seed, unsliced_states
from .tiling import compute_dtype

if TYPE_CHECKING:
    from .head_chunks import HeadChunkedAttention
    from .head_split import ChunkHeads

__all__ = ["KV", "Blank", "ChunkParts", "add_at", "core_inputs", "exchanged_heads", "rows_index", "take"]

KV = -1  # the stage of the kv heads the chunks share


def rows_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """``rows`` as a slice where they are one ascending run, else as an index tensor (sent to a GPU from pinned
    memory without waiting: from pageable memory the copy waits for the stream, at each call of each layer)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    pinned = device.type == "cuda"
    return torch.tensor(rows, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)


def take(t: torch.Tensor, dim: int, index: slice | torch.Tensor) -> torch.Tensor:
    """``t``'s rows ``index`` along ``dim``: a view for a slice, else a copy."""
    if isinstance(index, slice):
        return t.narrow(dim, index.start, index.stop - index.start)
    return t.index_select(dim, index)


def add_at(target: torch.Tensor, dim: int, index: slice | torch.Tensor, value: torch.Tensor) -> None:
    """``target``'s rows ``index`` along ``dim`` += ``value``: in place through a view for a slice, else scattered."""
    if isinstance(index, slice):
        take(target, dim, index).add_(value)
    else:
        target.index_add_(dim, index, cast(value, target.dtype))


@dataclass(frozen=True)
class Blank:
    """A projection not computed in one capture: the module's forward gets zeros of ``rows`` outputs instead.
    ``made``: the zeros made so far in this call, by shape, dtype and device (one call's captures share them)."""

    rows: int
    weight: torch.Tensor | None = field(default=None, compare=False, hash=False)  # the projection's
    made: dict[tuple, torch.Tensor] | None = field(default=None, compare=False, hash=False)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Zeros ``[..., rows]`` in the dtype ``F.linear(x, weight)`` gives (autocast's where it is on), one element
        expanded (no memory: a chunk's blank k/v were ``[t, 2 d]`` of zeros at its peak); ``x`` may be a data-less
        stand-in (only its shape is read). A module that wrote into its projection's output in place would fail
        loudly here (and its probe would keep it unchunked), never compute on shared zeros."""
        device = weight.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        key = (*x.shape[:-1], self.rows, dtype, weight.device)
        found = None if self.made is None else self.made.get(key)
        if found is None:
            found = torch.zeros((), dtype=dtype, device=weight.device).expand(*x.shape[:-1], self.rows)
            if self.made is not None:
                self.made[key] = found
        return found


class ChunkParts:
    """The rows (columns for the output projection) of ``owner``'s sliced projections for each stage of ``heads``."""

    def __init__(self, owner: HeadChunkedAttention, heads: ChunkHeads, rank: int = 0) -> None:
        self.owner, self.heads = owner, heads
        # The projections' LoRA adapters as the call found them (backward uses the same, whatever train() / eval()
        # or adapter switches happen before it), and the call's seed for their input dropout (drawn only if one has)
        names = (*owner.names.query, *owner.names.kv, owner.names.out)
        # the projections' linear layers as the call found them (looked up once per call, not per use)
        self.linears: dict[str, nn.Module] = {name: owner.projection(name) for name in names}
        self._adapters = {name: owner.adapters(name) for name in names}
        self.unsliced = unsliced_states(owner.module, {owner.module._modules[name] for name in names})
        active = any(a.p > 0 for found in self._adapters.values() for a in found)
        self.seed, self.rank = (owner.dropout_seed() if active else 0), rank
        self._dropouts = {  # one per adapter and call: its dropout keys are made once (InputDropout.keys)
            (name, i): InputDropout(a.p, adapter_seed(self.seed, name, i, rank))
            for name, found in self._adapters.items()
            for i, a in enumerate(found)
            if a.p > 0
        }
        self.shared_kv = heads.shared_kv
        self.stages = list(range(heads.chunks))  # (the shared kv heads: projected in chunk 0's capture)
        # the layer's, kept across calls for this split (an index tensor made once, not per call)
        self._index = owner.row_indices.setdefault(heads, {})
        self._blanks: dict[tuple, torch.Tensor] = {}  # the call's blank projections' zeros (Blank.made)

    @property
    def out_proj(self) -> nn.Module:
        """The output projection's linear layer (a LoRA layer's base layer)."""
        return self.linears[self.owner.names.out]

    def head_ids(self, name: str, stage: int) -> list[int] | None:
        """The heads of projection ``name`` that ``stage`` computes, in order (None: it is blank there)."""
        names, heads = self.owner.names, self.heads
        is_query = name in names.query or name == names.out
        if stage == KV:
            return None if is_query else list(range(heads.num_kv_heads))
        if is_query:
            return heads.query_ids(stage)
        return heads.kv_ids(stage) if not self.shared_kv or stage == 0 else None

    def projects_shared_kv(self, stage: int) -> bool:
        """Whether ``stage`` is the chunk whose capture projects the kv heads the chunks share (chunk 0), with its
        query heads: one capture, not one of the kv heads and their blank queries and one of the queries and their
        blank kv heads (whose RoPE the module's forward would still run)."""
        return self.shared_kv and stage == 0

    def head_counts(self, stage: int) -> tuple[int, int]:
        """The query and kv head counts the module's forward sees in ``stage``'s capture (a blank projection's
        included: where the chunks share the kv heads, chunk 0 projects all of them, the other chunks one blank)."""
        heads = self.heads
        if not self.shared_kv:
            return heads.heads_per_chunk, heads.kv_per_chunk
        return heads.heads_per_chunk, heads.num_kv_heads if stage == 0 else 1

    def _width(self, name: str) -> int:
        proj = self.linears[name]
        if name == self.owner.names.out:
            return proj.in_features // self.heads.num_heads
        per = self.heads.num_heads if name in self.owner.names.query else self.heads.num_kv_heads
        return proj.out_features // per

    def index(self, name: str, stage: int, device: torch.device) -> slice | torch.Tensor:
        """``stage``'s rows of ``name`` (its columns for the output projection): a slice where they are one run,
        else their indices."""
        key = (name, stage, device)
        if key not in self._index:
            ids, per = self.head_ids(name, stage), self._width(name)
            if ids is None:
                raise RuntimeError(f"{name} is blank in stage {stage}")
            self._index[key] = rows_index([h * per + i for h in ids for i in range(per)], device)
        return self._index[key]

    def shared_rows(self, chunk: int, blocks: int, device: torch.device) -> slice | torch.Tensor:
        """Where the chunks share the kv heads: the rows of them that chunk ``chunk`` reads
        (:meth:`~ulysses_sp.head_split.ChunkHeads.shared_rows`), made once for the layer."""
        key = ("shared kv rows", chunk, blocks, device)
        if key not in self._index:
            self._index[key] = rows_index(self.heads.shared_rows(chunk, blocks), device)
        return self._index[key]

    def _dim(self, name: str, t: torch.Tensor) -> int:
        return 1 if name == self.owner.names.out and t.dim() == 2 else 0

    def part(self, name: str, stage: int, t: torch.Tensor) -> torch.Tensor:
        """``stage``'s part of ``t``, a weight or bias (or its gradient) of ``name``: a view where its rows are one
        run, else a copy. The output projection's bias is whole."""
        if name == self.owner.names.out and t.dim() == 1:
            return t
        return take(t, self._dim(name, t), self.index(name, stage, t.device))

    def add(self, name: str, stage: int, target: torch.Tensor, value: torch.Tensor) -> None:
        """``target``'s part for ``stage`` += ``value`` (``target`` a whole weight's, or bias', sum)."""
        if name == self.owner.names.out and target.dim() == 1:
            target.add_(value)
            return
        add_at(target, self._dim(name, target), self.index(name, stage, target.device), value)

    def add_mm(self, name: str, stage: int, target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """``target``'s part for ``stage`` += ``a @ b``: in place where its rows are one run (no product tensor)."""
        index = self.index(name, stage, target.device)
        if isinstance(index, slice):
            part = self.part(name, stage, target)
            if part.dtype == a.dtype:
                part.addmm_(a, b)
                return
        self.add(name, stage, target, a.mm(b))

    def adapters(self, name: str, stage: int | None = None) -> tuple[Adapter, ...]:
        """Projection ``name``'s LoRA adapters with the dropout of their input in this call and ``stage``'s rows of
        their B (a view or copy of the parameter, so that autograd reaches the parameter where it differentiates
        them; None: B whole)."""
        found = []
        for index, a in enumerate(self._adapters[name]):
            dropout = self._dropouts.get((name, index))
            b = a.b_param if stage is None else self.part(name, stage, a.b_param)
            found.append(replace(a, b=b, dropout=dropout))
        return tuple(found)

    def columns(self, stage: int, device: torch.device) -> torch.Tensor:
        """The output projection's input columns that chunk ``stage`` has, as indices."""
        index = self.index(self.owner.names.out, stage, device)
        if isinstance(index, slice):
            key = ("columns", stage, device)
            if key not in self._index:
                self._index[key] = torch.arange(index.start, index.stop, device=device)
            return self._index[key]
        return index

    def _blank_rows(self, name: str, stage: int) -> int:
        """The outputs of projection ``name`` where it is blank in ``stage`` (0: it is computed there); the layer's,
        worked out at its first call."""
        key = ("blank rows", name, stage)
        if key not in self._index:
            query, kv = self.head_counts(stage)
            blank = self.head_ids(name, stage) is None
            self._index[key] = (query if name in self.owner.names.query else kv) * self._width(name) if blank else 0
        return self._index[key]

    def weights(self, stage: int, *, leaves: bool = False) -> dict[str, tuple]:
        """``stage``'s ``(weight, bias, adapters)`` of every sliced input projection: its parts, or (``leaves``)
        detached parts that autograd differentiates separately, and its LoRA adapters (:meth:`adapters`);
        ``(Blank, None, ())`` for one it does not compute."""
        found: dict[str, tuple] = {}
        for name in (*self.owner.names.query, *self.owner.names.kv):
            proj = self.linears[name]
            rows = self._blank_rows(name, stage)
            if rows:
                found[name] = (Blank(rows, proj.weight, self._blanks), None, ())
                continue
            pair = []
            for t in (proj.weight, proj.bias):
                if t is not None and leaves:
                    pair.append(self.part(name, stage, t.detach()).requires_grad_(t.requires_grad))
                else:
                    pair.append(None if t is None else self.part(name, stage, t))
            found[name] = (pair[0], pair[1], self.adapters(name, stage))
        return found


def exchanged_heads(heads: int, kv_heads: int, sp: int) -> list[int]:
    """The q/k/v head counts on one rank after the exchange: H/P query heads, max(Hkv/P, 1) kv heads each."""
    hkv = max(kv_heads // sp, 1)
    return [heads // sp, hkv, hkv]


def core_inputs(x: torch.Tensor, *qkv: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """q/k/v in the dtype the core computes in: under autocast its dtype (the model's RoPE may have made q and k
    fp32; autocast's sdpa casts them, and so does this before the exchange), else as they are (None stays)."""
    dtype = compute_dtype(x)
    return tuple([None if t is None else cast(t, dtype) for t in qkv])
