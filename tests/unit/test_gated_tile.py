"""The tiled gated MLP's chunks back-propagated by hand in row blocks: exact, used only where it applies, leaner."""

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from tests.unit.test_tiling import loss_and_grads
from ulysses_sp.gated_tile import MIN_BLOCK_ROWS, GatedChunk
from ulysses_sp.instance_forward import installed_forward
from ulysses_sp.memory import PeakMemory
from ulysses_sp.tiling import TiledMLP

TOL = dict(rtol=1e-5, atol=1e-6)
MODULE_TOL = dict(rtol=1e-5, atol=1e-5)  # a bare MLP at nn.Linear's init: gradients of ~10, summed in other orders


@pytest.fixture
def blocks(monkeypatch):
    """The row counts of every block the hand-written backward runs."""
    seen = []
    block = GatedChunk._block

    def spy(self, x, *args):
        seen.append(x.shape[0])
        return block(self, x, *args)

    monkeypatch.setattr(GatedChunk, "_block", spy)
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])  # silu; silu; gelu (tanh)
@pytest.mark.parametrize("norms", [False, True])  # the MLP's norm fused into its chunks or not
def test_loss_and_every_gradient_equal_the_untiled_model(arch, norms, blocks):
    model, batch = build(arch, kv_heads=2, attn="eager" if arch == "gemma2" else "sdpa"), make_batch(1, 600)
    want = loss_and_grads(copy.deepcopy(model), batch)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=512)
    if norms:
        U.enable_tiled_norms(tiled)
    loss, grads = loss_and_grads(tiled, batch)
    torch.testing.assert_close(loss, want[0], **TOL)
    assert grads.keys() == want[1].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # per layer: the 512-token chunk in two blocks of MIN_BLOCK_ROWS, the last 88 tokens in one
    assert MIN_BLOCK_ROWS == 256 and blocks == [256, 256, 88] * model.config.num_hidden_layers


def test_bf16_autocast_and_biases(blocks):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=96, mlp_bias=True))
    x, grad = torch.randn(2, 700, 32, requires_grad=True), torch.randn(2, 700, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
        mlp.forward = TiledMLP(mlp, 600)
        got = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
    assert blocks == [300, 300, 300, 300, 200]  # 1200 rows then 200 (batch 2): blocks of a quarter of a chunk
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert (g.float() - w.float()).norm() <= 1e-2 * w.float().norm()


class ScaledMLP(LlamaMLP):
    def forward(self, x):
        return 2 * super().forward(x)


def test_only_mlps_of_the_handled_kind_are_back_propagated_by_hand(blocks):
    """A hook on a projection, a forward that is not down(act(gate(x)) * up(x)), another library's forward or a
    replaced activation: autograd's backward, or a new probe, and the gradients stay exact."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=2)
    x, grad = torch.randn(1, 300, 16, requires_grad=True), torch.randn(1, 300, 16)

    def check(mlp, by_hand):
        want = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
        mlp.forward = TiledMLP(mlp, 280, mlp.__dict__.get("forward"))
        assert (mlp.forward.chunk_backward() is not None) == by_hand
        blocks.clear()
        got = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
        assert blocks == ([256, 24, 20] if by_hand else [])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **MODULE_TOL)
        return mlp

    check(LlamaMLP(config), True)
    check(ScaledMLP(config), False)
    hooked = LlamaMLP(config)
    hooked.up_proj.register_forward_hook(lambda m, i, o: o * 1.5)
    check(hooked, False)
    wrapped = LlamaMLP(config)
    wrapped.forward = lambda h: LlamaMLP.forward(wrapped, h)  # another library's forward on the module
    check(wrapped, False)
    swapped = check(LlamaMLP(config), True)
    swapped.act_fn = torch.nn.Tanh()  # probed again: the same form, a new activation
    assert swapped.forward.chunk_backward() is not None
    want = torch.autograd.grad(LlamaMLP.forward(swapped, x), [x, *swapped.parameters()], grad)
    got = torch.autograd.grad(swapped(x), [x, *swapped.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **MODULE_TOL)


def test_lora_projections_use_autograd():
    peft = pytest.importorskip("peft")
    model = build("llama", kv_heads=2)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["gate_proj", "down_proj"]))
    U.enable_tiled_mlp(model)
    mlp = model.base_model.model.model.layers[0].mlp
    assert installed_forward(mlp).chunk_backward() is None


def test_a_chunk_backward_holds_about_one_chunk_of_intermediates():
    """Autograd's backward of a chunk of c tokens holds about six [c, I] tensors at its peak; by hand, in blocks of
    c / 4 rows, at most five [c / 4, I] ones: the bound below (two [c, I] next to the [n, h] buffers and the three
    fp32 gradient sums) fails for autograd's."""
    torch.manual_seed(0)
    b, n, h, inter, c = 1, 4096, 32, 512, 1024
    x = torch.randn(b, n, h, requires_grad=True)
    grad = torch.randn(b, n, h)
    peaks = {}
    for by_hand in (True, False):
        mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=inter))
        if not by_hand:
            mlp.gate_proj.register_forward_hook(lambda m, i, o: None)  # a hook: autograd's backward
        mlp.forward = TiledMLP(mlp, c)
        out = mlp(x)
        with PeakMemory() as peak:
            out.backward(grad)
        peaks[by_hand] = peak.peak_bytes
    bound = (2 * c * inter + 3 * b * n * h + 3 * h * inter) * 4
    assert peaks[True] <= bound < peaks[False], (peaks, bound)


class ReluInPlace(torch.nn.Module):
    def forward(self, t):
        return t.relu_()


class DropMLP(LlamaMLP):
    def forward(self, x):
        hidden = torch.nn.functional.dropout(self.act_fn(self.gate_proj(x)), 0.5, self.training) * self.up_proj(x)
        return self.down_proj(hidden)


def test_activations_with_parameters_or_in_place_and_training_only_ops_use_autograd():
    """A learnable activation (its parameter would get no gradient by hand), an in-place one (it cannot run on the
    leaf whose gradient the backward takes) and dropout that the probe saw off in eval mode: each probe is per
    training mode, and the probe leaves the global RNG state as it found it."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=2)
    x, grad = torch.randn(1, 300, 16, requires_grad=True), torch.randn(1, 300, 16)
    learnable = LlamaMLP(config)
    learnable.act_fn = torch.nn.PReLU()
    want = torch.autograd.grad(learnable(x), [x, *learnable.parameters()], grad)
    learnable.forward = TiledMLP(learnable, 280)
    assert learnable.forward.chunk_backward() is None
    got = torch.autograd.grad(learnable(x), [x, *learnable.parameters()], grad)
    for g, w in zip(got, want, strict=True):  # the PReLU weight's gradient among them
        torch.testing.assert_close(g, w, **MODULE_TOL)
    in_place = LlamaMLP(config)
    in_place.act_fn = torch.nn.SiLU(inplace=True)
    in_place.forward = TiledMLP(in_place, 280)
    assert in_place.forward.chunk_backward() is None
    in_place.act_fn = ReluInPlace()  # no flag to read: the probe finds it
    assert in_place.forward.chunk_backward() is None
    drop = DropMLP(config)
    drop.forward = TiledMLP(drop, 280)
    drop.eval()
    assert drop.forward.chunk_backward() is not None
    drop.train()
    state = torch.get_rng_state()
    assert drop.forward.chunk_backward() is None
    assert torch.equal(torch.get_rng_state(), state)


def test_bf16_parameters_in_one_chunk_and_an_empty_batch(monkeypatch):
    """One chunk in four blocks: bf16 weight gradients summed in fp32 over the blocks, as over chunks; a batch of
    no sequences back-propagates like autograd's (no block to run)."""
    from ulysses_sp import tiling

    made = []
    grad_sums = tiling.GradSums

    def spy(params, *, wide):
        made.append(wide)
        return grad_sums(params, wide=wide)

    monkeypatch.setattr(tiling, "GradSums", spy)
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=96, num_attention_heads=2)).to(torch.bfloat16)
    x, grad = torch.randn(1, 1024, 32, dtype=torch.bfloat16), torch.randn(1, 1024, 32, dtype=torch.bfloat16)
    x.requires_grad_()
    want = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
    mlp.forward = TiledMLP(mlp, 1024)
    got = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], grad)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert (g.float() - w.float()).norm() <= 1e-2 * w.float().norm()
    assert made == [True]  # one chunk, yet its block sums are fp32
    empty = torch.zeros(0, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    (grad_empty,) = torch.autograd.grad(mlp(empty).sum(), [empty])
    assert grad_empty.shape == empty.shape
