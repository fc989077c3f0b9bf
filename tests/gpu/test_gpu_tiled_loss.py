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
