"""Experiment tracking for ``ulysses-sp train``: ``--report-to tensorboard|wandb`` and the loss-curve PNG.

``metrics.jsonl`` is always written (:mod:`ulysses_sp.train.metrics`); a reporter receives the same records
on rank 0. Both trackers are optional dependencies (``pip install 'ulysses-sp[tensorboard]'`` / ``[wandb]``);
the run checks for them before any rank trains and goes on without one that is missing, saying so.
At the end of a run rank 0 draws ``loss_curve.png`` beside the metrics file (matplotlib, ``[plot]``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol

from ulysses_sp.train.metrics import read_metrics

__all__ = ["Reporter", "make_reporter", "write_loss_curve"]

# train record key -> scalar name (TensorBoard tag / W&B key); eval records give "eval/loss"
_TRAIN_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_sec": "train/tokens_per_sec",
    "seq_len": "train/seq_len",
    "tflops": "train/tflops",
    "mfu": "train/mfu",
    "peak_mem_gib": "train/peak_mem_gib",
}


class Reporter(Protocol):
    """Where metrics records go besides ``metrics.jsonl``."""

    def log(self, record: dict[str, Any]) -> None: ...

    def replay(self, step: int, records: list[dict[str, Any]]) -> None:
        """Before any :meth:`log` of a resumed run that logs ``step``'s held-out loss again: forget what was logged
        at ``step`` where the tracker can, and take ``records`` (those of ``step`` that ``metrics.jsonl`` keeps)."""

    def close(self) -> None: ...


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    if record.get("event") == "train":
        pairs = ((tag, record.get(key)) for key, tag in _TRAIN_SCALARS.items())
    elif record.get("event") == "eval":
        pairs = (("eval/loss", record.get("eval_loss")),)
    else:
        return {}
    return {tag: float(value) for tag, value in pairs if isinstance(value, (int, float))}


class TensorBoardReporter:
    """Scalars into event files under ``log_dir``; a resumed run purges the lost steps of the interrupted one (the
    writer starts at the first record, so that :meth:`replay` can purge the resumed step as well)."""

    def __init__(self, log_dir: Path, resume_step: int | None) -> None:
        self.log_dir = log_dir
        self.purge_step = resume_step + 1 if resume_step is not None else None
        self._writer: Any = None

    def _write(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self.purge_step)
        return self._writer

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in _scalars(record).items():
            self._write().add_scalar(tag, value, global_step=record["step"])

    def replay(self, step: int, records: list[dict[str, Any]]) -> None:
        """Purge from ``step`` (TensorBoard then hides every event of it: the held-out loss an earlier resume of the
        same checkpoint logged there too) and log ``records`` there again."""
        if self._writer is not None:  # (replay comes first; a writer already open would keep its own purge step)
            self._writer.close()
            self._writer = None
        self.purge_step = step
        self._write()
        for record in records:
            self.log(record)

    def close(self) -> None:
        if self._writer is None and self.purge_step is not None:
            self._write()  # a resumed run that logged nothing still hides the interrupted run's lost steps
        if self._writer is not None:
            self._writer.close()


class WandbReporter:
    """A Weights & Biases run (project ``$WANDB_PROJECT``, default ``ulysses-sp``; ``WANDB_MODE=offline`` works
    without a network), resumed under the id kept in ``output_dir/.wandb-run-id``."""

    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        id_file = output_dir / ".wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id)
        project = os.environ.get("WANDB_PROJECT", "ulysses-sp")
        self.run = wandb.init(project=project, dir=str(output_dir), config=config, id=run_id, resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        if scalars := _scalars(record):
            self.run.log(scalars, step=record["step"])

    def replay(self, step: int, records: list[dict[str, Any]]) -> None:
        """Nothing: a W&B run cannot take back what it was given (a held-out loss that an earlier resume logged
        stays); it ignores, with a warning, a step below its newest, as this run's own log of it again may be."""

    def close(self) -> None:
        self.run.finish()


def make_reporter(
    report_to: str, *, output_dir: Path, tensorboard_dir: Path, config: dict[str, Any], resume_step: int | None
) -> Reporter | None:
    """The reporter for ``--report-to`` (None for 'none'); the launcher already checked that it is installed."""
    if report_to == "tensorboard":
        return TensorBoardReporter(tensorboard_dir, resume_step)
    if report_to == "wandb":
        return WandbReporter(output_dir, config)
    return None


def _plotted(record: dict[str, Any], key: str) -> float | None:
    """The value to plot of ``record[key]``: null (not finite, see metrics.py) is NaN, a gap in the curve."""
    value = record.get(key)
    if value is None:
        return math.nan if key in record else None
    return float(value) if isinstance(value, (int, float)) else None


def write_loss_curve(metrics_path: str | os.PathLike[str], png_path: str | os.PathLike[str]) -> str | None:
    """Draw the training (and held-out) loss of ``metrics_path`` into ``png_path``; returns a note to print
    when it cannot (matplotlib missing, no finite loss yet), else None."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return f"matplotlib is not installed: no {Path(png_path).name} (pip install 'ulysses-sp[plot]')"
    train, held_out = [], []
    for record in read_metrics(metrics_path):
        event, step = record.get("event"), record.get("step")
        if event == "train" and (value := _plotted(record, "loss")) is not None:
            train.append((step, value))
        elif event == "eval" and (value := _plotted(record, "eval_loss")) is not None:
            held_out.append((step, value))
    if not any(math.isfinite(loss) for _, loss in train):
        return None
    figure = Figure(figsize=(7, 4), dpi=100, layout="tight")  # no pyplot: no global figure state
    axes = figure.add_subplot()
    axes.plot(*zip(*train, strict=True), label="train", linewidth=1.2)
    if held_out:
        axes.plot(*zip(*held_out, strict=True), "o-", label="held-out", linewidth=1.2)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(png_path)
    return None
