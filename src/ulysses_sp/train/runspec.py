"""One frozen description of a run, resolved and checked once before any rank trains: :class:`RunSpec`.

:func:`resolve_run` does everything that can be known and checked without the ranks: the resolved config
(world size, tokenizer, learning rate), the checkpoint to resume from (verified against its checksums), the
refusal of a folder that holds an earlier run, the tokenizer, the dataset's files, the model's config and
the ring degree. Our launcher writes the spec to a file that its ranks read (``ULYSSES_SP_RUN_SPEC``);
under torchrun / Slurm rank 0 resolves it and broadcasts it. The ranks never derive any of it again: they
only load what cannot travel (the tokenizer and the data, which they need as objects).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ulysses_sp.cli_config import flag_name, to_mapping
from ulysses_sp.hf import learned_positions
from ulysses_sp.shapes import SHAPES
from ulysses_sp.train.checkpoint import find_latest_checkpoint, list_checkpoints, read_saved_config, resolve_checkpoint
from ulysses_sp.train.config import TrainConfig, config_from_dict
from ulysses_sp.train.dataset_checks import check_dataset
from ulysses_sp.train.documents import EMBEDDED_TOKENIZER, load_tokenizer
from ulysses_sp.train.hub import HubProbe
from ulysses_sp.train.integrity import MANIFEST, newest_intact_checkpoint, verify_checkpoint
from ulysses_sp.train.model_factory import (
    check_attn_core,
    check_model_reachable,
    choose_run_layout,
    hf_model_config,
    tokenizer_source,
)
from ulysses_sp.train.outdir import previous_run_files

__all__ = [
    "RunSpec",
    "changed_settings",
    "check_same_batch_plan",
    "check_same_model_and_data",
    "resolve_run",
    "resume_point",
]

# Settings that may change when resuming without changing what the run computes next.
_FREE_ON_RESUME = {"resume", "overwrite", "nproc", "max_steps", "epochs", "eval_every", "eval_batches", "log_every"}
_FREE_ON_RESUME |= {"output_dir", "save_every", "keep_last", "metrics_file", "dist_timeout", "final_save"}
_FREE_ON_RESUME |= {"max_skipped_steps", "save_on_sigterm", "report_to", "gpus_per_node"}
# Memory features: the same step, computed with less memory.
_FREE_ON_RESUME |= {
    "activation_checkpointing",
    "tiled_loss",
    "loss_chunk_mib",
    "tiled_mlp",
    "tiled_norms",
    "mlp_chunk_tokens",
    "checkpoint_stride",
}
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass(frozen=True)
class RunSpec:
    """What a run is, resolved once (see the module docstring).

    Attributes:
        config: the resolved config: ``nproc`` = the world size, ``tokenizer`` = what is loaded, ``lr`` = the
            peak learning rate (this is what checkpoints save as ``config.yaml``: the checkpoints' place as asked,
            ``auto`` beside ``--host-memory``; the ranks train with the place the planner chooses for their GPUs,
            :func:`~ulysses_sp.train.model_factory.place_checkpoints`).
        ring: the ring degree inside ``sp`` (1 = pure Ulysses).
        layout_reason: why this ulysses x ring (one sentence, printed with the layout).
        resume_from: the verified checkpoint to continue from, or None for a fresh start.
        model_source: where pretrained weights come from (the checkpoint, a hub id, a directory), or None
            for a seeded random init.
        hf_config: the model's transformers config, as a dict.
        notes: lines rank 0 prints at the start (settings changed since the checkpoint, skipped extras).
    """

    config: TrainConfig
    ring: int
    layout_reason: str
    resume_from: str | None
    model_source: str | None
    hf_config: dict[str, Any]
    notes: tuple[str, ...] = ()

    def model_config(self) -> Any:
        """The transformers config object of :attr:`hf_config`."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.hf_config["model_type"]].from_dict(self.hf_config)

    def to_json(self) -> str:
        data = dataclasses.asdict(self) | {"config": to_mapping(self.config), "notes": list(self.notes)}
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        data = json.loads(text)
        data["config"] = config_from_dict(data["config"], "the run spec")
        data["notes"] = tuple(data["notes"])
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunSpec:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


def _damaged_checkpoint(path: Path, candidates: list[Path]) -> str | None:
    """The message for a checkpoint that does not verify (None when it does)."""
    damage = verify_checkpoint(path)
    if damage is None:
        return None
    intact = newest_intact_checkpoint(candidates, exclude=path)
    use = f"resume from the newest intact one with --resume {intact}" if intact else "no intact checkpoint is left"
    return f"checkpoint {path} is damaged: {damage.describe(path)}; {use} (or start fresh with --overwrite)"


def resume_point(config: TrainConfig) -> Path | None:
    """The verified checkpoint this run starts from (None = fresh); ValueError when the checkpoint is damaged
    (naming the file and the newest intact one) or a fresh start would mix with an earlier run's files."""
    output_dir = Path(config.output_dir)
    if isinstance(config.resume, str):
        path = resolve_checkpoint(config.resume)
        candidates = list_checkpoints(path.parent)
        elsewhere = path.parent.resolve() != output_dir.resolve()
        if elsewhere and (existing := previous_run_files(output_dir, config)):
            names = ", ".join(p.name for p in existing[-3:])
            raise ValueError(
                f"--resume {config.resume!r} continues a run of {str(path.parent)!r}, but --output-dir "
                f"{str(output_dir)!r} holds another run's files ({names}), which it would set aside and mix with "
                f"that run's history; give an empty --output-dir, or --output-dir {str(path.parent)!r}"
            )
    elif config.resume:
        path = find_latest_checkpoint(output_dir)
        candidates = list_checkpoints(output_dir)
    else:
        existing = previous_run_files(output_dir, config)
        if existing and not config.overwrite:
            names = ", ".join(p.name for p in existing[-3:])
            raise ValueError(
                f"--output-dir {str(output_dir)!r} already holds an earlier run's files ({names}); pass --resume "
                "to continue it, --overwrite to delete them and start fresh, or another --output-dir"
            )
        return None
    if path is not None and (message := _damaged_checkpoint(path, candidates)):
        raise ValueError(message)
    if path is not None and not (path / MANIFEST).is_file():  # nothing to verify against: say so
        print(
            f"ulysses-sp train: warning: checkpoint {path} has no {MANIFEST} (saved before checksums existed, or the "
            "manifest was deleted): resuming it unverified",
            file=sys.stderr,
        )
    return path


def check_same_batch_plan(saved: dict[str, Any], current: TrainConfig) -> None:
    """Refuse a resume that would change what a step consumes (and so what the run computes next)."""
    saved_dp = (saved.get("nproc") or 0) // max(saved.get("sp") or 1, 1)
    current_dp = (current.nproc or 0) // current.sp
    problems = []
    if "grad_accum" in saved and saved["grad_accum"] != current.grad_accum:
        problems.append(f"--grad-accum {saved['grad_accum']} -> {current.grad_accum}")
    if saved_dp and saved_dp != current_dp:
        problems.append(f"data-parallel groups (--nproc / --sp) {saved_dp} -> {current_dp}")
    if problems:
        raise ValueError(
            "cannot resume with a different batch per step (" + "; ".join(problems) + "): the data position and "
            "the sequence-length schedule count micro-batches; resume with the saved values, or start a new run "
            "from the checkpoint's weights with --model <checkpoint dir>"
        )


# Settings that choose the training documents and their order: the saved data position means nothing under others.
_DATA_SETTINGS = ("seed", "pack", "eval_fraction", "text_field", "dataset_split")


def _same_model(saved: str, current: str) -> bool:
    """The same name, or two spellings of one local directory (``./base/`` and ``/abs/base``)."""
    if saved == current:
        return True
    paths = [Path(name).expanduser() for name in (saved, current)]
    return all(path.exists() for path in paths) and paths[0].resolve() == paths[1].resolve()


def check_same_model_and_data(saved: dict[str, Any], current: TrainConfig, checkpoint: Path) -> None:
    """Refuse a resume under another ``--model`` (the checkpoint's weights would train on under the new name,
    with the new name's default --lr) or another setting that chooses the documents and their order."""
    if "model" in saved and not _same_model(str(saved["model"]), current.model):
        raise ValueError(
            f"--model {current.model!r} differs from the model of {checkpoint} ({saved['model']!r}): --resume "
            f"continues the checkpoint's weights; resume with --model {saved['model']}, or start a new run from "
            f"the checkpoint's weights with --model {checkpoint} (and another --output-dir or --overwrite)"
        )
    now = to_mapping(current)
    changed = [
        f"{flag_name(key)} {saved[key]!r} -> {now[key]!r}"
        for key in _DATA_SETTINGS
        if key in saved and now[key] is not None and saved[key] != now[key]  # (None: the checkpoint's)
    ]
    if changed:
        raise ValueError(
            f"cannot resume {checkpoint} with other training documents or order ({'; '.join(changed)}): the saved "
            "data position counts tokens of the saved ones; resume with the saved values"
        )


def changed_settings(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """``"lr: 0.001 -> 0.003"`` for every setting that differs from the checkpoint's and matters."""
    now = to_mapping(current)
    return [
        f"{key}: {saved[key]!r} -> {now[key]!r}"
        for key in now
        if key in saved and key not in _FREE_ON_RESUME and saved[key] != now[key]
    ]


def _with_held_out_fraction(config: TrainConfig, resume: Path | None, saved_config: dict[str, Any]) -> TrainConfig:
    """``config`` with ``eval_fraction`` set: as given, else the resumed checkpoint's (``saved_config``: its
    config.yaml; its training documents), else the default for ``--eval-every``
    (:meth:`TrainConfig.held_out_fraction`)."""
    if config.eval_fraction is not None:
        return config
    saved = saved_config.get("eval_fraction")
    if saved is None:
        return dataclasses.replace(config, eval_fraction=config.held_out_fraction())
    if saved == 0 and config.eval_every:
        raise ValueError(
            f"--eval-every {config.eval_every}: {resume} trained on every document (--eval-fraction 0), so none is "
            "held out to evaluate on; resume with --eval-every 0 (holding some out now would change its training "
            "documents)"
        )
    return dataclasses.replace(config, eval_fraction=float(saved))


def _check_not_a_run_folder(model: str) -> None:
    """Refuse ``--model`` naming a run's ``--output-dir`` (its checkpoints are the models): the tokenizer's or the
    model config's error about it would say only that it holds neither."""
    folder = Path(model).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file() and (latest := find_latest_checkpoint(folder)):
        raise ValueError(
            f"--model {model!r} is a training run's --output-dir, not a model; give one of its checkpoints, e.g. "
            f"--model {latest} (or --resume with --output-dir {model} to continue that run)"
        )


def resolve_run(config: TrainConfig, world_size: int) -> RunSpec:
    """Resolve and check everything about a run that needs no rank (see the module docstring); ValueError
    naming the flag or file and the fix. ``--output-dir`` must exist and be held by this run already."""
    notes = []
    resume = resume_point(config)
    saved = read_saved_config(resume) if resume is not None else {}  # the checkpoint's config.yaml, read once
    config = _with_held_out_fraction(config, resume, saved)
    if resume is not None:  # before the tokenizer and the model are looked up under names that may differ
        check_same_model_and_data(saved, config, resume)
    report_to = config.report_to
    if report_to in _PACKAGES and importlib.util.find_spec(_PACKAGES[report_to]) is None:
        notes.append(
            f"--report-to {report_to}: the {_PACKAGES[report_to]!r} package is not installed, so the metrics go "
            f"to {config.metrics_file} only (pip install 'ulysses-sp[{report_to}]')"
        )
        report_to = "none"
    if resume is None and config.model not in SHAPES:  # (a built-in name is the shape; a resume reads its own)
        _check_not_a_run_folder(config.model)
    source = tokenizer_source(config)
    hub = HubProbe()  # the Hub probed once: for the model, the tokenizer, the config and the dataset
    if resume is None and config.tokenizer is None and source is not None:
        # the model's own tokenizer: a model that cannot be reached is named as --model (told of --tokenizer, a
        # user met the same refusal for --model next)
        check_model_reachable(config.model, hub)
    flag = "--tokenizer" if config.tokenizer is not None else "--model (its own tokenizer; --tokenizer picks one)"
    tokenizer = load_tokenizer(source, flag=flag, hub=hub)
    notes += check_dataset(
        config.dataset, text_field=config.text_field, eval_fraction=config.held_out_fraction(), hub=hub
    )
    model_source = str(resume) if resume else (None if config.model in SHAPES else config.model)
    model_config = hf_model_config(config, tokenizer, source=model_source, hub=hub)
    positions, longest = learned_positions(model_config), config.schedule().max_seq_len
    if positions is not None and longest > positions:  # (an IndexError on every rank at the first step)
        flag = "--seq-len-schedule" if config.seq_len_schedule.strip() else "--seq-len"
        raise ValueError(
            f"{flag}: sequences of {longest} tokens are longer than the {positions} positions --model "
            f"{config.model!r} learned (a position table, no RoPE); train at most {positions} tokens a sequence"
        )
    vocab_size = model_config.get_text_config().vocab_size
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"--tokenizer {source or EMBEDDED_TOKENIZER!r} has {len(tokenizer)} tokens but --model "
            f"{config.model!r} has a vocabulary of {vocab_size}; use the model's own tokenizer"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # ranks on this node
    ring, layout_reason = choose_run_layout(config, model_config, gpus_per_node=local)
    check_attn_core(config)
    resolved = dataclasses.replace(
        config, nproc=world_size, tokenizer=source or EMBEDDED_TOKENIZER, lr=config.peak_lr(), report_to=report_to
    )
    if resume is not None:
        if not (resume / MANIFEST).is_file():
            notes.append(f"{resume.name} has no {MANIFEST} (saved before checksums existed): not verified")
        check_same_batch_plan(saved, resolved)
        notes += [f"changed since the checkpoint: {line}" for line in changed_settings(saved, resolved)]
    hf_config = json.loads(json.dumps(model_config.to_dict()))  # as it travels (JSON keys are strings)
    return RunSpec(
        resolved, ring, layout_reason, str(resume) if resume else None, model_source, hf_config, tuple(notes)
    )
