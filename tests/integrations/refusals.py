"""Integration jobs (run by tests/integrations/jobs.py's entry points): a batch refused on ONE rank only.

A collator that refuses the batch on rank 1 alone stands for a bad sample dealt to one rank. Every rank must raise a
ValueError, instead of the others going on into a collective (the forward's agreement, the gradient all-reduce)
that the stopped rank never reaches.
"""

from __future__ import annotations

import os

import torch

from tests.helpers.models import build
from tests.integrations.common import TRAIN_LENGTHS, pad_collate, token_dataset, trainer_args


def _expect(error: type[Exception], fragment: str, fn) -> None:
    try:
        fn()
    except error as exc:
        assert fragment in str(exc), f"expected {fragment!r} in the message, got: {exc}"
        return
    raise AssertionError(f"expected {error.__name__} mentioning {fragment!r}")


def refused_on_rank1(features: list[dict]) -> dict[str, torch.Tensor]:
    """Rank 1's batch has labels a token short (refused there); RANK is inherited by dataloader workers."""
    batch = pad_collate(features)
    if os.environ["RANK"] == "1":
        batch["labels"] = batch["labels"][:, 1:]
    return batch


class _FixedLengthStream(torch.utils.data.IterableDataset):
    """An iterable dataset (accelerate dispatches its batches from process 0) of rows of one length."""

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(8):
            ids = torch.randint(3, 100, (12,), generator=gen).tolist()
            yield {"input_ids": ids, "labels": ids}


def _trainer(collator, sp: int, workers: int = 0, data=None, **args):
    from ulysses_sp.integrations import UlyssesTrainer

    out = os.path.join(os.environ["ULYSSES_IT_OUT"], "refusal")
    return UlyssesTrainer(
        model=build("llama"),
        args=trainer_args(out, dataloader_num_workers=workers, **args),
        train_dataset=data if data is not None else token_dataset(TRAIN_LENGTHS[:8], seed=1),
        data_collator=collator,
        sp_size=sp,
    )


def _accelerate_first_batch(collator, sp: int, workers: int) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from ulysses_sp.integrations import SequenceParallelConfig

    data = token_dataset(TRAIN_LENGTHS[:8], seed=1)
    loader = DataLoader(data, batch_size=2, collate_fn=collator, num_workers=workers)
    _, loader, _ = SequenceParallelConfig(sp_size=sp).prepare(Accelerator(cpu=True), build("llama"), loader)
    next(iter(loader))


def refusal_on_one_rank() -> None:
    """World 2. With two replicas and no sequence split (sp=1, dp=2), collated in the main process: a batch refused
    on rank 1 raises on both ranks in the Trainer and in an Accelerate loop. A dispatching dataloader (an iterable
    dataset) at sp=1 collates on process 0 alone: no agreement runs there, and it trains."""
    replica = "data-parallel replica(s) [1] rejected their batch"
    _expect(ValueError, replica, _trainer(refused_on_rank1, 1).train)
    _expect(ValueError, replica, lambda: _accelerate_first_batch(refused_on_rank1, 1, workers=0))
    _trainer(pad_collate, 1, data=_FixedLengthStream(), max_steps=2).train()
