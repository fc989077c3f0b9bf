"""The tiled loss makes its gradients in the forward: backward does no matmul, only what autograd needs is
made and kept, for as long as the graph lives, and the peak is what the planner counts."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from ulysses_sp.memory import PeakMemory
from ulysses_sp.tiled_loss import BYTES_PER_LOGIT, LogitsHead, chunk_bytes_per_logit, kernel

TOL = dict(rtol=1e-5, atol=1e-6)
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class _CountMatmuls(TorchDispatchMode):
    """Counts the matmul kernels that run inside it (``F.linear`` and ``@`` land on these)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket in _MATMULS
        return func(*args, **(kwargs or {}))


def _inputs(bias: bool = False, dtype=torch.float32, tokens: int = 37, vocab: int = 50, hidden: int = 16):
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, vocab, (tokens,))
    targets[:5] = -100
    return h, w, b, targets


@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=2.0, softcap=5.0)], ids=["linear", "softcap"])
@pytest.mark.parametrize("bias", [False, True])
def test_backward_does_no_matmul_and_recompute_does(head, bias):
    h, w, b, targets = _inputs(bias)
    for recompute, want_calls in ((False, 0), (True, 3 * 6)):  # 6 chunks of 7: logits, hidden and weight grads
        loss = U.tiled_cross_entropy_sum(h, w, targets, bias=b, head=head, chunk_tokens=7, recompute=recompute)
        with _CountMatmuls() as counter:
            (loss / 3).backward()
        assert counter.calls == want_calls, (recompute, counter.calls)


@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=0.5, softcap=3.0)], ids=["linear", "softcap"])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_recompute_path_equals_plain(head, chunk):
    h, w, b, targets = _inputs(bias=True)
    want = F.cross_entropy(head.apply(F.linear(h, w, b)), targets, reduction="sum")
    want_grads = torch.autograd.grad(want * 0.3, [h, w, b])
    got = U.tiled_cross_entropy_sum(h, w, targets, bias=b, head=head, chunk_tokens=chunk, recompute=True)
    torch.testing.assert_close(got, want, **TOL)
    for g, r in zip(torch.autograd.grad(got * 0.3, [h, w, b]), want_grads, strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_no_grad_and_frozen_inputs_keep_nothing():
    h, w, _, targets = _inputs(tokens=64, vocab=4000, hidden=32)
    want = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=16)
    chunk_bytes = 16 * 4000 * chunk_bytes_per_logit(4, softcap=False)
    with torch.no_grad(), PeakMemory("cpu") as peak:
        got = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=16)
    assert got.grad_fn is None and peak.peak_bytes <= 1.02 * chunk_bytes  # no gradient buffer was made
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with PeakMemory("cpu") as peak:
        frozen = U.tiled_cross_entropy_sum(h.detach(), w.detach(), targets, chunk_tokens=16)
    assert frozen.grad_fn is None and peak.peak_bytes <= 1.02 * chunk_bytes
    only_hidden = U.tiled_cross_entropy_sum(h, w.detach(), targets, chunk_tokens=16)
    grads = only_hidden.grad_fn.grads  # the stored gradients: the hidden states' only
    assert grads.hidden is not None and grads.weight is None and grads.bias is None


def test_stored_gradients_are_freed_with_the_graph_or_by_backward():
    h, w, _, targets = _inputs()
    loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=7)
    refs = [weakref.ref(t) for t in (loss.grad_fn.grads.hidden, loss.grad_fn.grads.weight)]
    assert all(ref() is not None for ref in refs)
    del loss  # backward never called: the graph, and the gradients with it, are gone
    assert all(ref() is None for ref in refs)
    loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=7)
    loss.backward()
    assert loss.grad_fn.grads is None  # handed to autograd, not kept by the graph node


def test_retain_graph_needs_recompute():
    h, w, _, targets = _inputs()
    loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=7)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute=True"):
        loss.backward()
    once = w.grad.clone()
    w.grad = None
    loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=7, recompute=True)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * once, **TOL)


def test_several_forwards_then_their_backwards_equal_plain():
    """Each forward's gradients belong to its own graph node (gradient accumulation, two losses alive)."""
    h, w, b, targets = _inputs(bias=True)
    parts = [(slice(0, 20), 0.25), (slice(20, 37), 3.0)]
    plain = [F.cross_entropy(F.linear(h[s], w, b), targets[s], reduction="sum") * k for s, k in parts]
    want = torch.autograd.grad(sum(plain), [h, w, b])
    losses = [U.tiled_cross_entropy_sum(h[s], w, targets[s], bias=b, chunk_tokens=6) * k for s, k in parts]
    for loss in reversed(losses):
        loss.backward()
    for got, ref in zip((h.grad, w.grad, b.grad), want, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def test_model_with_checkpointing_and_accumulation_equals_plain():
    model = build("llama")
    batches = [make_batch(1, 16, seed=seed) for seed in (1, 2)]
    plain = copy.deepcopy(model)
    for batch in batches:
        plain(**batch).loss.backward()
    tiled = U.enable_activation_checkpointing(U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)).train()
    losses = [tiled(**batch).loss for batch in batches]  # both forwards first, then both backwards
    for loss in losses:
        loss.backward()
    for (name, got), ref in zip(tiled.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(got.grad, ref.grad, **TOL, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=0.5, softcap=30.0)], ids=["linear", "softcap"])
def test_peak_is_what_the_planner_counts(dtype, head):
    """Forward: the gradient buffers and one chunk (chunk_bytes_per_logit, <= BYTES_PER_LOGIT); backward: the
    weight gradient cast to its dtype (none under fp32). 2% slack covers the [chunk] vectors."""
    vocab, tokens, hidden, chunk = 32_000, 256, 64, 32
    h, w, _, targets = _inputs(dtype=dtype, tokens=tokens, vocab=vocab, hidden=hidden)
    elt = torch.finfo(dtype).bits // 8
    buffers = 4 * w.numel() + elt * h.numel()
    gc.collect()  # garbage of earlier tests freed inside the block would skew PeakMemory (address reuse)
    with PeakMemory("cpu") as forward:
        loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=chunk, head=head)
    with PeakMemory("cpu") as backward:
        loss.backward()
    working = chunk_bytes_per_logit(elt, head.softcap is not None) * chunk * vocab
    assert working <= BYTES_PER_LOGIT * chunk * vocab
    assert buffers + working <= forward.peak_bytes <= 1.02 * (buffers + working)
    assert backward.peak_bytes <= 1.02 * (elt * w.numel() if elt < 4 else 0) + 64


def test_bf16_gradients_close_to_plain():
    h, w, b, targets = _inputs(bias=True, dtype=torch.bfloat16, tokens=64, vocab=300, hidden=32)
    want = torch.autograd.grad(F.cross_entropy(F.linear(h, w, b).float(), targets, reduction="sum"), [h, w, b])
    got = torch.autograd.grad(U.tiled_cross_entropy_sum(h, w, targets, bias=b, chunk_tokens=9), [h, w, b])
    for g, r in zip(got, want, strict=True):
        assert g.dtype == r.dtype and (g.float() - r.float()).norm() <= 1e-2 * r.float().norm()


def test_fp32_product_mode_is_probed_without_error():
    # the CPU build of torch 2.13 has no out_dtype matmul: the product is rounded to bf16 before it is added
    assert kernel._fp32_product_mode("cpu", torch.bfloat16) in (None, "mm", "addmm")


def _adapters(vocab: int, hidden: int, dtype=torch.float32, ranks=(3, 2), scalings=(2.0, 0.5)):
    """Two LoRA-like low-rank terms: (A [r, h], B [V, r], B's bias [V] or None (the second), scaling)."""
    torch.manual_seed(1)
    made = []
    for i, (rank, scaling) in enumerate(zip(ranks, scalings, strict=True)):
        a = (torch.randn(rank, hidden, dtype=dtype) / 4).requires_grad_()
        b = (torch.randn(vocab, rank, dtype=dtype) / 4).requires_grad_()
        bias = torch.randn(vocab, dtype=dtype).requires_grad_() if i == 0 else None
        made.append((a, b, bias, scaling))
    return made


def _plain_with_adapters(h, w, b, adapters, head):
    """PEFT's arithmetic: ``base(h) + scaling x lora_B(lora_A(x))`` per adapter (x: its inputs, else h), then the
    head."""
    raw = F.linear(h, w, b)
    for a, up, bias, scaling, *inputs in adapters:
        x = inputs[0] if inputs and inputs[0] is not None else h
        raw = raw + F.linear(F.linear(x, a), up, bias) * scaling
    return head.apply(raw.float())


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=0.5, softcap=3.0)], ids=["linear", "softcap"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trained_base", "frozen_base"])
def test_low_rank_adapters_equal_peft_arithmetic(recompute, head, frozen):
    """Loss and every gradient (hidden, base weight and bias unless frozen, each adapter's A, B and B's bias) equal
    the plain computation, label smoothing on, in chunks of 7 over 37 tokens; the second adapter reads inputs of its
    own (the hidden states after a dropout mask), through which hidden's gradient flows too."""
    h, w, b, targets = _inputs(bias=True)
    if frozen:
        w, b = w.detach(), b.detach()
    adapters = _adapters(w.shape[0], w.shape[1])
    mask = torch.rand(h.shape, generator=torch.Generator().manual_seed(2)) > 0.3
    adapters[1] = (*adapters[1], h * mask / 0.7)  # the second reads its own inputs (h after a dropout), as PEFT's
    leaves = [h, *(x for x in (w, b) if x.requires_grad), *(x for a in adapters for x in a[:3] if x is not None)]
    plain = F.cross_entropy(
        _plain_with_adapters(h, w, b, adapters, head), targets, reduction="sum", label_smoothing=0.1
    )
    want = torch.autograd.grad(plain * 0.3, leaves, retain_graph=True)  # (the mask's product is shared)
    got = U.tiled_cross_entropy_sum(
        h, w, targets, bias=b, head=head, chunk_tokens=7, recompute=recompute, label_smoothing=0.1, adapters=adapters
    )
    torch.testing.assert_close(got, plain, **TOL)
    for index, (g, r) in enumerate(zip(torch.autograd.grad(got * 0.3, leaves), want, strict=True)):
        torch.testing.assert_close(g, r, **TOL, msg=lambda m, i=index: f"leaf {i}: {m}")


def test_low_rank_adapters_keep_no_vocab_by_hidden_tensor():
    """With the base weight frozen (LoRA), the forward holds the hidden-state gradient, the adapters' (rank-r)
    gradients and one chunk, never a [V, h] tensor; backward does no matmul."""
    vocab, tokens, hidden, chunk = 32_000, 128, 256, 8
    h, w, _, targets = _inputs(tokens=tokens, vocab=vocab, hidden=hidden)
    w = w.detach()
    adapters = _adapters(vocab, hidden, ranks=(4,), scalings=(2.0,))
    adapter_grads = 4 * sum(x.numel() for a in adapters for x in a[:3] if x is not None)
    buffers = 4 * h.numel() + adapter_grads
    working = BYTES_PER_LOGIT * chunk * vocab  # the logits and one more [c, V] (the adapter's term as it is added)
    gc.collect()
    with PeakMemory("cpu") as forward:
        loss = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=chunk, adapters=adapters)
    quarter_of_head = w.numel() * w.element_size() // 4  # (bytes: a quarter of one fp32 [V, h] tensor)
    assert buffers + 4 * chunk * vocab <= forward.peak_bytes <= 1.02 * (buffers + working) < quarter_of_head
    with _CountMatmuls() as counter:
        loss.backward()
    assert (
        counter.calls == 0 and w.grad is None and all(a[0].grad is not None and a[1].grad is not None for a in adapters)
    )


def test_a_misshapen_adapter_is_refused():
    h, w, _, targets = _inputs()
    (a, b, bias, scaling), _ = _adapters(w.shape[0], w.shape[1])
    for bad in [(a.t(), b, bias, scaling), (a, b[:-1], bias, scaling), (a, b, bias[:-1], scaling)]:
        with pytest.raises(ValueError, match=r"an adapter must be A \[r, 16\], B \[50, r\]"):
            U.tiled_cross_entropy_sum(h, w, targets, adapters=[bad])


def test_bf16_base_with_fp32_adapters_runs_them_as_peft_does():
    """PEFT keeps adapters in fp32 over a bf16 base: without autocast it casts the input to fp32, adds the adapter's
    term in fp32 and returns the sum in bf16; so does the kernel: the same loss, the adapters' fp32 gradients within
    1e-5 of PEFT's and the bf16 hidden one within its rounding (computing the adapters in bf16 was 1% off in all)."""
    h, w, _, targets = _inputs(dtype=torch.bfloat16, tokens=64, vocab=300, hidden=32)
    w = w.detach()
    adapters = _adapters(300, 32)
    leaves = [h, *(x for a in adapters for x in a[:3] if x is not None)]
    raw = F.linear(h, w)
    for a, up, bias, scaling in adapters:  # PEFT's LoRA Linear forward, cast by cast
        raw = raw + F.linear(F.linear(h.to(a.dtype), a), up, bias) * scaling
    peft = F.cross_entropy(raw.to(torch.bfloat16).float(), targets, reduction="sum")
    want = torch.autograd.grad(peft, leaves)
    got = U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=9, adapters=adapters)
    torch.testing.assert_close(got, peft, rtol=1e-5, atol=0)
    for g, r in zip(torch.autograd.grad(got, leaves), want, strict=True):
        rel = 5e-3 if g.dtype == torch.bfloat16 else 1e-5  # (bf16 sums of the base's and the adapters' parts)
        assert g.dtype == r.dtype and (g.float() - r.float()).norm() <= rel * r.float().norm()
