"""The tiled MLP and norms under torch.compile (decoder layers compiled one by one over activation checkpointing, as
the FSDP2 recipe does; aot_eager, what inductor gets): the compiled layers equal the eager ones bit for bit."""

import copy

import torch
from torch._dynamo.utils import counters
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from tests.unit.test_tiling import assert_same
from ulysses_sp.tiled_facts import ForwardFacts, forward_facts

EXACT = dict(rtol=0, atol=0)


def eager_then_compiled(model, features, autocast=None):
    """Loss and every gradient (None where none) of one training step of ``model`` with ``features``, eager then with
    its decoder layers compiled, and the compiled run's (graphs, breaks)."""
    batch, single = make_batch(2, 24, seed=1), U.ParallelLayout.single()
    runs = []
    for compiled in (False, True):
        par = U.parallelize(copy.deepcopy(model), single)
        U.apply_features(par, features, "cpu")
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            for layer in par.model.layers:
                layer.compile(backend="aot_eager")
        torch.manual_seed(7)
        par.train()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = U.causal_lm_loss(par, U.shard_batch(batch, single), single)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in par.named_parameters()}))
    return runs[0], runs[1], (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


CHECKPOINTED = U.Features(mlp_chunk_tokens=5, activation_checkpointing="checkpoint")


def test_compiled_checkpointed_layer_replays_the_mlp_dropout_of_its_forward():
    """Dropout inside a tiled MLP: the forward operator is recomputed in the compiled backward, and it drew its own
    masks there (the RNG had moved on), so gradients were off by up to 6.9e-3 with the loss right; tagged as drawing
    random numbers, the recompute runs under the forward's RNG state: loss and gradients equal the eager layers',
    one graph per layer, no break."""
    model = build("llama", kv_heads=2)
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.3))
    eager, compiled, counts = eager_then_compiled(model, CHECKPOINTED)
    assert counts == (1, 0), dict(counters)
    assert_same(compiled, eager)


def test_a_parameter_the_mlp_never_uses_gets_no_gradient_compiled_as_eagerly():
    """An MLP parameter its forward never reaches: eagerly its gradient is None, and the compiled operator gave it
    zeros (AdamW then decayed it, 1.0 -> 0.999 at lr 1e-2, weight decay 0.1); the operator now takes only the
    parameters the forward reaches (found on fake tensors when tiling is turned on): None, as eagerly."""
    model = build("llama", kv_heads=2)
    for layer in model.model.layers:
        layer.mlp.spare = torch.nn.Parameter(torch.ones(3))
    eager, compiled, counts = eager_then_compiled(model, CHECKPOINTED)
    assert counts == (1, 0), dict(counters)
    assert eager[1]["model.layers.0.mlp.spare"] is None
    assert_same(compiled, eager)  # (None against None; zeros against None fail)


def test_compiled_mlp_returns_its_eager_dtype_under_autocast():
    """Gemma-3 under CPU bf16 autocast: the MLP returns bf16 eagerly, and the compiled operator widened it to fp32
    (its input's dtype), so the post-feedforward norm returned fp32 where eagerly it returns bf16: the loss was
    4.862106 against 4.862163. The operator now returns the dtype the forward returns (found on fake tensors): loss
    and every gradient bit for bit (the norms untiled: a tiled norm's projections sum their weight gradients in fp32
    eagerly, plainly traced); with the default features the loss is bit for bit too."""
    model = build("gemma3")
    features = U.Features(mlp_chunk_tokens=5, activation_checkpointing="checkpoint", tiled_norms=False)
    eager, compiled, _ = eager_then_compiled(model, features, torch.bfloat16)
    assert_same(compiled, eager, **EXACT)
    eager, compiled, _ = eager_then_compiled(model, CHECKPOINTED, torch.bfloat16)
    torch.testing.assert_close(compiled[0], eager[0], **EXACT)


def test_forward_facts_of_an_mlp_and_of_a_moe_block():
    """What the compiled operators are told: a Llama MLP's output dtype per input and autocast dtype and its unused
    parameter; a Mixtral block (routing: data-dependent, not run on fake tensors) has none, and then takes every
    trainable parameter and returns its input's dtype, as before. Nothing real runs (no random numbers drawn); a
    parameter under two names is reached by either; parameters on the meta device are probed on the CPU."""
    llama = build("llama", kv_heads=2)
    mlp = llama.model.layers[0].mlp
    assert isinstance(mlp, LlamaMLP)
    mlp.spare = torch.nn.Parameter(torch.ones(3))
    state = torch.get_rng_state()
    facts = forward_facts(mlp, mlp.forward, llama.config.hidden_size)
    assert torch.equal(torch.get_rng_state(), state)
    assert facts.unused == ("spare",)
    x = torch.zeros(1, 2, llama.config.hidden_size)
    assert facts.out_dtype(x, torch.bfloat16) == torch.bfloat16
    assert facts.out_dtype(x, None) == torch.float32
    assert {d for d, *_ in facts.out_dtypes} == {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    with torch.device("meta"):  # a model made on the meta device (FSDP2's recipe): probed on the CPU
        on_meta = LlamaMLP(llama.config)
        on_meta.spare = torch.nn.Parameter(torch.ones(3))
    assert forward_facts(on_meta, on_meta.forward, llama.config.hidden_size) == facts
    tied = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    tied.b.weight = tied.a.weight  # reached by its second name only: still a parameter the forward reaches
    facts = forward_facts(tied, lambda x: tied.b(x), 4)
    assert facts.unused == ("a.bias",)
    mixtral = build("mixtral")
    block = mixtral.model.layers[0].mlp
    assert isinstance(block, MixtralSparseMoeBlock)
    assert forward_facts(block, block.forward, mixtral.config.hidden_size) == ForwardFacts()


def test_alike_layers_share_one_probe(monkeypatch):
    """Tiling probes each kind of module once, not each layer: enable_tiled_mlp, enable_tiled_norms (one fused MLP +
    norm and one input norm) and disable_tiled_norms probed 3 times on 2 layers, not 8 (128 probes, 6.8 s on this
    VM for a 32-layer model made on the meta device). A layer unlike the others is probed on its own, and every
    layer's facts are its own probe's."""
    from ulysses_sp import tiling
    from ulysses_sp.instance_forward import installed_forward

    probed = []
    monkeypatch.setattr(tiling, "forward_facts", lambda *args: probed.append(args) or forward_facts(*args))
    model = build("llama", kv_heads=2)
    U.enable_tiled_mlp(model)
    U.enable_tiled_norms(model)
    U.disable_tiled_norms(model)
    assert len(probed) == 3
    model.model.layers[1].mlp.spare = torch.nn.Parameter(torch.ones(3))  # unlike its neighbours
    U.disable_tiled_mlp(model)
    U.enable_tiled_mlp(model)
    assert len(probed) == 5
    for layer in model.model.layers:
        mlp = layer.mlp
        facts = installed_forward(mlp).facts
        assert facts == forward_facts(mlp, installed_forward(mlp).call_module, model.config.hidden_size)
        assert facts.unused == (("spare",) if mlp is model.model.layers[1].mlp else ())
