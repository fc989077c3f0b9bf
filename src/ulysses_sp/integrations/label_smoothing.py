"""transformers' label smoothing (``TrainingArguments(label_smoothing_factor=e)``) under sequence parallelism.

The Trainer's ``LabelSmoother`` shifts the labels it is given by one token inside what the model saw: under SP a
shard, so the last token of each shard would lose its target and the first of the next one would take it. Here the
targets are the collator's ``shift_labels`` (the whole sequence's, shifted before the split) and each shard's
smoothed loss is summed over its tokens and divided by the batch's count of valid targets, as ``LabelSmoother`` does
with ``num_items_in_batch``: inside the tiled loss (no ``[tokens, vocab]`` logits), else over the shard's logits.
As in one process, the model's own loss is not used, an MoE's load-balancing term included.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tiled_loss import LABEL_SMOOTHING, ROUTER_LOGITS_TO_CALLER, tiled_loss_enabled
from ..validation import IGNORE_INDEX

__all__ = ["smoothed_loss"]


def smoothed_loss(
    model: torch.nn.Module, inputs: dict[str, Any], epsilon: float, num_items_in_batch: Any
) -> tuple[torch.Tensor, Any]:
    """``(loss, outputs)``: the label-smoothed loss of this rank's shard (``inputs`` from the SP collator, with
    ``shift_labels``) divided by ``num_items_in_batch`` (else by the shard's valid targets), and the model's outputs
    (no logits under the tiled loss)."""
    from transformers.trainer_pt_utils import LabelSmoother

    inputs = {key: value for key, value in inputs.items() if key != "labels"}
    if tiled_loss_enabled(model):
        options = {LABEL_SMOOTHING: epsilon, ROUTER_LOGITS_TO_CALLER: True}  # router logits unused, as in one process
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch, **options)
        return outputs.loss, outputs
    targets = inputs.pop("shift_labels")
    if num_items_in_batch is None:  # the shard's valid targets, at least 1: 0, not NaN, when it has none (as tiled)
        num_items_in_batch = (targets != IGNORE_INDEX).sum().clamp(min=1)
    outputs = model(**inputs)
    return LabelSmoother(epsilon=epsilon)(outputs, targets, num_items_in_batch=num_items_in_batch), outputs
