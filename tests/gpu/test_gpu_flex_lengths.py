"""flex_attention over many sequence lengths on a CUDA device (skipped without one): compiled a few times, not once a
length, and exact (issue: with ``dynamic=False`` every length compiled again and past torch's recompile limit flex
ran uncompiled, with dense [q, k] scores). In benchmarks/gpu_session.sh these run after the issues' GPU proofs: their
compiles take a while.
"""

import pytest
import torch

from tests.gpu.test_gpu_ring import _check
from tests.helpers.models import make_batch
from tests.helpers.spy import dynamo_compiles
from ulysses_sp import cores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

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


def test_flex_ring_over_ten_lengths_never_reaches_the_recompile_limit():
    """The ring's flex kernel over ten lengths of packed rows (ring 2, fp32): its forward (no grad) and its
    backward's recompute (with grad) are two dynamo entries a length, so with ``dynamic=False`` torch ran flex
    uncompiled, with dense scores, from the 5th length on; now a few compiles serve every length, exactly."""
    with dynamo_compiles():
        for n in (300 + 96 * i for i in range(10)):  # divisible by 2 x ring
            pieces = [n // 10] * 9
            _check("flex", 2, make_batch(2, n, packed=(*pieces, n - sum(pieces))), dtype=torch.float32)
