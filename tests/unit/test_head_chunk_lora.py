"""Head-chunked attention with PEFT LoRA adapters on its projections, in one process (sp=1): exact against the
plain PEFT model, and what is refused or kept unchunked. The multi-rank proof is tests/dist/test_head_chunks_parity.py
(``*_lora_*`` cases)."""

import contextlib
import copy

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import build, loss_and_grads, make_batch, with_lora
from ulysses_sp.head_chunks import HeadChunkedAttention

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _chunked(model) -> list[HeadChunkedAttention]:
    return [
        m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), HeadChunkedAttention)
    ]


def _parallel_loss_and_grads(model, batch, chunks=2, **kwargs):
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=chunks, **kwargs)
    return loss_and_grads(model, batch, layout)


@pytest.mark.parametrize(
    ("arch", "targets", "unfreeze", "autocast"),
    [
        ("llama", ATTENTION, False, False),
        ("qwen3", ("q_proj", "v_proj"), True, False),  # the base q_proj trained too: its rows and B's rows
        ("deepseek_v3_mla_v4", ("q_b_proj", "kv_b_proj", "o_proj"), False, False),  # projections not of x
        ("llama", ATTENTION, False, True),
    ],
)
def test_lora_chunks_match_the_plain_peft_model(arch, targets, unfreeze, autocast):
    batch = make_batch(2, 20, packed=(8, 12))
    model = with_lora(build(arch, kv_heads=2 if arch != "deepseek_v3_mla_v4" else None), targets)
    if unfreeze:
        for name, param in model.named_parameters():
            if "q_proj.base_layer" in name:
                param.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref, want = loss_and_grads(copy.deepcopy(model), batch)
        loss, grads = _parallel_loss_and_grads(model, batch)
    installed = _chunked(model)
    assert len(installed) == 2 and all(h.verified for h in installed)  # the chunked path ran
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n, g in grads.items() if g is not None} == trained == {n for n, g in want.items() if g is not None}
    assert any("lora_A" in n for n in trained) and any("lora_B" in n for n in trained)
    assert all(grads[n].abs().sum() > 0 for n in trained)  # random A and B: every gradient reached
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref, **tol)
    for name in trained:
        torch.testing.assert_close(grads[name], want[name], **tol, msg=name)


def test_lora_dropout_while_training_refused_or_kept_unchunked():
    """Each chunk would draw its own dropout mask: asked-for chunks raise at the call (naming the fix) before any
    gradient; automatic chunks keep the module's own path; in eval mode (no dropout) the chunks run."""
    batch = make_batch(1, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION, lora_dropout=0.1)
    asked = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    with pytest.raises(ValueError, match=r"lora_dropout=0.1.*LoraConfig\(lora_dropout=0.0\)"):
        loss_and_grads(asked, batch, U.ParallelLayout.single())
    assert all(p.grad is None for p in asked.parameters())

    auto = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunk_budget_bytes=1)
    torch.manual_seed(5)
    loss, _ = loss_and_grads(auto, batch, U.ParallelLayout.single())
    assert all(h.verified is None for h in _chunked(auto))  # never chunked, so never probed
    torch.manual_seed(5)
    torch.testing.assert_close(loss, model(**batch, use_cache=False).loss.detach(), rtol=1e-5, atol=1e-6)

    asked.eval()
    with torch.no_grad():
        want = model.eval()(**batch, use_cache=False).loss
        layout = U.ParallelLayout.single()
        shard = U.shard_batch(batch, layout)
        logits = asked(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        got = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
    assert all(h.verified for h in _chunked(asked))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (dict(use_dora=True), r"q_proj: its LoRA adapter 'default' is a variant \(DoRA or another\)"),
        (dict(lora_bias=True), r"q_proj: its LoRA adapter 'default' has a bias \(lora_bias=True\)"),
    ],
)
def test_lora_variants_refused_at_parallelize(config, reason):
    model = with_lora(build("llama", kv_heads=2), ATTENTION, **config)
    with pytest.raises(ValueError, match=rf"LlamaAttention cannot run its heads in chunks: {reason}.*head_chunks=1"):
        U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    auto = U.parallelize(model, U.ParallelLayout.single(), head_chunk_budget_bytes=1)  # automatic: unchunked
    assert not _chunked(auto)


def test_merged_and_disabled_adapters_run_the_base_weights_in_chunks():
    batch = make_batch(1, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION)
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    layout = U.ParallelLayout.single()
    shard = U.shard_batch(batch, layout)

    def both(setup):
        with torch.no_grad(), setup(model), setup(par):
            want = model(**batch, use_cache=False).loss
            logits = par(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
            return U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout), want

    with_adapters = both(lambda m: contextlib.nullcontext())
    disabled = both(lambda m: m.disable_adapter())
    assert all(h.verified for h in _chunked(par))
    torch.testing.assert_close(*with_adapters, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(*disabled, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(with_adapters[0], disabled[0])  # the adapters count, and are switched off
    model.merge_adapter()
    par.merge_adapter()
    merged = both(lambda m: contextlib.nullcontext())
    torch.testing.assert_close(*merged, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged[0], with_adapters[0], rtol=1e-5, atol=1e-6)
