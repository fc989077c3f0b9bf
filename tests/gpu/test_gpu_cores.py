"""Cores on a CUDA device (skipped without one): every core against plain transformers attention.

One GPU cannot host an SP group of several NCCL ranks, so these tests run sp=1 through the same
Ulysses path (segments, core, identity exchange); the exchanges themselves are proven on gloo in tests/dist.
"""

import importlib.util

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch
from tests.helpers.spy import calls_to, dynamo_compiles
from ulysses_sp import cores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CORES = ["sdpa", "eager", "flex_attention"]
CORES += [
    c
    for c, m in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface"))
    if importlib.util.find_spec(m) is not None
]
# 16 documents of 8 tokens a row: more than FLEX_MIN_DOCS_PER_ROW (8), so the sdpa core hands them to one flex call
# (packed_kernel). (16,) * 8, chosen when that threshold was 4, became a tie that the per-document loop keeps.
MANY = (8,) * 16


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("arch,packed", [("llama", None), ("llama", (40, 88)), ("mistral", (70, 58)), ("llama", MANY)])
def test_core_matches_plain_attention_bf16(core, arch, packed):
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=packed).items()}
    # head_dim 16: flex_attention on CUDA needs >= 16 (the flex core refuses less with a ValueError)
    ref = build(arch, kv_heads=2, window=32, head_dim=16).to(device, torch.bfloat16)
    par = build(arch, kv_heads=2, window=32, head_dim=16).to(device, torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    layout = U.ParallelLayout.single(device)
    U.parallelize(par, layout, core=core)
    with calls_to(cores, "flex_core") as flex_calls:  # the sdpa core's own calls (the flex core is called directly)
        loss, grads = loss_and_grads(par, batch, layout)
    assert bool(flex_calls) == (core == "sdpa" and packed == MANY), len(flex_calls)
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=0.0)
    for name, grad in grads.items():  # bf16 compute: within 5% of each gradient's norm (a zero grad fails)
        ref_grad = ref_grads[name]
        assert (grad - ref_grad).norm() <= 5e-2 * ref_grad.norm(), (
            f"{name}: {(grad - ref_grad).norm()} vs {ref_grad.norm()}"
        )


def test_flex_refuses_head_dim_below_16_on_cuda():
    device = torch.device("cuda")
    model = U.parallelize(
        build("llama", kv_heads=2, head_dim=8).to(device), U.ParallelLayout.single(device), core="flex_attention"
    )
    with pytest.raises(ValueError, match="head dim >= 16 on CUDA"):
        model(input_ids=torch.zeros(1, 32, dtype=torch.long, device=device))


# Ten lengths of padding-free packed rows (a new length nearly every step), none a multiple of the 128-token block
FLEX_LENGTHS = tuple(300 + 97 * i for i in range(10))


def test_flex_core_over_ten_lengths_compiles_a_few_times_and_stays_exact(gpu_record):
    """The flex core (compiled BlockMask, compiled flex_attention) over ten lengths of rows packed with ten documents,
    fp32 forward + backward, as a Gemma-2-like model calls it: global layers and sliding-window + softcap layers in
    every step. torch.compile never reaches its recompile limit (past it flex ran uncompiled, with dense [q, k]
    scores; with ``dynamic=False``, at the 5th length here: two entries a length), and out / grads equal the fp64
    eager core's."""
    device = torch.device("cuda")
    variants = ((None, None), (100, 30.0))  # (sliding_window, softcap)
    worst = 0.0
    with dynamo_compiles() as compiled:
        for n in FLEX_LENGTHS:
            pieces = [n // 10] * 9
            positions = torch.cat([torch.arange(p) for p in (*pieces, n - sum(pieces))])[None].to(device)
            segments = cores.Segments.from_positions(positions)
            gen = torch.Generator(device).manual_seed(n)
            q, k, v = (torch.randn(1, h, n, 64, device=device, generator=gen) for h in (8, 2, 2))
            grad = torch.randn(1, n, 8, 64, device=device, generator=gen)
            for window, softcap in variants:
                inputs = [x.clone().requires_grad_() for x in (q, k, v)]
                out = cores.flex_core(*inputs, segments, sliding_window=window, softcap=softcap)
                out.backward(grad)
                ref_inputs = [x.double().requires_grad_() for x in (q, k, v)]
                ref = cores.eager_core(*ref_inputs, segments, sliding_window=window, softcap=softcap)
                ref.backward(grad.double())
                pairs = [(out, ref)] + [(x.grad, r.grad) for x, r in zip(inputs, ref_inputs, strict=True)]
                for got, want in pairs:
                    error = float((got.double() - want.detach()).norm() / want.norm())
                    worst = max(worst, error)
                    assert error <= 2e-3, f"length {n}, window {window}: relative error {error}"
        graphs = compiled["unique_graphs"]
    gpu_record(lengths=len(FLEX_LENGTHS), variants=len(variants), dynamo_graphs=graphs, worst_relative_error=worst)
    # a few graphs a variant (flex and its BlockMask, each specialised once, then generic in the length; on CPU 3
    # each), not one a length: static shapes compiled 2 x 10 a variant here
    assert graphs <= 8 * len(variants), f"{graphs} graphs for {len(FLEX_LENGTHS)} lengths: compiled per length"
