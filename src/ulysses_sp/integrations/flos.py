"""The Trainer's gather of floating-point operation counts (``store_flos``), made self-checking.

``store_flos`` runs at every log, at the start of every checkpoint save and at the end of ``train()``: its
all-gather is the first collective of a rank that saves a checkpoint while the others go on to the next step (a
callback that sets ``control.should_save`` on one rank only). Sent as a report of
:func:`ulysses_sp.validation.gather_reports` (one all-gather, as transformers' own), it meets the next step's batch
check on the other ranks as a report both sides can read: each raises :class:`~ulysses_sp.validation.RanksOutOfStep`
saying what every rank is doing, instead of gloo aborting the saving rank (or NCCL mixing their bytes). The counts
themselves are one process's: from the collated batches' tokens, not the shards' (``floating_point_ops``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.training_args import ParallelMode

from ..validation import Report, gather_reports
from .data import TOKEN_COUNT_KEY

__all__ = ["CheckedFlos"]


class CheckedFlos:
    """Mixed into :class:`~ulysses_sp.integrations.UlyssesTrainerMixin` (before ``transformers.Trainer``)."""

    args: Any
    state: Any
    current_flos: Any

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's count for the collated batch, as one process counts it (``6 x tokens x parameters``), not
        for the shard, which also holds the tokens added to make the length divisible by ``sp``: the batch's tokens
        on SP rank 0 (from :data:`~.data.TOKEN_COUNT_KEY`), none on the others, so the world's sum is exact."""
        flos = super().floating_point_ops(inputs)  # type: ignore[misc]
        counts, ids = inputs.get(TOKEN_COUNT_KEY), inputs.get("input_ids")
        if counts is None or not isinstance(ids, torch.Tensor) or not flos or ids.numel() == 0:
            return flos
        return flos // ids.numel() * int(counts[0])  # flos = 6 x ids.numel() x parameters

    def store_flos(self) -> None:
        """The Trainer's: add every rank's ``current_flos`` to ``state.total_flos`` (summed in the dtype transformers
        sums them in), then reset it; over several processes, in one self-checked all-gather."""
        if self.args.parallel_mode != ParallelMode.DISTRIBUTED:
            return super().store_flos()  # type: ignore[misc]
        dtype = torch.tensor([self.current_flos]).dtype  # transformers': float32, or int64 before any flos
        bits = torch.tensor([float(self.current_flos)], dtype=torch.float64).view(torch.int64)
        reports = gather_reports(bits.to(self.args.device), Report.FLOS, None)
        values = torch.tensor([got[0] for got in reports], dtype=torch.int64).view(torch.float64)
        self.state.total_flos += values.to(dtype).sum().item()
        self.current_flos = 0
        return None
