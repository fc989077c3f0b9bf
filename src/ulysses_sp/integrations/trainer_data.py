"""The Trainer integration's dataloaders: batches dealt over the ``dp`` SP groups, not over every rank
(:func:`~ulysses_sp.integrations.dealing.deal_batches_over_dp`; ``datasets.IterableDataset``s as shared streams),
and every rank agreeing on each batch a dataloader worker collated."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..layout import ParallelLayout
from .accelerate import check_split_batches, split_over_dp_groups
from .data import agree_on_batch, replace_collator
from .dealing import deal_batches_over_dp, shared_stream, shared_streams

__all__ = ["DealtDataloaders"]


class DealtDataloaders:
    """Mixed into :class:`~ulysses_sp.integrations.UlyssesTrainerMixin` (before ``transformers.Trainer``)."""

    sp_layout: ParallelLayout
    accelerator: Any
    args: Any
    _train_batch_size: int

    def get_train_dataloader(self) -> Any:
        """The Trainer's dataloader, dealing batches over the dp SP groups (same batch on an SP group)."""
        return self._dealt_over_dp(super().get_train_dataloader, "train")  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The Trainer's eval dataloader, dealing batches over the dp SP groups; batches without labels pass (as
        in one process: logits, no loss)."""
        eval_dataset = shared_stream(eval_dataset, self.sp_layout)  # (a name or None: as it is)
        return self._dealt_over_dp(functools.partial(super().get_eval_dataloader, eval_dataset), "eval")  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The Trainer's test dataloader, dealing batches over the dp SP groups; batches without labels pass."""
        test_dataset = shared_stream(test_dataset, self.sp_layout)
        return self._dealt_over_dp(functools.partial(super().get_test_dataloader, test_dataset), "eval")  # type: ignore[misc]

    def _batch_size(self, kind: str) -> tuple[str, int]:
        """The argument that sets the ``kind`` ("train" / "eval") batch size, and the size now (a resume or
        ``auto_find_batch_size`` may change the train one)."""
        size = self._train_batch_size if kind == "train" else self.args.eval_batch_size
        return f"per_device_{kind}_batch_size", size

    def _dealt_over_dp(self, make: Any, kind: str) -> Any:
        """``make()``'s dataloader dealing batches over the dp SP groups (split_batches: each split; shared_streams)."""
        split = check_split_batches(self.accelerator, self.sp_layout, [self._batch_size(kind)])
        with split_over_dp_groups(self.accelerator, split), shared_streams(self, self.sp_layout):
            loader = replace_collator(make(), require_labels=kind == "train")
        return deal_batches_over_dp(loader, self.sp_layout, split_batches=split)

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: batch x accumulation x dp (SP ranks share samples; split_batches: not x dp)."""
        groups = 1 if self.accelerator.split_batches else self.sp_layout.dp
        return self._train_batch_size * args.gradient_accumulation_steps * groups

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, with every rank agreeing on each batch that a dataloader worker collated before it is
        counted (:func:`~ulysses_sp.integrations.data.agree_on_batch`): a batch refused on one rank raises the same
        ValueError on every rank, not only where the worker refused it. Without ``average_tokens_across_devices`` the
        targets counted are the SP group's (the dp replica's), not this rank's shards' alone."""
        checked = (agree_on_batch(batch, self.sp_layout) for batch in epoch_iterator)
        batches, count = super().get_batch_samples(checked, num_batches, *args, **kwargs)  # type: ignore[misc]
        if isinstance(count, torch.Tensor) and not self.args.average_tokens_across_devices and self.sp_layout.sp > 1:
            # the Trainer counts the targets of this rank's shards; the dp replica's are those of its SP group (what
            # plain DDP divides each rank's loss by without the world's count); kept whole, with the losses scaled by
            # sp (_sp_count_scale), not handed back as count / sp: TRL and the tiled loss clamp a count at 1, so a
            # replica of fewer targets than sp (one answer token under a long prompt) would lose a factor
            count = count.clone()
            dist.all_reduce(count, group=self.sp_layout.sp_group)
        return batches, count
