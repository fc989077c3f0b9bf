"""Multi-rank cases: many architectures, inputs and refusals against one process, run inside gloo workers by
tests/dist/test_architectures.py.

Parity cases compare loss and every gradient with one process on the full batch (plain transformers attention,
the model's own mask), as in :mod:`tests.dist.cases_core`; the other cases check that bad input on ONE rank
raises a ValueError on EVERY rank before any collective can hang.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import torch

import ulysses_sp as U
from tests.dist.cases_core import check_parity, raises_everywhere, reference, sequence_parallel
from tests.dist.cases_memory_features import full_grad, wrap
from tests.dist.cases_zoo import zoo_cases
from tests.helpers.harness import run_cases
from tests.helpers.models import VOCAB, build, build_generic, dp_share, make_batch, router_aux_on
from tests.helpers.parity import assert_loss_and_grads

# Every family of the issue, tiny: (arch, kv_heads). heads=4 so sp=4 splits them.
PARITY_ARCHS = {
    "llama_dynamic": 2,  # rope "dynamic": frequencies from the largest position
    "phi3_longrope": 2,  # rope "longrope": long or short factors from the largest position
    "llama3_yarn": 2,
    "qwen2_moe_window": 2,  # sliding window only through the mask
    "phimoe_window": 2,  # sliding window only through the mask
    "deepseek_v3_mla": None,  # MLA, v head dim == qk head dim
    "deepseek_v3_mla_v4": None,  # MLA, v head dim 4 != qk head dim 8
    "deepseek_v2_mla_v4": None,
    "opt": None,  # the CausalLM calls its decoder directly
    "stablelm": 2,
    "granite": 2,
    "starcoder2": 2,
    "mixtral": 2,
    "qwen3_moe": 2,
    "smollm3": 2,
    "glm": 2,
    "glm4": 2,
    "phi": None,
    "exaone4": 2,
    "olmo3": 2,
    "ministral": 2,
    "llama_unused_window": 2,  # a sliding_window key that Llama's own mask never applies
    "biogpt": None,  # masks built without position_ids: packed documents attend to each other, as in one process
    "afmoe": 2,
    "granitemoeshared": 2,  # the MLP's norm also feeds a shared MLP: tiled on its own, not fused into the MLP
}
# PhiMoE's router samples (Gumbel) in train mode: two runs never route alike, so it is compared in eval only.
EVAL_ONLY = {"phimoe_window"}


def parity_cases(layout, prefix: str, seq_len: int, modes: tuple[str, ...]) -> dict:
    """One parity case per architecture and mode; an EVAL_ONLY architecture runs in eval whatever ``modes``."""
    P = functools.partial
    cases = {}
    for arch, kv in PARITY_ARCHS.items():
        batch = make_batch(2, seq_len, packed=(seq_len - 9, 9))
        for mode in ("eval",) if arch in EVAL_ONLY else modes:
            train = mode == "train"
            cases[f"{prefix}_{arch}_{mode}"] = P(check_parity, layout, arch, kv_heads=kv, batch=batch, train=train)
    return cases


def batch_differs_in(layout, key: str) -> None:
    """Same input_ids on both ranks; only ``key`` differs on sp_rank 1: caught by shard_batch on every rank."""
    batch = make_batch(2, 16, packed=(7, 9), pad="right")
    if layout.sp_rank == 1:
        batch[key] = batch[key].clone()
        batch[key][1, 3] += 1 if key != "labels" else 5
    raises_everywhere(lambda: U.shard_batch(batch, layout), "hold different batches", key)


def paired_edits(layout) -> None:
    """sp_rank 1's input_ids differ by +1 and -1 at two tokens 65521 apart (they cancelled in the old fingerprint)."""
    batch = make_batch(1, 65536)
    batch["input_ids"][0, [3, 3 + 65521]] = 10
    if layout.sp_rank == 1:
        batch["input_ids"][0, [3, 3 + 65521]] += torch.tensor([1, -1])
    raises_everywhere(lambda: U.shard_batch(batch, layout), "hold different batches", "input_ids")


def bad_id_in_shard_batch(layout, key: str, value: int) -> None:
    """An id outside the vocabulary on sp_rank 1 only: every rank raises naming the id and the vocab size."""
    batch = make_batch(1, 16)
    if layout.sp_rank == 1:
        batch[key][0, 5] = value
    raises_everywhere(lambda: U.shard_batch(batch, layout, vocab_size=VOCAB), str(value), str(VOCAB), key)


def bad_id_in_forward(layout, key: str) -> None:
    """An out-of-vocabulary token (or label given to the model) on sp_rank 1 only, no vocab_size given to
    shard_batch: the model's agreement step raises on every rank before the first all-to-all (no hang)."""
    model = U.parallelize(build("llama"), layout)
    shard = U.shard_batch(make_batch(1, 16), layout)
    if layout.sp_rank == 1:
        shard[key] = shard[key].clone()
        shard[key][0, 2] = VOCAB + 7
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "labels")}
    raises_everywhere(lambda: model(**inputs), str(VOCAB + 7), str(VOCAB), "sp_rank 1")


def bad_label_in_plain_loss(layout) -> None:
    """An out-of-vocabulary label on sp_rank 1 only, plain loss (no tiled loss, no vocab_size given to shard_batch):
    the labels never reach the model's agreement; every rank raises from the loss's own all-reduce instead of
    sp_rank 1 raising IndexError while sp_rank 0 waits."""
    model = U.parallelize(build("llama"), layout)
    shard = U.shard_batch(make_batch(1, 16), layout)
    if layout.sp_rank == 1:
        shard["shift_labels"] = shard["shift_labels"].clone()
        shard["shift_labels"][0, 2] = VOCAB + 7
    needle = f"id {VOCAB + 7}" if layout.sp_rank == 1 else "1 target id(s) of this step"
    raises_everywhere(lambda: U.causal_lm_loss(model, shard, layout), needle, f"vocabulary of {VOCAB} logits")


def float_input_ids(layout) -> None:
    """Float input_ids: a ValueError (not a raw embedding error), on every rank, from shard_batch and the model."""
    batch = make_batch(1, 16)
    batch["input_ids"] = batch["input_ids"].float()
    raises_everywhere(lambda: U.shard_batch(batch, layout), "integer token ids", "float32")
    model = U.parallelize(build("llama"), layout)
    shard = U.shard_batch(make_batch(1, 16), layout)
    ids = shard["input_ids"].float() if layout.sp_rank == 0 else shard["input_ids"]
    needle = "integer token ids" if layout.sp_rank == 0 else "sp_rank(s) [0] of this sequence-parallel group rejected"
    raises_everywhere(lambda: model(input_ids=ids, position_ids=shard["position_ids"]), needle)


def own_mask_refused(layout) -> None:
    """Doge passes a dynamic mask of its own to the attention function: every rank refuses at the first layer."""
    model = U.parallelize(build_generic("doge"), layout)
    shard = U.shard_batch(make_batch(1, 16), layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
    raises_everywhere(lambda: model(**inputs), "DogeAttention passes its own attention mask")


def left_padding(layout, arch: str) -> None:
    """Left padding: OPT derives its positions from the mask, so shard_batch's 0, 1, ... are refused on every rank
    and the model's own positions are exact; BioGPT numbers tokens 0, 1, ... itself: exact as it is."""
    batch = make_batch(2, 24, pad="left", pad_lengths=(0, 7))
    if arch == "biogpt":
        return check_parity(layout, arch, batch=batch)
    model = U.parallelize(build(arch), layout)
    shard = U.shard_batch(batch, layout)
    raises_everywhere(lambda: U.causal_lm_loss(model, shard, layout), "OPTDecoder derives position ids", "row 1")
    mask = batch["attention_mask"]
    check_parity(layout, arch, batch=batch, sp_batch={**batch, "position_ids": mask.cumsum(-1) * mask - 1})


def zero_pad_embedding(layout, seq_len: int) -> None:
    """Gemma3n: right pads (the user's and shard_batch's) that hold the embedding's padding_idx (a zero row) get a
    zero attention output under Ulysses, so their hidden column stays zero and AltUp's ``mean(x**2) ** 0.5`` made
    every gradient NaN; exact (and finite) now, as in one process. Row 1's pads hold the pad id, as a tokenizer's."""
    model = build_generic("gemma3n_text", num_kv_shared_layers=0).train()
    batch = make_batch(2, seq_len, pad="right", pad_lengths=(0, 5))
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, model.config.pad_token_id)
    assert model.get_input_embeddings().weight[model.config.pad_token_id].abs().max() == 0
    ref_loss, ref_grads = reference(model, batch)
    loss, grads, _ = sequence_parallel(model, batch, layout)
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads)


def ids_numbered_positions(layout) -> None:
    """RoBERTa numbers tokens from their ids when given no position_ids (padding_idx + 1 + the count of non-pad
    tokens): shard_batch's 0, 1, ... (silently different before) are refused on every rank, and the model's own
    numbering is exact. Token ids avoid the pad id (one inside a row would repeat a position: a second document)."""
    batch = make_batch(2, 23, pad="right", pad_lengths=(0, 7))
    batch["input_ids"] = batch["input_ids"] % (VOCAB - 1) + 1
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model = U.parallelize(build("roberta"), layout)
    shard = U.shard_batch(batch, layout)
    raises_everywhere(lambda: U.causal_lm_loss(model, shard, layout), "RobertaEmbeddings numbers the tokens", "row 0")
    own = model.roberta.embeddings.create_position_ids_from_input_ids(batch["input_ids"], model.config.pad_token_id)
    check_parity(layout, "roberta", batch=batch, sp_batch={**batch, "position_ids": own})


def unshifted_own_loss(layout) -> None:
    """Whisper's decoder scores token t's logits against labels[t] (its labels come shifted already), and its
    config's num_attention_heads are its encoder's (2; its decoder has 4): shard_batch's shifted labels are refused
    on every rank (silently different before), the targets as the model reads them (shift_labels=labels) are
    exact, at sp=4 too (the config's 2 heads were refused there)."""
    batch = make_batch(2, 24, pad="right", pad_lengths=(0, 5))
    model = U.parallelize(build("whisper"), layout)
    shard = U.shard_batch(batch, layout)
    raises_everywhere(lambda: U.causal_lm_loss(model, shard, layout), "WhisperForCausalLM's own loss", "shift_labels")
    targets = {**{k: v for k, v in batch.items() if k != "labels"}, "shift_labels": batch["labels"]}
    check_parity(layout, "whisper", batch=batch, sp_batch=targets)


def per_layer_kv_heads(layout, seq_len: int) -> None:
    """Gemma-4 whose full-attention layer holds 1 kv head (num_global_key_value_heads, k = v) and its sliding one 2:
    reading the config's num_key_value_heads raises, and parallelize crashed on it (AmbiguousGlobalPerLayerAttribute
    Error); exact now, each layer's kv heads checked against the layout, and head_chunks=2 refused on every rank."""
    check_parity(layout, "gemma4_per_layer_kv", kv_heads=2, batch=make_batch(2, seq_len, packed=(seq_len - 9, 9)))
    model = build("gemma4_per_layer_kv", kv_heads=2)
    raises_everywhere(lambda: U.parallelize(model, layout, head_chunks=2), "different numbers of kv heads [1, 2]")


def _own_masks_one_generator(layout, mask: torch.Tensor, state: torch.Tensor, where: str) -> None:
    """The SP ranks drew different dropout masks ``mask``, and left torch's global generator in one ``state``."""
    import torch.distributed as dist

    masks = [torch.empty_like(mask) for _ in range(layout.sp)]
    dist.all_gather(masks, mask, group=layout.sp_group)
    assert not torch.equal(masks[0], masks[1]), f"both sp ranks drew the same dropout masks {where}"
    states = [torch.empty_like(state) for _ in range(layout.sp)]
    dist.all_gather(states, state, group=layout.sp_group)
    assert torch.equal(states[0], states[1]), "the global generator differs across the SP group"


def dropout_streams(layout) -> None:
    """Each SP rank draws its own dropout masks (they used to repeat: same generator state, same shapes); the run
    is deterministic, the global generator stays alike on every rank, and activation checkpointing recomputes
    the masks it drew (same loss and gradients as without it)."""

    def step(checkpointing: bool):
        model = U.parallelize(build_generic("gpt2", embd_pdrop=0.5, resid_pdrop=0.3, attn_pdrop=0.3), layout)
        if checkpointing:
            U.enable_activation_checkpointing(model, "checkpoint")
        masks = []
        model.transformer.drop.register_forward_hook(lambda m, i, out: masks.append(out == 0))
        torch.manual_seed(7)
        loss = U.causal_lm_loss(model.train(), U.shard_batch(make_batch(1, 32), layout), layout)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return loss.detach(), masks[0], grads, torch.get_rng_state()

    loss, mask, grads, state = step(False)
    again = step(False)
    torch.testing.assert_close(again[0], loss, rtol=0, atol=0)
    assert torch.equal(again[1], mask)
    _own_masks_one_generator(layout, mask, state, "in the decoder")
    recomputed = step(True)
    torch.testing.assert_close(recomputed[0], loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed[2][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def head_dropout_streams(layout) -> None:
    """LoRA with dropout on lm_head (outside the decoder): each SP rank draws its own masks there too (they repeated:
    the head ran on the generator state every rank shares), the plain and the tiled loss draw the same ones (same
    loss and gradients), and the global generator stays alike on every rank."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=2, target_modules=["lm_head"], lora_dropout=0.5, init_lora_weights=False)
    base = get_peft_model(build("llama", kv_heads=2), config)

    def step(tiled: bool):
        model = U.parallelize(copy.deepcopy(base), layout)
        if tiled:
            U.enable_tiled_loss(model, chunk_tokens=5)
        masks = []
        hook = lambda m, args, out: masks.append(out == 0)  # noqa: E731
        model.base_model.model.lm_head.lora_dropout["default"].register_forward_hook(hook)
        torch.manual_seed(7)
        loss = U.causal_lm_loss(model.train(), U.shard_batch(make_batch(1, 32), layout), layout)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), masks[-1], grads, torch.get_rng_state()

    loss, mask, grads, state = step(False)
    _own_masks_one_generator(layout, mask, state, "on lm_head")
    tiled = step(True)
    assert torch.equal(tiled[1], mask) and torch.equal(tiled[3], state)
    torch.testing.assert_close(tiled[0], loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == tiled[2].keys() and any("lm_head.lora_A" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def generator_untouched_without_dropout(layout) -> None:
    """A training step of a model without dropout (every memory feature on, head chunks, LoRA without dropout)
    leaves torch's global generator where one process leaves it: untouched. It used to draw a seed for the dropout
    streams every forward, so what draws from it later (transformers' group_by_length sampler) drew otherwise."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama", kv_heads=2), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = U.parallelize(model, layout, head_chunks=2)
    U.apply_features(model, U.Features(mlp_chunk_tokens=4), "cpu")
    torch.manual_seed(5)
    before = torch.get_rng_state()
    U.causal_lm_loss(model.train(), U.shard_batch(make_batch(2, 23, pad="right"), layout), layout).backward()
    assert torch.equal(torch.get_rng_state(), before), "a step without dropout moved the global generator"


def with_router_aux(arch: str, coef: float = 0.5):
    """``arch`` (2 kv heads) collecting router logits for its load-balancing loss, weighted ``coef``."""
    return router_aux_on(build(arch, kv_heads=2), coef)


def router_aux_parity(
    layout, arch: str, *, tiled: bool, batch, wrapper: str = "none", layer: str | None = None
) -> None:
    """Loss (cross-entropy + coef x load-balancing loss) and every gradient against one process on the full batch of
    all dp replicas' rows, the model's own loss; under SP via causal_lm_loss, with or without the tiled loss;
    ``wrapper``: "ddp" or "fsdp2" (fully_shard, whose class swap hides the model's module) after parallelize;
    ``layer``: the tiled MLP and norms (chunks of 5 tokens: the router logits recorded whole, with gradient) with
    activation checkpointing ``layer`` ("none", "checkpoint", "offload")."""
    model = with_router_aux(arch)
    ref_loss, ref_grads = reference(model, batch)
    par = U.parallelize(copy.deepcopy(model), layout)
    if tiled:
        U.enable_tiled_loss(par, chunk_tokens=5)
    if layer is not None:
        U.enable_tiled_mlp(par, chunk_tokens=5)
        U.enable_tiled_norms(par, chunk_tokens=5)
        U.enable_activation_checkpointing(par, layer)
    wrapped = par if wrapper == "none" else wrap(par, wrapper)
    mine = dp_share(batch, layout)
    loss = U.causal_lm_loss(wrapped, U.shard_batch(mine, layout), layout)
    loss.backward()
    if wrapper == "none":
        U.sync_gradients(par, layout)
    assert_loss_and_grads(loss, {n: full_grad(p) for n, p in par.named_parameters()}, ref_loss, ref_grads)


def router_aux_own_loss_refused(layout) -> None:
    """Under SP the model's own loss would add a load-balancing loss of one shard: refused on every rank."""
    model = U.parallelize(with_router_aux("mixtral"), layout)
    shard = U.shard_batch(make_batch(1, 16), layout)
    inputs = {k: shard[k] for k in ("input_ids", "position_ids", "labels")}
    raises_everywhere(lambda: model(**inputs), "output_router_logits=True", "ulysses_sp.causal_lm_loss")


def router_aux_cases(layout, prefix: str, batch, tiled: tuple[bool, ...]) -> dict:
    P = functools.partial
    return {
        f"{prefix}_{arch}_router_aux{'_tiled' if t else ''}": P(router_aux_parity, layout, arch, tiled=t, batch=batch)
        for arch in ("mixtral", "qwen3_moe", "qwen2_moe_window")
        for t in tiled
    }


def deepcopy_parallelized(layout) -> None:
    """copy.deepcopy of a parallelized model (EMA / reference copies): the copy runs SP on the same layout with
    the same loss and gradients, has its own hooks and counters, and unparallelizing it leaves the original."""
    model = U.parallelize(build("llama_dynamic", kv_heads=2), layout)
    twin = copy.deepcopy(model)
    assert U.ulysses_context(twin) is not U.ulysses_context(model)
    assert U.ulysses_context(twin).layout is layout
    shard = U.shard_batch(make_batch(2, 24, packed=(15, 9)), layout)
    losses, grads = [], []
    for m in (model, twin):
        logits = m(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).logits
        loss = U.sequence_parallel_cross_entropy(logits, shard["shift_labels"], layout)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0)
    assert U.ulysses_context(twin).stats.calls["all_to_all"] == U.ulysses_context(model).stats.calls["all_to_all"]
    U.unparallelize(twin)
    assert twin.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation.startswith("ulysses_")
    with torch.no_grad():  # the original still runs under SP (its hooks were not removed with the copy's)
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])


def pickle_parallelized(layout) -> None:
    """torch.save / pickle of a parallelized model (its memory features on, DDP-wrapped too) is one TypeError naming
    what to save instead; the weights save, and so does a model once unparallelized."""
    model = U.parallelize(build("llama", kv_heads=2), layout)
    U.apply_features(model, U.Features(), "cpu")
    saves = {
        "torch.save": lambda: torch.save(model, io.BytesIO()),
        "pickle": lambda: pickle.dumps(model),
        "ddp": lambda: torch.save(torch.nn.parallel.DistributedDataParallel(model), io.BytesIO()),
        "layout": lambda: pickle.dumps(layout),
    }
    for name, save in saves.items():
        try:
            save()
        except TypeError as err:
            assert "cannot pickle ParallelLayout(dp=1, sp=2" in str(err), (name, str(err))
            assert all(fix in str(err) for fix in ("model.state_dict()", "save_pretrained", "unparallelize")), err
        else:
            raise AssertionError(f"{name}: no TypeError")
    assert copy.deepcopy(layout) is layout and copy.copy(layout).sp_group is layout.sp_group
    weights = io.BytesIO()
    torch.save(model.state_dict(), weights)
    plain = U.unparallelize(U.parallelize(build("llama", kv_heads=2), layout))
    whole = io.BytesIO()
    torch.save(plain, whole)
    loaded = torch.load(io.BytesIO(weights.getvalue())), torch.load(io.BytesIO(whole.getvalue()), weights_only=False)
    for want, got in ((model.state_dict(), loaded[0]), (plain.state_dict(), loaded[1].state_dict())):
        assert want.keys() == got.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0)


def world2_cases(sp2) -> dict:
    P = functools.partial
    return {
        **parity_cases(sp2, "sp2", 24, ("eval", "train")),
        # 23 tokens: the padding shard_batch adds must not raise the largest position dynamic RoPE reads
        "sp2_llama_dynamic_padded_to_sp": P(check_parity, sp2, "llama_dynamic", kv_heads=2, batch=make_batch(2, 23)),
        **{f"batch_differs_in_{k}": P(batch_differs_in, sp2, k) for k in ("position_ids", "labels", "attention_mask")},
        "batch_differs_by_paired_edits": P(paired_edits, sp2),
        "bad_token_id_in_shard_batch": P(bad_id_in_shard_batch, sp2, "input_ids", VOCAB + 3),
        "negative_token_id_in_shard_batch": P(bad_id_in_shard_batch, sp2, "input_ids", -2),
        "bad_label_id_in_shard_batch": P(bad_id_in_shard_batch, sp2, "labels", VOCAB),
        "bad_token_id_in_forward": P(bad_id_in_forward, sp2, "input_ids"),
        "bad_label_id_in_forward": P(bad_id_in_forward, sp2, "labels"),
        "bad_label_id_in_plain_loss": P(bad_label_in_plain_loss, sp2),
        "float_input_ids": P(float_input_ids, sp2),
        "deepcopy_parallelized": P(deepcopy_parallelized, sp2),
        "pickle_parallelized": P(pickle_parallelized, sp2),
        "own_mask_refused": P(own_mask_refused, sp2),
        **router_aux_cases(sp2, "sp2", make_batch(2, 23, pad="right"), (False, True)),
        **{
            f"sp2_mixtral_router_aux{'_tiled' if t else ''}_fsdp2": P(
                router_aux_parity, sp2, "mixtral", tiled=t, batch=make_batch(2, 23, pad="right"), wrapper="fsdp2"
            )
            for t in (False, True)
        },
        "sp2_qwen3_moe_router_aux_tiled_layer_checkpoint": P(
            router_aux_parity, sp2, "qwen3_moe", tiled=False, batch=make_batch(2, 23, pad="right"), layer="checkpoint"
        ),
        "router_aux_own_loss_refused": P(router_aux_own_loss_refused, sp2),
        "dropout_streams_per_sp_rank": P(dropout_streams, sp2),
        "generator_untouched_without_dropout": P(generator_untouched_without_dropout, sp2),
        "head_dropout_streams_per_sp_rank": P(head_dropout_streams, sp2),
        "opt_left_padding": P(left_padding, sp2, "opt"),
        "biogpt_left_padding": P(left_padding, sp2, "biogpt"),
        "sp2_roberta_ids_numbered_positions": P(ids_numbered_positions, sp2),
        "sp2_whisper_unshifted_own_loss": P(unshifted_own_loss, sp2),
        "sp2_gemma3n_zero_pad_embedding": P(zero_pad_embedding, sp2, 23),  # the user's right pads and the tail
        "sp2_gemma4_per_layer_kv_heads": P(per_layer_kv_heads, sp2, 24),
        **zoo_cases(sp2),
    }


def world4_cases(sp4, dp2sp2) -> dict:
    P = functools.partial
    return {
        **parity_cases(sp4, "sp4", 26, ("train",)),  # train mode: forward and backward as in training
        "sp4_roberta_ids_numbered_positions": P(ids_numbered_positions, sp4),
        "sp4_whisper_unshifted_own_loss": P(unshifted_own_loss, sp4),
        "sp4_gemma3n_zero_pad_embedding": P(zero_pad_embedding, sp4, 26),
        "sp4_gemma4_per_layer_kv_heads": P(per_layer_kv_heads, sp4, 26),  # 1 kv head, 2 and 4 ranks
        "dp2_sp2_gemma3n_zero_pad_embedding": P(zero_pad_embedding, dp2sp2, 23),
        **router_aux_cases(sp4, "sp4", make_batch(2, 26, packed=(9, 17)), (True,)),
        **router_aux_cases(dp2sp2, "dp2_sp2", make_batch(4, 22, pad="left"), (False,)),
        "dp2_sp2_qwen3_moe_router_aux_ddp": P(
            router_aux_parity, dp2sp2, "qwen3_moe", tiled=False, batch=make_batch(4, 22, pad="left"), wrapper="ddp"
        ),
        "dp2_sp2_qwen3_moe_router_aux_tiled_fsdp2": P(
            router_aux_parity, dp2sp2, "qwen3_moe", tiled=True, batch=make_batch(4, 22, pad="left"), wrapper="fsdp2"
        ),
        "dp2_sp2_mixtral_router_aux_tiled_layer_offload_fsdp2": P(
            router_aux_parity,
            dp2sp2,
            "mixtral",
            tiled=True,
            batch=make_batch(4, 22, packed=(9, 13)),
            wrapper="fsdp2",
            layer="offload",
        ),
    }


def world2() -> dict[str, str]:
    return run_cases(world2_cases(U.ParallelLayout.from_env(sp=2)))


def world4() -> dict[str, str]:
    return run_cases(world4_cases(U.ParallelLayout.from_env(sp=4), U.ParallelLayout.from_env(sp=2)))


_NAMES = U.ParallelLayout.rank_view(1, 0)  # case names only: no process group needed
WORLD2 = sorted(world2_cases(_NAMES))
WORLD4 = sorted(world4_cases(_NAMES, _NAMES))
