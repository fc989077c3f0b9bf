"""Single-process tests of the ring attention math: zigzag order, block kernel, online-softmax merge, layouts."""

import pytest
import torch
import torch.nn.functional as F

import ulysses_sp as U
from tests.helpers.models import make_batch
from ulysses_sp.cores import Segments, eager_core
from ulysses_sp.layout import choose_ring_degree, hybrid_layouts_for
from ulysses_sp.ring import block_backward, block_forward, merge_partial, ring_attention, zigzag_order


def _qkv(b=2, h=4, hkv=2, n=12, d=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, n, d, generator=gen, dtype=dtype) for heads in (h, hkv, hkv)]


def _reference(q, k, v, visible, scale, softcap=None):
    # plain softmax attention with a [b, nq, nk] visibility mask; rows that see nothing give 0
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return probs @ v.repeat_interleave(groups, 1)


def test_zigzag_order():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert sorted(zigzag_order(24, 4).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="divisible by 2 x ring = 4"):
        zigzag_order(10, 2)


def test_zigzag_balances_causal_work():
    """Every ring rank sees the same number of (query, key) pairs under a causal mask."""
    ring, n = 4, 32
    order = zigzag_order(n, ring).view(ring, n // ring)
    work = [int((order[r][:, None] >= torch.arange(n)[None]).sum()) for r in range(ring)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_block_forward_and_backward_match_autograd(softcap):
    q, k, v = _qkv()
    gen = torch.Generator().manual_seed(3)
    visible = torch.rand(2, 12, 12, generator=gen) > 0.4
    visible[0, 5] = False  # a query that sees no key: output 0, lse -inf, no NaN
    scale = 0.3
    out, lse = block_forward(q, k, v, visible, scale=scale, softcap=softcap)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference(*inputs, visible, scale, softcap)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[0, :, 5]).all() and (out[0, :, 5] == 0).all()
    grad = torch.randn_like(ref)
    ref.backward(grad)
    delta = (grad * out.double()).sum(-1)
    grads = block_backward(q, k, v, grad, lse, delta, visible, scale=scale, softcap=softcap)
    for got, x in zip(grads, inputs, strict=True):
        torch.testing.assert_close(got.double(), x.grad, rtol=1e-5, atol=1e-6)
        assert torch.isfinite(got).all()


def test_merge_of_key_blocks_equals_full_softmax():
    q, k, v = _qkv(n=16)
    visible = torch.ones(2, 16, 16, dtype=torch.bool).tril()
    full, full_lse = block_forward(q, k, v, visible, scale=0.35)
    out = torch.zeros_like(full)
    lse = torch.full_like(full_lse, float("-inf"))
    for cols in torch.arange(16).split(5):  # 4 uneven key blocks; the last rows see keys of several blocks
        part = block_forward(q, k[:, :, cols], v[:, :, cols], visible[:, :, cols], scale=0.35)
        out, lse = merge_partial(out, lse, *part)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)  # float64 throughout
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_fp32_merge_error_does_not_grow_with_blocks():
    """bf16 block outputs merged in fp32: the error vs float64 stays that of one bf16 rounding however many
    blocks; merging into a bf16 accumulator (the failure this guards against) grows with the block count."""
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(b=1, h=4, hkv=4, n=256, d=16, seed=5, dtype=torch.float32))
    visible = torch.ones(1, 256, 256, dtype=torch.bool)
    exact, _ = block_forward(q.double(), k.double(), v.double(), visible, scale=0.25)

    def error(blocks, accumulate_bf16):
        out = torch.zeros(1, 4, 256, 16)
        lse = torch.full((1, 4, 256), float("-inf"))
        for cols in torch.arange(256).chunk(blocks):
            part_out, part_lse = block_forward(q, k[:, :, cols], v[:, :, cols], visible[:, :, cols], scale=0.25)
            out, lse = merge_partial(out, lse, part_out.to(torch.bfloat16).float(), part_lse)  # bf16 like a kernel
            if accumulate_bf16:
                out = out.to(torch.bfloat16).float()
        return float((out.to(torch.bfloat16).double() - exact).norm() / exact.norm())

    good = [error(blocks, False) for blocks in (2, 4, 16)]
    bad = [error(blocks, True) for blocks in (2, 4, 16)]
    assert good[2] <= 1.1 * good[0], good
    assert bad[2] > 1.5 * bad[0] and bad[2] > 1.5 * good[2], (good, bad)


@pytest.mark.parametrize("window,query_chunk", [(None, None), (4, None), (None, 5)])
def test_ring_of_one_matches_eager_core(window, query_chunk):
    """ring_attention without a group (ring 1) over packed documents and padding equals the eager core,
    also when the queries are computed in chunks."""
    batch = make_batch(2, 24, packed=(7, 10, 7), pad="right")
    segments = Segments.from_positions(batch["position_ids"], batch["attention_mask"])
    q, k, v = (x.float().requires_grad_() for x in _qkv(n=24))
    out = ring_attention(q, k, v, segments, None, scaling=0.3, sliding_window=window, query_chunk=query_chunk)
    ref_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = eager_core(*ref_inputs, segments, scaling=0.3, sliding_window=window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for got, want in zip((q, k, v), ref_inputs, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_ring_refuses_dropout_and_bad_lengths():
    q, k, v = (x.float() for x in _qkv(n=8))
    segments = Segments.from_positions(torch.arange(8)[None].expand(2, 8))
    with pytest.raises(ValueError, match="dropout"):
        ring_attention(q, k, v, segments, None, dropout=0.1)
    with pytest.raises(ValueError, match="shard_batch"):
        ring_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], segments, None)


def test_choose_ring_degree_and_layouts():
    assert choose_ring_degree(8, 32, 8) == 1  # pure Ulysses whenever the heads allow it
    assert choose_ring_degree(4, 2, 2) == 2  # 2 heads at sp=4: ulysses 2 x ring 2
    assert choose_ring_degree(64, 32, 8) == 2
    assert choose_ring_degree(6, 4, 4) == 3  # ulysses 2 x ring 3
    assert choose_ring_degree(3, 4) == 3  # nothing but a pure ring
    assert hybrid_layouts_for(4, 2) == [(2, 2), (1, 4)]


def test_bad_ring_layout_is_refused_before_any_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="ring degrees that divide sp=4: 1, 2, 4"):
        U.ParallelLayout.from_env(sp=4, ring=3)
    with pytest.raises(ValueError, match="ulysses 4 x ring 1 cannot be formed.*ulysses 2 x ring 2, ulysses 1 x ring 4"):
        U.ParallelLayout.from_env(sp=4, ring=1, num_heads=2)
    layout = U.ParallelLayout.single()
    object.__setattr__(layout, "sp", 4)
    object.__setattr__(layout, "ring", 2)  # check_heads reads sp and ring only
    layout.check_heads(2, 2)
    with pytest.raises(ValueError, match="layouts of sp=4 that work for these heads: ulysses 1 x ring 4"):
        layout.check_heads(3, 3)


def test_shard_batch_zigzag_keeps_every_token_with_its_label():
    """With a ring the shards hold the zigzag order; concatenated they are a permutation of the padded row,
    and each token keeps its own target and position."""
    batch = make_batch(2, 21, packed=(9, 12))
    sp, ring = 4, 2
    shards = [U.shard_batch(batch, U.ParallelLayout.rank_view(sp, r, ring=ring)) for r in range(sp)]
    length = 24  # padded to a multiple of lcm(sp, 2 x ring) = 4
    order = zigzag_order(length, ring)
    padded = F.pad(batch["input_ids"], (0, length - 21))
    ids = torch.cat([s["input_ids"] for s in shards], dim=1)
    torch.testing.assert_close(ids, padded[:, order])
    targets = F.pad(batch["labels"][:, 1:], (0, length - 20), value=-100)
    torch.testing.assert_close(torch.cat([s["shift_labels"] for s in shards], dim=1), targets[:, order])
    # the padding for divisibility is a document of its own (positions restart at 0)
    positions = torch.cat([torch.arange(9), torch.arange(12), torch.arange(3)]).expand(2, -1)
    torch.testing.assert_close(torch.cat([s["position_ids"] for s in shards], dim=1), positions[:, order])
