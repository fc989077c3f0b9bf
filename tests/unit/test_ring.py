"""Single-process tests of the ring attention math: zigzag order, block kernels, rectangles, merge, layouts.

Rings of several ranks run here as threads of one process (tests/helpers/ring_sim.py), with the real ring code.
"""

import random

import pytest
import torch
import torch.nn.functional as F

import ulysses_sp as U
from tests.helpers.models import make_batch
from tests.helpers.ring_sim import one_process_error_sums, ring_error_sums, run_threads
from tests.helpers.spy import CountOps
from ulysses_sp.cores import Segments, eager_core
from ulysses_sp.layout import choose_layout, choose_ring_degree, hybrid_layouts_for, resolve_ring_degree
from ulysses_sp.ring import merge_partial, ring_attention, zigzag_order
from ulysses_sp.ring_blocks import band_pieces, ring_pieces
from ulysses_sp.ring_kernels import PlainKernel, acc_dtype, get_ring_kernel


def _qkv(b=2, h=4, hkv=2, n=12, d=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, heads, n, d, generator=gen, dtype=dtype) for heads in (h, hkv, hkv)]


def _reference(q, k, v, visible, scale, softcap=None):
    # plain softmax attention with a [nq, nk] visibility mask (every row sees a key)
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return probs @ v.repeat_interleave(groups, 1), torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)


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


@pytest.mark.parametrize("kernel", ["plain", "cpu_flash"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_kernels_match_autograd(kernel, causal, softcap):
    """Each kernel's (out, lse) and its backward from the final (out, lse) equal autograd of plain attention
    (GQA: 4 query heads over 2 kv heads; a full rectangle has fewer queries than keys)."""
    q, k, v = _qkv(n=12)
    if not causal:
        q = q[:, :, :7]
    block = get_ring_kernel(kernel)
    if softcap is not None and not block.supports_softcap:
        with pytest.raises(ValueError, match="softcap"):
            block.forward(q, k, v, causal=causal, scale=0.3, softcap=softcap)
        return
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    visible = visible.tril() if causal else visible
    out, lse = block.forward(q, k, v, causal=causal, scale=0.3, softcap=softcap)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = _reference(*inputs, visible, 0.3, softcap)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse.detach(), rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    grads = block.backward(grad, q, k, v, out, lse, causal=causal, scale=0.3, softcap=softcap)
    for got, x in zip(grads, inputs, strict=True):
        assert got.shape == x.shape
        torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-10)


def test_cpu_flash_runs_bf16_in_fp32():
    """The CPU fused kernel computes 16-bit inputs in fp32 (its bf16 backward is much slower)."""
    assert get_ring_kernel("cpu_flash").compute_dtype(torch.bfloat16) == torch.float32
    assert get_ring_kernel("cpu_flash").compute_dtype(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="unknown ring kernel 'nope'"):
        get_ring_kernel("nope")


def test_acc_dtype_is_promote_types_with_fp32_and_dispatches_no_op_for_the_float_dtypes():
    """The accumulation dtype (ring, block kernels, head chunks' cores) is ``torch.promote_types(dtype, fp32)`` for
    every dtype that takes; for fp16/bf16/fp32/fp64 without an aten op (promote_types dispatches one each call)."""
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    with CountOps() as counted:
        found = [acc_dtype(dtype) for dtype in floats]
    assert not counted.ops, counted.ops
    assert found == [torch.float32, torch.float32, torch.float32, torch.float64]
    for dtype in (*floats, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128):
        assert acc_dtype(dtype) == torch.promote_types(dtype, torch.float32), dtype


@pytest.mark.parametrize("name", ["cuda_flash", "cuda_efficient", "cuda_cudnn"])
def test_cuda_kernels_call_their_ops_on_meta(name):
    """The CUDA kernels' calls match the aten schemas and give the shapes the ring expects (meta tensors: no
    numbers, those are checked in tests/gpu)."""
    block = get_ring_kernel(name)
    q, k, v = (torch.empty(2, h, 40, 64, device="meta", dtype=torch.bfloat16) for h in (8, 2, 2))
    out, lse = block.forward(q, k, v, causal=True, scale=0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 40) and lse.dtype == torch.float32
    dq, dk, dv = block.backward(out, q, k, v, out, lse, causal=True, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def _paint(boxes, nq, nk, q_first=0, k_first=0):
    # the [nq, nk] count of how many rectangles cover each (query, key) pair
    covered = torch.zeros(nq, nk, dtype=torch.int)
    for q0, q1, k0, k1, kind in boxes:
        i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None]
        assert kind == "full" or q1 - q0 == k1 - k0, (kind, q0, q1, k0, k1)
        part = {"full": torch.ones_like(i * j), "causal": j <= i, "anti": j >= i}[kind]
        covered[q0 - q_first : q1 - q_first, k0 - k_first : k1 - k_first] += part.int()
    return covered


def test_band_pieces_cover_exactly_the_band():
    """Rectangles of a window band: every visible pair exactly once, nothing else (brute force)."""
    rng = random.Random(0)
    for _ in range(1500):
        qa, ka = rng.randint(0, 40), rng.randint(0, 60)
        qb, kb = qa + rng.randint(1, 30), ka + rng.randint(1, 30)
        window = rng.choice([None, 1, 2, 3, 5, 8, 13, 100])
        q, k = torch.arange(qa, qb)[:, None], torch.arange(ka, kb)[None]
        want = (k <= q) & ((k > q - window) if window else True)
        got = _paint(band_pieces(qa, qb, ka, kb, window), qb - qa, kb - ka, qa, ka)
        assert torch.equal(got, want.int()), (qa, qb, ka, kb, window)


def test_ring_pieces_cover_exactly_the_visible_pairs():
    """For random rings, documents, padding and windows, the rectangles of every (rank, source) pair cover
    exactly the pairs in the same document, causal and inside the window."""
    rng = random.Random(1)
    for _ in range(250):
        ring, chunk, batch = rng.choice([1, 2, 3, 4]), rng.randint(1, 6), rng.randint(1, 3)
        seq_len = 2 * ring * chunk
        spans = []
        for _row in range(batch):
            cuts = sorted(rng.sample(range(1, seq_len), rng.randint(0, min(4, seq_len - 1))))
            row = list(zip([0, *cuts], [*cuts, seq_len], strict=True))
            row = row[rng.random() < 0.3 :]  # left padding
            spans.append(row[: len(row) - (rng.random() < 0.3)])  # right padding
        if rng.random() < 0.3:
            spans = [spans[0]] * batch
        window = rng.choice([None, 1, 2, 3, 7])
        order, n = zigzag_order(seq_len, ring).view(ring, -1), seq_len // ring
        for rank in range(ring):
            for source in range(ring):
                pieces = ring_pieces(spans, seq_len, ring, rank, source, window)
                for row in range(batch):
                    boxes = [(p.q0, p.q1, p.k0, p.k1, p.kind) for p in pieces if p.rows.start in (None, row)]
                    docs = torch.full((seq_len,), -1)
                    for doc, (s, e) in enumerate(spans[row]):
                        docs[s:e] = doc
                    qi, kj = order[rank][:, None], order[source][None]
                    want = (docs[qi] == docs[kj]) & (docs[qi] >= 0) & (kj <= qi)
                    want &= (kj > qi - window) if window else True
                    assert torch.equal(_paint(boxes, n, n), want.int()), (ring, spans, window, rank, source, row)


def test_merge_of_key_blocks_equals_full_softmax():
    q, k, v = _qkv(n=16)
    block = PlainKernel()
    full, full_lse = block.forward(q, k, v, causal=False, scale=0.35)
    out = torch.zeros_like(full)
    lse = torch.full_like(full_lse, float("-inf"))
    for cols in torch.arange(16).split(5):  # 4 uneven key blocks
        out, lse = merge_partial(out, lse, *block.forward(q, k[:, :, cols], v[:, :, cols], causal=False, scale=0.35))
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)  # float64 throughout
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)


def test_fp32_merge_error_does_not_grow_with_blocks():
    """bf16 block outputs merged in fp32: the error vs float64 stays that of one bf16 rounding however many
    blocks; merging into a bf16 accumulator (the failure this guards against) grows with the block count."""
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(b=1, h=4, hkv=4, n=256, d=16, seed=5, dtype=torch.float32))
    block = PlainKernel()
    exact, _ = block.forward(q.double(), k.double(), v.double(), causal=False, scale=0.25)

    def error(blocks, accumulate_bf16):
        out = torch.zeros(1, 4, 256, 16)
        lse = torch.full((1, 4, 256), float("-inf"))
        for cols in torch.arange(256).chunk(blocks):
            part_out, part_lse = block.forward(q, k[:, :, cols], v[:, :, cols], causal=False, scale=0.25)
            out, lse = merge_partial(out, lse, part_out.to(torch.bfloat16).float(), part_lse)  # bf16 like a kernel
            if accumulate_bf16:
                out = out.to(torch.bfloat16).float()
        return float((out.to(torch.bfloat16).double() - exact).norm() / exact.norm())

    good = [error(blocks, False) for blocks in (2, 4, 16)]
    bad = [error(blocks, True) for blocks in (2, 4, 16)]
    assert good[2] <= 1.1 * good[0], good
    assert bad[2] > 1.5 * bad[0] and bad[2] > 1.5 * good[2], (good, bad)


def _ring_vs_eager(size, batch, window, kernel, *, heads=4, kv_heads=2, query_chunk=None, softcap=None):
    """Ring attention on ``size`` thread ranks (fp32) against the eager core on the full rows: out and grads."""
    length = batch["input_ids"].shape[1]
    positions = batch.get("position_ids", torch.arange(length).expand(batch["input_ids"].shape))
    segments = Segments.from_positions(positions, batch.get("attention_mask"))
    seq_len = segments.seq_len
    q, k, v = (x.float() for x in _qkv(b=segments.batch, h=heads, hkv=kv_heads, n=seq_len, seed=3))
    grad = torch.randn(segments.batch, seq_len, heads, 8, generator=torch.Generator().manual_seed(4))
    ref_inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = eager_core(*ref_inputs, segments, scaling=0.3, sliding_window=window, softcap=softcap)  # [b, N, h, d]
    ref.backward(grad)
    order = zigzag_order(seq_len, size)
    n = seq_len // size

    def rank_run(transport):
        mine = order[transport.rank * n : (transport.rank + 1) * n]
        local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
        out = ring_attention(
            *local, segments, transport, scaling=0.3, sliding_window=window, softcap=softcap, kernel=kernel,
            query_chunk=query_chunk,
        )  # fmt: skip
        out.backward(grad[:, mine])
        return mine, out.detach(), [x.grad for x in local]

    for mine, out, grads in run_threads(size, rank_run):
        torch.testing.assert_close(out, ref.detach()[:, mine], rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, ref_inputs, strict=True):
            torch.testing.assert_close(got, want.grad[:, :, mine], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", ["cpu_flash", "plain"])
@pytest.mark.parametrize("window,query_chunk", [(None, None), (4, None), (None, 5)])
def test_ring_of_one_matches_eager_core(kernel, window, query_chunk):
    """ring_attention without a group (ring 1) over packed documents and padding equals the eager core,
    also when the plain kernel computes the queries in chunks."""
    _ring_vs_eager(1, make_batch(2, 24, packed=(7, 10, 7), pad="right"), window, kernel, query_chunk=query_chunk)


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("kernel", ["cpu_flash", "plain"])
def test_thread_ring_matches_eager_core(size, kernel):
    """Rings of 2-8 ranks (threads) with packed documents, left padding, windows and MQA equal the eager core."""
    length = 16 * size
    cuts = (length // 3, length - length // 3 - 5, 5)
    _ring_vs_eager(size, make_batch(2, length, packed=cuts), None, kernel)
    _ring_vs_eager(size, make_batch(2, length, pad="left", pad_lengths=(3, 9)), 6, kernel, kv_heads=1)


def _dense_flex(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=True):
    """flex_attention's contract computed densely with autograd (flex has no CPU backward): (out, lse), rows
    that see no key give out 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(groups, 1).transpose(2, 3) * scale
    if score_mod is not None:
        scores = score_mod(scores, None, None, None, None)
    index = [torch.arange(n) for n in (q.shape[0], q.shape[2], k.shape[2])]
    keep = block_mask.mask_mod(index[0][:, None, None], None, index[1][None, :, None], index[2][None, None, :])
    keep = keep[:, None]  # [b, 1, nq, nk]
    lse = torch.logsumexp(torch.where(keep, scores, torch.finfo(scores.dtype).min), -1)
    lse = torch.where(keep.any(-1), lse, float("-inf"))
    probs = torch.where(keep, torch.exp(scores - torch.where(keep.any(-1), lse, 0)[..., None]), 0)
    return probs @ v.repeat_interleave(groups, 1), lse


@pytest.mark.parametrize("size", [1, 2, 4])
def test_flex_kernel_ring_with_a_dense_stand_in(monkeypatch, size):
    """The ``flex`` path (one BlockMask per block pair, backward from the block's lse gradient) with compiled
    flex_attention replaced by a dense autograd stand-in of its contract: packed, padded, windowed, softcap."""
    from ulysses_sp import ring_kernels

    monkeypatch.setattr(ring_kernels, "compiled_flex", lambda: _dense_flex)
    length = 16 * size
    _ring_vs_eager(size, make_batch(2, length, packed=(5, length - 9, 4)), 6, "flex")
    _ring_vs_eager(size, make_batch(2, length, pad="right", pad_lengths=(0, 7)), None, "flex", kv_heads=1)
    _ring_vs_eager(size, make_batch(2, length), None, "flex", softcap=3.0)


def test_bf16_error_does_not_grow_with_the_ring():
    """bf16 ring attention at ring 2, 4 and 8 (threads) has no larger error against float64 than one bf16 process
    running sdpa on the whole sequence (output, dq, dk, dv)."""
    one = one_process_error_sums()
    one_error = (one[:, 0] / one[:, 1]).sqrt()
    for size in (2, 4, 8):
        sums = sum(run_threads(size, lambda t: ring_error_sums(t, t.rank, t.size)))
        error = (sums[:, 0] / sums[:, 1]).sqrt()
        assert (error <= one_error).all() and (error > 0).all(), (size, error, one_error)
    fp32 = sum(run_threads(8, lambda t: ring_error_sums(t, t.rank, t.size, dtype=torch.float32)))
    assert ((fp32[:, 0] / fp32[:, 1]).sqrt() < 1e-5).all(), fp32


def test_ring_refuses_dropout_and_bad_lengths():
    q, k, v = (x.float() for x in _qkv(n=8))
    segments = Segments.from_positions(torch.arange(8)[None].expand(2, 8))
    with pytest.raises(ValueError, match="dropout"):
        ring_attention(q, k, v, segments, None, dropout=0.1)
    with pytest.raises(ValueError, match="shard_batch"):
        ring_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], segments, None)
    with pytest.raises(ValueError, match="'cpu_flash' cannot apply softcap"):
        ring_attention(q, k, v, segments, None, softcap=5.0, kernel="cpu_flash")


def test_choose_ring_degree_and_layouts():
    assert choose_ring_degree(8, 32, 8) == 1  # pure Ulysses whenever the heads allow it
    assert choose_ring_degree(4, 2, 2) == 2  # 2 heads at sp=4: ulysses 2 x ring 2
    assert choose_ring_degree(64, 32, 8) == 2
    assert choose_ring_degree(6, 4, 4) == 3  # ulysses 2 x ring 3
    assert choose_ring_degree(3, 4) == 3  # nothing but a pure ring
    assert hybrid_layouts_for(4, 2) == [(2, 2), (1, 4)]


def test_choose_layout_keeps_ulysses_inside_a_node():
    """The heads AND the node size pick ulysses x ring: the all-to-all inside a node, the ring across nodes."""
    assert choose_layout(8, 32, 8)[:2] == (8, 1)
    assert choose_layout(16, 32, 8)[:2] == (16, 1)  # one node of 16 (or no topology known): pure Ulysses
    ulysses, ring, reason = choose_layout(16, 32, 8, gpus_per_node=8)
    assert (ulysses, ring) == (8, 2)
    assert reason.startswith("ulysses 8 x ring 2 for sp=16") and "ring of 2 crosses nodes" in reason, reason
    assert choose_layout(16, 32, 8, gpus_per_node=4)[:2] == (4, 4)
    assert choose_layout(8, 32, 8, gpus_per_node=8)[2].startswith("pure Ulysses (ulysses 8) for sp=8")
    # ranks, not GPUs: `ulysses-sp train` on a CPU machine printed "inside a node of 2 GPUs"
    assert choose_layout(2, 4, 2, gpus_per_node=2)[2].endswith("each Ulysses group lies inside a node of 2 ranks")
    assert "would not fit inside a node of 8 ranks" in reason, reason
    assert choose_layout(4, 2, 2, gpus_per_node=8)[:2] == (2, 2)  # the heads limit it, not the node
    assert choose_layout(6, 4, 4, gpus_per_node=8)[:2] == (2, 3)
    assert choose_layout(4, 4, 4, gpus_per_node=6)[:2] == (2, 2)  # groups of 4 would straddle nodes of 6
    assert choose_layout(3, 4)[2].startswith("pure ring (ring 3)")
    assert choose_layout(16, None, gpus_per_node=8)[:2] == (8, 2)  # no head counts: the node alone
    assert choose_layout(16, None)[:2] == (16, 1)
    assert resolve_ring_degree(16, None, 32, 8, gpus_per_node=8) == 2  # what from_env uses (LOCAL_WORLD_SIZE)
    with pytest.raises(ValueError, match="gpus_per_node must be a positive int"):
        choose_layout(8, 8, gpus_per_node=0)


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
