"""Projections of a tiled norm's output that save the norm's input (ulysses_sp.norm_projections): which
projections take that path, exactness (fp32, bf16 autocast, LoRA, checkpointing), undo, and the memory."""

import copy

import pytest
import torch
from torch import nn

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from tests.helpers.spy import calls_to
from tests.unit.test_tiled_norms import tiled
from tests.unit.test_tiling import assert_rel_close, assert_same, loss_and_grads
from ulysses_sp import norm_projections
from ulysses_sp.instance_forward import installed_forward
from ulysses_sp.norm_projections import NormProjection


def projected(model, batch, **kwargs):
    """loss_and_grads, and the class names of the modules whose linear took the norm-output path."""
    with calls_to(norm_projections._ProjectNormOutput, "apply", lambda made, x, *rest: made.norm.module) as norms:
        result = loss_and_grads(model, batch, **kwargs)
    return result, norms


@pytest.mark.parametrize(
    "arch,per_layer",
    [
        ("llama", 3),  # q, k, v of the input norm's output
        ("qwen3", 3),
        ("deepseek_v3_mla_v4", 2),  # MLA: q_a_proj and kv_a_proj_with_mqa
        ("olmo2", 0),  # post-norm block: no norm output is projected
    ],
)
@pytest.mark.parametrize("checkpointing", ["none", "checkpoint"])
def test_the_input_norms_projections_are_exact(arch, per_layer, checkpointing):
    model, batch = build(arch, kv_heads=2), make_batch(2, 24, packed=(10, 14))
    want = loss_and_grads(copy.deepcopy(model), batch)
    got, norms = projected(tiled(model, checkpointing=checkpointing), batch)
    assert_same(got, want)
    layers = model.config.num_hidden_layers
    runs = 2 if checkpointing == "checkpoint" else 1  # the recompute projects again
    assert len(norms) == runs * layers * per_layer, len(norms)


def test_a_plain_mlp_after_a_tiled_norm_takes_the_path_too():
    """Without a tiled MLP the MLP's norm is tiled on its own: gate and up project its output."""
    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    want = loss_and_grads(copy.deepcopy(model), batch)
    got = copy.deepcopy(model)
    U.enable_tiled_norms(got, chunk_tokens=5)
    result, norms = projected(got, batch)
    assert_same(result, want)
    assert len(norms) == model.config.num_hidden_layers * (3 + 2)


def test_bf16_autocast_matches_the_plain_projections():
    """Under bf16 autocast over fp32 weights the weight gradient is made from the recomputed norm output in bf16,
    as autocast's linear makes it (summed over chunks in fp32): equal to the tiled norms without the path."""
    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    ref = loss_and_grads(copy.deepcopy(model), batch, bf16_autocast=True)
    got, norms = projected(tiled(model, checkpointing="checkpoint"), batch, bf16_autocast=True)
    assert norms
    torch.testing.assert_close(got[0], ref[0], rtol=1e-2, atol=1e-2)
    assert_rel_close(got[1], ref[1])


def test_lora_projections_keep_their_own_path_and_stay_exact():
    """A LoRA layer is not a plain nn.Linear: its base layer takes the path (the adapter still saves the norm
    output, so nothing is gained there), and loss and gradients are unchanged."""
    from peft import LoraConfig, get_peft_model

    model, batch = build("llama", kv_heads=2), make_batch(2, 24)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    want = loss_and_grads(copy.deepcopy(peft_model), batch)
    got, norms = projected(tiled(peft_model, checkpointing="checkpoint"), batch)
    assert_same(got, want)
    assert norms  # k_proj, and the LoRA layers' base layers


def test_disable_restores_every_linear():
    model = tiled(build("llama", kv_heads=2))
    linears = [m for m in model.model.layers.modules() if type(m) is nn.Linear]  # not lm_head: outside the layers
    assert linears and all(isinstance(installed_forward(m), NormProjection) for m in linears)
    U.disable_tiled_norms(model)
    assert not any("forward" in m.__dict__ for m in linears)


def test_the_norm_output_is_not_saved_for_backward(monkeypatch):
    """In a checkpointed layer's recompute + backward (benchmarks/layer_peak.py, CPU fp32) the peak with the
    norms tiled is one more [tokens, hidden] tensor lower than without this path (at hidden 512, 16K tokens on
    rank 0 of sp=2: 9.28 with it)."""
    import ulysses_sp.tiled_norms as tiled_norms
    from tests.unit.test_tiled_norms import layer_peak_bench
    from ulysses_sp.features import Features

    bench, shape, one = layer_peak_bench()
    features = Features(tiled_loss=False, activation_checkpointing="checkpoint")
    with_path = bench.layer_backward_peak(features, 1, **shape)["peak_bytes"]
    monkeypatch.setattr(tiled_norms, "install_norm_projections", lambda layer, norms: None)
    without_path = bench.layer_backward_peak(features, 1, **shape)["peak_bytes"]
    assert without_path - with_path >= 0.9 * one, (without_path / one, with_path / one)


class _NormThenProject(nn.Module):
    """A toy layer: norm, then (optionally after an in-place change of its output) two projections."""

    def __init__(self, change_in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.q, self.k = nn.RMSNorm(8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.change_in_place = change_in_place

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        if self.change_in_place:
            x.mul_(2)  # no longer what the norm made: the projections must not recompute it from the norm
        return (self.q(x) * self.k(x)).sum()


@pytest.mark.parametrize("change_in_place", [False, True])
def test_an_output_changed_in_place_is_not_taken_for_the_norms(change_in_place):
    from ulysses_sp.tiled_norms import TiledNorm

    h = torch.randn(2, 6, 8, requires_grad=True)
    want = copy.deepcopy(_NormThenProject(change_in_place))
    want(h).backward()
    got = _NormThenProject(change_in_place)
    got.norm.forward = TiledNorm(got.norm, 4)
    norm_projections.install_norm_projections(got, [got.norm.forward])
    with calls_to(norm_projections._ProjectNormOutput, "apply") as taken:
        got(h.detach().requires_grad_()).backward()
    assert len(taken) == (0 if change_in_place else 2)
    for (name, p), q in zip(got.named_parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_saves_after_a_step(tmp_path):
    model, batch = tiled(build("llama", kv_heads=2)), make_batch(2, 24)
    loss_and_grads(model, batch)
    torch.save(model, tmp_path / "model.pt")  # what a norm last made is not pickled
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert installed_forward(loaded.model.layers[0].input_layernorm).made is None


def test_an_empty_sequence_gets_zero_gradients():
    from ulysses_sp.tiled_norms import TiledNorm

    layer = _NormThenProject(change_in_place=False)
    layer.norm.forward = TiledNorm(layer.norm, 4)
    norm_projections.install_norm_projections(layer, [layer.norm.forward])
    layer(torch.randn(2, 0, 8, requires_grad=True)).backward()
    assert not layer.q.weight.grad.any() and not layer.k.weight.grad.any()
