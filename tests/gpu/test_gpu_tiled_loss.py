"""The tiled lm_head + loss on a CUDA device (skipped without one): bf16 autocast against the plain path,
and the peak memory of a Qwen3-4B-sized vocabulary against the plain logits."""

import pytest
import torch
import torch.nn.functional as F

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from ulysses_sp.memory import PeakMemory
from ulysses_sp.tiled_loss import loss_chunk_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_autocast_model_matches_plain():
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 256, pad="right").items()}
    plain, tiled = build("llama").to(device), build("llama").to(device)
    U.enable_tiled_loss(tiled, chunk_tokens=64)
    losses, grads = [], []
    for model in (plain, tiled):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        losses.append(loss.float())
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=0.0)
    for name, ref in grads[0].items():
        assert (grads[1][name] - ref).norm() <= 3e-2 * ref.norm(), name


def test_peak_memory_qwen3_vocab_8k_tokens():
    """hidden 2560, vocab 151,936, 8K tokens in bf16: the plain path holds several GiB of logits."""
    device = torch.device("cuda")
    tokens, hidden, vocab = 8192, 2560, 151_936
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, requires_grad=True) * 0.02
    w = w.detach().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    with PeakMemory(device) as plain:
        F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum").backward()
    h.grad = w.grad = None
    budget = 256 << 20
    with PeakMemory(device) as tiled:
        U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=loss_chunk_tokens(vocab, budget)).backward()
    # plain: bf16 + fp32 logits, log-softmax and its gradient, ~15 GiB; tiled: one chunk (256 MiB) plus the fp32
    # weight-gradient accumulator (1.45 GiB) and its bf16 per-chunk term (0.7 GiB)
    assert tiled.peak_bytes * 4 <= plain.peak_bytes, (tiled.peak_gib, plain.peak_gib)
    assert tiled.peak_bytes <= budget + 4 * w.numel() * 2 + 2 * h.numel() * 2, tiled.peak_gib


def test_bf16_weight_gradient_summed_in_fp32_without_bf16_rounding():
    """On CUDA the chunks' bf16 weight-gradient products reach the fp32 accumulator unrounded (out_dtype
    matmuls, probed): the accumulated gradient matches an fp64 reference to fp32 precision, ~100x closer
    than one bf16 rounding, whichever mode the probe picked."""
    from ulysses_sp.tiled_loss import kernel

    mode = kernel._fp32_product_mode("cuda", torch.bfloat16)
    if mode is None:
        pytest.skip(f"torch {torch.__version__} has no out_dtype matmul on CUDA")
    torch.manual_seed(0)
    acc = torch.randn(4096, 512, device="cuda")
    want = acc.double()
    for _ in range(4):  # four chunks of 256 tokens
        grad = torch.randn(256, 4096, device="cuda").bfloat16()
        h = torch.randn(256, 512, device="cuda").bfloat16()
        kernel._accumulate_weight_grad(acc, grad, h)
        want += grad.double().t() @ h.double()
    err = (acc.double() - want).norm() / want.norm()
    assert err < 1e-5, (mode, err.item())


def test_backward_makes_no_matmul_and_peak_holds_on_cuda():
    """The gradients are made in the forward: backward launches no matmul; the forward + backward peak is the
    gradient buffers and one chunk (<= 8 bytes per logit)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    device = torch.device("cuda")
    tokens, hidden, vocab, chunk = 4096, 1024, 32_000, 1024
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * 0.02).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device)
    with PeakMemory(device) as peak:
        loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=chunk)
        with Count():
            (loss / tokens).backward()
    assert Count.calls == 0
    assert peak.peak_bytes <= 1.02 * (4 * w.numel() + 2 * h.numel() + 8 * chunk * vocab), peak.peak_gib
