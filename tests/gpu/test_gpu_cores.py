"""Cores on a CUDA device (skipped without one): every core against plain transformers attention.

One GPU cannot host an SP group of several NCCL ranks, so these tests run sp=1 through the same
Ulysses path (segments, core, identity exchange); the exchanges themselves are proven on gloo in tests/dist.
"""

import importlib.util

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch

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


@pytest.mark.parametrize("core", CORES)
# (16,) * 8: many short documents per row, which the sdpa core hands to one flex call (packed_kernel)
@pytest.mark.parametrize(
    "arch,packed", [("llama", None), ("llama", (40, 88)), ("mistral", (70, 58)), ("llama", (16,) * 8)]
)
def test_core_matches_plain_attention_bf16(core, arch, packed):
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=packed).items()}
    # head_dim 16: flex_attention on CUDA needs >= 16 (the flex core refuses less with a ValueError)
    ref = build(arch, kv_heads=2, window=32, head_dim=16).to(device, torch.bfloat16)
    par = build(arch, kv_heads=2, window=32, head_dim=16).to(device, torch.bfloat16)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    layout = U.ParallelLayout.single(device)
    U.parallelize(par, layout, core=core)
    loss, grads = loss_and_grads(par, batch, layout)
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
