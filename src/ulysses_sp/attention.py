"""Ulysses attention: exchange sequence shards for head shards, run a local core, exchange back.

:class:`UlyssesAttention` holds everything one parallelized model needs (layout, core, wire dtype,
counters) and is reached from each attention module through an attribute set by
:func:`ulysses_sp.parallelize`, so two models with two layouts can live in one process.
:func:`ulysses_attention_forward` is the function registered with ``transformers.AttentionInterface``;
it takes exactly what transformers passes to any attention function.

Once per forward pass (a pre-hook on the decoder, see :mod:`ulysses_sp.model`) :meth:`begin_forward`
checks that every rank of the SP group holds a shard of the same shape (one tiny all-gather, so a
mismatch is a ValueError on every rank instead of a hang) and gathers the global position_ids and
padding mask (one all-gather of ``b x N`` integers) into :class:`~ulysses_sp.cores.Segments`. Every layer
then reuses them: per attention layer the only collectives are the two all-to-alls.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .comm import CommStats, all_gather_tensor, heads_to_seq, qkv_seq_to_heads
from .cores import Core, Segments
from .layout import ParallelLayout

__all__ = ["UlyssesAttention", "ulysses_attention_forward", "ulysses_mask"]

MODULE_ATTR = "_ulysses_sp"


class UlyssesAttention:
    """Per-model Ulysses state: layout, local core, wire dtype, collective counters, current segments."""

    def __init__(
        self,
        layout: ParallelLayout,
        core: Core,
        *,
        core_name: str,
        comm_dtype: torch.dtype | None = None,
        stats: CommStats | None = None,
    ) -> None:
        self.layout = layout
        self.core = core
        self.core_name = core_name
        self.comm_dtype = comm_dtype
        self.stats = stats if stats is not None else CommStats()
        # position_ids tensor of a forward pass -> its Segments. A few entries, so activation checkpointing
        # that recomputes a layer after another forward pass still finds its own documents.
        self._segments: OrderedDict[int, tuple[torch.Tensor, Segments]] = OrderedDict()

    # ---------------------------------------------------------------------------------- once per forward
    def begin_forward(
        self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch_size: int, seq_len: int
    ) -> None:
        """Validate this rank's shard against its SP group and work out the documents of the full rows.

        position_ids ``[b or 1, n]`` hold global positions; attention_mask ``[b, n]`` (or None).
        """
        layout = self.layout
        if position_ids is None:
            if layout.sp > 1:
                raise ValueError(
                    "under sequence parallelism the model needs position_ids with the GLOBAL positions of this "
                    "rank's tokens (else RoPE restarts at 0 on every shard); pass the output of "
                    "ulysses_sp.shard_batch(batch, layout) to the model"
                )
            position_ids = torch.arange(seq_len, device=layout.device)[None]
        if position_ids.dim() != 2 or position_ids.shape[-1] != seq_len:
            raise ValueError(f"position_ids must be [batch, {seq_len}], got shape {tuple(position_ids.shape)}")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be a 2-D padding mask [batch, seq] under Ulysses, got shape "
                f"{tuple(attention_mask.shape)}; 4-D masks are not supported (documents come from position_ids)"
            )
        positions = position_ids.expand(batch_size, seq_len)
        if layout.sp > 1:
            positions, attention_mask = self._gather_rows(positions, attention_mask)
        segments = Segments.from_positions(positions, attention_mask)
        self._segments[id(position_ids)] = (position_ids, segments)
        while len(self._segments) > 4:
            self._segments.popitem(last=False)

    def _gather_rows(
        self, positions: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # positions [b, n] local -> [b, N]; mask likewise. Shapes are agreed first so that a mismatch raises.
        layout, device = self.layout, positions.device
        batch, n = positions.shape
        shape = torch.tensor([batch, n, int(attention_mask is not None)], dtype=torch.long, device=device)
        shapes = all_gather_tensor(shape, layout.sp_group, self.stats).tolist()
        if any(s != shapes[0] for s in shapes):
            described = ", ".join(
                f"sp_rank {i}: batch={s[0]} seq={s[1]} mask={bool(s[2])}" for i, s in enumerate(shapes)
            )
            raise ValueError(
                "the ranks of one sequence-parallel group must hold shards of the same batch with the same "
                f"shape, got {described}; give every rank of an SP group the same batch and shard it with "
                "ulysses_sp.shard_batch"
            )
        rows = [positions.to(torch.long)]
        if attention_mask is not None:
            rows.append(attention_mask.to(device=device, dtype=torch.long))
        gathered = all_gather_tensor(torch.stack(rows), layout.sp_group, self.stats)  # [P, 1|2, b, n]
        full = gathered.permute(1, 2, 0, 3).reshape(len(rows), batch, layout.sp * n)  # [1|2, b, N]
        return full[0], (full[1] if attention_mask is not None else None)

    def segments_for(self, position_ids: torch.Tensor | None) -> Segments:
        if not self._segments:
            raise RuntimeError(
                "Ulysses attention ran before the model's forward pre-hook: call the parallelized model itself "
                "(not a single layer), or call UlyssesAttention.begin_forward first"
            )
        if position_ids is not None and id(position_ids) in self._segments:
            ref, segments = self._segments[id(position_ids)]
            if ref is position_ids:
                return segments
        return next(reversed(self._segments.values()))[1]

    # ---------------------------------------------------------------------------------- every layer
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """q ``[b, H, n, d]``, k/v ``[b, Hkv, n, d]`` (local tokens) -> ``([b, n, H, d], None)``."""
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            raise ValueError("Ulysses attention supports causal (decoder) attention only")
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"query length {query.shape[2]} != key length {key.shape[2]}: a KV cache is in use; call "
                "ulysses_sp.unparallelize(model) (or use `with plain_attention(model):`) before generating"
            )
        segments = self.segments_for(position_ids)
        group, wire = self.layout.sp_group, self.comm_dtype
        q, k, v = qkv_seq_to_heads(query, key, value, group, comm_dtype=wire, stats=self.stats)
        # q [b, H/P, N, d]; k/v [b, hkv, N, d]
        out = self.core(
            q, k, v, segments, scaling=scaling, sliding_window=sliding_window, softcap=softcap, dropout=dropout
        )  # [b, N, H/P, d]
        return heads_to_seq(out, group, comm_dtype=wire, stats=self.stats), None  # [b, n, H, d]


def _context(module: torch.nn.Module) -> UlyssesAttention:
    ctx = getattr(module, MODULE_ATTR, None)
    if ctx is None:
        raise RuntimeError(
            f"{type(module).__name__} uses a Ulysses attention implementation but was not prepared by "
            "ulysses_sp.parallelize(model, layout); parallelize the model instead of setting attn_implementation"
        )
    return ctx


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered with ``transformers.AttentionInterface`` (same signature as ``sdpa``'s)."""
    return _context(module)(module, query, key, value, attention_mask, **kwargs)


def ulysses_mask(*args, **kwargs) -> None:
    """Registered with transformers' ``AttentionMaskInterface``: Ulysses needs no dense mask.

    Padding and documents are read once per forward pass from the 2-D mask and position_ids
    (:meth:`UlyssesAttention.begin_forward`), so transformers never materialises an ``N x N`` mask.
    """
    return None
