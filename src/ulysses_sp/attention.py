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

With a ring (``layout.ring > 1``, hybrid Ulysses x Ring) the all-to-alls run inside the Ulysses group and
the core is :func:`ulysses_sp.ring.ring_attention` over the ring group; the gathered positions are put
back from the zigzag order of :func:`ulysses_sp.shard_batch` into sequence order.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .comm import CommStats, all_gather_tensor, heads_to_seq, qkv_seq_to_heads
from .compile_boundary import run_eagerly
from .cores import AttentionCall, Core, Segments
from .forward_segments import ForwardPasses
from .layout import ParallelLayout
from .masks import DecoderMasks, ids_positions_problem, left_padding_problem, mask_window
from .ring import from_zigzag, ring_attention
from .sliced_core import sliced_core
from .validation import (
    IGNORE_INDEX,
    PeerRejected,
    Report,
    check_id_ranges,
    cut_problem,
    gather_reports,
    id_range,
    input_problem,
    replicas_agree,
)

__all__ = [
    "INTERCEPT_ATTR",
    "RING_CORES",
    "UlyssesAttention",
    "check_ring_core",
    "intercepting",
    "pad_qkv",
    "ulysses_attention_forward",
]

MODULE_ATTR = "_ulysses_sp"
_UNSET = object()
# Core names a ring accepts: both compute exact attention, as the ring's block kernels do (sdpa: the device's
# fused kernel, eager: the plain-PyTorch reference kernel; see ulysses_sp.ring_kernels).
RING_CORES = ("sdpa", "eager")
# An attribute a caller may set on an attention module (see ulysses_sp.head_chunks): a callable that receives the
# module's attention call instead of Ulysses (to capture q/k/v, or to run a local reference attention).
INTERCEPT_ATTR = "_ulysses_sp_intercept"


@contextlib.contextmanager
def intercepting(module: nn.Module, handler: Callable) -> Iterator[None]:
    """While inside, ``module``'s attention call goes to ``handler`` (called as the attention function is)."""
    module.__dict__[INTERCEPT_ATTR] = handler
    try:
        yield
    finally:
        module.__dict__.pop(INTERCEPT_ATTR, None)


def pad_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad the last dim of q/k/v to ``width`` (MLA: v head dim != qk head dim); as is when it is already."""

    def pad(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] != width else x

    return pad(query), pad(key), pad(value)


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
        vocab_size: int | None = None,
        masks: DecoderMasks | None = None,
        slice_budget_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        # None: the core runs as it is; else its heads in slices where the sdpa core's kernel buffers would exceed
        # it (ulysses_sp.sliced_core)
        self.slice_budget_bytes = slice_budget_bytes
        self.core = core
        self.core_name = core_name
        self.comm_dtype = comm_dtype
        self.stats = stats if stats is not None else CommStats()
        self.vocab_size = vocab_size  # input_ids / labels outside [0, vocab_size) are refused on every rank
        self.masks = masks if masks is not None else DecoderMasks()  # what the model's own mask does
        # True while a caller replaces the load-balancing loss the model computes from its shard with the whole
        # sequence's (ulysses_sp.integrations.trl_sft): labels with router logits are then not refused
        self.router_aux_by_caller = False
        self.head_chunks: int | None = None  # parallelize's head_chunks (None: automatic), for apply_features
        self.forwards = ForwardPasses()  # the forward passes alive: their documents, for each attention call
        # Called (no arguments) in backward once per attention call, when its q/k/v projections' outputs have
        # their gradient: the attention's own backward working set is gone (ulysses_sp.offload times its
        # prefetch of the next layer input by it).
        self.backward_hooks: list[Callable[[], None]] = []

    def __deepcopy__(self, memo: dict) -> UlyssesAttention:
        # copy.deepcopy of a parallelized model (an EMA or reference copy): process groups cannot be copied, so
        # the copy shares the layout and the core; it gets its own counters and its own forward passes.
        new = UlyssesAttention(
            self.layout,
            self.core,
            core_name=self.core_name,
            comm_dtype=self.comm_dtype,
            stats=copy.deepcopy(self.stats, memo),
            vocab_size=self.vocab_size,
            masks=self.masks,
            slice_budget_bytes=self.slice_budget_bytes,
        )
        memo[id(self)] = new
        new.backward_hooks = copy.deepcopy(self.backward_hooks, memo)  # bound to the copied model's own parts
        return new

    def attention_done(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` (an attention call's input) as it is, with :attr:`backward_hooks` called when its gradient
        is made in backward (it is made with k's and v's, by the exchange's adjoint)."""
        if self.backward_hooks and torch.is_grad_enabled() and query.requires_grad:
            return _AttentionDone.apply(query, self.backward_hooks)
        return query

    # ---------------------------------------------------------------------------------- once per forward
    def begin_forward(
        self,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        batch_size: int,
        seq_len: int,
        *,
        input_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> None:
        """Validate this rank's shard against its SP group and work out the documents of the full rows.

        position_ids ``[b or 1, n]`` hold global positions; attention_mask ``[b, n]`` (or None); input_ids
        and targets (labels given to the model, -100 ignored) are checked against ``vocab_size``. Under
        sp > 1 every check is agreed across the SP group before any other collective, so bad input on one
        rank raises a ValueError on every rank instead of leaving the others waiting; with dp > 1 (sp = 1
        included) the verdict is then shared with the other replicas too
        (:func:`~ulysses_sp.validation.replicas_agree`).
        """
        with replicas_agree(self.layout):
            position_ids, segments = self._checked_segments(
                position_ids, attention_mask, batch_size, seq_len, input_ids=input_ids, targets=targets
            )
        self.forwards.add(position_ids, segments)

    def _checked_segments(
        self,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        batch_size: int,
        seq_len: int,
        *,
        input_ids: torch.Tensor | None,
        targets: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Segments]:
        # (the position_ids the forward runs with, the documents of the full rows); ValueError for bad input
        layout = self.layout
        problem = input_problem(position_ids, attention_mask, batch_size, seq_len, layout.sp)
        problem = problem or cut_problem(position_ids, layout)  # a shard cut for another layout
        if input_ids is not None and (input_ids.is_floating_point() or input_ids.dtype == torch.bool):
            problem = problem or f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; use .long()"
            input_ids = None
        device = layout.device
        ranges = torch.stack([*id_range(input_ids, None, device), *id_range(targets, IGNORE_INDEX, device)])  # [4]
        if layout.sp > 1:
            self._agree(batch_size, seq_len, attention_mask is not None, problem, ranges)
        elif problem is not None:
            raise ValueError(problem)
        else:
            check_id_ranges([ranges.tolist()], self.vocab_size)
        given = position_ids is not None
        if not given:  # sp == 1: the model's own default positions
            position_ids = torch.arange(seq_len, device=layout.device)[None]
        positions = position_ids.expand(batch_size, seq_len)
        # the token ids, where the model numbers tokens from them when given no position_ids (RoBERTa)
        ids = input_ids if given and self.masks.positions_from_ids is not None else None
        if layout.sp > 1:
            positions, attention_mask, ids = self._gather_rows(positions, attention_mask, ids)
        # the full rows from here on: every check below gives the same verdict on every rank
        problem = left_padding_problem(positions if given else None, attention_mask, self.masks)
        problem = problem or ids_positions_problem(positions, ids, attention_mask, self.masks)
        if problem is not None:
            raise ValueError(problem)
        segments = Segments.from_positions(positions, attention_mask, documents=self.masks.documents is not False)
        if self.masks.documents is None and any(len(row) > 1 for row in segments.spans):
            raise ValueError(
                f"{self.masks.decoder} builds its attention mask in a way Ulysses cannot read, so it cannot tell "
                "whether one process keeps packed documents apart; give one document per row (pad instead of "
                "packing) for this model"
            )
        return position_ids, segments

    def _agree(self, batch: int, seq_len: int, has_mask: bool, problem: str | None, ranges: torch.Tensor) -> None:
        # One tiny self-checked all-gather of (batch, seq, mask?, bad input?, id ranges) over the SP group.
        head = torch.tensor([batch, seq_len, int(has_mask), int(problem is not None)], dtype=torch.long)
        report = torch.cat([head.to(ranges.device), ranges])
        reports = gather_reports(report, Report.FORWARD, self.layout.sp_group, self.stats)
        if problem is not None:
            raise ValueError(problem)
        bad = [i for i, r in enumerate(reports) if r[3]]
        if bad:
            raise PeerRejected(
                f"sp_rank(s) {bad} of this sequence-parallel group rejected their input (see their error)"
            )
        if any(r[:3] != reports[0][:3] for r in reports):
            described = ", ".join(
                f"sp_rank {i}: batch={r[0]} seq={r[1]} mask={bool(r[2])}" for i, r in enumerate(reports)
            )
            raise ValueError(
                "the ranks of one sequence-parallel group must hold shards of the same batch with the same "
                f"shape, got {described}; give every rank of an SP group the same batch and shard it with "
                "ulysses_sp.shard_batch"
            )
        check_id_ranges([r[4:] for r in reports], self.vocab_size)

    def _gather_rows(
        self, positions: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        # positions [b, n] local -> [b, N]; mask and input_ids likewise (shapes already agreed by _agree).
        layout, device = self.layout, positions.device
        batch, n = positions.shape
        given = [t for t in (attention_mask, input_ids) if t is not None]
        rows = [positions.to(torch.long), *(t.to(device=device, dtype=torch.long) for t in given)]
        gathered = all_gather_tensor(torch.stack(rows), layout.sp_group, self.stats)  # [P, 1..3, b, n]
        full = gathered.permute(1, 2, 0, 3).reshape(len(rows), batch, layout.sp * n)  # [1..3, b, N]
        full = from_zigzag(full, layout.ring, dim=2)  # shard_batch dealt a ring's tokens in zigzag order
        mask = full[1] if attention_mask is not None else None
        return full[0], mask, (full[-1] if input_ids is not None else None)

    def segments_for(self, position_ids: torch.Tensor | None) -> Segments:
        """The Segments of the forward pass that ``position_ids`` belongs to."""
        return self.forwards.find(position_ids)

    # ---------------------------------------------------------------------------------- every layer
    def prepare(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None | object = _UNSET,
        softcap: float | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> AttentionCall:
        """Check one call of the attention function and work out what its core needs (see :meth:`__call__`).

        The window is the one the model's own mask gives this layer: ``attention_mask`` is what
        :func:`ulysses_mask` returned for it (None: causal, a :class:`SlidingWindowMask`: that window); any
        other mask is one the model made itself, which Ulysses cannot apply (ValueError). A ``sliding_window``
        the model passes must agree with its mask (OLMoE passes the config's key but masks causally).
        """
        window = mask_window(module, attention_mask)
        if sliding_window is not _UNSET and (sliding_window or None) != window:
            raise ValueError(
                f"{type(module).__name__} passes sliding_window={sliding_window} to its attention function, but the "
                f"mask its model builds for this layer applies {f'a window of {window}' if window else 'no window'} "
                "(transformers applies the first under flash attention and the second under sdpa/eager, so one "
                "process gives different losses); make them agree, e.g. remove sliding_window from the config"
            )
        if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
            raise ValueError(
                f"{type(module).__name__} runs bidirectional (non-causal) attention, and Ulysses attention supports "
                "causal (decoder) attention only; a BERT-style model trained as a causal LM needs is_decoder=True"
            )
        for name in ("s_aux", "sinks"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{type(module).__name__} uses attention sinks ({name}), which Ulysses does not support yet; "
                    "results would be silently wrong, so this model cannot be parallelized"
                )
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"query length {query.shape[2]} != key length {key.shape[2]}: a KV cache is in use; call "
                "ulysses_sp.unparallelize(model) (or use `with plain_attention(model):`) before generating"
            )
        # MLA (DeepSeek-V2/V3) has a v head dim != the q/k head dim: the narrower side is zero-padded to one
        # width (pad_qkv) so q, k and v still travel in one all-to-all (zeros change no score and no output).
        d_qk, d_v = query.shape[-1], value.shape[-1]
        if d_v > d_qk and scaling is None:
            scaling = d_qk**-0.5
        return AttentionCall(self.segments_for(position_ids), window, scaling, softcap, dropout, d_v, max(d_qk, d_v))

    def core_for(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
    ) -> torch.Tensor:  # [b, N/R, h, d_v]
        """The local core (the ring's in a hybrid layout) on head-sharded q/k/v, the padding sliced off."""
        if not call.segments.is_dense or self.layout.ring > 1:
            return self._core_eagerly(q, k, v, call)
        return self._core(q, k, v, call)

    @run_eagerly(
        "runs attention eagerly over packed documents or padding (a graph would hold this batch's spans: a compile "
        "per batch) and in a ring (its point-to-point exchanges)"
    )
    def _core_eagerly(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        return self._core(q, k, v, call)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        if self.layout.ring == 1 and self.slice_budget_bytes is not None:
            out = sliced_core(q, k, v, call, core_name=self.core_name, budget_bytes=self.slice_budget_bytes)
            if out is not None:
                return out  # [b, N, H/U, d_v]
        core = self.core if self.layout.ring == 1 else self._ring_core
        out = core(
            q,
            k,
            v,
            call.segments,
            scaling=call.scaling,
            sliding_window=call.window,
            softcap=call.softcap,
            dropout=call.dropout,
        )  # [b, N/R, h, d]
        if torch.is_grad_enabled() and not out.requires_grad and any(x.requires_grad for x in (q, k, v)):
            # nothing but padding here (an epoch's last batch can leave a replica without tokens): the core made
            # zeros without a graph, so q/k/v's projections would get no gradient on this replica alone and
            # DDP / FSDP2 would pair its next collective with the others' gradient reduction. Sums of empty
            # slices (0, whatever q holds) hand them zero gradients instead.
            out = out + sum(x[..., :0].sum() for x in (q, k, v)).to(out.dtype)
        return out[..., : call.d_v] if out.shape[-1] != call.d_v else out

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """q ``[b, H, n, d]``, k/v ``[b, Hkv, n, d]`` (local tokens) -> ``([b, n, H, d], None)``; the keyword
        arguments are transformers' (dropout, scaling, sliding_window, softcap, position_ids, ...)."""
        call = self.prepare(module, query, key, value, attention_mask, **kwargs)
        group, wire = self.layout.ulysses_group, self.comm_dtype
        query = self.attention_done(query)
        q, k, v = qkv_seq_to_heads(*pad_qkv(query, key, value, call.width), group, comm_dtype=wire, stats=self.stats)
        # q [b, H/U, N/R, d]; k/v [b, hkv, N/R, d] (U = ulysses, R = ring; N/R = N without a ring)
        out = self.core_for(q, k, v, call)  # [b, N/R, H/U, d_v]
        # contiguous, as transformers' own attention functions return it (JetMoE .view()s it)
        return heads_to_seq(out, group, comm_dtype=wire, stats=self.stats).contiguous(), None  # [b, n, H, d_v]

    def _ring_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, **kwargs):
        """The core of a hybrid layout: ring attention over ``layout.ring_group`` (see :mod:`ulysses_sp.ring`)."""
        kernel = "plain" if self.core_name == "eager" else None  # eager: the plain-PyTorch reference kernel
        return ring_attention(q, k, v, segments, self.layout.ring_group, stats=self.stats, kernel=kernel, **kwargs)


class _AttentionDone(torch.autograd.Function):
    """Identity whose backward calls the attention's backward hooks (see :meth:`UlyssesAttention.attention_done`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hooks: list[Callable[[], None]]) -> torch.Tensor:
        ctx.hooks = hooks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for hook in ctx.hooks:
            hook()
        return grad, None


def check_ring_core(core_name: str, ring: int) -> None:
    """ValueError unless the core ``core_name`` may run in a layout with ``ring`` ring ranks (:data:`RING_CORES`)."""
    if ring > 1 and core_name not in RING_CORES:
        usable = " or ".join(map(repr, RING_CORES))
        raise ValueError(
            f"core={core_name!r} cannot run inside a ring (ring degree {ring}): the ring uses its own blockwise "
            f"core with an fp32 online-softmax merge; use core={usable}, or a layout without a ring"
        )


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
    intercept = module.__dict__.get(INTERCEPT_ATTR)
    if intercept is not None:
        return intercept(module, query, key, value, attention_mask, **kwargs)
    return _context(module)(module, query, key, value, attention_mask, **kwargs)
