"""The unchunked core in slices of heads (ulysses_sp.sliced_core): how many slices, exactness in one process,
and what the planner counts for it (the multi-rank parity cases are in tests/dist/cases_head_chunks.py)."""

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, make_batch
from tests.helpers.spy import calls_to
from tests.unit.test_core_single import _loss
from ulysses_sp import sliced_core
from ulysses_sp.head_split import core_slices
from ulysses_sp.plan import Features, plan_memory

GiB = 1 << 30


@pytest.mark.parametrize(
    "heads,kv,tokens,want",
    [
        (4, 1, 8 << 20, 4),  # Llama-3.1-8B at sp=8, 8M tokens: 4 GiB per head, one head per slice
        (4, 1, 1024, 1),  # short: not sliced
        (32, 8, 1 << 20, 16),  # Llama-3.1-8B at sp=1, 1M tokens: 2 heads (part of a kv group) per slice
        (32, 8, 2 << 20, 32),
        (6, 3, 1 << 20, 3),  # whole kv groups or part of one: 2 heads (one group) per slice
        (6, 3, 1 << 22, 6),  # none fits: one head per slice
    ],
)
def test_slices_are_the_fewest_whose_dq_accumulator_fits_the_budget(heads, kv, tokens, want):
    assert core_slices(heads, kv, tokens=tokens, head_dim=128, budget_bytes=GiB) == want


@pytest.mark.parametrize(
    "arch,kv,batch,budget,slices",
    [
        ("llama", 2, make_batch(2, 20), 1, 4),  # one query head per slice
        ("llama", 2, make_batch(2, 20), 4 * 40 * 2 * 8, 2),  # one whole kv group (2 heads) per slice
        ("qwen3", 2, make_batch(2, 20, packed=(8, 12)), 1, 4),
        ("qwen3", 1, make_batch(2, 20, packed=(8, 12)), 4 * 40 * 2 * 8, 2),  # part of a kv group per slice
        ("llama", 1, make_batch(2, 19, pad="right"), 1, 4),
        ("deepseek_v3_mla_v4", None, make_batch(2, 20), 1, 4),
    ],
)
def test_sliced_core_equals_the_plain_model(arch, kv, batch, budget, slices):
    """4 query heads in ``slices`` slices (the budget: fp32 [tokens, heads per slice, head dim 8]): loss and every
    gradient equal the plain model's (fp32)."""
    model = build(arch, heads=4, kv_heads=kv)
    ref = model(**batch, use_cache=False).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=1, head_chunk_budget_bytes=budget)
    with calls_to(sliced_core, "kernel_backward") as calls:
        loss = _loss(model, batch, layout)
        loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-6)
    assert len(calls) == model.config.num_hidden_layers * slices  # every layer, one backward per slice


def test_sliced_core_under_autocast_computes_in_its_dtype(monkeypatch):
    """bf16 autocast over fp32 weights (RoPE leaves q/k fp32): the slices run in bf16 as autocast's sdpa would,
    return bf16, and the step matches the unsliced core under the same autocast to bf16 precision."""
    batch, layout = make_batch(2, 20), U.ParallelLayout.single()
    dtypes, results = [], {}
    forward = sliced_core.SlicedCore.forward

    def logged(ctx, q, k, v, *args):
        dtypes.append((q.dtype, k.dtype, v.dtype))
        return forward(ctx, q, k, v, *args)

    monkeypatch.setattr(sliced_core.SlicedCore, "forward", staticmethod(logged))
    for budget in (1 << 40, 1):
        model = build("llama", heads=4, kv_heads=2)
        U.parallelize(model, layout, head_chunks=1, head_chunk_budget_bytes=budget)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, batch, layout)
        loss.backward()
        results[budget] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert dtypes == [(torch.bfloat16,) * 3] * 2  # both layers, sliced run only
    (ref, ref_grads), (got, grads) = results[1 << 40], results[1]
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=0.0)
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() <= 5e-2 * ref_grads[name].norm(), name


def test_the_default_budget_leaves_a_short_sequence_unsliced():
    model, batch, layout = build("llama", heads=4, kv_heads=2), make_batch(2, 20), U.ParallelLayout.single()
    U.parallelize(model, layout)
    with calls_to(sliced_core, "kernel_backward") as calls:
        _loss(model, batch, layout).backward()
    assert calls == []


def test_the_planner_counts_one_slice_of_kernel_buffers_on_a_gpu():
    """Llama-3.1-8B at sp=8, 8M tokens (1M per rank), bf16, on a GPU: the core runs in 4 slices of one head, so
    the flash kernel's fp32 dq accumulator is one head's (4 GiB) instead of four (16 GiB), the per-query-head
    k/v gradients of GQA are gone (16 GiB), and one slice's gradients and output gradient copy are added."""
    # (head chunks 1: automatic C takes 4 chunks there, whose cores are not sliced)
    features = Features(cpu_offload_optimizer=True, dtype="bf16", activation_checkpointing="offload", head_chunks=1)
    args = dict(seq_len=8 << 20, sp=8, gpus_per_node=8, features=features)
    plan = plan_memory("llama-3.1-8b", **args)
    assert (plan.head_chunks, plan.core_slices) == (1, 4)
    # the second layer in backward order: the last one's plus its fp32 reduce-scatter input (plan.earlier_layers)
    phase = "backward: layer 30's attention"
    assert plan.phase == "recompute: layer 30's attention"  # (the recompute holds its output's gradient too)
    cpu = plan_memory("llama-3.1-8b", device="cpu", **args)  # no kernel buffers modelled on a CPU
    kernel = plan.phases[phase]["attention"] - cpu.phases[phase]["attention"]
    per_head = 1 << 20 << 3 << 7  # one local head: 8M tokens x 128, elements
    # dq accumulator (fp32) + softmax sums (fp32, [N] per head) + output-gradient copy and dq (bf16) + dk, dv
    assert kernel == 4 * per_head + 4 * (8 << 20) + 2 * 2 * per_head + 2 * 2 * per_head
