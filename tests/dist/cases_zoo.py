"""Multi-rank cases from a sweep of every transformers causal-LM model_type (tiny generic configs, sp=2, the
library loop: shard_batch + causal_lm_loss, with the default memory features and head chunks), run in the WORLD2 job
of tests/dist/test_architectures.py: what the sweep found refused with a misleading reason or not at all, one
representative per mechanism. The full sweep is too slow for CI; its table is in the report of branch ``zoo``.
"""

from __future__ import annotations

import copy
import functools

import torch

import ulysses_sp as U
from tests.dist.cases_core import raises_everywhere, reference
from tests.helpers.models import build_generic, make_batch
from tests.helpers.parity import assert_loss_and_grads

# LongCat-Flash's MLA (q through a low-rank q_a_proj) and MoE, tiny
_LONGCAT = dict(
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, head_dim=4,
    num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
)  # fmt: skip
# Nemotron-H with attention, MLP and MoE blocks only (no Mamba): its layer types 'mlp' / 'moe' mix no tokens
_NEMOTRON_H = dict(
    layers_block_type=["full_attention", "mlp", "full_attention", "moe"], n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
)  # fmt: skip


def library_loop_parity(layout, model_type: str, batch, *, extra=None, features: bool = False, **kwargs) -> None:
    """The README's loop on ``build_generic(model_type, **extra)`` (parallelize, apply_features with chunks of 5 / 7
    tokens when ``features``, shard_batch, causal_lm_loss, sync_gradients): loss and every gradient of one process
    on the full batch, the model's own loss."""
    model = build_generic(model_type, **(extra or {}))
    ref_loss, ref_grads = reference(model, batch)
    par = U.parallelize(copy.deepcopy(model), layout, **kwargs)
    if features:
        U.apply_features(par, U.Features(mlp_chunk_tokens=5, loss_chunk_tokens=7), "cpu")
    loss = U.causal_lm_loss(par, U.shard_batch(batch, layout), layout)
    loss.backward()
    U.sync_gradients(par, layout)
    grads = {name: param.grad for name, param in par.named_parameters()}  # (a router's bias: reached by none)
    assert_loss_and_grads(loss, grads, ref_loss, ref_grads, zeros_for_none=True)


def head_chunks_name_the_part(layout, model_type: str, needle: str, at_parallelize: bool) -> None:
    """head_chunks=2 on an attention module the chunks cannot split: the ValueError names the part that prevents it
    (it read 'the chunked forward failed on a probe (RuntimeError: The size of tensor a (32) must match ...)' for
    OLMo-2's whole-width q_norm, and 'its projections do not split by heads' for BitNet's attn_sub_norm); a
    q/k norm over all heads is refused at parallelize, before any forward."""
    model = build_generic(model_type)
    if at_parallelize:
        return raises_everywhere(lambda: U.parallelize(model, layout, head_chunks=2), needle, "head_chunks=1")
    par = U.parallelize(model, layout, head_chunks=2)
    shard = U.shard_batch(make_batch(2, 24, packed=(15, 9)), layout)
    raises_everywhere(lambda: U.causal_lm_loss(par, shard, layout), needle, "head_chunks=1")


def non_causal_attention(layout) -> None:
    """A BERT-style LM head model built without is_decoder=True attends both ways: refused at the first forward on
    every rank naming the module and is_decoder=True (the message said only 'causal (decoder) attention only');
    with is_decoder=True, right-padded rows are exact."""
    batch = make_batch(2, 23, pad="right", pad_lengths=(0, 5))
    par = U.parallelize(build_generic("bert"), layout)
    shard = U.shard_batch(batch, layout)
    raises_everywhere(
        lambda: U.causal_lm_loss(par, shard, layout), "BertSelfAttention runs bidirectional", "is_decoder=True"
    )
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    library_loop_parity(layout, "bert", batch, extra=dict(is_decoder=True, **no_dropout))


def token_wise_layer_types(layout) -> None:
    """Nemotron-H's layer types 'mlp' and 'moe' mix no tokens: a model of attention, MLP and MoE blocks is exact
    (it was refused as 'layer types [mlp, moe] are not supported'); its Mamba blocks ('linear_attention') are
    refused naming that type alone, and why."""
    library_loop_parity(layout, "nemotron_h", make_batch(2, 24, packed=(15, 9)), extra=_NEMOTRON_H)
    hybrid = build_generic("nemotron_h", **{**_NEMOTRON_H, "layers_block_type": ["linear_attention", "mlp"]})
    raises_everywhere(
        lambda: U.parallelize(hybrid, layout),
        "layer types ['linear_attention'] are",
        "each rank would see its own shard",
    )


def gradients_on_some_ranks(layout) -> None:
    """Two experts of one shape, each reached on one rank only (no token of the other's shard picked it): the
    experts' averaged gradients are each one rank's / 2. sync_gradients reduced only the gradients a rank had, so
    rank 0's expert A and rank 1's expert B were summed into both, silently (LongCat-Flash, whose tokens may all go
    to its zero experts, gave buckets of other sizes: gloo aborted the process, 'Received data size doesn't match')."""
    experts = torch.nn.ModuleList([torch.nn.Linear(3, 2, bias=False) for _ in range(2)])
    mine = experts[layout.sp_rank]
    (mine.weight * (layout.sp_rank + 1)).sum().backward()
    U.sync_gradients(experts, layout)
    for rank, expert in enumerate(experts):
        torch.testing.assert_close(expert.weight.grad, torch.full((2, 3), (rank + 1) / 2), rtol=0, atol=0)
    lone = torch.nn.Linear(2, 2)  # reached on no rank: no gradient made up
    U.sync_gradients(lone, layout)
    assert lone.weight.grad is None


def zoo_cases(sp2) -> dict:
    P = functools.partial
    packed = make_batch(2, 24, packed=(15, 9))
    chunk_refusals = {
        "olmo2": ("its q_norm normalises 32 features at once (4 heads x 8", True),
        "bitnet": ("differ on a probe; it also computes with ['attn_sub_norm']", False),
        "diffllama": ("it also computes with ['lambda_k1', 'lambda_k2', 'lambda_q1', 'lambda_q2']", False),
    }
    return {
        "sp2_sync_gradients_reached_on_some_ranks": P(gradients_on_some_ranks, sp2),
        # a LongCat-Flash layer whose tokens all go to its zero experts leaves its experts without a gradient there
        "sp2_longcat_flash_experts_reached_on_one_rank": P(
            library_loop_parity, sp2, "longcat_flash", packed, extra=_LONGCAT
        ),
        # LongCat-Flash keeps its norms in ModuleLists: the default features refused it ('has no norm ... to tile')
        "sp2_longcat_flash_features_norms_in_lists": P(
            library_loop_parity, sp2, "longcat_flash", packed, extra=_LONGCAT, features=True
        ),
        # Fuyu embeds through its text decoder's get_input_embeddings: the tiled loss's probe stand-in lacked it
        "sp2_fuyu_tiled_loss": P(
            library_loop_parity, sp2, "fuyu", make_batch(2, 23, pad="right", pad_lengths=(0, 5)), features=True
        ),
        "sp2_nemotron_h_token_wise_layer_types": P(token_wise_layer_types, sp2),
        **{
            f"sp2_head_chunks_name_{t}_part": P(head_chunks_name_the_part, sp2, t, *v)
            for t, v in chunk_refusals.items()
        },
        "sp2_bert_non_causal_refused_decoder_exact": P(non_causal_attention, sp2),
    }
