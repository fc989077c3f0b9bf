"""Cores on a CUDA device (skipped without one): every core against plain transformers attention.

One GPU cannot host an SP group of several NCCL ranks, so these tests run sp=1 through the same
Ulysses path (segments, core, identity exchange); the exchanges themselves are proven on gloo in tests/dist.
"""

import importlib.util

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch
from tests.helpers.spy import calls_to
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
