"""Block kernels of the ring: attention of a query range to a key range that also returns the log-sum-exp.

The ring cuts the visible part of each block pair into unmasked rectangles (:mod:`ulysses_sp.ring_blocks`)
and hands each to a kernel with two methods:

* ``forward(q, k, v, *, causal, scale, softcap) -> (out [b, h, nq, d], lse [b, h, nq])``
* ``backward(grad_out, q, k, v, out, lse, *, causal, scale, softcap) -> (dq, dk, dv)``

q ``[b, h, nq, d]``, k/v ``[b, hkv, nk, d]`` with ``h`` a multiple of ``hkv`` (grouped-query attention,
query head ``i`` reads kv head ``i // (h / hkv)``). ``lse`` is the natural log of the sum of ``exp(score)``
over the given keys (fp32, or fp64 for fp64 inputs). ``causal`` is asked of squares only (key ``j``
visible to query ``i`` iff ``j <= i``). ``backward`` gets the FINAL output and lse of its rows, after the
ring's merge over all blocks, so its gradients are exactly this block's share (the recompute of the
standard ring backward); dk/dv come back with ``hkv`` heads. ``compute_dtype(dtype)`` says which dtype
the ring hands the kernel.

:data:`RING_KERNELS` (chosen per call by name, :func:`default_ring_kernel` when none is named):

* ``plain``: plain PyTorch, fp32 scores of a chunk of queries at a time (at most 2^24 elements); the
  reference, any device, and the only one with ``softcap`` on CPU.
* ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (fused, tiled,
  returns the lse, groups kv heads itself). Run in fp32 (fp64 for fp64): its bf16 backward is several
  times slower on CPU, and fp32 keeps the ring's bf16 error that of one process.
* ``cuda_flash`` / ``cuda_efficient`` / ``cuda_cudnn``: the ``aten._scaled_dot_product_*_attention`` ops
  and their ``_backward`` (as torch's ``context_parallel`` calls them); kv heads are repeated for them.
* ``flash_attn``: the flash-attn package (>= 2.7) ``_flash_attn_forward`` / ``_flash_attn_backward``;
  groups kv heads itself and applies ``softcap``.
* ``flex``: compiled ``flex_attention(return_lse=True)`` over a whole block pair with a ``BlockMask``
  (CUDA): one call for rows packed with many documents, and softcap; takes ``block_mask=`` for ``causal=``.

The CUDA kernels (and ``flex`` on CUDA) have NOT been run on a GPU yet: the aten calls are checked against
the ops' schemas on the ``meta`` device and ``flex``'s backward with a dense stand-in, in
tests/unit/test_ring.py; tests/gpu/test_gpu_ring.py runs them all where a GPU is present.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import torch

from .cores import compiled_flex, flex_compiles
from .grad_sums import sum_dtype

__all__ = ["RING_KERNELS", "acc_dtype", "default_ring_kernel", "get_ring_kernel"]

aten = torch.ops.aten
_SCORES_BUDGET = 1 << 24  # elements of one [b, h, chunk, nk] score tensor of the plain kernel
_HALF = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention accumulates ``dtype`` inputs in (output, lse, gradients): fp32 for 16-bit floats, a wider
    float's own (fp64 stays fp64), as :func:`~ulysses_sp.grad_sums.sum_dtype` sums them; other dtypes promoted with
    fp32 (``torch.promote_types`` dispatches an aten op per call: the head chunks ask per chunk and stage)."""
    if dtype.is_floating_point and dtype.itemsize > 1:
        return sum_dtype(dtype, True)
    return torch.promote_types(dtype, torch.float32)


def _group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # [b, h, n, d] -> [b, hkv, h/hkv, n, d]: query heads grouped by the kv head they read (GQA)
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def _no_softcap(name: str, softcap: float | None) -> None:
    if softcap is not None:
        raise ValueError(f"ring kernel {name!r} cannot apply softcap={softcap}; use kernel='plain' or 'flash_attn'")


# ---------------------------------------------------------------------------------------------- plain
class PlainKernel:
    """Plain PyTorch: softmax(q k^T) of ``query_chunk`` queries at a time in fp32; supports softcap."""

    name = "plain"
    supports_softcap = True

    def __init__(self, query_chunk: int | None = None) -> None:
        self.query_chunk = query_chunk

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return acc_dtype(dtype)

    def _chunks(self, q: torch.Tensor, nk: int) -> Iterator[tuple[int, int]]:
        b, h, nq, _ = q.shape
        step = self.query_chunk or max(1, _SCORES_BUDGET // (b * h * nk))
        for start in range(0, nq, step):
            yield start, min(start + step, nq)

    @staticmethod
    def _scores(q, k, r0, r1, causal, scale, softcap):
        # q [b, hkv, g, rows, d] (rows r0..r1 of the square when causal), k [b, hkv, nk, d] -> fp32 scores
        # [b, hkv, g, rows, nk] with keys after the query at -inf, and tanh(scores / softcap) for softcap
        acc = acc_dtype(q.dtype)
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q.to(acc), k.to(acc)) * scale
        capped = None
        if softcap is not None:
            capped = torch.tanh(scores / softcap)
            scores = capped * softcap
        if causal:
            rows = torch.arange(r0, r1, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(k.shape[2], device=q.device)[None] > rows, float("-inf"))
        return scores, capped

    def forward(self, q, k, v, *, causal: bool, scale: float, softcap: float | None = None):
        b, h, nq, d = q.shape
        hkv, acc = k.shape[1], acc_dtype(q.dtype)
        out = torch.empty(b, h, nq, d, dtype=acc, device=q.device)
        lse = torch.empty(b, h, nq, dtype=acc, device=q.device)
        for r0, r1 in self._chunks(q, k.shape[2]):
            keys = slice(0, r1) if causal else slice(None)  # causal rows < r1 see keys < r1 only
            scores, _ = self._scores(_group(q[:, :, r0:r1], hkv), k[:, :, keys], r0, r1, causal, scale, softcap)
            row_lse = torch.logsumexp(scores, dim=-1)  # [b, hkv, g, rows]
            probs = torch.exp(scores - row_lse[..., None])
            part = torch.einsum("bhgqk,bhkd->bhgqd", probs, v[:, :, keys].to(acc))
            out[:, :, r0:r1] = part.reshape(b, h, r1 - r0, d)
            lse[:, :, r0:r1] = row_lse.reshape(b, h, r1 - r0)
        return out, lse

    def backward(self, grad_out, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float | None = None):
        b, h, nq, d = q.shape
        hkv, acc = k.shape[1], acc_dtype(q.dtype)
        dq = torch.empty(b, h, nq, d, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [b, h, nq]
        for r0, r1 in self._chunks(q, k.shape[2]):
            keys = slice(0, r1) if causal else slice(None)
            qg = _group(q[:, :, r0:r1], hkv)
            scores, capped = self._scores(qg, k[:, :, keys], r0, r1, causal, scale, softcap)
            probs = torch.exp(scores - _group(lse[:, :, r0:r1, None].to(acc), hkv))  # [b, hkv, g, rows, nk]
            dout = _group(grad_out[:, :, r0:r1], hkv).to(acc)
            dv[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", probs, dout)
            dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dout, v[:, :, keys].to(acc))
            dscores = probs * (dprobs - _group(delta[:, :, r0:r1, None], hkv))
            if capped is not None:
                dscores = dscores * (1 - capped * capped)
            dq[:, :, r0:r1] = (torch.einsum("bhgqk,bhkd->bhgqd", dscores, k[:, :, keys].to(acc)) * scale).reshape(
                b, h, r1 - r0, d
            )
            dk[:, :, keys] += torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg.to(acc)) * scale
        return dq, dk, dv


# ---------------------------------------------------------------------------------------------- CPU
class CpuFlashKernel:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), in fp32 (fp64 for fp64).

    Never given a mask: with one, a fully masked row comes back as out 0 and lse 0 (not -inf), which a merge
    would weigh as if it had seen keys. Its lse is ``[b, h, nq]`` stored ``[b, nq, h]``-major (any strides work).
    """

    name = "cpu_flash"
    supports_softcap = False

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return acc_dtype(dtype)

    def forward(self, q, k, v, *, causal: bool, scale: float, softcap: float | None = None):
        _no_softcap(self.name, softcap)
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def backward(self, grad_out, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float | None = None):
        _no_softcap(self.name, softcap)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )


# ---------------------------------------------------------------------------------------------- CUDA (aten)
def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    # [b, hkv, n, d] -> [b, heads, n, d] (query head i reads kv head i // (heads / hkv))
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # [b, h, n, d] -> [b, hkv, n, d]: the gradient of a repeated kv head is the sum over its query heads
    b, h, n, d = grad.shape
    return grad if h == kv_heads else grad.view(b, kv_heads, h // kv_heads, n, d).sum(2)


class _CudaAtenKernel:
    """Shared part of the CUDA aten kernels: kv heads repeated to the query heads, contiguous inputs.

    The dropout RNG state (seed, offset) that the backward ops take is kept from this kernel's last forward
    (dropout is 0, so it is never read; passing the forward's own tensors keeps their types right).
    """

    name = ""
    supports_softcap = False
    half_only = True

    def __init__(self) -> None:
        self._rng: tuple[torch.Tensor, torch.Tensor] | None = None

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.half_only and dtype not in _HALF:
            raise ValueError(f"ring kernel {self.name!r} needs fp16/bf16 inputs, got {dtype}; use 'cuda_efficient'")
        return dtype

    def forward(self, q, k, v, *, causal: bool, scale: float, softcap: float | None = None):
        _no_softcap(self.name, softcap)
        k, v = (_repeat_kv(x, q.shape[1]).contiguous() for x in (k, v))
        return self._forward(q.contiguous(), k, v, causal, scale)

    def backward(self, grad_out, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float | None = None):
        _no_softcap(self.name, softcap)
        if self._rng is None:
            raise RuntimeError(f"ring kernel {self.name!r}: backward before any forward")
        h, hkv = q.shape[1], k.shape[1]
        tensors = [x.contiguous() for x in (grad_out, q, _repeat_kv(k, h), _repeat_kv(v, h), out)]
        dq, dk, dv = self._backward(*tensors, lse.float().contiguous(), causal, scale)
        return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)


class CudaFlashKernel(_CudaAtenKernel):
    """``aten._scaled_dot_product_flash_attention`` (+ ``_backward``): fp16/bf16, head dim <= 256."""

    name = "cuda_flash"

    def _forward(self, q, k, v, causal, scale):
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        self._rng = (seed, offset)
        return out, lse  # [b, h, nq, d], [b, h, nq] fp32

    def _backward(self, grad_out, q, k, v, out, lse, causal, scale):
        seed, offset = self._rng  # type: ignore[misc]
        nq, nk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, nq, nk, 0.0, causal, seed, offset, scale=scale
        )


class CudaEfficientKernel(_CudaAtenKernel):
    """``aten._scaled_dot_product_efficient_attention`` (+ ``_backward``): also fp32; its lse is padded to a
    multiple of 32 queries (except on ROCm)."""

    name = "cuda_efficient"
    half_only = False

    def _forward(self, q, k, v, causal, scale):
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        self._rng = (seed, offset)
        return out, lse[..., : q.shape[2]]

    def _backward(self, grad_out, q, k, v, out, lse, causal, scale):
        seed, offset = self._rng  # type: ignore[misc]
        nq = q.shape[2]
        if torch.version.hip is None:
            lse = torch.nn.functional.pad(lse, (0, -nq % 32))
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
        )
        return grads[0], grads[1], grads[2]


class CudaCudnnKernel(_CudaAtenKernel):
    """``aten._scaled_dot_product_cudnn_attention`` (+ ``_backward``): fp16/bf16; lse ``[b, h, nq, 1]``."""

    name = "cuda_cudnn"

    def _forward(self, q, k, v, causal, scale):
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        self._rng = (seed, offset)
        return out, lse.reshape(lse.shape[:3])

    def _backward(self, grad_out, q, k, v, out, lse, causal, scale):
        seed, offset = self._rng  # type: ignore[misc]
        nq, nk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse[..., None], seed, offset, None, None, None, nq, nk, 0.0, causal, scale=scale
        )


# ---------------------------------------------------------------------------------------------- flash-attn
class FlashAttnKernel:
    """The flash-attn package (>= 2.7): ``[b, n, h, d]`` layout inside, GQA and softcap native."""

    name = "flash_attn"
    supports_softcap = True

    def __init__(self) -> None:
        self._rng: torch.Tensor | None = None

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if dtype not in _HALF:
            raise ValueError(f"ring kernel 'flash_attn' needs fp16/bf16 inputs, got {dtype}; use 'cuda_efficient'")
        return dtype

    def forward(self, q, k, v, *, causal: bool, scale: float, softcap: float | None = None):
        from flash_attn.flash_attn_interface import _flash_attn_forward

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [b, n, heads, d]
        out, lse, _, self._rng = _flash_attn_forward(
            qt, kt, vt, 0.0, scale, causal, -1, -1, softcap or 0.0, None, False
        )
        return out.transpose(1, 2), lse  # [b, h, nq, d], [b, h, nq] fp32

    def backward(self, grad_out, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float | None = None):
        from flash_attn.flash_attn_interface import _flash_attn_backward

        dout, qt, kt, vt, ot = (x.transpose(1, 2).contiguous() for x in (grad_out, q, k, v, out))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _flash_attn_backward(
            dout, qt, kt, vt, ot, lse.float().contiguous(), dq, dk, dv, 0.0, scale, causal, -1, -1,
            softcap or 0.0, None, False, self._rng,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- flex
class FlexKernel:
    """Compiled ``flex_attention(return_lse=True)`` over a WHOLE block pair with a ``BlockMask`` (documents,
    causality, window from global indices): one call where the other kernels need one per document.

    ``forward``/``backward`` take ``block_mask=`` instead of ``causal=``. Rows that see no key get out 0 and
    lse -inf. Backward recomputes the block with autograd and feeds it the gradients that the ring's merge
    gives a block: ``w * grad_out`` for its output and ``w * (grad_out . out_block - delta)`` for its lse,
    ``w = exp(lse_block - lse_final)``, ``delta = grad_out . out_final`` (exact; one extra forward).
    """

    name = "flex"
    supports_softcap = True

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    @staticmethod
    def _call(q, k, v, block_mask, scale, softcap):
        def capped(score, b, h, qi, kj):
            return torch.tanh(score / softcap) * softcap

        return compiled_flex()(
            q, k, v, score_mod=capped if softcap is not None else None, block_mask=block_mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
        )  # fmt: skip

    def forward(self, q, k, v, *, block_mask, scale: float, softcap: float | None = None):
        with torch.no_grad():
            return self._call(q, k, v, block_mask, scale, softcap)

    def backward(self, grad_out, q, k, v, out, lse, *, block_mask, scale: float, softcap: float | None = None):
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            part, part_lse = self._call(*inputs, block_mask, scale, softcap)
        acc = acc_dtype(q.dtype)
        weight = torch.where(torch.isfinite(part_lse), torch.exp(part_lse - lse), 0.0)  # [b, h, n]
        dout = grad_out.to(acc)
        delta = (dout * out.to(acc)).sum(-1)
        grad_lse = weight * ((dout * part.detach().to(acc)).sum(-1) - delta)
        grad_part = (weight[..., None] * dout).to(part.dtype)
        return torch.autograd.grad([part, part_lse], inputs, [grad_part, grad_lse.to(part_lse.dtype)])


# ---------------------------------------------------------------------------------------------- choice
RING_KERNELS: dict[str, type] = {
    "plain": PlainKernel,
    "cpu_flash": CpuFlashKernel,
    "cuda_flash": CudaFlashKernel,
    "cuda_efficient": CudaEfficientKernel,
    "cuda_cudnn": CudaCudnnKernel,
    "flash_attn": FlashAttnKernel,
    "flex": FlexKernel,
}


def _flash_attn_usable(dtype: torch.dtype, head_dim: int) -> bool:
    fits = dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256
    return fits and importlib.util.find_spec("flash_attn") is not None


def default_ring_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, softcap: float | None, many_documents: bool = False
) -> str:
    """The kernel a ring uses when none is named: the device's fused kernel, ``plain`` where none fits.

    CPU: ``cpu_flash`` (``plain`` for softcap). CUDA: ``flex`` where compiled flex runs (triton, head dim >= 16)
    and the rows hold many documents (``many_documents``, the sdpa core's own test) or softcap is asked for;
    else ``cuda_flash`` for fp16/bf16 with head dim <= 256 (multiple of 8), ``cuda_efficient`` otherwise;
    softcap without flex: ``flash_attn`` when installed, else ``plain``.
    """
    if device.type == "cpu":
        return "plain" if softcap is not None else "cpu_flash"
    if device.type != "cuda":
        return "plain"
    if (many_documents or softcap is not None) and flex_compiles(device, head_dim):
        return "flex"
    if softcap is not None:
        return "flash_attn" if _flash_attn_usable(dtype, head_dim) else "plain"
    if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256:
        return "cuda_flash"
    return "cuda_efficient"


def get_ring_kernel(name: str, *, query_chunk: int | None = None):
    """A fresh kernel object by name (see :data:`RING_KERNELS`); ValueError for an unknown name."""
    if name not in RING_KERNELS:
        raise ValueError(f"unknown ring kernel {name!r}; choose one of {sorted(RING_KERNELS)}")
    if name == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("ring kernel 'flash_attn' needs the flash-attn package (>= 2.7); use 'cuda_flash'")
    return PlainKernel(query_chunk) if name == "plain" else RING_KERNELS[name]()
