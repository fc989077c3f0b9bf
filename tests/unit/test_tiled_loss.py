"""The tiled lm_head + cross-entropy equals the plain path (loss and every gradient) and holds far less."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

import ulysses_sp as U
from tests.helpers.models import VOCAB, build, make_batch
from ulysses_sp.memory import PeakMemory
from ulysses_sp.tiled_loss import LogitsHead, loss_chunk_tokens, tiled_loss_enabled

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=0.25), LogitsHead(scale=2.0, softcap=5.0)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_kernel_matches_plain_cross_entropy(head, bias, chunk):
    torch.manual_seed(0)
    h = torch.randn(2, 37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :5] = -100
    params = [h, w] + ([b] if bias else [])
    want = F.cross_entropy(head.apply(F.linear(h, w, b)).flatten(0, 1), targets.flatten(), reduction="sum")
    want_grads = torch.autograd.grad(want, params)
    got = U.tiled_cross_entropy_sum(h, w, targets, bias=b, head=head, chunk_tokens=chunk)
    got_grads = torch.autograd.grad(got, params)
    torch.testing.assert_close(got, want, **TOL)
    for g, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=2.0, softcap=5.0)])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("recompute", [False, True])
def test_kernel_label_smoothing_matches_transformers_label_smoother(head, chunk, recompute):
    """label_smoothing=e: the loss and gradients of transformers' LabelSmoother(epsilon=e) over the same logits,
    as a sum (its mean times the count of valid targets)."""
    from transformers.trainer_pt_utils import LabelSmoother

    torch.manual_seed(0)
    h = torch.randn(2, 37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :5] = -100
    count = int((targets != -100).sum())
    logits = head.apply(F.linear(h, w))
    want = LabelSmoother(epsilon=0.1)({"logits": logits}, targets, num_items_in_batch=count) * count
    want_grads = torch.autograd.grad(want, [h, w])
    got = U.tiled_cross_entropy_sum(
        h, w, targets, head=head, chunk_tokens=chunk, recompute=recompute, label_smoothing=0.1
    )
    got_grads = torch.autograd.grad(got, [h, w])
    torch.testing.assert_close(got, want, **TOL)
    for g, r in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, r, **TOL)
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        U.tiled_cross_entropy_sum(h, w, targets, label_smoothing=1.0)


def test_kernel_no_valid_target_gives_zero_and_zero_grads():
    h = torch.randn(1, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss = U.tiled_cross_entropy_sum(h, w, torch.full((1, 5), -100), chunk_tokens=2)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_kernel_errors_name_the_shapes():
    with pytest.raises(ValueError, match="disagree"):
        U.tiled_cross_entropy_sum(torch.randn(2, 5, 8), torch.randn(11, 8), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"weight must be \[vocab, 8\]"):
        U.tiled_cross_entropy_sum(torch.randn(2, 5, 8), torch.randn(11, 7), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_tokens"):
        U.tiled_cross_entropy_sum(torch.randn(5, 8), torch.randn(11, 8), torch.zeros(5).long(), chunk_tokens=0)


def test_chunk_from_budget():
    assert loss_chunk_tokens(151_936, 1 << 30) == (1 << 30) // (151_936 * 8)
    assert loss_chunk_tokens(10**9, 1) == 1
    with pytest.raises(ValueError):
        loss_chunk_tokens(0)


def _quiet(**extra):
    return dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        **extra,
    )


def _model(arch: str):
    torch.manual_seed(0)
    if arch == "llama_tied":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_quiet(tie_word_embeddings=True)))
    if arch == "granite":  # logits / logits_scaling
        return tf.GraniteForCausalLM(tf.GraniteConfig(**_quiet(logits_scaling=4.0)))
    if arch == "cohere":  # logits * logit_scale, tied
        return tf.CohereForCausalLM(tf.CohereConfig(**_quiet(logit_scale=0.5)))
    if arch == "gemma2":  # final_logit_softcapping
        return build("gemma2", attn="eager")
    return build(arch)  # llama (untied), gpt_neox (embed_out)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "arch", ["llama", "llama_tied", "granite", "cohere", "gemma2", "gpt_neox", "qwen3_moe", "mixtral"]
)
def test_model_loss_and_grads_equal_plain(arch):
    model = _model(arch).float()
    batch = make_batch(2, 24, pad="right")
    plain = copy.deepcopy(model)
    want = plain(**batch, use_cache=False).loss
    want.backward()
    tiled = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)
    out = tiled(**batch, use_cache=False)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, **TOL)
    got, ref = _grads(tiled), _grads(plain)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], **TOL, msg=name)


@pytest.fixture
def default_float64():
    """torch.set_default_dtype(torch.float64) for the test, restored after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def test_fp64_model_under_a_float64_default_dtype_equals_plain(default_float64):
    """An fp64 model built after torch.set_default_dtype(torch.float64): the kernel's logits gradient came out in
    the default dtype (a bool mask times a Python float), and scatter_add_ refused it ("Expected self.dtype to be
    equal to src.dtype"). The loss (fp32, as transformers' logits.float()) and every fp64 gradient equal plain."""
    model = build("llama").double()
    batch = make_batch(2, 24, pad="right")
    plain = copy.deepcopy(model)
    want = plain(**batch, use_cache=False).loss
    want.backward()
    tiled = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)
    got = tiled(**batch, use_cache=False).loss
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    got_grads, ref = _grads(tiled), _grads(plain)
    assert got_grads.keys() == ref.keys() and {g.dtype for g in got_grads.values()} == {torch.float64}
    for name in ref:
        torch.testing.assert_close(got_grads[name], ref[name], **TOL, msg=name)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_kernel_fp64_under_a_float64_default_dtype(default_float64, recompute, smoothing):
    """The kernel on fp64 inputs under a float64 default dtype, with a softcap, label smoothing and the recompute
    path: cross-entropy over the fp32 logits, as the plain path's logits.float(), and fp64 gradients."""
    torch.manual_seed(0)
    head = LogitsHead(scale=2.0, softcap=5.0)
    h = torch.randn(2, 37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (2, 37))
    targets[0, :5] = -100
    logits = head.apply(F.linear(h, w).float())
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", label_smoothing=smoothing)
    want_grads = torch.autograd.grad(want, [h, w])
    got = U.tiled_cross_entropy_sum(
        h, w, targets, head=head, chunk_tokens=7, recompute=recompute, label_smoothing=smoothing
    )
    got_grads = torch.autograd.grad(got, [h, w])
    torch.testing.assert_close(got, want, **TOL)
    for g, r in zip(got_grads, want_grads, strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, r, **TOL)


def test_under_torch_compile_loss_and_grads_equal_plain():
    """torch.compile (dynamo's tracing; the eager backend keeps it quick) over a model with the tiled loss: the lm_head
    call whose forward the loss swaps in runs eagerly (dynamo failed on the swap before), the rest compiled."""
    model = build("llama")
    batch = make_batch(2, 12, pad="right")
    plain = copy.deepcopy(model)
    want = plain(**batch, use_cache=False).loss
    want.backward()
    tiled = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)
    torch._dynamo.reset()
    got = torch.compile(tiled, backend="eager")(**batch, use_cache=False).loss
    got.backward()
    torch.testing.assert_close(got, want, **TOL)
    got_grads = _grads(tiled)
    for name, grad in _grads(plain).items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=name)
    assert "forward" not in tiled.get_output_embeddings().__dict__


def test_shift_labels_num_items_and_no_labels():
    model = build("llama")
    batch = make_batch(1, 16)
    shifted = U.shift_labels(batch["labels"])
    plain = model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=7).loss
    U.enable_tiled_loss(model)
    tiled = model(input_ids=batch["input_ids"], shift_labels=shifted, num_items_in_batch=7).loss
    torch.testing.assert_close(tiled, plain, **TOL)
    logits = model(input_ids=batch["input_ids"]).logits  # no labels: the original forward, full logits
    assert logits.shape == (1, 16, VOCAB)
    assert tiled_loss_enabled(model)
    U.disable_tiled_loss(model)
    assert not tiled_loss_enabled(model) and "forward" not in model.__dict__


def test_a_step_without_targets_counted_as_zero_items_is_zero_with_zero_gradients():
    """The Trainer passes num_items_in_batch = 0 for a step whose every label is -100: the loss divided by 0 made
    the kernel's gradients 0 x inf = NaN, and the next optimizer step turned every weight into NaN."""
    model = build("llama")
    U.enable_tiled_loss(model)
    batch = make_batch(1, 16)
    loss = model(input_ids=batch["input_ids"], labels=torch.full_like(batch["labels"], -100), num_items_in_batch=0).loss
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_bf16_autocast_close_to_plain():
    model = build("llama")
    batch = make_batch(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = copy.deepcopy(model)(**batch).loss
        got = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=9)(**batch).loss
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_refusals():
    model = build("llama")
    U.enable_tiled_loss(model)
    with pytest.raises(ValueError, match="already enabled"):
        U.enable_tiled_loss(model)
    with pytest.raises(ValueError, match="chunk_tokens"):
        U.enable_tiled_loss(build("llama"), chunk_tokens=0)
    with pytest.raises(TypeError, match="causal LM"):
        U.enable_tiled_loss(torch.nn.Linear(2, 2))


def test_moe_router_auxiliary_loss_is_refused_not_dropped():
    plain = build("qwen3_moe")
    model = U.enable_tiled_loss(copy.deepcopy(plain))
    batch = make_batch(1, 16)
    # no router logits asked for: the cross-entropy is the whole loss, as in the model's own forward
    torch.testing.assert_close(model(**batch).loss, plain(**batch).loss, **TOL)
    with pytest.raises(ValueError, match="output_router_logits=True: the tiled loss .* drop the MoE"):
        model(**batch, output_router_logits=True)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits = False"):
        model(**batch)


def test_disable_restores_a_forward_wrapper_set_on_the_instance_before():
    model = build("llama")
    calls = []

    def wrapper(*args, **kwargs):  # as Accelerate's autocast wrapper: an instance attribute over the class's
        calls.append(1)
        return type(model).forward(model, *args, **kwargs)

    model.forward = wrapper
    batch = make_batch(1, 8)
    U.enable_tiled_loss(model)
    model(input_ids=batch["input_ids"])  # no labels: the previous forward (the wrapper) runs
    assert calls == [1]
    U.disable_tiled_loss(model)
    assert model.__dict__["forward"] is wrapper
    model(**batch)
    assert calls == [1, 1]


def test_dora_on_lm_head_refused_lora_elsewhere_exact():
    """DoRA on lm_head (a weight norm over the whole [V, h] matrix) is refused by name; LoRA on the attention
    projections runs under the tiled loss with the model's own loss and gradients."""
    peft = pytest.importorskip("peft")
    refused = peft.get_peft_model(build("llama"), peft.LoraConfig(r=2, target_modules=["lm_head"], use_dora=True))
    with pytest.raises(ValueError, match="plain torch.nn.Linear .*DoRA"):
        U.enable_tiled_loss(refused)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(build("llama"), lora)
    batch = make_batch(1, 20)
    plain = copy.deepcopy(model)
    plain(**batch).loss.backward()
    tiled = U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=3)
    tiled(**batch).loss.backward()
    ref, got = _grads(plain), _grads(tiled)
    assert ref and ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], **TOL, msg=name)


def test_lora_dropout_on_lm_head_draws_the_masks_peft_draws():
    """LoRA on lm_head with lora_dropout 0.3, training: the tiled loss draws the masks PEFT's forward draws (one per
    adapter over the whole hidden states, from the same generator state; the first call's check of the head draws
    none), so two steps' losses and gradients equal the plain model's; another seed, other masks; in eval, none."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"], lora_dropout=0.3, init_lora_weights=False)
    model = peft.get_peft_model(build("llama"), config).train()
    batch = make_batch(2, 12)
    plain, tiled = copy.deepcopy(model), U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=5)
    for seed in (1, 2):
        torch.manual_seed(seed)
        want = plain(**batch).loss
        torch.manual_seed(seed)
        got = tiled(**batch).loss
        torch.testing.assert_close(got, want, **TOL)
        want.backward()
        got.backward()
    ref, grads = _grads(plain), _grads(tiled)
    assert ref.keys() == grads.keys() and any("lm_head.lora_A" in name for name in ref)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], **TOL, msg=name)
    with torch.no_grad():
        torch.manual_seed(3)
        assert not torch.allclose(tiled(**batch).loss, got)
        plain.eval(), tiled.eval()
        torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, **TOL)


def test_adaption_prompt_runs_the_tiled_loss_its_wrapper_calls():
    """PEFT's adaption prompt (LLaMA-Adapter) wraps the causal LM in a module whose ``forward`` is the causal LM's
    forward as it was when the adapter was added: the tiled forward installed later was bypassed, so the model
    returned whole logits and, given only ``shift_labels`` (as causal_lm_loss gives them), no loss
    (causal_lm_loss: AttributeError 'NoneType' object has no attribute 'device'). Now the wrapper calls the tiled
    forward: the loss and gradients of the plain model, no logits, and the wrapper's own forward back after
    disable_tiled_loss."""
    peft = pytest.importorskip("peft")
    config = peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM")
    torch.manual_seed(0)
    model = peft.get_peft_model(build("llama"), config)
    with torch.no_grad():  # the gates start at zero (the prompt would add nothing and get no gradient)
        for name, param in model.named_parameters():
            if "adaption_gate" in name:
                param.fill_(0.5)
    batch, layout = make_batch(2, 20), U.ParallelLayout.single()
    plain = copy.deepcopy(model)
    want = plain(**batch)
    want.loss.backward()
    tiled = U.enable_tiled_loss(U.parallelize(copy.deepcopy(model), layout), chunk_tokens=7)
    got = U.causal_lm_loss(tiled, U.shard_batch(batch, layout), layout)
    got.backward()
    assert tiled(**batch).logits is None  # the tiled forward ran
    torch.testing.assert_close(got, want.loss, **TOL)
    ref, grads = _grads(plain), _grads(tiled)
    assert ref.keys() == grads.keys() and any("adaption_prompt" in name for name in ref)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], **TOL, msg=name)
    U.disable_tiled_loss(tiled)
    assert tiled(**batch).logits is not None and not tiled_loss_enabled(tiled)


@pytest.mark.parametrize("kind", ["modules_to_save", "trainable_tokens_tied", "lora"])
def test_peft_trained_lm_head_runs_in_the_weight_the_model_uses(kind):
    """PEFT's modules_to_save copy of lm_head, trainable tokens on a tied lm_head, and LoRA on lm_head (with a bias on
    lora_B): the tiled loss runs with the weight the wrapper's call would use (the adapter's copy, the rows it trains
    copied in, or the base weight plus scaling x lora_B(lora_A(h)); the original with the adapter off), with the loss
    and gradients of the model's own."""
    peft = pytest.importorskip("peft")
    lora = dict(r=2, target_modules=["q_proj"], init_lora_weights=False)
    if kind == "lora":
        config = peft.LoraConfig(**{**lora, "target_modules": ["q_proj", "lm_head"]}, lora_bias=True)
        model = peft.get_peft_model(build("llama"), config)
        trained = model.base_model.model.lm_head.lora_B["default"].bias
    elif kind == "modules_to_save":
        model = peft.get_peft_model(build("llama"), peft.LoraConfig(**lora, modules_to_save=["lm_head"]))
        trained = model.base_model.model.lm_head.modules_to_save["default"].weight
    else:
        config = peft.LoraConfig(**lora, trainable_token_indices=[5, 6, 7])
        model = peft.get_peft_model(_model("llama_tied"), config)
        trained = model.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
    with torch.no_grad():  # the trained weight differs from the original, so using the wrong one shows
        trained.mul_(1.5)
    batch = make_batch(2, 20, pad="right")
    plain, tiled = copy.deepcopy(model), U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=3)
    losses = [net(**batch).loss for net in (plain, tiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    ref, got = _grads(plain), _grads(tiled)
    assert ref.keys() == got.keys() and any(k in n for n in ref for k in ("modules_to_save", "trainable", "lm_head"))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], **TOL, msg=name)
    with torch.no_grad(), plain.disable_adapter(), tiled.disable_adapter():  # nothing trainable: the loss alone
        torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, **TOL)


@pytest.mark.parametrize("kind", ["modules_to_save", "trainable_tokens", "lora"])
def test_peft_lm_head_merged_then_disabled_and_mixed_adapter_batches(kind):
    """A PEFT adapter on an untied lm_head merged (scored with the merged weight), then with the adapter off: the
    original rows, as PEFT's forward unmerges them (the tiled loss read the merged weight); a batch of mixed adapters
    (adapter_names) is refused by name, not scored as logits or with a shape error."""
    peft = pytest.importorskip("peft")
    head = {
        "modules_to_save": {"modules_to_save": ["lm_head"]},
        "trainable_tokens": {"trainable_token_indices": {"lm_head": [1, 2, 3]}},
        "lora": {"target_modules": ["q_proj", "lm_head"], "init_lora_weights": False},
    }[kind]
    model = peft.get_peft_model(build("llama"), peft.LoraConfig(r=2, **{"target_modules": ["q_proj"], **head}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name or "trainable_tokens" in name:
                param.mul_(3.0)
    batch = make_batch(2, 12)
    plain, tiled = copy.deepcopy(model).eval(), U.enable_tiled_loss(copy.deepcopy(model)).eval()
    with torch.no_grad():
        for net in (plain, tiled):
            net.merge_adapter()
        torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, **TOL)  # merged and on
        with plain.disable_adapter(), tiled.disable_adapter():
            torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, **TOL)
        torch.testing.assert_close(tiled(**batch).loss, plain(**batch).loss, **TOL)
        with pytest.raises(ValueError, match="adapter_names"):
            tiled(**batch, adapter_names=["default", "__base__"])


def test_peft_lora_on_lm_head_trains_without_a_vocab_by_hidden_tensor():
    """LoRA on a frozen lm_head (vocabulary 32,000, hidden 32): a training step through the tiled loss holds no
    [V, h] tensor (the adapter's term is added per chunk; only A and B get gradients), and equals PEFT's own."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    config = tf.LlamaConfig(**{**_quiet(), "vocab_size": 32_000, "tie_word_embeddings": False})
    lora = peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False)
    model = peft.get_peft_model(tf.LlamaForCausalLM(config), lora)
    batch = make_batch(1, 16)
    plain, tiled = copy.deepcopy(model), U.enable_tiled_loss(copy.deepcopy(model), chunk_tokens=2)
    tiled(**batch)  # the first call checks the head against the model's logits
    head = model.base_model.model.lm_head.base_layer.weight  # [V, h], frozen
    with PeakMemory("cpu") as step:
        tiled(**batch).loss.backward()
    assert step.peak_bytes < head.numel() * head.element_size()
    plain(**batch).loss.backward()
    trained = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    assert any("lm_head.lora_A" in n for n in trained)
    for name, param in tiled.named_parameters():  # (sums over 32,000 logits: 1e-5 of the largest gradient)
        if param.requires_grad:
            torch.testing.assert_close(param.grad, trained[name], rtol=1e-5, atol=1e-5, msg=name)


class _ScaledLogits(tf.LlamaForCausalLM):
    """A model whose forward post-processes logits in a way the tiled head does not know."""

    factor = 2.0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.factor
        return out


@pytest.mark.parametrize("factor", [2.0, 1.0015])  # 1.0015: a different loss, beyond fp32 rounding
def test_unknown_logit_post_processing_is_refused_at_first_forward(factor):
    torch.manual_seed(0)
    model = _ScaledLogits(tf.LlamaConfig(**_quiet()))
    model.factor = factor
    with pytest.raises(ValueError, match="cannot reproduce _ScaledLogits's logits") as err:
        U.enable_tiled_loss(model)(**make_batch(1, 8))
    assert "its logits differ from the head's by up to" in str(err.value)  # not only their (equal) shapes


def test_deepcopy_of_a_tiled_model_is_independent():
    model = U.enable_tiled_loss(build("llama"), chunk_tokens=4)
    twin = copy.deepcopy(model)
    U.disable_tiled_loss(model)
    assert tiled_loss_enabled(twin) and not tiled_loss_enabled(model)
    batch = make_batch(1, 12)
    torch.testing.assert_close(twin(**batch).loss, model(**batch).loss, **TOL)


def test_peak_memory_at_least_8x_below_plain():
    """vocab 32K, 4K tokens: the plain path holds ~3 fp32 [tokens, vocab] tensors; the tiled one a chunk."""
    vocab, tokens, hidden = 32_000, 4096, 64
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with PeakMemory("cpu") as plain:
        F.cross_entropy(F.linear(h, w), targets, reduction="sum").backward()
    budget = 64 << 20
    with PeakMemory("cpu") as tiled:
        U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=loss_chunk_tokens(vocab, budget)).backward()
    logits_bytes = tokens * vocab * 4
    assert plain.peak_bytes >= 3 * logits_bytes
    assert tiled.peak_bytes * 8 <= plain.peak_bytes, (tiled.peak_bytes, plain.peak_bytes)
    assert tiled.peak_bytes <= 2 * budget + 4 * w.numel() * 2  # one chunk + the weight-gradient buffers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head", [LogitsHead(), LogitsHead(scale=0.5, softcap=30.0)], ids=["linear", "softcap"])
def test_chunk_budget_is_honoured(dtype, head):
    """Forward + backward never hold more than the chunk budget on top of the [V, h] / [t, h] buffers.

    The buffers: the fp32 weight-gradient accumulator, the weight gradient returned in the weight's dtype
    and the hidden-state gradient. 2% slack covers the few [chunk] / [chunk, 1] vectors.
    """
    vocab, tokens, hidden, budget = 32_000, 256, 64, 8 << 20  # 8 chunks of 32 tokens
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    chunk = loss_chunk_tokens(vocab, budget)
    with PeakMemory("cpu") as tiled:
        U.tiled_cross_entropy_sum(h, w, targets, chunk_tokens=chunk, head=head).backward()
    elt = torch.finfo(dtype).bits // 8
    buffers = 4 * w.numel() + (elt * w.numel() if dtype != torch.float32 else 0) + elt * h.numel()
    assert chunk * vocab * 8 <= budget
    assert tiled.peak_bytes <= 1.02 * (budget + buffers), (tiled.peak_bytes, budget + buffers)


def test_torch_save_of_a_tiled_model_is_refused_and_a_copy_or_the_disabled_model_is_fine(tmp_path):
    """torch.save of a model with the tiled loss wrote a file that torch.load refused ('no attribute _tiled_forward':
    the forward set on the instance pickles by a name the class lacks); now the save is a TypeError naming the fix.
    A deep copy has a tiled loss of its own; disabled, the model saves and loads."""
    model = U.enable_tiled_loss(build("llama"), chunk_tokens=5)
    with pytest.raises(TypeError, match=r"model.state_dict\(\).*ulysses_sp.disable_tiled_loss\(model\)"):
        torch.save(model, tmp_path / "model.pt")
    batch = make_batch(2, 12, pad="right")
    copied = copy.deepcopy(model)
    assert tiled_loss_enabled(copied) and copied(**batch).logits is None
    torch.testing.assert_close(copied(**batch).loss, model(**batch).loss, rtol=0, atol=0)
    torch.save(U.disable_tiled_loss(model), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(loaded(**batch).loss, model(**batch).loss, rtol=0, atol=0)
