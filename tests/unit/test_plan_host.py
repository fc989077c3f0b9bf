"""The planner's host memory: pinned parameter and gradient shards rounded up to powers of two, as PyTorch's
CachingHostAllocator does; offloaded layer inputs at about their size (ulysses_sp.pinned)."""

import pytest
import torch
from transformers import LlamaConfig, MixtralConfig

from ulysses_sp.pinned import buffer_bytes
from ulysses_sp.plan import Features, ModelShape, max_seq_len, plan_memory
from ulysses_sp.plan.host import host_terms, pinned_bytes
from ulysses_sp.shapes import PUBLISHED_SHAPES, shape_config

GiB, MiB = 1 << 30, 1 << 20
OFFLOADED = Features(cpu_offload_optimizer=True, activation_checkpointing="offload")


def test_a_pinned_allocation_takes_the_next_power_of_two_and_a_registered_buffer_a_32nd_more_at_most():
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    assert [buffer_bytes(n) for n in (0, 1, 4096, 4097, 320 * MiB, 320 * MiB + 4096)] == [
        0, 4096, 4096, 8192, 320 * MiB, 328 * MiB,
    ]  # fmt: skip
    assert pinned_bytes(40960 * 4096 * 2) == 512 * MiB  # one sp=8 rank's Llama layer input at 327,680 tokens


def _meta_tally(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts = {}
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        counts[rows, p.numel() // rows] = counts.get((rows, p.numel() // rows), 0) + 1
    return tuple(sorted((rows, row, n) for (rows, row), n in counts.items()))


@pytest.mark.parametrize("name", PUBLISHED_SHAPES)
def test_the_formulas_list_the_parameter_tensors_of_the_real_model(name):
    config = shape_config(name)
    shape = ModelShape.from_config(config)
    assert shape.param_tensors == _meta_tally(config)
    assert sum(rows * row * n for rows, row, n in shape.param_tensors) == shape.params


def test_a_mixture_of_experts_lists_its_counted_tensors():
    config = MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    shape = ModelShape.from_config(config)
    assert shape.counted_tensors == shape.param_tensors == _meta_tally(config)
    assert sum(rows * row * n for rows, row, n in shape.param_tensors) == shape.params


def test_host_bytes_of_a_tiny_model_are_the_pinned_sum_by_hand():
    """dp=2 (FSDP2 over 2 ranks), 50 tokens a rank, hidden 48, 3 heads of 16, 1 kv head, MLP 80, vocabulary 300."""
    config = LlamaConfig(
        vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    plan = plan_memory(config, seq_len=50, dp=2, gpus_per_node=2, features=OFFLOADED, device="cuda")
    assert plan.features.dtype == "bf16" and plan.tokens_per_rank == 50
    # fp32 shards of ceil(rows / 2) rows: q and o 24 x 48 (4,608 B -> 8 KiB), k and v 8 x 48 (1,536 -> 2 KiB),
    # gate and up 40 x 48 and down 24 x 80 (7,680 -> 8 KiB), two norms 24 (96 -> 128); embedding and lm_head
    # 150 x 48 (28,800 -> 32 KiB), final norm 24 (128)
    layer, layer_exact = 5 * 8192 + 2 * 2048 + 2 * 128, 2 * 4608 + 2 * 1536 + 3 * 7680 + 2 * 96
    pinned, exact = 2 * layer + 2 * 32768 + 128, 2 * layer_exact + 2 * 28800 + 96
    # pinned parameters and gradients, AdamW's two pageable states, its step's 3 temporaries of the largest
    # shard; 2 layer inputs of 50 x 48 bf16 (4,800 B -> a page more: ulysses_sp.pinned.buffer_bytes)
    per_rank = 2 * pinned + 2 * exact + 3 * 28800 + 2 * 8192
    assert plan.host_bytes_per_node == 2 * per_rank == 2 * 672_832
    terms = host_terms(
        ModelShape.from_config(config), world=2, offload_states=True, checkpoint_bytes=4800, checkpoints=2
    )
    assert terms == {
        "parameters": pinned,
        "gradients": pinned,
        "optimizer": 2 * exact + 3 * 28800,
        "checkpoints": 8192 * 2,
    }


def test_llama_8b_with_its_optimizer_offloaded_does_not_fit_one_gpu_with_120_gib_of_host_memory():
    """Measured on an H200 with 128 GiB of host memory: the step at sp=1, 49,152 tokens, planned at 119.66 GiB of
    120, was killed by the host. Pinned parameters and gradients (2 GiB blocks for the embedding's 1.96 GiB and
    lm_head's, 256 MiB for each 224 MiB MLP matrix) make 33.0 GiB each, not 29.9."""
    config = shape_config("llama-3.1-8b")
    settings = dict(gpu_memory_bytes=14 * GiB, host_memory_bytes=120 * GiB, gpus_per_node=1, device="cuda")
    states = Features(cpu_offload_optimizer=True, activation_checkpointing="checkpoint")
    plan = plan_memory(config, seq_len=49152, features=states, **{**settings, "host_memory_bytes": 0})
    assert 131 * GiB < plan.host_bytes_per_node < 132 * GiB  # 119.66 GiB before
    chosen = plan_memory(config, seq_len=49152, features=Features(cpu_offload_optimizer=True), **settings)
    assert not chosen.fits_host and "no placement fits both memories" in chosen.checkpoint_choice
    assert max_seq_len(config, features=Features(cpu_offload_optimizer=True), **settings) == 0


def test_offloaded_layer_inputs_are_pinned_at_their_exact_size():
    """One sp=8 rank at 327,680 tokens: 32 layer inputs of 40,960 x 4,096 bf16 take 320 MiB each (ulysses_sp.pinned
    registers exact-size buffers; torch's pinned allocator would take 512 MiB blocks)."""
    features = Features(activation_checkpointing="offload")
    plan = plan_memory("llama-3.1-8b", seq_len=327680, sp=8, gpus_per_node=1, features=features, device="cuda")
    assert plan.host_bytes_per_node == 32 * 320 * MiB


def test_the_plan_reports_a_ranks_host_parts_and_they_add_up():
    """The host line and the JSON name a rank's parts (parameters, gradients, optimizer, checkpoints), which add up
    to the per-node figure over the ranks of a node."""
    from ulysses_sp.plan.cli import _table

    plan = plan_memory(
        shape_config("llama-3.1-8b", use_cache=False), seq_len=327680, sp=8, gpus_per_node=8,
        features=Features(cpu_offload_optimizer=True), gpu_memory_bytes=10 << 30, host_memory_bytes=960 << 30,
        device="cuda",
    )  # fmt: skip
    parts = plan.to_dict()["host_breakdown_bytes"]
    assert set(parts) == {"parameters", "gradients", "optimizer", "checkpoints"}
    assert sum(parts.values()) * 8 == plan.host_bytes_per_node and parts["checkpoints"] == 32 * (320 << 20)
    assert "(a rank: parameters 4.13 GiB, gradients 4.13 GiB, optimizer 8.21 GiB, checkpoints 10.00 GiB" in _table(plan)
