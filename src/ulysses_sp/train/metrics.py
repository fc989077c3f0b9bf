"""Training metrics: throughput, TFLOPs and MFU, peak memory, the JSON-lines log and the progress display.

Every record of the log is one JSON object on its own line with an ``"event"`` key: ``"train"`` (one per
logged step; its ``"epoch"`` is the 0-based pass over the data that the step trained on), ``"eval"``,
``"checkpoint"``, ``"resume"`` and ``"summary"``. When a run resumes from step ``k``, records of later steps
left by the interrupted run are dropped first, so the file always tells one consistent history (the whole
earlier file is kept as ``abandoned-metrics-<time>.jsonl`` first: :func:`ulysses_sp.train.outdir.set_aside_logs`).
Lines are strict JSON: a value that is not finite (a NaN loss) is written as ``null`` and its spelling kept under
``"non_finite"`` (``{"loss": null, "non_finite": {"loss": "nan"}}``).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLog", "Progress", "format_summary", "peak_memory_gib", "peak_tflops", "read_metrics"]

# Dense bf16 tensor-core peaks (TFLOPs, no sparsity) from NVIDIA's datasheets, which print the sparse figure (x2)
# with an asterisk: dense = that / 2. A key matches when each of its words is a whole word of
# torch.cuda.get_device_name() split on spaces and '-' ("L4" is not "L40"); the first key that matches wins, so a
# variant comes before its model. None: a variant with no datasheet figure found (unknown, rather than another's).
_PEAK_BF16_TFLOPS: tuple[tuple[str, float | None], ...] = (
    ("H100 PCIe", 756.0),  # H100 datasheet, PCIe column: 1,513 sparse
    ("H100 NVL", 835.0),  # H100 datasheet, NVL column: 1,671 sparse
    ("H100", 989.0),  # H100 datasheet, SXM column: 1,979 sparse
    ("H200 NVL", 835.0),  # H200 datasheet, NVL column: 1,671 sparse
    ("H200", 989.0),  # H200 datasheet, SXM column: 1,979 sparse
    ("H800 PCIe", None),  # no datasheet figure found: unknown, not the SXM column's
    ("H800", 989.0),  # H800 datasheet, SXM column: 1,979 sparse
    ("H20", 148.0),  # H20 specification: 148 dense, 296 sparse
    ("GH200", 989.0),  # GH200 Grace Hopper Superchip datasheet: 1,979 sparse
    ("B200", 2250.0),  # HGX B200 datasheet, per GPU: 4.5 PFLOPs sparse
    ("A100", 312.0),  # A100 datasheet: 312 dense, 624 sparse (SXM and PCIe)
    ("A800", 312.0),  # A800 datasheet: 312 dense, 624 sparse
    ("L40S", 362.0),  # L40S datasheet: 733 sparse (362.05 dense)
    ("L40", 181.0),  # L40 datasheet: 181.05 dense, 362.1 sparse
    ("L4", 121.0),  # L4 datasheet: 242 sparse
    ("A10G", 70.0),  # an AWS-only part without an NVIDIA datasheet: the figure this table always had
    ("A10", 125.0),  # A10 datasheet: 250 sparse
)


def _name_words(name: str) -> set[str]:
    return {word.upper() for word in re.split(r"[\s-]+", name) if word}


def peak_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The dense tensor-core peak of ``device`` in TFLOPs for a step computing in ``dtype``, or None (CPU, unknown
    GPU, fp32): MFU needs it. fp32 has no one peak (TF32 tensor cores or not, as torch's matmul precision says):
    an fp32 run reports no MFU rather than one against the bf16 peak, 2x (TF32) to 15x (H100) too low."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    words = _name_words(torch.cuda.get_device_name(device))
    for key, tflops in _PEAK_BF16_TFLOPS:
        if _name_words(key) <= words:
            return tflops
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, else the peak resident set size (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def _strict_json(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON: non-finite floats become null, their spelling kept under
    ``"non_finite"`` (keyed by the record's key, ``a.b`` / ``a[0]`` inside mappings and lists)."""
    non_finite: dict[str, str] = {}

    def clean(value: Any, key: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            non_finite[key] = "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
            return None
        if isinstance(value, dict):
            return {name: clean(item, f"{key}.{name}") for name, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(item, f"{key}[{index}]") for index, item in enumerate(value)]
        return value

    cleaned = {key: clean(value, key) for key, value in record.items()}
    if non_finite:
        cleaned["non_finite"] = non_finite
    return json.dumps(cleaned, allow_nan=False)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics log, in order (a line cut short by a kill is skipped). Non-finite values read
    as null (see the module docstring); the NaN / Infinity that logs of earlier versions hold are read too."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsLog:
    """Append JSON records to ``path`` (only where ``enabled``, i.e. on rank 0).

    ``resume_step=None`` starts a new file; otherwise records with a step after ``resume_step`` are
    dropped (they belong to the interrupted run's lost steps, or to a line of training a rewind abandoned; the
    trainer kept the whole file aside first) and a ``resume`` record is appended; ``redo_eval``: so is a held-out
    loss at ``resume_step`` (the resumed run computes it again: its checkpoint was saved, on SIGTERM, before it),
    and the ``reporter`` forgets that step and gets back the records of it that are kept (``reporter.replay``), so a
    checkpoint resumed any number of times leaves that held-out loss in the reporter once.
    A fresh run never meets an earlier run's file here: the launcher refused that folder without --overwrite.
    A resume past step 0 that finds no file (deleted) starts a new one and sets ``missing``, a line to show: nothing is
    replayed to the reporter then (what it holds at ``resume_step`` stays, rather than being purged for nothing).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        enabled: bool,
        resume_step: int | None = None,
        reporter: Any = None,
        redo_eval: bool = False,
    ) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.reporter = reporter  # e.g. TensorBoard (ulysses_sp.train.tracking): gets every record too
        self.missing: str | None = None
        if not enabled:
            return
        if resume_step and not self.path.is_file():
            self.missing = _missing_note(self.path, resume_step, replayed=redo_eval and reporter is not None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, Any]] = []
        if resume_step is not None and self.path.is_file():
            records = read_metrics(self.path)
            redone = [r for r in records if redo_eval and r.get("event") == "eval" and r.get("step") == resume_step]
            kept = [r for r in records if (r.get("step") or 0) <= resume_step and r not in redone]
        tmp = self.path.with_name(self.path.name + ".tmp")  # strict JSON again (an earlier version's may hold NaN)
        tmp.write_text("".join(_strict_json(r) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        if redo_eval and reporter is not None and self.missing is None:
            reporter.replay(resume_step, [r for r in kept if r.get("step") == resume_step])
        if resume_step is not None:
            self.write({"event": "resume", "step": resume_step})

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (as strict JSON) and flush it to the file; the reporter gets it as it is."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(_strict_json(record) + "\n")
            handle.flush()
        if self.reporter is not None:
            self.reporter.log(record)

    def close(self) -> None:
        """Flush and close the reporter (the JSON lines are flushed as they are written)."""
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None


def _missing_note(path: Path, resume_step: int, *, replayed: bool) -> str:
    """What a resume from ``resume_step`` tells when its metrics file ``path`` is gone; ``replayed``: a reporter was
    to be given the file's records of that step again."""
    note = f"{path} is missing (deleted?): it starts again at step {resume_step}, without the earlier steps' records"
    if replayed:
        note += (
            f"; --report-to keeps what it holds at step {resume_step} (nothing to replay it from), and gets the "
            "held-out loss owed there again, beside any an earlier resume of this checkpoint gave it"
        )
    return note


def _format_rate(tokens_per_sec: float) -> str:
    return f"{tokens_per_sec / 1000:.1f}k" if tokens_per_sec >= 1000 else f"{tokens_per_sec:.0f}"


class Progress:
    """Rank 0's view of the run: a tqdm bar on a terminal, plain lines otherwise (logs, CI, Slurm)."""

    def __init__(self, *, enabled: bool, total: int, initial: int, log_every: int) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.total = total
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        """Show one train record (the bar moves every step; plain lines every ``log_every`` steps)."""
        if not self.enabled:
            return
        fields = {"loss": f"{record['loss']:.4f}", "tok/s": _format_rate(record["tokens_per_sec"])}
        if record.get("tflops") is not None and record.get("mfu") is not None:
            fields["TFLOPs"] = f"{record['tflops']:.1f}"
            fields["MFU"] = f"{100 * record['mfu']:.1f}%"
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total:
            text = "  ".join(f"{k} {v}" for k, v in fields.items())
            text += "  SKIPPED (not finite)" if record.get("skipped") else ""
            print(
                f"step {record['step']}/{self.total}  {text}  lr {record['lr']:.2e}  "
                f"seq {record['seq_len']}  {record['step_time_s']:.2f} s/step",
                flush=True,
            )

    def message(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_summary(summary: dict[str, Any], metrics_path: str | os.PathLike[str]) -> str:
    """The lines rank 0 prints at the end of a run: losses, speed, memory, where the checkpoint is."""
    lines = []
    if summary["first_loss"] is None:
        lines.append(f"nothing to train: already at step {summary['step']} of {summary['total_steps']}")
        if summary["step"] > summary["total_steps"]:  # a --max-steps / --epochs that ends before the checkpoint
            lines[-1] += " (to train from an earlier checkpoint, name it: --resume <output-dir>/checkpoint-N)"
    else:
        held_out = f", held-out {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
        verb = "stopped" if summary.get("stopped") else "done"
        lines.append(
            f"{verb}: step {summary['step']}/{summary['total_steps']} in {summary['time_s']:.1f} s, "
            f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}{held_out}, "
            f"{_format_rate(summary['tokens_per_sec'] or 0.0)} tokens/s, "
            f"peak memory {summary['peak_mem_gib']:.2f} GiB (rank 0)"
        )
    if summary["data_exhausted"]:
        lines.append(f"the training data ran out after {summary['epochs_completed']} epoch(s)")
    if summary.get("skipped_steps"):
        lines.append(f"skipped {summary['skipped_steps']} step(s) whose loss or gradient norm was not finite")
    if summary.get("stopped"):
        lines.append(f"stopped by {summary['stopped']}: every rank saved step {summary['step']} together")
    if summary["checkpoint"]:
        path = summary["checkpoint"]
        lines.append(f"checkpoint: {path}")
        lines.append(f'  load it:  AutoModelForCausalLM.from_pretrained("{path}")  (plain transformers, no SP)')
        more = "" if summary.get("stopped") else " and a larger --max-steps"
        lines.append(f"  continue: the same command with --resume{more}")
    lines.append(f"metrics:    {metrics_path}")
    return "\n".join(lines)
