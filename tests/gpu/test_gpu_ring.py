"""The ring's blockwise core on a CUDA device (skipped without one), ring of one rank, bf16.

One GPU cannot host a ring of several NCCL ranks; the ring exchange itself is proven on gloo in
tests/dist/test_ring_parity.py. This checks that the block kernel, the merge and the backward run on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from ulysses_sp.cores import Segments
from ulysses_sp.ring import ring_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_ring_of_one_matches_sdpa_bf16():
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(2, h, 256, 64, device=device, generator=gen, dtype=torch.bfloat16) for h in (8, 2, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    segments = Segments.from_positions(torch.arange(256, device=device).expand(2, 256))
    out = ring_attention(q, k, v, segments, None, query_chunk=64)  # [b, n, h, d]
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_inputs, is_causal=True, enable_gqa=True).transpose(1, 2)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert (out.double() - ref).norm() <= 1e-2 * ref.norm()
    for got, want in zip((q, k, v), ref_inputs, strict=True):
        assert (got.grad.double() - want.grad).norm() <= 2e-2 * want.grad.norm()
