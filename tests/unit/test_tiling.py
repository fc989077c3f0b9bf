"""Tiled MLP in one process: exact against the untiled model, autocast, checkpointing, LoRA, MoE, memory."""

import copy

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import ulysses_sp as U
from tests.helpers.models import VOCAB, build, make_batch, router_aux_on
from ulysses_sp.instance_forward import installed_forward
from ulysses_sp.memory import PeakMemory
from ulysses_sp.tiling import TiledMLP, default_chunk_tokens

TOL = dict(rtol=1e-5, atol=1e-6)
BF16_REL = 2e-2  # |g - g_ref| <= 2% of |g_ref| per parameter


def loss_and_grads(model, batch, bf16_autocast=False):
    """Forward (under CPU bf16 autocast if asked), then backward outside it, as a training loop does."""
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want, **tol):
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, **(tol or TOL))
    assert grads.keys() == ref_grads.keys(), grads.keys() ^ ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **(tol or TOL), msg=lambda m, n=name: f"{n}: {m}")


def assert_rel_close(grads, ref_grads, rel=BF16_REL):
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        err, scale = (grad.float() - ref_grads[name].float()).norm(), ref_grads[name].float().norm()
        assert err <= rel * scale + 1e-12, f"{name}: |diff| {err:.3e} > {rel} x |ref| {scale:.3e}"


def count_chunks(model):
    """Calls of the first layer's gate projection, per forward and backward."""
    calls = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
    return calls


@pytest.mark.parametrize("chunk", [None, 5, 7])
def test_loss_and_every_gradient_equal_untiled(chunk):
    model, batch = build("qwen3", kv_heads=2), make_batch(2, 24, packed=(10, 14))
    want = loss_and_grads(copy.deepcopy(model), batch)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=chunk)
    calls = count_chunks(tiled)
    assert_same(loss_and_grads(tiled, batch), want)
    size = chunk or default_chunk_tokens(model.config.hidden_size)
    spans = [min(size, 24 - s) for s in range(0, 24, size)]
    assert calls == spans + spans  # forward chunks, then the same chunks recomputed in backward


def test_evaluation_under_inference_mode_equals_untiled():
    """An inference tensor has no version counter: the in-place check read it and every forward under
    torch.inference_mode() failed with a RuntimeError (the tiled MLP and the tiled norms)."""
    model, batch = build("qwen3", kv_heads=2).eval(), make_batch(2, 24, packed=(10, 14))
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
    tiled = U.enable_tiled_norms(U.enable_tiled_mlp(model, chunk_tokens=5), chunk_tokens=5)
    with torch.inference_mode():
        got = tiled(**batch, use_cache=False).loss
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("chunk", [3, 8, 50, 64])
def test_mlp_output_and_gradients_equal_untiled(chunk):
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=48, num_attention_heads=2))
    x = torch.randn(3, 50, 16, requires_grad=True)
    grad_out = torch.randn(3, 50, 16)
    want = mlp(x)
    want_grads = torch.autograd.grad(want, [x, *mlp.parameters()], grad_out)
    mlp.forward = TiledMLP(mlp, chunk)
    out = mlp(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    for got, ref in zip(torch.autograd.grad(out, [x, *mlp.parameters()], grad_out), want_grads, strict=True):
        torch.testing.assert_close(got, ref, **TOL)


def test_dropout_masks_of_the_forward_are_replayed_in_backward():
    """y = dropout(x) * w, so dL/dw = sum(dropout(x) * g) = sum(y / w * g): true only if backward's recompute
    draws the forward's masks (chunks in the same order from the same RNG state)."""

    class DropMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.full((8,), 1.5))

        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True) * self.w

    module = DropMLP()
    module.forward = TiledMLP(module, 3)
    x, g = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    torch.manual_seed(0)
    y = module(x)
    torch.rand(100)  # the RNG moves on between forward and backward, as in training
    (grad_w,) = torch.autograd.grad(y, [module.w], g)
    torch.testing.assert_close(grad_w, (y / 1.5 * g).sum((0, 1)), **TOL)


def test_default_chunk_is_a_function_of_the_hidden_size_only():
    assert default_chunk_tokens(64) == 1024 and default_chunk_tokens(4096) == 4096
    model = U.enable_tiled_mlp(build("llama"))
    calls = count_chunks(model)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2500, dtype=torch.long))
    assert calls == [1024, 1024, 452]


def test_bf16_autocast_recomputes_under_autocast():
    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), batch, bf16_autocast=True)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=5)
    dtypes = []
    tiled.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    loss, grads = loss_and_grads(tiled, batch, bf16_autocast=True)
    assert dtypes == [torch.bfloat16] * 10, dtypes  # 5 chunks forward, 5 recomputed in backward, all bf16
    torch.testing.assert_close(loss, ref_loss, rtol=BF16_REL, atol=0)
    assert_rel_close(grads, ref_grads)


def test_bf16_parameters_get_bf16_gradients_summed_in_fp32():
    model, batch = build("llama", kv_heads=2).to(torch.bfloat16), make_batch(2, 24)
    fp32_grads = loss_and_grads(copy.deepcopy(model).float(), batch)[1]
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=3)
    grads = loss_and_grads(tiled, batch)[1]
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert_rel_close(grads, fp32_grads)


def test_with_transformers_gradient_checkpointing():
    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    want = loss_and_grads(copy.deepcopy(model), batch)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=5)
    tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = count_chunks(tiled)
    assert_same(loss_and_grads(tiled, batch), want)
    assert len(calls) == 15  # 5 chunks: forward, the checkpoint's recompute, and the tiled backward


def test_peft_lora_on_the_mlp_projections():
    from peft import LoraConfig, get_peft_model

    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    want = loss_and_grads(copy.deepcopy(peft_model), batch)
    got = loss_and_grads(U.enable_tiled_mlp(copy.deepcopy(peft_model), chunk_tokens=7), batch)
    assert any("mlp.down_proj.lora_B" in name for name in got[1]) and len(got[1]) == 16
    assert_same(got, want)


def test_state_dict_keys_save_load_and_disable(tmp_path):
    model = build("llama")
    keys = list(model.state_dict())
    ids = torch.randint(0, VOCAB, (1, 12))
    want = model(input_ids=ids).logits
    U.enable_tiled_mlp(model, chunk_tokens=5)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in build("llama").named_parameters()]
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    torch.testing.assert_close(loaded(input_ids=ids).logits, want)
    copied = copy.deepcopy(model)  # the copy's MLPs are tiled and run the copy's weights
    assert installed_forward(copied.model.layers[0].mlp).module is copied.model.layers[0].mlp
    U.disable_tiled_mlp(model)
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=0, atol=0)


def test_keeps_and_restores_a_forward_set_by_another_library():
    model = build("llama")
    mlp = model.model.layers[0].mlp
    calls = []

    def hooked(x):
        calls.append(x.shape[-2])
        return type(mlp).forward(mlp, x)

    mlp.forward = hooked
    U.enable_tiled_mlp(model, chunk_tokens=4)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 10, dtype=torch.long))
    assert calls == [4, 4, 2]
    U.disable_tiled_mlp(model)
    assert mlp.forward is hooked


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_blocks_are_tiled_exactly(arch):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    common.update(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=24))
    model = model.float()
    batch = make_batch(2, 24)
    want = loss_and_grads(copy.deepcopy(model), batch)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=5)
    assert_same(loss_and_grads(tiled, batch), want)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe_window"])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_moe_router_logits_for_the_load_balancing_loss_are_recorded_whole_with_gradient(arch, fused_norm):
    """output_router_logits=True under the tiled MLP (and its fused norm): the model's own loss (cross-entropy +
    0.5 x the load-balancing loss, which reads the router logits) and every gradient, the routers' included, equal
    the untiled model's; one entry per layer, [b n, experts] in the untiled block's row order."""
    model = router_aux_on(build(arch, kv_heads=2))
    batch = make_batch(2, 23, pad="right")
    want = loss_and_grads(copy.deepcopy(model), batch)
    tiled = U.enable_tiled_mlp(copy.deepcopy(model), chunk_tokens=5)
    if fused_norm:
        U.enable_tiled_norms(tiled, chunk_tokens=5)
    assert_same(loss_and_grads(tiled, batch), want)
    out, ref = tiled(**batch), model(**batch)
    assert len(out.router_logits) == len(ref.router_logits) == model.config.num_hidden_layers
    for got, logits in zip(out.router_logits, ref.router_logits, strict=True):
        assert got.requires_grad
        # not a view (as the untiled block's): FSDP2 warns of a view among its root's outputs that an in-place op on
        # it would skip backward's all-gather, "wrong gradients", for every MoE model under FSDP2 + the tiled MLP
        assert not got._is_view()
        torch.testing.assert_close(got, logits, **TOL)


def test_router_logits_of_a_block_that_routes_otherwise_are_refused():
    """A block whose router sees something other than the block's input as one [tokens, hidden] matrix (here: an
    instance forward that scales it first) records logits the tiled MLP cannot remake: refused, not recorded
    wrong."""
    model = build("mixtral", kv_heads=2)
    model.config.output_router_logits = True
    block = model.model.layers[0].mlp
    block.forward = lambda x: type(block).forward(block, 2 * x)
    tiled = U.enable_tiled_mlp(model, chunk_tokens=5)
    with pytest.raises(ValueError, match="does not give the router_logits the block records"):
        tiled(**make_batch(1, 12))


def test_router_logits_asked_for_in_the_call_only_are_refused():
    """The tiled MLP reads the config (a checkpointed layer's recompute, outside transformers' collection, must
    run what its forward ran): output_router_logits=True in the call alone is refused, naming the config."""
    tiled = U.enable_tiled_mlp(build("qwen3_moe", kv_heads=2), chunk_tokens=5)
    with pytest.raises(ValueError, match="set model.config.output_router_logits = True"):
        tiled(**make_batch(1, 12), output_router_logits=True)


def test_errors():
    model = U.enable_tiled_mlp(build("llama"))
    with pytest.raises(ValueError, match="already tiled.*disable_tiled_mlp"):
        U.enable_tiled_mlp(model)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            U.enable_tiled_mlp(build("llama"), chunk_tokens=bad)
    with pytest.raises(TypeError, match="got Linear"):
        U.enable_tiled_mlp(torch.nn.Linear(2, 2))
    no_mlp = build("llama")
    for layer in no_mlp.model.layers:
        del layer.mlp
    with pytest.raises(ValueError, match="LlamaForCausalLM has no recognisable MLP.*LlamaDecoderLayer"):
        U.enable_tiled_mlp(no_mlp)
    mlp = model.model.layers[0].mlp
    with pytest.raises(ValueError, match="called as mlp\\(hidden_states"):
        mlp(torch.zeros(1, 4, 32), torch.zeros(1))


def test_in_place_input_changes_are_refused():
    model = build("llama")
    mlp = model.model.layers[0].mlp

    def mutating(x):
        x.mul_(2)
        return type(mlp).forward(mlp, x)

    mlp.forward = mutating
    U.enable_tiled_mlp(model, chunk_tokens=4)
    with pytest.raises(ValueError, match="modifies its input in place"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


def test_memory_holds_one_chunk_of_intermediates():
    """Untiled, a SwiGLU MLP keeps 4 [b, n, I] tensors for backward (gate, up, act, product) and backward
    adds 2 more; tiled, only [b, c, I] chunks exist, plus [b, n, h] input/output-sized buffers."""
    torch.manual_seed(0)
    b, n, h, inter, c = 1, 4096, 32, 512, 256
    mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=inter))
    x = torch.randn(b, n, h, requires_grad=True)
    peaks = []
    for tiled in (False, True):
        if tiled:
            mlp.forward = TiledMLP(mlp, c)  # what enable_tiled_mlp installs on each decoder layer's MLP
        with PeakMemory() as peak:
            mlp(x).square().sum().backward()
        peaks.append(peak.peak_bytes)
    untiled, tiled = peaks
    assert untiled >= 4 * b * n * inter * 4
    # one chunk forward + backward (<= 8 [b, c, I]), 5 [b, n, h] buffers, 2 sets of MLP weight grads
    assert tiled <= (8 * b * c * inter + 5 * b * n * h + 2 * 3 * h * inter) * 4, tiled
    assert tiled * 4 < untiled, (tiled, untiled)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_holds_the_gradient_sums_and_one_parameter_gradient(dtype):
    """Weights much larger than the chunks: the backward holds each parameter's gradient sum (fp32 for bf16
    parameters) and one parameter-sized gradient being added, not a whole chunk's parameter gradients on top of
    the sums (3 more matrices; the bound fails then). The sums stay exact."""
    torch.manual_seed(0)
    b, n, h, inter, c = 1, 64, 256, 1024, 16  # 4 chunks; one [h, I] matrix is 16x the whole [n, I]
    mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=inter)).to(dtype)
    want = copy.deepcopy(mlp)
    x = torch.randn(b, n, h, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(b, n, h, dtype=dtype)
    mlp.forward = TiledMLP(mlp, c)
    out = mlp(x)
    with PeakMemory() as peak:
        out.backward(grad_out)
    weight = h * inter
    assert peak.peak_bytes <= (3 * 4 + 2 * dtype.itemsize) * weight, peak.peak_bytes / weight
    want(x.detach()).backward(grad_out)
    for (name, got), ref in zip(mlp.named_parameters(), want.parameters(), strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(got.grad, ref.grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert_rel_close({name: got.grad}, {name: ref.grad})


def test_a_parameter_gradient_from_outside_the_chunk_is_refused_not_summed():
    """While a chunk is back-propagated, the hook that sums a parameter's gradient would also take one that another
    graph delivers to that parameter in the same window (a weight shared with a parallel branch): the chunk's
    check sees two gradients and raises instead of returning a wrong sum."""
    from ulysses_sp.grad_sums import GradSums

    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)
    with GradSums([weight], wide=False) as sums:
        torch.autograd.grad((x @ weight).sum(), [weight])  # the chunk's own
        sums.check_chunk()
        torch.autograd.grad((x @ weight).sum(), [weight])
        torch.autograd.grad((2 * x @ weight).sum(), [weight])  # a second one in the same chunk
        with pytest.raises(RuntimeError, match="more than one gradient"):
            sums.check_chunk()
    assert not weight._backward_hooks  # the hook is gone after the chunks
    torch.testing.assert_close(sums.sums[0], 4 * x.sum(0)[:, None].expand(3, 3), **TOL)  # 1 + 1 + 2 times
