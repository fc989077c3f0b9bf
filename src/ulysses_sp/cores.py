"""Local attention cores: exact causal attention over the FULL sequence for this rank's heads.

After the sequence -> heads exchange every rank holds q ``[b, h, N, d]`` and k/v ``[b, hkv, N, d]``
(``h`` divisible by ``hkv``). A core returns ``[b, N, h, d]`` (the layout transformers' attention
functions return). Documents packed in one row and padding are described by :class:`Segments`, worked out
once per forward pass; no core builds an O(N^2) mask:

* ``sdpa``: ``scaled_dot_product_attention`` once per document (one call for the whole batch when every
  row is one document); sliding windows in blocks of ``window`` queries, so memory is O(N * window). On
  CUDA, rows packed with many documents go to one ``flex_attention`` call instead (:func:`packed_kernel`).
* ``eager``: explicit softmax(q k^T) per document, the reference; supports ``softcap``.
* ``flex_attention``: one ``flex_attention`` call with a document (+ window) ``BlockMask``; on CUDA compiled
  with automatic dynamic shapes (:func:`compiled_flex`), so new lengths do not compile again and again.
* ``flash_attention_2`` / ``flash_attention_3``: varlen kernels fed with ``cu_seqlens`` (CUDA only; :mod:`.flash_core`).

Padding tokens get a zero output (they never feed a real token; a target on padding whose output one process
makes otherwise is refused before any core runs: :func:`ulysses_sp.shard_batch`, :mod:`ulysses_sp.masks`).
Sliding window ``W`` follows transformers: query ``i`` sees keys ``j`` with ``i - W < j <= i``.

A core is any callable with the signature of :func:`sdpa_core`, so new kernels (a ring core for the
hybrid layout) plug in without touching the exchange.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .flash_core import FLASH_MODULES, flash_core
from .validation import hole_message

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

__all__ = [
    "CORES",
    "AttentionCall",
    "Core",
    "Segments",
    "check_core_trains",
    "compiled_flex",
    "eager_core",
    "flex_compiles",
    "flex_block_mask",
    "flex_core",
    "get_core",
    "packed_kernel",
    "sdpa_core",
]

Core = Callable[..., torch.Tensor]
FLEX_MIN_HEAD_DIM_CUDA = 16  # torch's compiled flex_attention kernels reject smaller head dims
FLEX_NO_BACKWARD_DEVICES = ("cpu", "mps")  # torch's flex_attention refuses inputs that require grad there
# The sdpa core hands packed rows to flex_attention on CUDA above this many documents per row (on average):
# below it the per-document sdpa loop is a few calls of the fastest kernel. Measured on an H200 (2026-11-30,
# benchmarks/packed_attention.py, 32K tokens, one layer's core fwd + bwd, BENCHMARKS.md section 5): at 8 documents
# a row the loop and flex tie (2.53 / 2.58 ms), at 32 flex takes 0.24x of the loop's time, at 512 0.02x.
FLEX_MIN_DOCS_PER_ROW = 8


@dataclass(eq=False)
class Segments:
    """Documents and padding of a batch of full rows ``[b, N]``: per row, the valid ``(start, end)`` spans.

    Built by :meth:`from_positions` from global position_ids (a document starts wherever the position is
    not the previous one plus 1, as in transformers' packed-sequence detection) and the 2-D padding mask.
    Derived forms (``cu_seqlens`` for varlen kernels, a flex ``BlockMask``) are built on first use and
    kept for the rest of the forward pass.
    """

    batch: int
    seq_len: int
    spans: list[list[tuple[int, int]]]
    device: torch.device
    max_position: int = 0  # the largest position id of the full rows (length-dependent RoPE reads it)
    _cache: dict = field(default_factory=dict, repr=False)
    # True when every row is a single document without padding (one kernel call for the batch). A bool worked out
    # once, which torch.compile guards on alone (reading the spans, it would guard on each: a recompile per length)
    is_dense: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_dense = all(row == [(0, self.seq_len)] for row in self.spans)

    @classmethod
    def from_positions(
        cls, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, documents: bool = True
    ) -> Segments:
        """position_ids ``[b, N]`` (global), attention_mask ``[b, N]`` (1 = token, 0 = padding) or None.

        ``documents=False``: position restarts do not start a document (each row's valid tokens are one span),
        for models whose own mask lets packed documents attend to each other.
        """
        batch, seq_len = position_ids.shape
        pos = position_ids.to("cpu", torch.long)
        starts = torch.zeros(batch, seq_len, dtype=torch.bool)
        starts[:, 0] = True
        if documents:
            starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
        if attention_mask is not None:
            valid = attention_mask.to("cpu").bool()
            starts[:, 1:] |= valid[:, 1:] != valid[:, :-1]
        spans: list[list[tuple[int, int]]] = []
        for row in range(batch):
            idx = torch.nonzero(valid[row]).flatten()
            if len(idx) and not bool(valid[row, int(idx[0]) : int(idx[-1]) + 1].all()):
                hole = int(idx[0]) + int(torch.nonzero(~valid[row, int(idx[0]) :]).flatten()[0])
                raise ValueError(hole_message(row, hole))
            begin = torch.nonzero(starts[row]).flatten().tolist()
            ends = begin[1:] + [seq_len]
            row_valid = valid[row]
            spans.append([(s, e) for s, e in zip(begin, ends, strict=True) if bool(row_valid[s])])
        largest = int(pos.max()) if pos.numel() else 0
        return cls(batch=batch, seq_len=seq_len, spans=spans, device=position_ids.device, max_position=largest)

    def cached(self, key: object, build: Callable[[], object]) -> object:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def varlen(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(token_index ``[T]`` into the flattened ``[b*N]`` tokens, cu_seqlens ``[docs+1]`` int32, max_len)."""

        def build() -> tuple[torch.Tensor, torch.Tensor, int]:
            index, lengths = [], []
            for row, spans in enumerate(self.spans):
                for s, e in spans:
                    index.append(torch.arange(row * self.seq_len + s, row * self.seq_len + e))
                    lengths.append(e - s)
            token_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
            cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
            return token_index.to(self.device), cu.to(self.device), max(lengths, default=0)

        return self.cached("varlen", build)  # type: ignore[return-value]

    def doc_ids(self) -> torch.Tensor:
        """``[b, N]`` document id per token (unique across the batch); -1 for padding."""

        def build() -> torch.Tensor:
            ids = torch.full((self.batch, self.seq_len), -1, dtype=torch.int32)
            doc = 0
            for row, spans in enumerate(self.spans):
                for s, e in spans:
                    ids[row, s:e] = doc
                    doc += 1
            return ids.to(self.device)

        return self.cached("doc_ids", build)  # type: ignore[return-value]


@dataclass
class AttentionCall:
    """What one attention call needs besides q/k/v: its documents, window, scaling, softcap, dropout, the value
    head dim (the output is sliced back to it) and the one width q, k and v travel at."""

    segments: Segments
    window: int | None
    scaling: float | None
    softcap: float | None
    dropout: float
    d_v: int
    width: int


def _per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, attend: Callable
) -> torch.Tensor:
    # q [b, h, N, d]; k/v [b, hkv, N, d] -> [b, N, h, d]; attend(q_doc, k_doc, v_doc) -> [1, h, L, d].
    # Rows and documents are cut with split(), whose backward concatenates the pieces' gradients
    # (slicing would zero-fill a full-size buffer per document). Padding gaps get a zero output.
    rows = []
    for row, (qr, kr, vr) in enumerate(zip(q.split(1), k.split(1), v.split(1), strict=True)):
        bounds, cursor = [], 0
        for s, e in segments.spans[row]:
            if s > cursor:
                bounds.append((cursor, s, False))
            bounds.append((s, e, True))
            cursor = e
        if cursor < segments.seq_len:
            bounds.append((cursor, segments.seq_len, False))
        sizes = [e - s for s, e, _ in bounds]
        pieces = zip(qr.split(sizes, dim=2), kr.split(sizes, dim=2), vr.split(sizes, dim=2), bounds, strict=True)
        outs = [attend(qd, kd, vd) if is_doc else torch.zeros_like(qd) for qd, kd, vd, (_, _, is_doc) in pieces]
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2)


def _window_mask(q_start: int, q_len: int, k_start: int, k_len: int, window: int, device) -> torch.Tensor:
    # [q_len, k_len] bool: key j visible to query i iff i - window < j <= i (absolute positions).
    qi = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    kj = torch.arange(k_start, k_start + k_len, device=device)[None, :]
    return (kj <= qi) & (kj > qi - window)


# ---------------------------------------------------------------------------------------------- sdpa
def sdpa_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` per document; q ``[b, h, N, d]``, k/v ``[b, hkv, N, d]`` -> ``[b, N, h, d]``."""
    if softcap is not None:
        raise ValueError(
            f"the sdpa core cannot apply attention logit softcapping (softcap={softcap}); "
            "use core='eager' or core='flash_attention_2', or set attn_logit_softcapping=None in the config"
        )
    gqa = q.shape[1] != k.shape[1]

    def causal(qd, kd, vd):
        return F.scaled_dot_product_attention(
            qd, kd, vd, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )

    def windowed(qd, kd, vd):
        length = qd.shape[2]
        if sliding_window is None or length <= sliding_window:
            return causal(qd, kd, vd)
        outs, masks = [], {}
        for start in range(0, length, sliding_window):  # blocks of `window` queries: O(L * window) memory
            stop = min(start + sliding_window, length)
            k_lo = max(0, start - sliding_window + 1)
            shape = (stop - start, stop - k_lo)  # the mask depends on the block's shape only
            if shape not in masks:
                masks[shape] = _window_mask(start - k_lo, shape[0], 0, shape[1], sliding_window, qd.device)
            mask = masks[shape]
            outs.append(
                F.scaled_dot_product_attention(
                    qd[:, :, start:stop],
                    kd[:, :, k_lo:stop],
                    vd[:, :, k_lo:stop],
                    attn_mask=mask,
                    dropout_p=dropout,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
        return torch.cat(outs, dim=2)

    if segments.is_dense and (sliding_window is None or segments.seq_len <= sliding_window):
        return causal(q, k, v).transpose(1, 2)
    if packed_kernel(segments, q.device, q.shape[-1], dropout) == "flex":
        return flex_core(q, k, v, segments, scaling=scaling, sliding_window=sliding_window)
    return _per_document(q, k, v, segments, windowed)


def packed_kernel(segments: Segments, device: torch.device, head_dim: int, dropout: float = 0.0) -> str:
    """How the sdpa core runs rows that hold several documents: ``"flex"`` or ``"per_document"``.

    On CUDA, rows packed with many documents (on average more than :data:`FLEX_MIN_DOCS_PER_ROW`) take ONE
    compiled ``flex_attention`` call with a document ``BlockMask`` instead of one sdpa call per document, so
    packing costs one kernel launch per layer; when flex cannot run (CPU, where it is eager and dense; no
    triton; attention dropout; a head dim < 16) the per-document loop stays. Both are exact.
    """
    if dropout or not flex_compiles(device, head_dim):
        return "per_document"
    documents = sum(len(row) for row in segments.spans)
    return "flex" if documents > FLEX_MIN_DOCS_PER_ROW * segments.batch else "per_document"


def flex_compiles(device: torch.device, head_dim: int) -> bool:
    """True where a compiled ``flex_attention`` (forward and backward) runs: CUDA, triton, head dim >= 16."""
    return device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM_CUDA and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# ---------------------------------------------------------------------------------------------- eager
def eager_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Explicit softmax attention per document (the reference core); supports softcap. O(L^2) per document."""
    groups = q.shape[1] // k.shape[1]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5

    def attend(qd, kd, vd):
        kd, vd = kd.repeat_interleave(groups, dim=1), vd.repeat_interleave(groups, dim=1)
        scores = torch.matmul(qd, kd.transpose(2, 3)) * scale  # [1, h, L, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        length = qd.shape[2]
        mask = _window_mask(0, length, 0, length, sliding_window or length + 1, qd.device)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qd.dtype)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        return torch.matmul(probs, vd)

    return _per_document(q, k, v, segments, attend)


# ---------------------------------------------------------------------------------------------- flex
def flex_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    *,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """One ``flex_attention`` call with a document/window ``BlockMask`` built once per forward pass."""
    from torch.nn.attention.flex_attention import flex_attention

    if dropout:
        raise ValueError(f"the flex_attention core has no attention dropout (dropout={dropout}); use sdpa")
    check_flex_head_dim(q.shape[-1], q.device)
    if q.requires_grad or k.requires_grad or v.requires_grad:  # (torch's own refusal: a NotImplementedError)
        check_core_trains("flex_attention", q.device.type)
    docs = segments.doc_ids()
    window = sliding_window

    def mask_mod(b, h, qi, kj):
        same = (docs[b, qi] == docs[b, kj]) & (docs[b, qi] >= 0)
        keep = same & (kj <= qi)
        if window is not None:
            keep = keep & (kj > qi - window)
        return keep

    # On CUDA both are compiled, so neither the block mask nor the scores are ever dense. On CPU flex runs
    # eagerly (dense scores, forward only in torch): a reference path, not one for long sequences.
    n = segments.seq_len
    block_mask = segments.cached(("flex", window), lambda: flex_block_mask(mask_mod, segments.batch, n, n, q.device))
    attend = compiled_flex() if q.is_cuda else flex_attention
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, qi, kj):
            return torch.tanh(score / softcap) * softcap

    out = attend(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
    )
    valid = (docs >= 0).to(out.dtype)[:, None, :, None]  # padding rows -> 0, as in the other cores
    return (out * valid).transpose(1, 2)


def check_flex_head_dim(head_dim: int, device: torch.device) -> None:
    """ValueError when flex_attention cannot run this head dim on this device (CUDA needs >= 16)."""
    if device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM_CUDA:
        raise ValueError(
            f"the flex_attention core needs a head dim >= {FLEX_MIN_HEAD_DIM_CUDA} on CUDA (its compiled kernel "
            f"does not support less), got head dim {head_dim}; use core='sdpa' for this model"
        )


@functools.cache
def compiled_flex() -> Callable:
    """``flex_attention`` compiled once per process, with automatic dynamic shapes (``dynamic=None``).

    The first call compiles a kernel for its shapes; the first call at another length compiles once more, a kernel
    generic in the sizes that changed (sequence length, block counts), which every later length reuses: about three
    compiles in all (a one-block length, 128 tokens or fewer, stays specialised). With ``dynamic=False`` every new
    length compiled again, and past ``torch._dynamo.config.recompile_limit`` (8) torch ran flex_attention uncompiled,
    with dense ``[q, k]`` scores, logging one warning: padding-free batches, a new length nearly every step, hit it
    within a few steps. One length compiles once, as before. The cache is torch's, per code object, so it is shared
    with every other ``torch.compile`` of flex_attention in the process (each variant of mask or score function
    takes an entry of the same limit).
    """
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)


@functools.cache
def _compiled_block_mask() -> Callable:
    """``create_block_mask`` compiled once per process, with automatic dynamic shapes as :func:`compiled_flex`: torch's
    advice in place of its deprecated ``create_block_mask(_compile=True)``, which compiles it the same way."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=None)


def flex_block_mask(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` (one for every head): compiled on CUDA, so no dense ``[q, k]`` mask is ever
    built; eagerly elsewhere (flex itself runs eagerly and densely there)."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled_block_mask() if device.type == "cuda" else create_block_mask
    return build(mask_mod, batch, None, q_len, kv_len, device=device)


CORES: dict[str, Core] = {
    "sdpa": sdpa_core,
    "eager": eager_core,
    "flex_attention": flex_core,
    **{name: flash_core(module) for name, module in FLASH_MODULES.items()},
}


def get_core(name: str, *, instead: str = "core='sdpa'") -> Core:
    """Look up a core by name; ValueError for unknown names or a flash core whose package is missing.
    ``instead``: how the caller's user asks for sdpa, for the message (``ulysses-sp train``: ``--attn-core sdpa``)."""
    if name not in CORES:
        raise ValueError(f"unsupported attention core {name!r}; choose one of {sorted(CORES)}")
    module = FLASH_MODULES.get(name)
    if module is not None:
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"core {name!r} needs the {module!r} package, which is not importable; install it "
                f"(`pip install ulysses-sp[flash]` on a CUDA machine) or use {instead}"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"core {name!r} needs a CUDA device; use {instead} on CPU")
    return CORES[name]


def check_core_trains(name: str, device_type: str, *, instead: str = "core='sdpa'") -> None:
    """ValueError when core ``name`` cannot make gradients on a ``device_type`` device: flex_attention on a CPU
    (or MPS), where torch refuses q/k/v that require grad (it has no backward kernel there; its forward under
    ``torch.no_grad()`` runs). ``instead``: how the caller's user asks for sdpa, as in :func:`get_core`."""
    if name == "flex_attention" and device_type in FLEX_NO_BACKWARD_DEVICES:
        raise ValueError(
            f"core 'flex_attention' cannot train on a {device_type} device (torch's flex_attention has no backward "
            f"there, only a forward under torch.no_grad()); use {instead} to train, or flex_attention on CUDA"
        )
