"""On a CUDA device (skipped without one): the core in slices of heads through the CUDA kernels, and what it and
the attention-timed offload prefetch take off the peak. These check the planner's GPU-only terms (the flash
kernel's backward buffers, one prefetched layer input) that no CPU run can.
"""

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch
from tests.helpers.spy import calls_to
from ulysses_sp import sliced_core
from ulysses_sp.memory import PeakMemory
from ulysses_sp.offload import offload_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sliced_run(model, batch, budget):
    layout = U.ParallelLayout.single(torch.device("cuda"))
    U.parallelize(model, layout, head_chunks=1, head_chunk_budget_bytes=budget)
    with calls_to(sliced_core, "kernel_backward", lambda kernel, *args, **kwargs: kernel.name) as calls:
        torch.cuda.synchronize()
        with PeakMemory("cuda") as peak:
            loss, grads = loss_and_grads(model, batch, layout)
    return loss, grads, calls, peak.peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_core_runs_the_cuda_kernels_and_matches(dtype):
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=(40, 88)).items()}
    ref_loss, ref_grads = loss_and_grads(build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype), batch)
    model = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    loss, grads, calls, _ = _sliced_run(model, batch, budget=1)
    expected = "cuda_flash" if dtype == torch.bfloat16 else "cuda_efficient"
    assert calls == [expected] * 8 * model.config.num_hidden_layers, calls
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=rtol, atol=0.0)
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() <= (2.5 * rtol) * ref_grads[name].norm(), name


def test_slices_take_the_kernel_buffers_off_the_peak():
    """Llama layers in bf16, 16K tokens, 8 heads of 128 over 2 kv heads: unsliced, the flash backward
    holds an fp32 dq accumulator over all 8 heads and the per-query-head k/v gradients (4 + 2 x 2 bytes per q
    element, 128 MiB); in 8 slices one head's (plus one slice's gradients). The measured gain must be at least
    half of that difference."""
    device, tokens = torch.device("cuda"), 1 << 14
    batch = {k: v.to(device) for k, v in make_batch(1, tokens).items()}
    peaks = {}
    for budget in (1 << 40, 1):
        model = build("llama", heads=8, kv_heads=2, head_dim=128).to(device, torch.bfloat16)
        *_, calls, peaks[budget] = _sliced_run(model, batch, budget)
        assert len(calls) == (0 if budget > 1 else 8 * model.config.num_hidden_layers)
    q_elements = tokens * 8 * 128
    unsliced_buffers = (4 + 2 * 2) * q_elements
    sliced_buffers = (4 + 2 * 2 + 2 * 2) * q_elements // 8  # one head's accumulator, its gradients, its copies
    assert peaks[1 << 40] - peaks[1] >= (unsliced_buffers - sliced_buffers) // 2, peaks


def test_offload_prefetch_waits_for_the_attention_backward():
    """Parallelized, no prefetched layer input is on the device when a layer's attention starts its backward;
    a plain model has the next one there already (from its second layer in backward on)."""
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(1, 4096).items()}
    seen = {}
    for parallel in (True, False):
        model = build("llama", heads=4, kv_heads=2).to(device, torch.bfloat16)
        layout = U.ParallelLayout.single(device)
        if parallel:
            U.parallelize(model, layout)
        U.enable_activation_checkpointing(model, "offload")
        store, found = offload_store(model), []
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_full_backward_hook(
                lambda *_, found=found, store=store: found.append(store.prefetched_bytes())
            )
        loss_and_grads(model, batch, layout if parallel else None)
        seen[parallel] = found
    assert seen[True] and not any(seen[True]), seen
    assert any(seen[False][:-1]), seen  # the last layer backward (layer 0) has nothing left to prefetch
