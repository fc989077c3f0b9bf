"""Hugging Face integrations: Trainer, TRL SFTTrainer and Accelerate, on DDP or FSDP2 (no DeepSpeed).

* :class:`UlyssesTrainer` / :class:`UlyssesSFTTrainer`: ``Trainer`` / ``SFTTrainer`` plus ``sp_size=``;
  :class:`UlyssesTrainerMixin` to add it to any other ``Trainer`` subclass.
* :class:`SequenceParallelConfig`: for ``accelerate launch`` with your own loop; one ``prepare`` call
  parallelizes the model, prepares everything with the ``Accelerator`` and returns the loss function.
* :class:`SequenceParallelCollator` and :func:`deal_batches_over_dp`: the data plumbing both use.

Names are imported on first use, so ``trl`` is only needed for :class:`UlyssesSFTTrainer`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SequenceParallelCollator",
    "SequenceParallelConfig",
    "SequenceParallelLoss",
    "UlyssesSFTTrainer",
    "UlyssesTrainer",
    "UlyssesTrainerMixin",
    "deal_batches_over_dp",
    "shard_full_batch",
]

_WHERE = {
    "SequenceParallelCollator": "data",
    "deal_batches_over_dp": "dealing",
    "shard_full_batch": "data",
    "SequenceParallelConfig": "accelerate",
    "SequenceParallelLoss": "accelerate",
    "UlyssesTrainer": "hf_trainer",
    "UlyssesTrainerMixin": "hf_trainer",
    "UlyssesSFTTrainer": "trl_sft",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
