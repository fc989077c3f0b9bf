"""Checkpoint placement: a stride k (every k-th layer's input kept, the layers between recomputed) is exact and
holds what it says; the planner chooses place and stride from the GPU and host memory, and train reports it."""

import copy
import types

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import ulysses_sp as U
from tests.helpers.models import _common, make_batch
from tests.unit.test_tiling import assert_same, loss_and_grads
from ulysses_sp.features import Features, apply_features
from ulysses_sp.fsdp import fully_shard_layers
from ulysses_sp.offload import offload_store
from ulysses_sp.plan import load_model_config, plan_memory
from ulysses_sp.plan.placement import placements
from ulysses_sp.train.config import TrainConfig
from ulysses_sp.train.model_factory import place_checkpoints

LAYERS = 5
GiB, TiB = 1 << 30, 1 << 40


def five_layers():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**_common(4, 2), "num_hidden_layers": LAYERS}))


@pytest.mark.parametrize("mode", ["checkpoint", "offload"])
@pytest.mark.parametrize("stride", [2, 3, LAYERS + 2])
def test_stride_is_exact_and_recomputes_the_layers_between(mode, stride):
    model, batch = five_layers(), make_batch(2, 24, packed=(10, 14))
    want = loss_and_grads(copy.deepcopy(model), batch)
    got = copy.deepcopy(model)
    U.enable_tiled_mlp(got, chunk_tokens=5)
    U.enable_tiled_norms(got, chunk_tokens=5)
    U.enable_activation_checkpointing(got, mode, stride=stride)
    runs = [0] * LAYERS
    for i, layer in enumerate(got.model.layers):
        layer.self_attn.q_proj.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    assert_same(loss_and_grads(got, batch), want)
    # forward + own recompute, and once more to rebuild a later input of its group unless it is a group's last
    last = {min(g + stride, LAYERS) - 1 for g in range(0, LAYERS, stride)}
    assert runs == [2 if i in last else 3 for i in range(LAYERS)]


def gathered(result):
    """(loss, gradients) with FSDP2's sharded gradients gathered whole."""
    loss, grads = result
    return loss, {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}


@pytest.fixture
def one_rank_group():
    """A gloo process group of this process alone, for FSDP2 in one process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["checkpoint", "offload"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("around", ["plain", "fsdp2", "parallelize"])
def test_a_deep_copy_recomputes_its_own_layers(mode, stride, around, request):
    """An EMA or reference model: copy.deepcopy of a model with checkpointing on, the original's weights then
    changed. The copy's loss and gradients are those of a copy made before enabling and then enabled. With a stride
    of 2 the copy's checkpoint functions served the original's layers: under FSDP2 the copy's backward gathered
    the original's layers and ran its own still sharded (RuntimeError "got mixed torch.Tensor and DTensor")."""
    model, batch = five_layers(), make_batch(2, 24, packed=(10, 14))
    features = Features(activation_checkpointing=mode, checkpoint_stride=stride, mlp_chunk_tokens=5)

    def enable(m):
        if around == "parallelize":  # at sp=1 (sp=2: tests/dist/cases_memory_features.py)
            apply_features(U.parallelize(m, U.ParallelLayout.single()), features, "cpu")
        else:
            U.enable_activation_checkpointing(m, mode, stride=stride)
        return m

    reference = enable(copy.deepcopy(model))
    twin = copy.deepcopy(enable(model))
    with torch.no_grad():
        for param in model.parameters():  # the original trains on; the copy keeps the weights it was made with
            param.mul_(1.5)
    if around == "fsdp2":
        request.getfixturevalue("one_rank_group")
        for m in (model, twin, reference):
            fully_shard_layers(m, torch.device("cpu"), 1)
    assert_same(gathered(loss_and_grads(twin, batch)), gathered(loss_and_grads(reference, batch)))


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_offload_holds_one_input_per_group(stride):
    model, batch = five_layers(), make_batch(1, 16)
    U.enable_activation_checkpointing(model, "offload", stride=stride)
    model.train()
    loss = model(**batch, use_cache=False).loss
    store = offload_store(model)
    groups = -(-LAYERS // stride)
    assert store.held_bytes() == groups * 16 * model.config.hidden_size * 4
    loss.backward()
    assert store.held_bytes() == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_stride_refused(bad):
    with pytest.raises(ValueError, match="stride"):
        U.enable_activation_checkpointing(five_layers(), "checkpoint", stride=bad)
    with pytest.raises(ValueError, match="--checkpoint-stride"):
        Features(checkpoint_stride=bad if bad != 1.5 else 0)


def test_plan_models_the_stride():
    args = dict(seq_len=1 << 20, sp=8, gpus_per_node=8)
    base = Features(cpu_offload_optimizer=True, activation_checkpointing="offload")
    one = plan_memory("llama-3.1-8b", features=base, **args)
    two = plan_memory("llama-3.1-8b", features=Features(**{**vars(base), "checkpoint_stride": 2}), **args)
    layer_input = 2 * one.tokens_per_rank * 4096  # bf16 [t, h]
    assert one.host_bytes_per_node - two.host_bytes_per_node == 8 * 16 * layer_input  # 16 of 32 inputs, 8 GPUs
    three = plan_memory("llama-3.1-8b", features=Features(**{**vars(base), "checkpoint_stride": 3}), **args)
    # on the GPU at the peak: the input of the layer in backward (the next one is fetched after its attention),
    # in a group of k the k - 1 rebuilt from the head (ulysses_sp.offload)
    assert one.phases[one.phase]["checkpoints"] == two.phases[two.phase]["checkpoints"] == layer_input
    assert three.phases[three.phase]["checkpoints"] == 2 * layer_input
    gpu = Features(**{**vars(base), "activation_checkpointing": "checkpoint", "checkpoint_stride": 4})
    assert plan_memory("llama-3.1-8b", features=gpu, **args).checkpoints == (8 + 3) * layer_input


def test_placements_go_from_least_recompute_up():
    order = [(f.activation_checkpointing, f.checkpoint_stride) for f in placements(Features(), 3)]
    assert order == [("offload", 1), ("checkpoint", 1), ("offload", 2), ("checkpoint", 2)] + [
        ("offload", 3),
        ("checkpoint", 3),
    ]


@pytest.mark.parametrize(
    "host,want",
    [
        (8 * TiB, ("offload", 1)),  # every layer's input fits on the host
        (1 * TiB, ("offload", 2)),  # half of them do, and a GPU holds the group's second input
        (0, None),  # no host memory given: no choice, the default (offload, every layer)
    ],
)
def test_planner_chooses_the_place_and_stride(host, want):
    features = Features(cpu_offload_optimizer=True)
    plan = plan_memory(
        "llama-3.1-8b", seq_len=4 << 20, sp=8, gpus_per_node=8, host_memory_bytes=host, features=features
    )
    if want is None:
        assert plan.checkpoint_choice == "" and plan.features.checkpoint_stride == 1
        return
    assert (plan.features.activation_checkpointing, plan.features.checkpoint_stride) == want
    assert plan.fits and "fits both memories" in plan.checkpoint_choice
    assert plan.to_dict()["checkpoint_choice"] == plan.checkpoint_choice


def test_train_places_the_checkpoints_on_a_gpu_with_host_memory():
    config = TrainConfig(model="llama-3.1-8b", seq_len=4 << 20, sp=8, host_memory="1TiB", cpu_offload_optimizer=True)
    layout = types.SimpleNamespace(device=torch.device("cuda", 0), sp=8, dp=1, ring=1)
    hf_config = load_model_config("llama-3.1-8b")[0]
    placed, line = place_checkpoints(config, hf_config, layout=layout, gpu_memory_bytes=80 * GiB, gpus_per_node=8)
    assert (placed.activation_checkpointing, placed.checkpoint_stride) == ("offload", 2)
    assert line.startswith("checkpoints: 1 in 2 layer inputs (the others recomputed) on host memory")
    cpu = types.SimpleNamespace(device=torch.device("cpu"), sp=8, dp=1, ring=1)
    assert place_checkpoints(config, hf_config, layout=cpu, gpu_memory_bytes=0, gpus_per_node=8) == (config, "")
    with pytest.raises(ValueError, match="--host-memory"):
        TrainConfig(model="llama-3.1-8b", host_memory="lots").validate()


def test_simulate_agrees_with_the_plan_for_a_stride():
    """One real step as rank 0 of sp=2 (6 layers, fp32, CPU): the planner within 5% of the measured peak for
    stride 1 and 3, and the stride's smaller peak is measured too (3 + 2 inputs held instead of 6)."""
    from tests.unit.test_plan import tiny
    from ulysses_sp.simulate import simulate_step

    config = tiny("llama", kv=2)
    config.num_hidden_layers = 6
    measured = {}
    for stride in (1, 3):
        features = Features(dtype="fp32", activation_checkpointing="checkpoint", checkpoint_stride=stride)
        result = simulate_step(config, seq_len=2048, sp=2, dp=1, features=features)
        assert 0.95 <= result["ratio"] <= 1.05, result
        measured[stride] = result["measured_peak_bytes"]
    assert measured[3] < measured[1]
