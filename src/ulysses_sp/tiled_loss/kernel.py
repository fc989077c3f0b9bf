"""The tiled lm_head + cross-entropy kernel: the causal-LM loss without ever holding ``[tokens, vocab]`` logits.

Tokens are cut into chunks; each chunk's logits are computed, reduced to token losses and dropped. The loss is
the end of the graph, so when autograd will need a gradient the forward also makes each chunk's (as fused
linear cross-entropy kernels do: Apple's Cut Cross Entropy, Liger's FLCE): it writes the chunk's hidden-state
gradient into one buffer and adds its weight gradient into one fp32 accumulator. Backward only scales those by
the incoming ``grad_output``, in place, and returns them: three lm_head-sized matmuls in all, as the plain
path, instead of four with a recompute (``recompute=True``). Under no_grad the forward makes the loss only.

Exact: the same arithmetic in the same dtypes as ``lm_head`` + ``F.cross_entropy(logits.float())``, summed in
a different order, and scaled by ``grad_output`` after the chunk sums rather than before (under fp32 that
moves the gradients' rounding by the last bit). A live chunk holds at most :data:`BYTES_PER_LOGIT` bytes per
logit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..validation import IGNORE_INDEX, check_label_smoothing
from .sizing import BYTES_PER_LOGIT, DEFAULT_LOSS_BUDGET_BYTES, chunk_bytes_per_logit, loss_chunk_tokens

__all__ = [
    "BYTES_PER_LOGIT",
    "Adapter",
    "DEFAULT_LOSS_BUDGET_BYTES",
    "LogitsHead",
    "chunk_bytes_per_logit",
    "loss_chunk_tokens",
    "tiled_cross_entropy_sum",
]


@dataclass(frozen=True)
class LogitsHead:
    """How hidden states become logits: ``softcap(scale * (h @ W^T + b))`` (softcap: ``c * tanh(x / c)``)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, config) -> LogitsHead:
        """The scalings transformers applies after ``lm_head`` for this config (text config of a VLM)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = 1.0
        if getattr(text, "logits_scaling", None):  # Granite: logits / logits_scaling
            scale /= float(text.logits_scaling)
        if getattr(text, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
            scale *= float(text.logit_scale)
        softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2/3
        return cls(scale=scale, softcap=float(softcap) if softcap else None)

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        """fp32 raw logits -> fp32 logits."""
        out = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def apply_(self, raw: torch.Tensor) -> torch.Tensor:
        """:meth:`apply` in place on ``raw`` (a temporary the caller owns); returns ``raw``."""
        if self.scale != 1.0:
            raw.mul_(self.scale)
        if self.softcap is not None:
            raw.div_(self.softcap).tanh_().mul_(self.softcap)
        return raw

    def softcap_grad_(self, logits: torch.Tensor) -> torch.Tensor:
        """d softcap(x) / d x at the softcapped ``logits`` (``1 - tanh^2``), written over them; the whole
        d logits / d raw is this times :attr:`scale`. Only with a softcap."""
        assert self.softcap is not None
        return logits.div_(self.softcap).square_().neg_().add_(1.0)


def _chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, chunk):
        yield start, min(start + chunk, total)


@functools.cache
def _fp32_product_mode(device_type: str, dtype: torch.dtype) -> str | None:
    """How this build multiplies two ``dtype`` matrices into an fp32 product on ``device_type`` (probed once).

    ``"addmm"``: ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` adds it into an fp32 tensor in
    place; ``"mm"``: ``torch.mm(a, b, out_dtype=torch.float32)`` makes it; None: neither (the CPU build of
    torch 2.13 has no such kernels), so the product is rounded to ``dtype`` before it is added.
    """
    a = torch.ones(2, 3, dtype=dtype, device=device_type)
    with contextlib.suppress(RuntimeError, TypeError):
        acc = torch.full((2, 2), 0.5, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
        if bool((acc == 3.5).all()):
            return "addmm"
    with contextlib.suppress(RuntimeError, TypeError):
        if torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32:
            return "mm"
    return None


def _accumulate_weight_grad(acc: torch.Tensor, grad: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += grad^T @ h`` with a transient no larger than half the chunk's ``grad``.

    acc [V, h] fp32; grad [c, V], h [c, h] in the compute dtype. In fp32 (or where :func:`_fp32_product_mode`
    is ``"addmm"``) the product goes straight into the accumulator. Otherwise it is made in blocks of
    vocabulary rows (in fp32 where the build can, else rounded to the compute dtype), each added to the fp32
    accumulator in place (the reduction over tokens is the same, so the sums are those of one [V, h] product),
    so that the product never costs a [V, h] tensor and its fp32 copy (2.3 GB for a vocabulary of 152K and a
    hidden size of 2560).
    """
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), h)
        return
    mode = _fp32_product_mode(acc.device.type, grad.dtype)
    if mode == "addmm":
        torch.addmm(acc, grad.t(), h, out_dtype=torch.float32, out=acc)
        return
    product_size = 4 if mode == "mm" else grad.element_size()
    rows = max(1, grad.numel() * grad.element_size() // (2 * product_size * max(1, h.shape[1])))
    for v0 in range(0, acc.shape[0], rows):
        block = grad[:, v0 : v0 + rows].t()  # [rows, c]
        acc[v0 : v0 + rows] += torch.mm(block, h, out_dtype=torch.float32) if mode == "mm" else block @ h


class Adapter(NamedTuple):
    """A low-rank term added to the raw logits, ``+ scaling x (B (A x) + bias)``: PEFT's LoRA on lm_head, with
    ``x`` the hidden states, or ``inputs`` where given (the hidden states after the adapter's dropout)."""

    a: torch.Tensor  # [r, h]
    b: torch.Tensor  # [V, r]
    bias: torch.Tensor | None  # [V]
    scaling: float
    inputs: torch.Tensor | None = None  # [..., h], shaped as the hidden states


_PER_ADAPTER = 4  # tensors per adapter among a kernel's params: A, B, bias, inputs


@dataclass
class _HeadGrads:
    """The gradients the chunks fill: ``hidden`` [T, h] and an adapter's ``inputs`` [T, h] (in their dtypes);
    ``weight`` [V, h], ``bias`` [V] and per adapter ``A [r, h], B [V, r], bias [V]`` in fp32 (None where not
    wanted)."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    adapters: list[list[torch.Tensor | None]]

    @classmethod
    def empty(
        cls, hidden: torch.Tensor, params: tuple[torch.Tensor | None, ...], wanted: tuple[bool, ...]
    ) -> _HeadGrads:
        """``params``: (weight, bias, then A, B, bias, inputs per adapter); ``wanted``: hidden's flag, then theirs."""

        def buffer(index: int, param: torch.Tensor | None, want: bool) -> torch.Tensor | None:
            if param is None or not want:
                return None
            if index > 1 and (index - 2) % _PER_ADAPTER == 3:  # an adapter's inputs: every row is set, in its dtype
                return torch.empty_like(param)
            return torch.zeros(param.shape, dtype=torch.float32, device=param.device)

        made = [buffer(i, p, want) for i, (p, want) in enumerate(zip(params, wanted[1:], strict=True))]
        hidden_grad = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if wanted[0] else None
        adapters = [made[i : i + _PER_ADAPTER] for i in range(2, len(made), _PER_ADAPTER)]
        return cls(hidden_grad, made[0], made[1], adapters)

    def add(self, span: slice, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, lows: list) -> None:
        """Tokens ``span``: ``grad`` = d loss / d raw logits [c, V], ``h`` [c, h], ``w`` [V, h]; ``lows``: per
        adapter ``(A [r, h], B [V, r], scaling, x [c, h], A x [c, r], whether x is h)`` as the chunk's forward used
        them (in the adapter's dtype)."""
        if self.hidden is not None and self.hidden.dtype == grad.dtype:
            torch.mm(grad, w, out=self.hidden[span])  # rows of a contiguous buffer: written in place
        elif self.hidden is not None:
            self.hidden[span] = grad @ w
        if self.weight is not None:
            _accumulate_weight_grad(self.weight, grad, h)
        if self.bias is not None:
            self.bias += grad.sum(0, dtype=torch.float32)
        for low, (grad_a, grad_b, grad_bias, grad_x) in zip(lows, self.adapters, strict=True):
            a, b, scaling, x, down, into_hidden = low
            grad_x = self.hidden if into_hidden else grad_x
            g = grad.to(a.dtype)  # [c, V]: the raw logits' gradient as the adapter's term receives it
            if grad_x is not None or grad_a is not None:
                grad_down = (g @ b).mul_(scaling)  # [c, r]: d loss / d (A x)
                if grad_x is not None and into_hidden:
                    grad_x[span] += grad_down @ a
                elif grad_x is not None:
                    grad_x[span] = grad_down @ a
                if grad_a is not None:
                    _accumulate_weight_grad(grad_a, grad_down, x)
            if grad_b is not None:
                _accumulate_weight_grad(grad_b, g, down * scaling)
            if grad_bias is not None:
                grad_bias += g.sum(0, dtype=torch.float32) * scaling
            del g

    def all(self) -> list[torch.Tensor | None]:
        return [self.hidden, self.weight, self.bias, *(g for grads in self.adapters for g in grads)]

    def scale_(self, factor: torch.Tensor) -> None:
        for grad in self.all():
            if grad is not None:
                grad.mul_(factor)

    def result(self, dtypes: list[torch.dtype | None]) -> list[torch.Tensor | None]:
        """hidden's gradient, then each parameter's in its dtype (``dtypes``, as ``params`` in :meth:`empty`)."""
        grads = self.all()
        return [grads[0], *(g.to(dt) if g is not None else None for g, dt in zip(grads[1:], dtypes, strict=True))]


def _chunk_loss_(
    logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, ...]:
    """Overwrite fp32 ``logits`` [c, V] by ``exp(logits - max)``; return their row sums [c, 1] and the summed
    loss of the valid rows (``max + log(sum) - logit[target]``: torch.logsumexp's arithmetic). With label
    ``smoothing`` e: ``(1 - e) x`` that ``+ e x`` the mean over the vocabulary of ``-log softmax`` (transformers'
    LabelSmoother), ``lse - (1 - e) logit[target] - e mean(logits)``."""
    picked = logits.gather(1, target.clamp(min=0).unsqueeze(1))  # [c, 1]
    mean = logits.mean(1, keepdim=True) if smoothing else None  # [c, 1], before the logits are overwritten
    top = logits.amax(1, keepdim=True)  # [c, 1]
    sums = logits.sub_(top).exp_().sum(1, keepdim=True)  # [c, 1]
    if mean is None:
        return sums, torch.where(valid, sums.log() + top - picked, 0.0).sum()
    return sums, torch.where(valid, sums.log() + top - (1 - smoothing) * picked - smoothing * mean, 0.0).sum()


def _logits_grad_(
    exps: torch.Tensor,
    sums: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    scale: float | torch.Tensor,
    slope: torch.Tensor | None,
    smoothing: float,
) -> torch.Tensor:
    """d loss / d raw logits [c, V] fp32 over ``exps`` (from :func:`_chunk_loss_`): ``(softmax - onehot(target))
    * valid * scale``, times ``slope`` (d softcap / d x) with a softcap. ``scale``: head.scale x grad_output.
    With label ``smoothing`` e: ``softmax - (1 - e) onehot(target) - e / V``."""
    factor = valid.to(exps.dtype) * scale  # [c, 1] (a bool times a Python float would be the default dtype)
    grad = exps.mul_(factor / sums)
    grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -factor * (1 - smoothing) if smoothing else -factor)
    if smoothing:
        grad.sub_(factor * (smoothing / grad.shape[1]))
    return grad.mul_(slope) if slope is not None else grad


def _run_chunks(
    hidden: torch.Tensor,
    params: tuple[torch.Tensor | None, ...],
    targets: torch.Tensor,
    args: tuple[int, LogitsHead, int, torch.dtype, float, tuple[tuple[float, torch.dtype], ...]],
    grads: _HeadGrads | None,
    scale: float | torch.Tensor,
) -> torch.Tensor:
    """The summed loss over all chunks; with ``grads``, each chunk's gradients (times ``scale``) added into them.
    ``params``: (weight, bias, then A, B, bias, inputs [T, h] or None per adapter)."""
    chunk, head, ignore_index, dtype, smoothing, specs = args
    w, b = (p.to(dtype) if p is not None else None for p in params[:2])
    adapters = []  # (A, B, bias) in the adapter's dtype, the inputs as given (cast a chunk at a time), scaling
    for i, (scaling, kind) in enumerate(specs):
        a, b_up, b_bias, inputs = params[2 + _PER_ADAPTER * i : 2 + _PER_ADAPTER * (i + 1)]
        adapters.append((a.to(kind), b_up.to(kind), b_bias.to(kind) if b_bias is not None else None, inputs, scaling))
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in _chunks(hidden.shape[0], chunk):
        h = hidden[start:end].to(dtype)  # [c, h]
        raw = F.linear(h, w, b)  # [c, V]
        lows = []
        for a, b_up, b_bias, inputs, scaling in adapters:  # + scaling x (B (A x) + bias), PEFT's LoRA arithmetic
            x = (h if inputs is None else inputs[start:end]).to(a.dtype)  # [c, h]
            down = F.linear(x, a)  # [c, r]
            raw = raw.to(torch.promote_types(raw.dtype, a.dtype))  # a wider adapter's term is added in its dtype
            raw.add_(F.linear(down, b_up, b_bias).mul_(scaling))  # (one more [c, V] while it is added)
            lows.append((a, b_up, scaling, x, down, inputs is None))
        raw = raw.to(dtype)  # the sum in the base's dtype, as PEFT returns it (the wider one freed here)
        logits = head.apply_(raw.float())  # [c, V] fp32 (raw itself in fp32)
        del raw
        target = targets[start:end]
        valid = (target != ignore_index).unsqueeze(1)  # [c, 1]
        slope = head.softcap_grad_(logits.clone()) if grads is not None and head.softcap is not None else None
        sums, loss = _chunk_loss_(logits, target, valid, smoothing)  # the logits are overwritten
        total += loss
        if grads is None:
            del logits  # before the next chunk's logits exist
            continue
        grad = _logits_grad_(logits, sums, target, valid, scale * head.scale, slope, smoothing)
        del logits, slope  # (grad is the logits, overwritten)
        grad = grad.to(dtype)  # d loss / d raw [c, V] in the compute dtype (the fp32 one is freed)
        grads.add(slice(start, end), grad, h, w, lows)
        del grad  # before the next chunk's logits exist
    return total


class _TiledHeadLoss(torch.autograd.Function):
    """sum over valid tokens of CE(head(hidden @ W^T + b), target); see :func:`tiled_cross_entropy_sum`."""

    @staticmethod
    def forward(ctx, hidden, targets, args, wanted, recompute, *params):  # type: ignore[override]
        # hidden [T, h]; targets [T]; args: (chunk, head, ignore_index, dtype, label smoothing, each adapter's
        # (scaling, dtype)); params: weight [V, h], bias [V] or None, then per adapter A [r, h], B [V, r], its bias
        # [V] or None, its inputs [T, h] or None
        make = any(wanted) and not recompute
        with torch.autocast(hidden.device.type, enabled=False):
            grads = _HeadGrads.empty(hidden, params, wanted) if make else None
            total = _run_chunks(hidden, params, targets, args, grads, 1.0)
        if recompute:
            ctx.save_for_backward(hidden, targets, *params)
        ctx.grads, ctx.args, ctx.recompute = grads, args, recompute
        ctx.dtypes = [p.dtype if p is not None else None for p in params]
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):  # type: ignore[override]
        scale = grad_total.float()
        if ctx.recompute:  # the chunks again, their logits recomputed: one more lm_head-sized matmul each
            hidden, targets, *params = ctx.saved_tensors
            wanted = (ctx.needs_input_grad[0], *ctx.needs_input_grad[5:])
            with torch.autocast(hidden.device.type, enabled=False):
                grads = _HeadGrads.empty(hidden, params, wanted)
                _run_chunks(hidden, params, targets, ctx.args, grads, scale)
        else:  # made by the forward for a grad_output of 1: scaled after the chunk sums, in place
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError(
                    "the tiled loss's gradients were made in its forward and consumed by a first backward; to "
                    "back-propagate through it twice (retain_graph=True), pass recompute=True"
                )
            grads.scale_(scale)
        hidden_grad, *param_grads = grads.result(ctx.dtypes)
        return (hidden_grad, None, None, None, None, *param_grads)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def tiled_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    head: LogitsHead | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    recompute: bool = False,
    label_smoothing: float = 0.0,
    adapters: Sequence[Adapter | tuple] = (),
) -> torch.Tensor:
    """Sum over valid targets of ``cross_entropy(head(hidden @ weight^T + bias), target)``, in chunks.

    Args:
        hidden: ``[..., h]`` final hidden states (after the model's last norm).
        weight: ``[V, h]`` the output embedding (``lm_head.weight``); ``bias``: ``[V]`` or None.
        targets: ``[...]`` target ids, already shifted (``shift_labels``); ``ignore_index`` = no target.
        head: scaling / soft-capping applied to the logits (default: none).
        chunk_tokens: tokens per chunk (default: :func:`loss_chunk_tokens` for a 1 GiB budget).
        recompute: make the gradients in backward, recomputing each chunk's logits (one more lm_head-sized
            matmul; holds only the inputs between forward and backward, and allows ``retain_graph=True``).
            Default: made in the forward, when autograd will need them (grad mode on and an input that
            requires grad), and only scaled by ``grad_output`` in backward.
        label_smoothing: e in [0, 1): each target's loss is ``(1 - e) x`` its cross-entropy ``+ e x`` the mean
            over the vocabulary of ``-log softmax`` (transformers' ``LabelSmoother``, summed, not averaged).
        adapters: low-rank terms added to the raw logits (:class:`Adapter`, or its fields as a tuple: ``A [r, h]``,
            ``B [V, r]``, bias ``[V]`` or None, scaling, inputs ``[..., h]`` or None for the hidden states):
            ``+ scaling x (B (A x) + bias)``, PEFT's LoRA on lm_head. Computed per chunk and back-propagated
            through the rank-r factors only: no ``[V, h]`` weight or gradient is made for them. Under autocast in
            its dtype; else, as PEFT, each in its A's dtype where that is wider (fp32 adapters over a bf16 base),
            the logits rounded back to the base's dtype after the last adapter's term.

    Returns an fp32 scalar. Under autocast the matmuls run in the autocast dtype (as ``lm_head`` would).
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree; expected hidden "
            "[..., hidden_size] for targets [...]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    label_smoothing = check_label_smoothing(label_smoothing)
    chunk = chunk_tokens if chunk_tokens is not None else loss_chunk_tokens(weight.shape[0])
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    params = [weight, bias]
    adapters = [Adapter(*adapter) for adapter in adapters]
    for a, b, b_bias, _, inputs in adapters:
        fits = a.dim() == 2 and a.shape[1] == weight.shape[1] and b.shape == (weight.shape[0], a.shape[0])
        fits = fits and (b_bias is None or b_bias.shape == weight.shape[:1])
        if not fits or (inputs is not None and inputs.shape != hidden.shape):
            raise ValueError(
                f"an adapter must be A [r, {weight.shape[1]}], B [{weight.shape[0]}, r], a bias [{weight.shape[0]}] "
                f"or None and inputs {tuple(hidden.shape)} or None, got {tuple(a.shape)}, {tuple(b.shape)}, "
                f"{None if b_bias is None else tuple(b_bias.shape)}, {None if inputs is None else tuple(inputs.shape)}"
            )
        params += [a, b, b_bias, None if inputs is None else inputs.reshape(-1, inputs.shape[-1])]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [T, h]
    flat_targets = targets.reshape(-1).to(device=hidden.device, dtype=torch.long)  # [T]
    grad_on = torch.is_grad_enabled()  # (always off inside Function.forward: read it here)
    wanted = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, *params))
    dtype = _compute_dtype(hidden, weight)
    autocast = torch.is_autocast_enabled(hidden.device.type)
    # each adapter's dtype: autocast's, else PEFT's (its input cast to A's dtype, its term added at the wider one)
    specs = tuple((float(ad.scaling), dtype if autocast else torch.promote_types(dtype, ad.a.dtype)) for ad in adapters)
    args = (chunk, head or LogitsHead(), ignore_index, dtype, label_smoothing, specs)
    return _TiledHeadLoss.apply(flat_hidden, flat_targets, args, wanted, recompute, *params)
