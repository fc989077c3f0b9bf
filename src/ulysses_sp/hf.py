"""Finding the parts of a Hugging Face model: the one module that knows where transformers keeps them.

Every feature that reaches into a model (Ulysses attention, the tiled loss and MLP, checkpointing, FSDP2
wrapping, the integrations) finds the transformers model, its decoder, layers, attention and MLP modules
through these functions, so a model family that keeps them elsewhere is taught here once.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # imported where a model is searched: the planner reads this module without transformers
    from transformers import PreTrainedModel

__all__ = [
    "MLP_NAMES",
    "attention_head_counts",
    "attention_modules",
    "decoder_layers",
    "decoder_module",
    "find_causal_lm",
    "find_pretrained",
    "first_argument",
    "head_counts",
    "in_mode",
    "layer_kv_heads",
    "layer_values",
    "learned_positions",
    "layer_mlp",
    "mlp_modules",
    "own_class",
    "refuse_prompt_learning",
    "refuse_unswitched_attention",
    "text_config",
]

# The attribute that holds a decoder layer's MLP, in the order tried (transformers' names for it).
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe")


def find_pretrained(model: nn.Module, caller: str = "parallelize") -> PreTrainedModel:
    """The model itself, or the transformers model inside a wrapper (PEFT, DDP, ...); TypeError otherwise."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(
        f"{caller} expects a transformers PreTrainedModel (or a wrapper around one, e.g. a PEFT model); "
        f"got {type(model).__name__}"
    )


def refuse_prompt_learning(model: nn.Module) -> None:
    """ValueError for a PEFT model with a prompt-learning adapter (prompt tuning, p-tuning, prefix tuning): it adds
    virtual tokens to each sequence the model sees (before the embeddings, or as a KV cache), which under sequence
    parallelism would be each shard, not the sequence. LoRA-like adapters and LLaMA-Adapter's adaption prompt (which
    works on each token's attention) are fine."""
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        for name, config in configs.items() if isinstance(configs, dict) else ():
            if getattr(config, "is_prompt_learning", False):
                kind = getattr(config, "peft_type", type(config).__name__)
                raise ValueError(
                    f"the PEFT adapter {name!r} is {getattr(kind, 'value', kind)}, prompt learning that adds virtual "
                    "tokens to each sequence (before its embeddings or as a KV cache): under sequence parallelism "
                    "each rank holds a shard, which would get them instead; use LoRA (or another adapter on the "
                    "weights) or LLaMA-Adapter's adaption prompt"
                )


def refuse_unswitched_attention(
    pretrained: PreTrainedModel, modules: list[nn.Module], name: str, original: str, sp: int
) -> None:
    """After ``pretrained.set_attn_implementation(name)`` with ``sp`` > 1: a ValueError (the model switched back to
    ``original`` first) when an attention module of ``modules`` did not follow, its config being a copy that
    transformers' switch does not reach (PEFT's ``modules_to_save`` deep-copies a listed attention module or decoder
    layer, config and all): its attention would run ``original`` on this rank's shard alone, silently wrong (at
    sp=1 it runs on the whole sequence: exact)."""
    if sp == 1:
        return
    ids = {id(m) for m in modules}
    stale = [
        path
        for path, m in pretrained.named_modules()
        if id(m) in ids and getattr(getattr(m, "config", None), "_attn_implementation", name) != name
    ]
    if stale:
        pretrained.set_attn_implementation(original)
        raise ValueError(
            f"{', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}: attention module(s) whose config is a copy "
            f"that set_attn_implementation does not reach (PEFT's modules_to_save copies a listed attention module "
            f"or decoder layer with its config), so under sequence parallelism they would run {original!r} on each "
            "rank's shard alone; list their projections instead (modules_to_save=['q_proj', 'k_proj', 'v_proj', "
            "'o_proj']) or train them with LoRA"
        )


# heads that read across the whole sequence: under SP each rank would read its own shard's (a wrong, rank-dependent
# result, not an error); token-wise heads (a causal LM's lm_head, token classification) read token by token
_WHOLE_SEQUENCE_HEADS = {
    "ForSequenceClassification": "pools one token of each row (the last non-padding one) for its score",
    "ForQuestionAnswering": "scores answer spans with a softmax over the positions of the whole sequence",
    "ForMultipleChoice": "pools one token of each row for its choice score",
}


def refuse_whole_sequence_head(pretrained: nn.Module) -> None:
    """ValueError for a model whose head reads across the whole sequence (sequence classification, question
    answering, multiple choice): under sequence parallelism each rank would compute it from its own shard."""
    name = type(pretrained).__name__
    for suffix, what in _WHOLE_SEQUENCE_HEADS.items():
        if name.endswith(suffix):
            raise ValueError(
                f"{name} {what}, which under sequence parallelism each rank would compute from its own shard of the "
                "sequence (the ranks would disagree); parallelize a causal LM (...ForCausalLM), "
                "or run this model without sequence parallelism (sp=1)"
            )


def find_causal_lm(model: nn.Module, caller: str = "enable_tiled_loss") -> PreTrainedModel:
    """The transformers model with an output embedding (``lm_head``) in ``model``; TypeError otherwise."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    raise TypeError(
        f"{caller} expects a transformers causal LM with an output embedding (lm_head), or a wrapper "
        f"around one (PEFT, DDP); got {type(model).__name__}"
    )


@contextlib.contextmanager
def in_mode(module: nn.Module, training: bool) -> Iterator[None]:
    """``module`` and its submodules in training (or eval) mode, each put back in its own mode after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def own_class(module: nn.Module) -> type:
    """``module``'s class as its library defines it: FSDP2's ``fully_shard`` swaps a module's class for
    ``FSDP<Name>``, a subclass of FSDPModule and it made in torch's own module, so ``type(module)`` no longer
    names the module that defines the model (where transformers keeps e.g. ``load_balancing_loss_func``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def text_config(model_or_config: Any) -> Any:
    """The text part of a model's (or a config's) configuration: the config itself for a text-only model."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_values(config: Any, name: str) -> list[Any] | None:
    """Each decoder layer's ``name`` where transformers' heterogeneous config varies it per layer (Gemma-4's
    ``head_dim`` and ``num_key_value_heads``: reading the global value raises there), in layer order; else None."""
    text = text_config(config)
    if not getattr(text, "is_heterogeneous", False) or name not in text.per_layer_attributes:
        return None
    return [getattr(text.per_layer_config[i], name, None) for i in range(text.num_hidden_layers)]


def layer_kv_heads(config: Any) -> list[int]:
    """The layers' distinct ``num_key_value_heads``, ascending, where transformers' heterogeneous config varies it per
    layer (Gemma-4's global layers: ``num_global_key_value_heads``), whose global value raises on reading; else []."""
    per_layer = layer_values(config, "num_key_value_heads")
    heads = getattr(text_config(config), "num_attention_heads", None)
    return [] if per_layer is None else sorted({kv or heads for kv in per_layer})


def head_counts(config: Any) -> tuple[int | None, int | None]:
    """``(num_attention_heads, num_key_value_heads)`` of a model or config (kv = query heads when unset; the fewest
    of any layer where they vary per layer, :func:`layer_kv_heads`)."""
    text = text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    per_layer = layer_kv_heads(text)
    return heads, per_layer[0] if per_layer else getattr(text, "num_key_value_heads", None) or heads


def attention_head_counts(config: Any, modules: list[nn.Module]) -> tuple[int | None, int | None]:
    """:func:`head_counts` of ``config``, unless every attention module in ``modules`` holds an int ``num_heads``,
    all the same and another: then theirs (with their ``num_key_value_heads``, else no grouping). Whisper's config
    maps ``num_attention_heads`` to its encoder's heads; its decoder's attention has ``decoder_attention_heads``."""
    heads, kv_heads = head_counts(config)
    own = [getattr(m, "num_heads", None) for m in modules]
    if not own or not all(isinstance(h, int) and not isinstance(h, bool) for h in own) or len(set(own)) != 1:
        return heads, kv_heads
    if own[0] == heads:
        return heads, kv_heads
    own_kv = {getattr(m, "num_key_value_heads", own[0]) for m in modules}
    return own[0], own_kv.pop() if len(own_kv) == 1 else own[0]


def config_size_problem(config: Any) -> str | None:
    """What makes a (text) config's sizes impossible to build or plan (None if nothing): a size that is not a
    positive int, or heads that do not group (kv heads) or split the hidden size (without ``head_dim``)."""
    text = text_config(config)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = getattr(text, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"its config's {name} must be a positive int, got {value!r}"
    heads, kv_heads = head_counts(text)  # kv heads: the heads where the config has none
    if not isinstance(kv_heads, int) or kv_heads < 1 or heads % kv_heads:
        return f"its config's num_key_value_heads={kv_heads!r} does not divide num_attention_heads={heads}"
    head_dims = layer_values(text, "head_dim") or [getattr(text, "head_dim", None)]
    if not all(head_dims) and text.hidden_size % heads:
        return f"its config's hidden_size={text.hidden_size} is not a multiple of num_attention_heads={heads}"
    return None


def learned_positions(config: Any) -> int | None:
    """How many positions a model's learned position table holds (GPT-2's ``n_positions``, OPT's, BioGPT's
    ``max_position_embeddings``): a longer sequence indexes past it. None where positions are computed (RoPE,
    ALiBi: any length runs, ``max_position_embeddings`` only says what it was trained on) or not stated."""
    text = text_config(config)
    keys = text.to_dict() if hasattr(text, "to_dict") else vars(text)
    if getattr(text, "alibi", False) or any("rope" in key or "rotary" in key for key in keys):
        return None
    limit = getattr(text, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def decoder_layers(pretrained: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules whose class is in ``_no_split_modules``, else ``base_model.layers``."""
    names = set(getattr(pretrained, "_no_split_modules", None) or ())
    layers = [m for m in pretrained.modules() if own_class(m).__name__ in names]
    if not layers:
        layers = list(getattr(getattr(pretrained, "base_model", None), "layers", None) or [])
    return layers


def layer_mlp(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's MLP: its child named the first of :data:`MLP_NAMES` it has; None where it has none."""
    children = layer._modules
    return next((children[name] for name in MLP_NAMES if isinstance(children.get(name), nn.Module)), None)


def mlp_modules(pretrained: nn.Module) -> list[nn.Module]:
    """Each decoder layer's MLP (:func:`layer_mlp`); ValueError when none is found."""
    layers = decoder_layers(pretrained)
    found = [mlp for mlp in map(layer_mlp, layers) if mlp is not None]
    if not found:
        layer_names = sorted({type(layer).__name__ for layer in layers}) or "none found"
        raise ValueError(
            f"{type(pretrained).__name__} has no recognisable MLP to tile: looked for a child named one of "
            f"{list(MLP_NAMES)} in its decoder layers ({layer_names})"
        )
    return found


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules: those with ``num_key_value_groups`` or a class name ending in ``Attention``."""
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") or type(m).__name__.endswith("Attention")]


def first_argument(module: nn.Module) -> str:
    """The name of ``module``'s forward's first argument after self (the hidden states)."""
    params = list(inspect.signature(type(module).forward).parameters)
    return params[1] if len(params) > 1 else "hidden_states"


def _takes_tokens(module: nn.Module) -> bool:
    params = inspect.signature(module.forward).parameters
    return "position_ids" in params and ("input_ids" in params or "inputs_embeds" in params)


def decoder_module(pretrained: PreTrainedModel, attention: list[nn.Module]) -> nn.Module:
    """The module every forward pass enters before its attention layers: the innermost module that holds all
    of them and takes input_ids/inputs_embeds and position_ids (``LlamaModel``; ``OPTDecoder``, which
    ``OPTForCausalLM`` calls directly, skipping ``OPTModel``). ValueError when there is none."""
    names = {id(m): n for n, m in pretrained.named_modules()}
    common = os.path.commonprefix([names[id(m)].split(".") for m in attention])  # element-wise on lists
    for depth in range(len(common), -1, -1):
        module = pretrained.get_submodule(".".join(common[:depth]))
        if not isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict) and _takes_tokens(module):
            return module
    raise ValueError(
        f"no module of {type(pretrained).__name__} that holds its attention layers takes position_ids; Ulysses "
        "needs the global positions of each shard (RoPE, documents), so this model is refused"
    )
