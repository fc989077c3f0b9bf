"""The ring's block kernels on a CUDA device (skipped without one): bf16 against float64, packed and windowed.

NOT RUN ON A GPU YET: written with the CUDA kernels of ulysses_sp.ring_kernels, whose op calls are checked
on the meta device in tests/unit/test_ring.py. One GPU cannot host a ring of several NCCL ranks, so the
rings here are threads of one process (tests/helpers/ring_sim.py) sharing the device; the NCCL exchange
itself is the same isend/irecv code that tests/dist/test_ring_parity.py runs on gloo.
"""

import importlib.util

import pytest
import torch

from tests.helpers.models import make_batch
from tests.helpers.ring_sim import run_threads
from tests.helpers.spy import calls_to
from ulysses_sp import ring
from ulysses_sp.cores import Segments, eager_core
from ulysses_sp.ring import ring_attention, zigzag_order

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KERNELS = ["cuda_flash", "cuda_efficient", "cuda_cudnn", "flex", "plain", None]


def test_default_kernel_packed_rows_take_flex():
    """Rows packed with many documents take the flex kernel on CUDA (as the sdpa core does), and it is exact."""
    batch = make_batch(2, 512, packed=(30, 40, 50, 60, 20, 30, 40, 50, 60, 70, 32, 30))  # 12 a row: over 8
    with calls_to(ring, "get_ring_kernel", lambda name, **kwargs: name) as kernels:
        _check(None, 2, batch, window=100)
    assert kernels and set(kernels) == {"flex"}, kernels


def _check(kernel, size, batch, window=None, softcap=None, dtype=torch.bfloat16, heads=8, kv_heads=2, d=64):
    if kernel == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    device = torch.device("cuda")
    seq_len = batch["input_ids"].shape[1]
    positions = batch.get("position_ids", torch.arange(seq_len).expand(batch["input_ids"].shape))
    segments = Segments.from_positions(positions.to(device), batch.get("attention_mask"))
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(2, h, seq_len, d, device=device, generator=gen, dtype=dtype) for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(2, seq_len, heads, d, device=device, generator=gen, dtype=dtype)
    ref_inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = eager_core(*ref_inputs, segments, sliding_window=window, softcap=softcap)  # [b, N, h, d] float64
    ref.backward(grad.double())
    order, n = zigzag_order(seq_len, size, device), seq_len // size

    def rank_run(transport):
        mine = order[transport.rank * n : (transport.rank + 1) * n]
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        out = ring_attention(*local, segments, transport, sliding_window=window, softcap=softcap, kernel=kernel)
        out.backward(grad[:, mine])
        torch.cuda.synchronize()
        return mine, out.detach(), [x.grad for x in local]

    for mine, out, grads in run_threads(size, rank_run):
        assert out.dtype == dtype
        want = ref.detach()[:, mine]
        assert (out.double() - want).norm() <= 1e-2 * want.norm()
        for got, ref_input in zip(grads, ref_inputs, strict=True):
            want = ref_input.grad[:, :, mine]
            assert (got.double() - want).norm() <= 2e-2 * want.norm()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("size", [1, 4])
def test_ring_kernels_dense_bf16(kernel, size):
    _check(kernel, size, make_batch(2, 512))


@pytest.mark.parametrize("kernel", KERNELS)
def test_ring_kernels_packed_window_padded(kernel):
    batch = make_batch(2, 512, packed=(100, 300, 112))
    _check(kernel, 2, batch, window=64)
    _check(kernel, 2, make_batch(2, 512, pad="left", pad_lengths=(0, 37)), kv_heads=1)


def test_ring_fp32_on_cuda_uses_a_kernel_that_takes_fp32():
    _check(None, 2, make_batch(2, 256), dtype=torch.float32)


@pytest.mark.parametrize("kernel", ["flash_attn", "flex", "plain"])
def test_ring_softcap_on_cuda(kernel):
    _check(kernel, 2, make_batch(2, 256), softcap=20.0)
