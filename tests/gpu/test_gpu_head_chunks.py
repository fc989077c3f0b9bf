"""Head-chunked attention on a CUDA device (skipped without one): the chunks' cores through the CUDA sdpa kernels
(ulysses_sp.chunk_core: output and lse saved, fused backward) against plain transformers attention.

One GPU hosts one rank, so these run sp=1 through the chunked path (identity exchanges); the exchanges and every
layout are proven on gloo in tests/dist/test_head_chunks_parity.py.
"""

import copy

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch
from tests.helpers.spy import calls_to
from ulysses_sp import head_chunk_pipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [None, (40, 88)])
def test_chunked_cores_run_the_cuda_kernels_and_match(dtype, packed):
    """4 chunks of 2 heads (kv heads 2, so each chunk reads part of one group): every chunk's backward runs the
    kernel's fused backward (cuda_flash in bf16, cuda_efficient in fp32), and loss and gradients match."""
    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=packed).items()}
    ref = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    par = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    layout = U.ParallelLayout.single(device)
    U.parallelize(par, layout, head_chunks=4)
    with calls_to(head_chunk_pipeline, "kernel_backward", lambda kernel, *args, **kwargs: kernel.name) as calls:
        loss, grads = loss_and_grads(par, batch, layout)
    expected = "cuda_flash" if dtype == torch.bfloat16 else "cuda_efficient"
    assert calls == [expected] * 4 * par.config.num_hidden_layers, calls
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=rtol, atol=0.0)
    for name, grad in grads.items():  # within rtol of each gradient's norm (a zero gradient fails)
        ref_grad = ref_grads[name]
        assert (grad - ref_grad).norm() <= (2.5 * rtol) * ref_grad.norm(), (name, (grad - ref_grad).norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_block_remakes_the_tiled_norm_output_on_cuda(dtype):
    """With tiled norms the chunked block keeps the input norm's input and its backward remakes the output tile by
    tile on the GPU (a data-less stand-in on the CUDA device for the module's forward); loss and gradients match."""
    from ulysses_sp.deferred_input import NormRemake

    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=(40, 88)).items()}
    ref = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    par = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    layout = U.ParallelLayout.single(device)
    U.parallelize(par, layout, head_chunks=4)
    U.enable_tiled_norms(par, chunk_tokens=48)
    with calls_to(NormRemake, "tiles", lambda remake, source: source.shape[-2]) as calls:
        loss, grads = loss_and_grads(par, batch, layout)
    assert 128 in calls, f"the block's input was never remade ({calls})"
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=rtol, atol=0.0)
    for name, grad in grads.items():
        ref_grad = ref_grads[name]
        assert (grad - ref_grad).norm() <= (2.5 * rtol) * ref_grad.norm(), (name, (grad - ref_grad).norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_chunked_block_with_lora_adapters_on_cuda(monkeypatch, dtype, dropout):
    """PEFT LoRA on every attention projection of a CUDA model (in bf16 PEFT keeps the adapters in fp32 and casts
    their input), with and without lora_dropout (the reference draws the chunks' mask, computed on the GPU): the
    chunks' kernels, and the adapters' gradients, match the plain PEFT model."""
    pytest.importorskip("peft")
    from tests.helpers.models import with_chunk_dropout, with_lora
    from ulysses_sp.head_chunks import HeadChunkedAttention

    device = torch.device("cuda")
    batch = {k: v.to(device) for k, v in make_batch(2, 128, packed=(40, 88)).items()}
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    model = build("llama", heads=8, kv_heads=2, head_dim=16).to(device, dtype)
    ref = with_lora(model, targets, lora_dropout=dropout)
    par = copy.deepcopy(ref)
    if dropout:
        with_chunk_dropout(ref, targets, dropout, seed=1000)
        monkeypatch.setattr(HeadChunkedAttention, "dropout_seed", lambda self: 1000 + self.module.layer_idx)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    layout = U.ParallelLayout.single(device)
    U.parallelize(par, layout, head_chunks=4)
    with calls_to(head_chunk_pipeline, "kernel_backward") as calls:
        loss, grads = loss_and_grads(par, batch, layout)
    assert len(calls) == 4 * par.config.num_hidden_layers, calls
    rtol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=rtol, atol=0.0)
    trained = [name for name, grad in grads.items() if grad is not None]
    assert trained and all("lora_" in name for name in trained)
    for name in trained:
        ref_grad = ref_grads[name]
        assert (grads[name] - ref_grad).norm() <= (2.5 * rtol) * ref_grad.norm(), (
            name,
            (grads[name] - ref_grad).norm(),
        )


def test_lora_input_dropout_mask_is_the_cpus():
    """The position hash's int32 arithmetic wraps alike on the GPU: the same mask as on the CPU."""
    from ulysses_sp.head_chunk_lora import InputDropout

    dropout = InputDropout(0.1, seed=-(1 << 61) + 12345)
    cpu = dropout.mask(3, 17, 64, torch.arange(40, 72))
    cuda = dropout.mask(3, 17, 64, torch.arange(40, 72, device="cuda"))
    assert torch.equal(cuda.cpu(), cpu)
