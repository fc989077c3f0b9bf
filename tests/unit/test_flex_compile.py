"""``cores.compiled_flex`` over many sequence lengths, compiled by inductor on the CPU (skipped without a C++ compiler).

The library compiles flex_attention on CUDA only; inductor's CPU flex kernel runs the same torch.compile wrapper here
(forward only: torch's CPU flex has no backward). A causal mask without captured tensors: the CPU kernel fails to
build (a C++ compile error, torch 2.13) once a mask_mod's captured tensor has a dynamic size, as the cores' document
ids do; torch's own dynamic captured-buffer test skips the CPU too. tests/gpu/test_gpu_cores.py runs the real flex
core (document masks, compiled BlockMask, backward) over many lengths on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from tests.helpers.spy import dynamo_compiles
from ulysses_sp.cores import compiled_flex


def _cpu_compiler_missing() -> str | None:
    """Why inductor cannot build CPU kernels here, or None when it can."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except (ImportError, RuntimeError, torch._inductor.exc.InvalidCxxCompiler) as e:
        return f"inductor has no C++ compiler here: {e}"
    return None


pytestmark = pytest.mark.skipif(_cpu_compiler_missing() is not None, reason=str(_cpu_compiler_missing()))


def _causal(b, h, qi, kj):
    return kj <= qi


def test_compiled_flex_compiles_twice_over_five_lengths_and_never_falls_back_to_dense_scores():
    """With ``dynamic=False`` every length compiled again; past the recompile limit (8 by default, 3 here, so that few
    lengths show it) torch ran flex_attention uncompiled, with dense [q, k] scores: here a FailOnRecompileLimitHit
    at the 4th length (512 tokens). Automatic dynamic shapes: one compile for the first length, which a repeat of it
    reuses, one more for the second, which every later length reuses; outputs equal sdpa's."""
    lengths = (256, 256, 384, 512, 640, 768)  # >= 2 blocks of 128: a one-block length stays specialised (a third)
    attend = compiled_flex()
    gen = torch.Generator().manual_seed(0)
    with dynamo_compiles(recompile_limit=3) as compiled:
        for step, n in enumerate(lengths):
            q = torch.randn(1, 4, n, 16, generator=gen)
            k, v = torch.randn(2, 1, 2, n, 16, generator=gen).unbind(0)
            block_mask = create_block_mask(_causal, 1, None, n, n, device="cpu")
            try:
                out = attend(q, k, v, block_mask=block_mask, scale=0.3, enable_gqa=True)
            except torch._inductor.exc.InductorError as e:  # the first, static compile: as before this change
                if step == 0:
                    pytest.skip(f"inductor cannot compile flex_attention on this CPU: {e}")
                raise
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
            torch.testing.assert_close(out, want)
            if step == 1:  # the same length again: no compile
                assert compiled["unique_graphs"] == 1, dict(compiled)
        assert compiled["unique_graphs"] == 2, dict(compiled)
