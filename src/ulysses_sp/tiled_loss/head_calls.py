"""Which weights a call of the output embedding multiplies by, for the tiled loss: a plain ``nn.Linear``, or the
PEFT wrappers of one (``modules_to_save``, trainable tokens, plain LoRA), each read as its forward would use it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .kernel import Adapter

HeadWeights = tuple[torch.Tensor, torch.Tensor | None, tuple[Adapter, ...]]
Weights = Callable[[nn.Module, torch.Tensor], HeadWeights]


def _linear_weights(module: nn.Module, hidden: torch.Tensor | None = None) -> HeadWeights:
    return module.weight, module.bias, ()


def _token_weights(layer: nn.Module, hidden: torch.Tensor | None = None) -> HeadWeights:
    """PEFT's TrainableTokensLayer on lm_head: the weight its forward multiplies by (the trained rows copied in
    while its adapters are on and unmerged, as ``F.linear`` without a bias; else its base layer's, unmerged first
    with the adapters off, as that forward does)."""
    if layer.disable_adapters or not layer.active_adapters:
        return _unmerged_base(layer)
    if layer.merged:
        return _linear_weights(layer.base_layer)
    return layer.get_merged_weights(layer.active_adapters), None, ()


def _unmerged_base(layer: nn.Module) -> HeadWeights:
    """A PEFT layer's base weight and bias with its adapters off: unmerged first, as its forward does then."""
    if layer.merged:
        layer.unmerge()
    return _linear_weights(layer.base_layer)


def _lora_weights(layer: nn.Module, hidden: torch.Tensor) -> HeadWeights:
    """PEFT's LoRA ``Linear`` on lm_head (plain LoRA, :func:`_plain_lora`): its base layer's weight and bias, and each
    active adapter's A, B, lora_B's bias and scaling, added to the logits as its forward adds
    ``scaling x lora_B(lora_A(dropout(x)))`` (never as a ``[V, h]`` matrix; the dropout drawn here, as that forward
    draws it: the same masks from the same generator state); the base layer's alone with the adapters off (unmerged
    first, as that forward does) or merged into it."""
    if layer.disable_adapters:
        return _unmerged_base(layer)
    weight, bias, _ = _linear_weights(layer.base_layer)
    if layer.merged:
        return weight, bias, ()
    adapters = []
    for name in (n for n in layer.active_adapters if n in layer.lora_A):  # (a ModuleDict)
        a, b, dropout = layer.lora_A[name].weight, layer.lora_B[name], layer.lora_dropout[name]
        inputs = dropout(layer._cast_input_dtype(hidden, a.dtype)) if _drops(dropout) else hidden
        adapters.append(Adapter(a, b.weight, b.bias, layer.scaling[name], None if inputs is hidden else inputs))
    return weight, bias, tuple(adapters)


def _drops(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0


def _plain_lora(module: object) -> bool:
    """PEFT's LoRA ``Linear`` over a plain ``nn.Linear``, each adapter plain LoRA (no DoRA or other variant; its
    dropout an ``nn.Dropout`` or none): its output is then the base layer's plus a low-rank term per adapter
    (:func:`_lora_weights`)."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:
        return False
    if type(module) is not LoraLinear or module.fan_in_fan_out or module.lora_variant:
        return False
    plain_dropout = all(type(d) in (nn.Identity, nn.Dropout) for d in module.lora_dropout.values())
    return plain_dropout and _plain_linear(module.base_layer)


def vocab_rows(module: nn.Module, weights: Weights) -> int:
    """The vocabulary size of a module :func:`head_calls` gives (read from a base weight: a trainable-tokens
    wrapper's ``.weight`` would copy the whole matrix to give it)."""
    return (module.base_layer if weights in (_token_weights, _lora_weights) else module).weight.shape[0]


def _plain_linear(module: object) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def head_calls(output: nn.Module) -> list[tuple[nn.Module, Weights]] | None:
    """The modules a call of the output embedding ends in, each with the weight and bias it multiplies by: itself,
    a plain ``nn.Linear``; for PEFT's ``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) the original and
    each adapter's trainable copy, one of which the wrapper calls (the active adapter's, or the original with
    adapters off); for its ``TrainableTokensWrapper`` (``trainable_token_indices`` on lm_head, or on a tied
    embedding) the token layer; for LoRA on lm_head (without a variant such as DoRA) the LoRA layer;
    None for anything else."""
    if _plain_linear(output):
        return [(output, _linear_weights)]
    if _plain_lora(output):
        return [(output, _lora_weights)]
    try:
        from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper
    except ImportError:
        return None
    if isinstance(output, ModulesToSaveWrapper):
        linears = [output.original_module, *output.modules_to_save.values()]
        return [(m, _linear_weights) for m in linears] if all(_plain_linear(m) for m in linears) else None
    if isinstance(output, TrainableTokensWrapper) and _plain_linear(output.token_adapter.base_layer):
        return [(output.token_adapter, _token_weights)]
    return None
