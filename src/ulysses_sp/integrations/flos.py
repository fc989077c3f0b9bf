"""The Trainer's gather of floating-point operation counts (``store_flos``), made self-checking.

``store_flos`` runs at every log, at the start of every checkpoint save and at the end of ``train()``: its
all-gather is the first collective of a rank that saves a checkpoint while the others go on to the next step (a
callback that sets ``control.should_save`` on one rank only). Sent as a report of
:func:`ulysses_sp.validation.gather_reports` (one all-gather, as transformers' own), it meets the next step's batch
check on the other ranks as a report both sides can read: each raises :class:`~ulysses_sp.validation.RanksOutOfStep`
saying what every rank is doing, instead of gloo aborting the saving rank (or NCCL mixing their bytes).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.training_args import ParallelMode

from ..validation import Report, gather_reports

__all__ = ["CheckedFlos"]


class CheckedFlos:
    """Mixed into :class:`~ulysses_sp.integrations.UlyssesTrainerMixin` (before ``transformers.Trainer``)."""

    args: Any
    state: Any
    current_flos: Any

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
