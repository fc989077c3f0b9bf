"""Tiny random-weight configs of real transformers architectures, and batches to feed them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 128


def _common(heads: int, kv_heads: int, head_dim: int = 8) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def build(
    arch: str,
    *,
    heads: int = 4,
    kv_heads: int | None = None,
    seed: int = 0,
    attn: str = "sdpa",
    window: int = 6,
    head_dim: int = 8,
):
    """A tiny model of ``arch`` with deterministic random weights (same on every rank for the same seed)."""
    kv_heads = heads if kv_heads is None else kv_heads
    common = _common(heads, kv_heads, head_dim)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation=attn))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window, attn_implementation=attn))
    elif arch == "qwen2":  # layer 0 full attention, layer 1 sliding window
        cfg = Qwen2Config(
            **common, use_sliding_window=True, sliding_window=window, max_window_layers=1, attn_implementation=attn
        )
        model = Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, attn_implementation=attn))
    elif arch == "gemma2":  # attention logit softcapping: eager only in transformers and here
        cfg = Gemma2Config(
            **common,
            sliding_window=window,
            attn_implementation=attn,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma2ForCausalLM(cfg)
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(
            **common,
            sliding_window=window,
            attn_implementation=attn,
            layer_types=["sliding_attention", "full_attention"],
        )
        model = Gemma3ForCausalLM(cfg)
    elif arch in MORE_ARCHS:
        model = MORE_ARCHS[arch](common, window, attn)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    return model.float()


def _more_archs() -> dict:
    """More decoder families: sliding windows (Phi-3, Cohere2), QK-norm after projection (OLMo-2), partial
    rotary and fused qkv (GPT-NeoX)."""
    import transformers as t

    def quiet(common):  # these configs default to special-token ids outside the tiny vocabulary
        return {**common, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}

    return {
        "phi3": lambda c, w, a: t.Phi3ForCausalLM(t.Phi3Config(**quiet(c), sliding_window=w, attn_implementation=a)),
        "olmo2": lambda c, w, a: t.Olmo2ForCausalLM(t.Olmo2Config(**quiet(c), attn_implementation=a)),
        "cohere2": lambda c, w, a: t.Cohere2ForCausalLM(
            t.Cohere2Config(
                **quiet(c), sliding_window=w, layer_types=["sliding_attention", "full_attention"], attn_implementation=a
            )
        ),
        "gpt_neox": lambda c, w, a: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(
                vocab_size=c["vocab_size"],
                hidden_size=c["hidden_size"],
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=c["num_attention_heads"],
                rotary_pct=0.5,
                bos_token_id=0,
                eos_token_id=1,
                attn_implementation=a,
            )
        ),
    }


def _model_family_archs() -> dict:
    """Architectures with a twist: length-dependent RoPE (dynamic, longrope, yarn), windows applied only through
    the mask (Qwen2-MoE, PhiMoE), MLA with a v head dim != the qk head dim (DeepSeek-V2/V3), a CausalLM that
    calls its decoder directly (OPT), and the families that already were exact (kept exact by the suite)."""
    import transformers as t

    def cfg(common, **extra):  # special-token ids inside the tiny vocabulary, no dropout
        return {**common, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **extra}

    def dims(common):
        return {k: common[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")}

    def mla(c, v_head_dim, cls=None, attn="sdpa"):
        cls = cls or (t.DeepseekV3Config, t.DeepseekV3ForCausalLM)
        extra = dict(
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=v_head_dim,
            head_dim=4,  # the rotary part of the qk head dim
            num_key_value_heads=c["num_attention_heads"],  # MLA: k and v have every head
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
        )
        if cls[0] is t.DeepseekV3Config:
            extra.update(n_group=1, topk_group=1, n_shared_experts=1)
        else:
            extra.update(n_group=1, topk_group=1, n_shared_experts=1, topk_method="greedy")
        return cls[1](cls[0](**{**cfg(c), **extra}, attn_implementation=attn))

    # The test rows hold documents longer than 12 tokens, so the long/dynamic frequencies are the ones in use
    # for the whole row, while the first shard alone (positions < 12) would pick the short ones.
    short = 12
    return {
        "llama_dynamic": lambda c, w, a: t.LlamaForCausalLM(
            t.LlamaConfig(
                **{**c, "max_position_embeddings": short},
                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                attn_implementation=a,
            )
        ),
        "phi3_longrope": lambda c, w, a: t.Phi3ForCausalLM(
            t.Phi3Config(
                **cfg({**c, "max_position_embeddings": 4 * short}),
                original_max_position_embeddings=short,
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 10000.0,
                    "short_factor": [1.0 + 0.1 * i for i in range(c["head_dim"] // 2)],
                    "long_factor": [2.0 + 0.5 * i for i in range(c["head_dim"] // 2)],
                    "original_max_position_embeddings": short,
                },
                attn_implementation=a,
            )
        ),
        "llama3_yarn": lambda c, w, a: t.LlamaForCausalLM(
            t.LlamaConfig(
                **{**c, "max_position_embeddings": 4 * short},
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": short,
                },
                attn_implementation=a,
            )
        ),
        "qwen2_moe_window": lambda c, w, a: t.Qwen2MoeForCausalLM(
            t.Qwen2MoeConfig(
                **cfg(c),
                use_sliding_window=True,
                sliding_window=w,
                max_window_layers=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                num_experts=4,
                num_experts_per_tok=2,
                attn_implementation=a,
            )
        ),
        "phimoe_window": lambda c, w, a: t.PhimoeForCausalLM(
            t.PhimoeConfig(
                **cfg(c), sliding_window=w, num_local_experts=4, num_experts_per_tok=2, attn_implementation=a
            )
        ),
        "deepseek_v3_mla": lambda c, w, a: mla(c, 8, attn=a),
        "deepseek_v3_mla_v4": lambda c, w, a: mla(c, 4, attn=a),
        "deepseek_v2_mla_v4": lambda c, w, a: mla(c, 4, (t.DeepseekV2Config, t.DeepseekV2ForCausalLM), attn=a),
        "opt": lambda c, w, a: t.OPTForCausalLM(
            t.OPTConfig(
                **dims(c),
                ffn_dim=64,
                max_position_embeddings=64,
                dropout=0.0,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=0,
                word_embed_proj_dim=c["hidden_size"],
                attn_implementation=a,
            )
        ),
        "stablelm": lambda c, w, a: t.StableLmForCausalLM(t.StableLmConfig(**cfg(c), attn_implementation=a)),
        "granite": lambda c, w, a: t.GraniteForCausalLM(t.GraniteConfig(**cfg(c), attn_implementation=a)),
        "starcoder2": lambda c, w, a: t.Starcoder2ForCausalLM(
            t.Starcoder2Config(**cfg(c), sliding_window=w, residual_dropout=0.0, attn_implementation=a)
        ),
        "mixtral": lambda c, w, a: t.MixtralForCausalLM(
            t.MixtralConfig(
                **cfg(c), sliding_window=w, num_local_experts=4, num_experts_per_tok=2, attn_implementation=a
            )
        ),
        "qwen3_moe": lambda c, w, a: t.Qwen3MoeForCausalLM(
            t.Qwen3MoeConfig(
                **cfg(c), moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, attn_implementation=a
            )
        ),
        "smollm3": lambda c, w, a: t.SmolLM3ForCausalLM(t.SmolLM3Config(**cfg(c), attn_implementation=a)),
        "glm": lambda c, w, a: t.GlmForCausalLM(t.GlmConfig(**cfg(c), attn_implementation=a)),
        "glm4": lambda c, w, a: t.Glm4ForCausalLM(t.Glm4Config(**cfg(c), attn_implementation=a)),
        "phi": lambda c, w, a: t.PhiForCausalLM(
            t.PhiConfig(**cfg(c), resid_pdrop=0.0, embd_pdrop=0.0, attn_implementation=a)
        ),
        "exaone4": lambda c, w, a: t.Exaone4ForCausalLM(
            t.Exaone4Config(
                **cfg(c), sliding_window=w, layer_types=["sliding_attention", "full_attention"], attn_implementation=a
            )
        ),
        "olmo3": lambda c, w, a: t.Olmo3ForCausalLM(
            t.Olmo3Config(
                **cfg(c), sliding_window=w, layer_types=["sliding_attention", "full_attention"], attn_implementation=a
            )
        ),
        "ministral": lambda c, w, a: t.MinistralForCausalLM(
            t.MinistralConfig(
                **cfg(c), sliding_window=w, layer_types=["sliding_attention", "full_attention"], attn_implementation=a
            )
        ),
    }


MORE_ARCHS = {**_more_archs(), **_model_family_archs()}


def _from_config(model_type: str, common: dict, attn: str = "sdpa", **extra):
    """A causal LM of any transformers ``model_type`` from the common tiny fields plus ``extra`` config keys."""
    from transformers import AutoConfig, AutoModelForCausalLM

    generic = {**common, "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, **{**generic, **extra}), attn_implementation=attn
    )


MORE_ARCHS.update(
    {
        # a sliding_window key that Llama's own mask never applies
        "llama_unused_window": lambda c, w, a: LlamaForCausalLM(LlamaConfig(**c, sliding_window=w // 2)),
        # masks built without position_ids (one process lets packed documents see each other); no dropout
        "biogpt": lambda c, w, a: _from_config(
            "biogpt", c, a, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        ),
        "gpt2": lambda c, w, a: _from_config("gpt2", c, a, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        # the post-attention norm's output feeds the MoE and a shared MLP (not fused into the tiled MLP)
        "granitemoeshared": lambda c, w, a: _from_config(
            "granitemoeshared", c, a, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=16
        ),
        # its own loss does not shift the labels; its config's num_attention_heads are its encoder's (2), its
        # decoder's attention has decoder_attention_heads (4)
        "whisper": lambda c, w, a: _from_config(
            "whisper",
            {k: v for k, v in c.items() if k not in ("num_attention_heads", "num_key_value_heads")},
            a,
            encoder_attention_heads=2,
            decoder_attention_heads=4,
            d_model=c["hidden_size"],
            decoder_layers=2,
            encoder_layers=1,
            decoder_ffn_dim=64,
            encoder_ffn_dim=64,
            max_target_positions=64,
            dropout=0.0,
            decoder_start_token_id=0,
        ),
        # numbers tokens from their ids (padding_idx + 1 + ...) when given no position_ids; a causal decoder
        "roberta": lambda c, w, a: _from_config(
            "roberta", c, a, is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        ),
        # KV sharing: layer 2 reuses the k/v that layer 1 stores (layer 0 neither stores nor reuses)
        "gemma3n_kv_shared": lambda c, w, a: _from_config(
            "gemma3n_text",
            {**c, "num_hidden_layers": 3},
            a,
            layer_types=["full_attention"] * 3,
            num_kv_shared_layers=1,
            activation_sparsity_pattern=[0.0] * 3,
            vocab_size_per_layer_input=VOCAB,  # (its default: 262,144 x 256 per layer, GBs per rank)
            hidden_size_per_layer_input=8,
        ),
        # a heterogeneous config: the full-attention layer holds 1 kv head of width 16 (k = v), the sliding one the
        # config's kv heads of width 8; reading config.num_key_value_heads raises
        "gemma4_per_layer_kv": lambda c, w, a: _from_config(
            "gemma4_text",
            c,
            a,
            sliding_window=w,
            layer_types=["sliding_attention", "full_attention"],
            attention_k_eq_v=True,
            num_global_key_value_heads=1,
            global_head_dim=16,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
        ),
        "afmoe": lambda c, w, a: _from_config(
            "afmoe",
            c,
            a,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            num_dense_layers=1,
            sliding_window=w,
            layer_types=["sliding_attention", "full_attention"],
        ),
    }
)


def build_generic(model_type: str, *, seed: int = 0, attn: str = "sdpa", **extra):
    """A tiny causal LM of any transformers ``model_type`` from one generic config (as outside testers build
    ~1,300 of them): 4 heads, 2 kv heads, head dim 8, 2 layers; ``extra`` adds or overrides config keys."""
    torch.manual_seed(seed)
    return _from_config(model_type, _common(4, 2), attn, **extra).float()


def with_lora(model, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"), seed: int = 2, **config):
    """``model`` with PEFT LoRA adapters (r 4) on ``targets``, A and B both random (PEFT's default B is zeros,
    which would leave A's gradient zero); ``config``: more LoraConfig fields."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False, **config)
    return get_peft_model(model, lora)


class _ChunkMask(torch.nn.Module):
    """A LoRA input dropout drawing the mask the head chunks of a ``dp x sp`` run draw (see
    ulysses_sp.head_chunk_lora.InputDropout), on the full batch: dp rank ``d``'s rows and sp rank ``s``'s tokens
    (contiguous shards of ``ceil(n / sp)``, the last cut where shard_batch pads the sequence) get global rank
    ``d * sp + s``'s mask, ``seeds[d * sp + s]``, at their local positions."""

    def __init__(self, p: float, seeds: list[int], dp: int = 1, sp: int = 1) -> None:
        super().__init__()
        from ulysses_sp.head_chunk_lora import InputDropout

        assert len(seeds) == dp * sp
        self.dropouts, self.dp, self.sp = [InputDropout(p, s) for s in seeds], dp, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., n, w]: rows are every dimension before the tokens
        rows, n, columns = x[..., 0, 0].numel(), x.shape[-2], torch.arange(x.shape[-1], device=x.device)
        assert rows % self.dp == 0, rows
        shard = -(-n // self.sp)
        mask = torch.cat(
            [
                torch.cat(
                    [self.dropouts[d * self.sp + s].mask(rows // self.dp, 0, shard, columns) for s in range(self.sp)],
                    dim=1,
                )
                for d in range(self.dp)
            ]
        )[:, :n]  # [rows, n, w]
        return x * mask.view(x.shape).to(x.dtype)


def with_chunk_dropout(peft_model, targets: tuple[str, ...], p: float, seed: int, layout=None):
    """``peft_model`` (in place) with each LoRA dropout of ``targets`` replaced by the mask the head chunks draw
    when layer ``l``'s call seed is ``seed + l`` (patch ``HeadChunkedAttention.dropout_seed`` to match) on every
    rank of ``layout`` (None: one process; its shards must be contiguous, not a ring's zigzag)."""
    from ulysses_sp.head_chunk_lora import adapter_seed

    dp, sp = (1, 1) if layout is None else (layout.dp, layout.sp)
    assert layout is None or layout.ring == 1, "the ring's zigzag shards are not contiguous"
    for layer in peft_model.base_model.model.model.layers:
        for name in targets:
            proj = getattr(layer.self_attn, name, None)  # (an MLA without q_lora_rank has no q_b_proj)
            if proj is not None:
                call_seed = seed + layer.self_attn.layer_idx
                seeds = [adapter_seed(call_seed, name, 0, rank) for rank in range(dp * sp)]
                proj.lora_dropout["default"] = _ChunkMask(p, seeds, dp, sp)
    return peft_model


def router_aux_on(model, coef: float = 0.5):
    """``model`` (in place) collecting router logits, its load-balancing loss weighted ``coef``: 0.5 is large enough
    that an aux loss off by 1% shows in the loss (transformers' default, 1e-3, would hide it under rtol 1e-5)."""
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = coef
    return model


@contextlib.contextmanager
def dropout_seeds(seed: int) -> Iterator[None]:
    """Layer ``l``'s LoRA dropout call seed ``seed + l`` in the head chunks on this rank (the seed
    :func:`with_chunk_dropout` gives the reference's masks); outside it they draw a fresh seed per call."""
    from ulysses_sp.head_chunks import HeadChunkedAttention

    old = HeadChunkedAttention.dropout_seed
    HeadChunkedAttention.dropout_seed = lambda self: seed + self.module.layer_idx
    try:
        yield
    finally:
        HeadChunkedAttention.dropout_seed = old


def make_batch(
    batch: int,
    seq_len: int,
    *,
    seed: int = 1,
    packed: tuple[int, ...] | None = None,
    pad: str | None = None,
    pad_lengths: tuple[int, ...] = (0, 5),
) -> dict[str, torch.Tensor]:
    """Random tokens with labels; optionally packed documents (lengths per row) or right/left padding."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    out = {"input_ids": input_ids, "labels": input_ids.clone()}
    if packed is not None:
        assert sum(packed) == seq_len
        positions = torch.cat([torch.arange(n) for n in packed])
        out["position_ids"] = positions.unsqueeze(0).expand(batch, -1).clone()
    if pad is not None:
        mask = torch.ones(batch, seq_len, dtype=torch.long)
        for row, n in enumerate(pad_lengths[:batch]):
            if n:
                if pad == "right":
                    mask[row, seq_len - n :] = 0
                else:
                    mask[row, :n] = 0
        out["attention_mask"] = mask
        out["labels"] = out["labels"].masked_fill(mask == 0, -100)
    return out


def dp_share(batch: dict[str, torch.Tensor], layout) -> dict[str, torch.Tensor]:
    """This rank's rows of a full batch: its dp replica's equal share (as a dp-split sampler would give it)."""
    rows = batch["input_ids"].shape[0] // layout.dp
    return {k: v[layout.dp_rank * rows : (layout.dp_rank + 1) * rows] for k, v in batch.items()}


def loss_and_grads(model, batch: dict[str, torch.Tensor], layout=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and fp32 gradients (None: a parameter the step did not reach) of one forward + backward: the model's
    own loss (``layout`` None), or the SP loss of ``layout``'s shard of ``batch`` (ulysses_sp.shard_batch,
    sequence_parallel_cross_entropy)."""
    import ulysses_sp as U

    if layout is None:
        loss = model(**batch, use_cache=False).loss
    else:
        shard = U.shard_batch(batch, layout)
        inputs = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask") if k in shard}
        loss = U.sequence_parallel_cross_entropy(model(**inputs).logits, shard["shift_labels"], layout)
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.float() for n, p in model.named_parameters()}


def assert_as_close_as_one_process(model, batch, loss, grads, factor: float = 3.0, floor: float = 1e-4) -> None:
    """For a run of ``model`` (16-bit somewhere) on ``batch`` that gave ``loss`` and ``grads``: per tensor, its
    relative distance from the fp64 truth (``model`` in float64, one process) is at most ``factor`` times that of one
    process running ``model`` as it is, plus ``floor`` (rounding in another order may round otherwise, not worse)."""
    import copy

    truth_loss, truth = loss_and_grads(copy.deepcopy(model).double(), batch)
    ref_loss, ref = loss_and_grads(copy.deepcopy(model), batch)
    assert {n for n, g in grads.items() if g is not None} == {n for n, g in ref.items() if g is not None}

    def distance(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.double() - want.double()).norm() / want.double().norm())

    for name, got, one, want in [("loss", loss, ref_loss, truth_loss)] + [
        (n, grads[n], ref[n], truth[n]) for n in ref if ref[n] is not None
    ]:
        worst = factor * distance(one, want) + floor
        assert distance(got, want) <= worst, f"{name}: {distance(got, want):.2e} from the truth > {worst:.2e}"
