"""Head-chunked attention with PEFT LoRA adapters on its projections, in one process (sp=1): exact against the
plain PEFT model, and what is refused or kept unchunked. The multi-rank proof is tests/dist/test_head_chunks_parity.py
(``*_lora_*`` cases)."""

import contextlib
import copy

import pytest
import torch

import ulysses_sp as U
from tests.helpers.models import (
    assert_as_close_as_one_process,
    build,
    loss_and_grads,
    make_batch,
    with_chunk_dropout,
    with_lora,
)
from ulysses_sp.head_chunk_lora import InputDropout
from ulysses_sp.head_chunks import HeadChunkedAttention
from ulysses_sp.instance_forward import installed_forward

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _chunked(model) -> list[HeadChunkedAttention]:
    return [installed_forward(m) for m in model.modules() if isinstance(installed_forward(m), HeadChunkedAttention)]


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


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_adapters_of_fp32_projections_run_in_chunks(adapter_dtype):
    """fp32 base weights with 16-bit LoRA adapters (PEFT casts the input to the adapter's dtype, so the adapters'
    share of each projection is rounded to 16 bits): the first call's probe compared the chunked forward with PEFT's at
    fp32's tolerance and refused head_chunks=2 ("its projections do not split by heads", 0.4% apart: the chunks sum
    the output projection's adapter shares in fp32). It now compares at the adapters' precision: chunked, and as close
    to the fp64 truth as the plain PEFT model."""
    batch = make_batch(2, 20, packed=(8, 12))
    model = with_lora(build("llama", kv_heads=2), ATTENTION)
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(adapter_dtype)
    chunked = copy.deepcopy(model)
    loss, grads = _parallel_loss_and_grads(chunked, batch)
    assert len(_chunked(chunked)) == 2 and all(h.verified for h in _chunked(chunked))
    assert_as_close_as_one_process(model, batch, loss, grads)


@pytest.mark.parametrize("first", ["bf16", "fp32"])
def test_two_active_adapters_of_different_dtypes_take_their_input_as_peft_casts_it(first):
    """Two adapters active at once on q/k/v, one bf16 and one fp32, on fp32 weights: PEFT's forward casts one input
    to each adapter's dtype in turn, so after a bf16 adapter the fp32 one gets the input rounded to bf16. The chunks
    cast the input afresh for each adapter: the first layer's attention output was 5.3e-4 off PEFT's with the bf16
    adapter first (the same otherwise); now it is PEFT's at fp32's tolerance in both orders, and the loss and
    gradients are as close to the fp64 truth as PEFT's (later layers pass fp32 noise through the bf16 rounding, as
    PEFT's own model does)."""
    from peft import LoraConfig

    targets = ("q_proj", "k_proj", "v_proj")
    batch = make_batch(2, 20, packed=(8, 12))
    model = with_lora(build("llama", kv_heads=2), targets)
    torch.manual_seed(5)
    model.add_adapter("other", LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False))
    low = "default" if first == "bf16" else "other"
    for name, param in model.named_parameters():
        if f".{low}." in name:
            param.data = param.data.to(torch.bfloat16)
    model.base_model.set_adapter(["default", "other"])
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    seen = []
    for net in (model, par):
        attention = net.base_model.model.model.layers[0].self_attn
        hook = attention.register_forward_hook(lambda module, args, out: seen.append(out[0].detach()))
        with torch.no_grad():
            _sp_loss(net, batch) if net is par else net(**batch, use_cache=False)
        hook.remove()
    assert all(h.verified for h in _chunked(par))
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-6)
    loss, grads = loss_and_grads(par, batch, U.ParallelLayout.single())
    assert {n for n, g in grads.items() if g is not None} >= {n for n, _ in model.named_parameters() if ".other." in n}
    assert_as_close_as_one_process(model, batch, loss, grads)


@pytest.mark.parametrize(
    ("arch", "targets", "tiled_norms"),
    [
        ("llama", ATTENTION, False),
        ("llama", ATTENTION, True),
        ("deepseek_v3_mla_v4", ("q_b_proj", "kv_b_proj", "o_proj"), False),  # projections of an inner tensor
    ],
)
def test_lora_dropout_is_one_mask_per_call_in_every_chunk_and_in_backward(monkeypatch, arch, targets, tiled_norms):
    """lora_dropout while training: every chunk, and backward (whole or remaking the tiled norm's output tile by
    tile), drop the same elements. The reference is the plain PEFT model whose dropout draws that mask."""
    p, seed = 0.25, 1000
    batch = make_batch(2, 20, packed=(8, 12))
    model = with_lora(build(arch, kv_heads=2 if arch == "llama" else None), targets, lora_dropout=p)
    ref = with_chunk_dropout(copy.deepcopy(model), targets, p, seed)
    want_loss, want = loss_and_grads(ref, batch)
    with torch.no_grad():
        no_dropout = copy.deepcopy(model).eval()(**batch, use_cache=False).loss
    monkeypatch.setattr(HeadChunkedAttention, "dropout_seed", lambda self: seed + self.module.layer_idx)
    layout = U.ParallelLayout.single()
    U.parallelize(model, layout, head_chunks=2)
    if tiled_norms:
        U.enable_tiled_norms(model, chunk_tokens=7)  # 40 tokens: tiles of 7
    loss, grads = loss_and_grads(model, batch, layout)
    assert all(h.verified for h in _chunked(model))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    trained = [n for n, g in grads.items() if g is not None]
    assert sorted(trained) == sorted(n for n, q in model.named_parameters() if q.requires_grad)
    assert len(trained) >= 2 * 2 * 2  # A and B of two projections or more, two layers
    for name in trained:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(no_dropout, want_loss)  # the adapters' dropout was on


def test_lora_dropout_seed_comes_back_under_activation_checkpointing():
    """The call's seed is drawn from torch's generator, which checkpointing's recompute restores: the same step
    with and without checkpointing gives the same loss and gradients."""
    batch = make_batch(1, 16)
    model = with_lora(build("llama", kv_heads=2), ATTENTION, lora_dropout=0.3)
    results = []
    for checkpointing in (False, True):
        par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
        if checkpointing:
            par.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        par.train()
        torch.manual_seed(7)
        results.append(loss_and_grads(par, batch, U.ParallelLayout.single()))
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=0)
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grads_ckpt[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_input_dropout_mask_depends_on_position_only():
    dropout = InputDropout(0.25, seed=123)
    columns = torch.arange(6)
    whole = dropout.mask(2, 0, 10, columns)
    tiles = torch.cat([dropout.mask(2, 0, 4, columns), dropout.mask(2, 4, 6, columns)], dim=1)
    assert torch.equal(whole, tiles)
    assert torch.equal(dropout.mask(2, 3, 5, torch.tensor([1, 4])), whole[:, 3:8][..., [1, 4]])
    assert set(whole.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    big = InputDropout(0.25, seed=5).mask(4, 0, 500, torch.arange(512))
    assert abs(float((big > 0).float().mean()) - 0.75) < 0.01
    assert not torch.equal(big, InputDropout(0.25, seed=6).mask(4, 0, 500, torch.arange(512)))


@pytest.mark.parametrize(
    ("config", "hooked", "reason"),
    [
        (dict(use_dora=True), None, r"q_proj: its LoRA adapter 'default' is a variant \(DoRA or another\)"),
        (dict(lora_bias=True), None, r"q_proj: its LoRA adapter 'default' has a bias \(lora_bias=True\)"),
        (dict(lora_dropout=0.1), "lora_dropout", r"q_proj: its LoRA adapter 'default' has forward hooks"),
        ({}, "lora_dropout", r"q_proj: its LoRA adapter 'default' has forward hooks"),  # (an nn.Identity)
        ({}, "lora_B", r"q_proj: its LoRA adapter 'default' has forward hooks"),
    ],
)
def test_lora_variants_refused_at_parallelize(config, hooked, reason):
    """Adapters the chunks cannot run as PEFT does: DoRA, a bias on B, a forward hook on lora_A, lora_B or the
    dropout of the input (the chunks call none of these modules)."""
    model = with_lora(build("llama", kv_heads=2), ATTENTION, **config)
    for layer in model.base_model.model.model.layers if hooked is not None else ():
        getattr(layer.self_attn.q_proj, hooked)["default"].register_forward_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match=rf"LlamaAttention cannot run its heads in chunks: {reason}.*head_chunks=1"):
        U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    auto = U.parallelize(model, U.ParallelLayout.single(), head_chunk_budget_bytes=1)  # automatic: unchunked
    assert not _chunked(auto)


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("IA3Config", dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])),
        ("LoHaConfig", dict(r=4, target_modules=list(ATTENTION), init_weights=False)),
    ],
)
def test_other_peft_layers_refused_by_their_full_name_or_run_unchunked(kind, config):
    """PEFT layers other than LoRA on the projections (IA3, LoHa) cannot be sliced by heads: head_chunks=2 is refused
    naming the layer's full class (PEFT calls them all ``Linear``: "k_proj is a Linear, not a plain torch.nn.Linear"
    named nothing); automatic chunking leaves them unchunked, with the plain PEFT model's loss and gradients."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    model = peft.get_peft_model(build("llama", kv_heads=2), getattr(peft, kind)(**config))
    layer = type(model.base_model.model.model.layers[0].self_attn.k_proj)
    assert layer.__name__ == "Linear" and layer.__module__.startswith("peft.tuners.")
    with pytest.raises(ValueError, match=rf"[qk]_proj is a {layer.__module__}\.Linear, not a plain torch\.nn\.Linear"):
        U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    batch = make_batch(2, 20, packed=(8, 12))
    want_loss, want = loss_and_grads(copy.deepcopy(model), batch)
    loss, grads = _parallel_loss_and_grads(model, batch, chunks=None, head_chunk_budget_bytes=1)
    assert not _chunked(model)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    trained = [n for n, g in want.items() if g is not None]
    assert trained and all(grads[n] is not None for n in trained)
    for name in trained:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


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


def _sp_loss(model, batch):
    layout = U.ParallelLayout.single()
    shard = U.shard_batch(batch, layout)
    logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
    return U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)


def _second_adapter(model, seed=5, **config):
    from peft import LoraConfig

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(ATTENTION), init_lora_weights=False, **config)
    model.add_adapter("other", lora)


def test_backward_keeps_the_forwards_dropout_after_a_mode_switch():
    """The adapters (and their dropout) are read once per call: eval() between forward and backward changes no
    gradient, as under PEFT's own forward."""
    batch = make_batch(1, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION, lora_dropout=0.3)
    par = U.parallelize(model, U.ParallelLayout.single(), head_chunks=2)
    found = []
    for switch in (False, True):
        par.train()
        torch.manual_seed(3)
        loss = _sp_loss(par, batch)
        if switch:
            par.eval()
        loss.backward()
        found.append({n: p.grad.clone() for n, p in par.named_parameters() if p.grad is not None})
        par.zero_grad(set_to_none=True)
    assert found[0].keys() == found[1].keys() and found[0]
    for name, grad in found[0].items():
        torch.testing.assert_close(found[1][name], grad, rtol=0, atol=0, msg=name)


def test_inactive_trainable_adapter_gets_no_gradient_and_mixed_batches_match_peft():
    """A trainable adapter that is not active gets None (not zeros, which AdamW's weight decay would act on); PEFT's
    per-sample ``adapter_names`` (forward hooks for one call) runs the module's own forward, exact."""
    batch = make_batch(2, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION)
    _second_adapter(model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    want_loss, want = loss_and_grads(copy.deepcopy(model), batch)
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    loss, grads = loss_and_grads(par, batch, U.ParallelLayout.single())
    assert all(h.verified for h in _chunked(par))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert {n for n, g in grads.items() if g is not None} == {n for n, g in want.items() if g is not None}
    assert all(grads[n] is None for n in grads if ".other." in n)
    model.eval()
    par.eval()
    with torch.no_grad():
        names = ["default", "other"]
        want_logits = model(input_ids=batch["input_ids"], adapter_names=names, use_cache=False).logits
        got_logits = par(input_ids=batch["input_ids"], adapter_names=names).logits
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)


def test_adapter_added_after_parallelize_is_checked_per_call():
    """A DoRA adapter added and set after the chunks were installed: asked-for chunks raise at the call; automatic
    chunks run the module's own forward (exact)."""
    batch = make_batch(1, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION)
    asked = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    auto = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunk_budget_bytes=1)
    for m in (model, asked, auto):
        _second_adapter(m, use_dora=True)
        m.set_adapter("other")
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
        torch.testing.assert_close(_sp_loss(auto, batch), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"q_proj: its LoRA adapter 'other' is a variant"):
            _sp_loss(asked, batch)


def test_merged_adapters_disabled_are_unmerged_as_peft_does():
    batch = make_batch(1, 12)
    model = with_lora(build("llama", kv_heads=2), ATTENTION)
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(**batch, use_cache=False).loss
        assert not torch.allclose(model(**batch, use_cache=False).loss, base)  # the adapters count
        for m in (model, par):
            m.merge_adapter()
        with model.disable_adapter(), par.disable_adapter():
            torch.testing.assert_close(_sp_loss(par, batch), base, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(model(**batch, use_cache=False).loss, base, rtol=1e-5, atol=1e-6)


def test_dropout_in_a_lora_layer_the_chunks_do_not_slice_is_refused_or_unchunked():
    """MLA with LoRA on every linear layer: kv_a_proj_with_mqa runs inside each chunk's forward, so its dropout
    would draw a mask per chunk."""
    batch = make_batch(1, 12)
    model = with_lora(build("deepseek_v3_mla_v4"), ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), lora_dropout=0.2)
    asked = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa, a LoRA layer the chunks do not slice, drops out"):
        _sp_loss(asked, batch)
    auto = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunk_budget_bytes=1)
    _sp_loss(auto, batch).backward()
    assert all(h.verified is None for h in _chunked(auto))  # never chunked


def _switched_step(model, batch, sp: bool, before, after):
    """One step whose forward runs under ``before(model)`` and backward under ``after(model)`` (context managers)."""
    with before(model):
        loss = _sp_loss(model, batch) if sp else model(**batch, use_cache=False).loss
    with after(model):
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@contextlib.contextmanager
def _mode(model, training: bool):
    model.train(training)
    yield


@pytest.mark.parametrize("case", ["eval_forward_train_backward", "adapters_disabled_in_forward_only"])
def test_state_changes_between_forward_and_backward_match_peft(case):
    """MLA with dropout in a LoRA layer the chunks do not slice: a forward in eval (dropout off, so chunked) and a
    backward after train(); and a forward under ``disable_adapter()`` (train mode: that dropout is inactive as the
    adapters are, so no refusal), its backward after it (the adapters trainable again)."""
    batch = make_batch(1, 12)
    model = with_lora(build("deepseek_v3_mla_v4"), ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), lora_dropout=0.5)
    if case == "adapters_disabled_in_forward_only":
        model.get_input_embeddings().weight.requires_grad_(True)
        before, after = (lambda m: m.disable_adapter()), (lambda m: contextlib.nullcontext())
    else:
        before, after = (lambda m: _mode(m, False)), (lambda m: _mode(m, True))
    par = U.parallelize(copy.deepcopy(model), U.ParallelLayout.single(), head_chunks=2)
    want_loss, want = _switched_step(model, batch, False, before, after)
    loss, grads = _switched_step(par, batch, True, before, after)
    assert all(h.verified for h in _chunked(par))
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert {n for n, g in grads.items() if g is not None} == {n for n, g in want.items() if g is not None}
    for name, grad in grads.items():
        if grad is not None:
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
