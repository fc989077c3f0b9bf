"""Integration job (run by tests/integrations/jobs.py's entry points): a Trainer subclass's own ``compute_loss``.

The loss a user writes for one process (cross-entropy of ``outputs.logits`` against ``inputs["labels"]`` shifted)
is wrong under SP: under the tiled loss (no logits) it must fail with a ValueError saying why, not a bare
``TypeError``, in training and in evaluation; with the tiled loss off it runs, and rank 0 is warned once; an
override that calls ``super().compute_loss`` is not warned about.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from tests.helpers.models import build
from tests.integrations.common import TRAIN_LENGTHS, expect_error, pad_collate, token_dataset, trainer_args, write_json


def _classes():
    from ulysses_sp.integrations import UlyssesTrainer

    class LogitsLossTrainer(UlyssesTrainer):
        """The one-process loss: next-token cross-entropy of the logits against the labels shifted by one."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            logits, labels = outputs.logits[:, :-1], inputs["labels"][:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return (loss, outputs) if return_outputs else loss

    class SuperLossTrainer(UlyssesTrainer):
        """The trainer's own loss plus a term of its own."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            return loss + 0.0 * sum(p.sum() for p in model.parameters())

    class CausalLMLossTrainer(UlyssesTrainer):
        """The documented way without super(): the library's loss over the shard's shift_labels."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            from ulysses_sp import causal_lm_loss

            return causal_lm_loss(model, inputs, self.sp_layout, num_items_in_batch=num_items_in_batch)

    class KeywordsLossTrainer(UlyssesTrainer):
        """transformers' documented form since 4.46: the count comes in **kwargs (evaluation passed it by position)."""

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)

    return LogitsLossTrainer, SuperLossTrainer, CausalLMLossTrainer, KeywordsLossTrainer


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def loss_override_sp2() -> None:
    """rank 0 writes what each trainer did: ``warnings`` (how many of the override's warning it logged, per class)."""
    out = os.path.join(os.environ["ULYSSES_IT_OUT"], "loss_override_sp2")
    logits_loss, super_loss, library_loss, keywords_loss = _classes()
    data = token_dataset(TRAIN_LENGTHS[:4], seed=1)

    def make(cls, **kwargs):
        args = trainer_args(out, num_train_epochs=1)
        return cls(model=build("llama"), args=args, train_dataset=data, eval_dataset=data, data_collator=pad_collate,
                   sp_size=2, **kwargs)  # fmt: skip

    said = "LogitsLossTrainer.compute_loss failed ('NoneType' object is not subscriptable) without calling the"
    expect_error(ValueError, said, make(logits_loss).train)
    expect_error(ValueError, said, make(logits_loss).evaluate)
    assert make(keywords_loss).evaluate()["eval_loss"] > 0
    handler = _Warnings()
    logger = logging.getLogger("ulysses_sp.integrations.loss_override")
    logger.addHandler(handler)
    try:
        counts, weights = {}, {}
        for cls, kwargs in ((logits_loss, {"sp_tiled_loss": False}), (super_loss, {}), (library_loss, {})):
            handler.messages.clear()
            trainer = make(cls, **kwargs)
            trainer.train()
            counts[cls.__name__] = sum("compute_loss does not call the trainer's own" in m for m in handler.messages)
            weights[cls.__name__] = [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        logger.removeHandler(handler)
    for got, want in zip(weights["CausalLMLossTrainer"], weights["SuperLossTrainer"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the same training as the trainer's own loss
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, counts)
    if dist.get_rank() == 0:
        write_json(os.path.join(out, "result.json"), {"warnings": gathered})
