"""What ``ulysses-sp bench`` measures: :class:`BenchConfig` (its flags, through :mod:`ulysses_sp.cli_config`)
and the preset sizes it starts from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ulysses_sp.cli_config import check_choices, option
from ulysses_sp.plan.units import parse_flag_bytes

__all__ = ["BENCH_MODELS", "PRESETS", "BenchConfig", "check_head_splits"]

BENCH_MODELS = ("llama-bench-tiny", "llama-bench-small")  # shapes of ulysses_sp.shapes sized for a CPU
PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(
        model="llama-bench-small",
        memory_seq_lens=(512, 1024, 2048, 4096),
        seq_len=2048,
        head_chunk_seq_lens=(4096, 8192),
        worlds=(2, 4),
        loss_tokens=4096,
        loss_vocab=32000,
    ),
    # For the test suite: a tiny model, seconds per section.
    "tiny": dict(
        model="llama-bench-tiny",
        memory_seq_lens=(256, 512),
        seq_len=512,
        head_chunk_seq_lens=(512,),
        worlds=(2,),
        loss_tokens=256,
        loss_vocab=2048,
    ),
}
_PRESET_REPS = {"small": {2: 11, 4: 7}, "tiny": {2: 3}}  # timed repetitions per world size
_PRESET_LOSS_ROUNDS = {"small": 7, "tiny": 3}  # timed rounds of the tiled-loss section


def _from_preset(name: str) -> str:
    """The end of a help text: what 'none' takes from each ``--size`` preset (``--help`` said only 'default: none')."""
    values = {size: preset[name] for size, preset in PRESETS.items()}
    shown = {size: ",".join(map(str, v)) if isinstance(v, tuple) else str(v) for size, v in values.items()}
    return "; none = the --size preset's: " + "; ".join(f"{size} {value}" for size, value in shown.items())


@dataclass(kw_only=True)
class BenchConfig:
    """What ``ulysses-sp bench`` measures and where it writes; 'none' values come from the ``--size`` preset."""

    size: str = option("small", help="Preset sizes (tiny: seconds per section).", choices=tuple(PRESETS))
    model: str | None = option(None, help=f"Benchmark model, one of {', '.join(BENCH_MODELS)}{_from_preset('model')}.")
    memory_seq_lens: tuple[int, ...] | None = option(
        None, help=f"Sequence lengths of the per-rank memory section{_from_preset('memory_seq_lens')}.", metavar="LENS"
    )
    memory_sp: tuple[int, ...] = option((1, 2, 4), help="sp degrees of the per-rank memory section.", metavar="SPS")
    seq_len: int | None = option(None, help=f"Sequence length of the step-time worlds{_from_preset('seq_len')}.")
    head_chunk_seq_lens: tuple[int, ...] | None = option(
        None,
        help="Sequence lengths of the head-chunk section (longer than --seq-len: head chunks are for long sequences, "
        f"where the attention core outweighs each chunk's fixed costs){_from_preset('head_chunk_seq_lens')}.",
        metavar="LENS",
    )
    worlds: tuple[int, ...] | None = option(
        None, help=f"World sizes (gloo ranks) of the step-time section{_from_preset('worlds')}."
    )
    loss_tokens: int | None = option(
        None,
        help="Tokens of the tiled-loss section (the lm_head + loss of the model's hidden size; 0: skip it)"
        f"{_from_preset('loss_tokens')}.",
    )
    loss_vocab: int | None = option(None, help=f"Vocabulary of the tiled-loss section{_from_preset('loss_vocab')}.")
    reps: int | None = option(
        None,
        help="Timed repetitions per world (after 1 warm-up) and rounds of the tiled-loss section; none = the --size "
        "preset's: "
        + "; ".join(
            f"{size} {', '.join(f'{reps} at {world} ranks' for world, reps in by_world.items())}, "
            f"{_PRESET_LOSS_ROUNDS[size]} rounds"
            for size, by_world in _PRESET_REPS.items()
        )
        + ".",
    )
    deepspeed: bool = option(True, help="Run DeepSpeed's Ulysses side by side when it is installed.")
    gpu: str = option("auto", help="auto: the GPU mode when CUDA is present.", choices=("auto", "off"))
    gpu_memory: str | None = option(
        None,
        help="GPU mode: the GPU memory planned for and the allocator's cap, e.g. 40GiB (less than the card has puts "
        "the planned limit at lengths a step can run in --gpu-step-budget-s); 'none' = the card's.",
    )
    host_memory: str = option("120GiB", help="GPU mode: this host's memory for offloaded checkpoints and optimizer.")
    gpu_step_budget_s: float = option(
        300.0, help="GPU mode: skip a point whose step is estimated to take longer (seconds).", metavar="SECONDS"
    )
    output_dir: str | None = option(
        None, help="Where results.json and the PNGs go; 'none' = benchmarks/results (with --report-from: its folder)."
    )
    markdown: bool | str = option(
        True,
        help="The markdown report to write: BENCHMARKS.md in the current directory, or --markdown PATH; "
        "--no-markdown: none.",
        metavar="PATH",
    )
    note: str | None = option(None, help="A line about the machine for the report (e.g. 'shared, 2 cores').")
    report_from: str | None = option(
        None,
        help="Measure nothing: redraw the plots and rewrite the markdown from a results.json of an earlier run.",
        metavar="RESULTS_JSON",
    )

    def validate(self) -> None:
        """ValueError naming the flag of a value the benchmark cannot run with."""
        check_choices(self)
        if self.model is not None and self.model not in BENCH_MODELS:
            raise ValueError(
                f"--model {self.model!r} is not a benchmark model; choose one of {', '.join(BENCH_MODELS)}"
            )
        if self.gpu_settings()["gpu_memory_bytes"] == 0:  # (parses the sizes, naming the flag on error)
            raise ValueError(f"--gpu-memory must be more than 0 (or 'none': the card's), got {self.gpu_memory!r}")
        if not 0 < self.gpu_step_budget_s < float("inf"):  # nan too
            raise ValueError(f"--gpu-step-budget-s must be > 0 and finite, got {self.gpu_step_budget_s}")
        if self.loss_tokens is not None and self.loss_tokens < 0:
            raise ValueError(f"--loss-tokens must be >= 0 (0: skip the tiled-loss section), got {self.loss_tokens}")
        for name in ("seq_len", "memory_seq_lens", "head_chunk_seq_lens", "reps", "loss_vocab", "worlds", "memory_sp"):
            value = getattr(self, name)
            if value is not None and min(_values(value)) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        resolved = self.resolve()
        check_head_splits(resolved, "--model" if self.model else f"the --size {self.size} preset's model")
        for name in ("seq_len", "head_chunk_seq_lens"):
            for value in _values(getattr(resolved, name)):
                if any(value % world for world in resolved.worlds):
                    flag = f"--{name.replace('_', '-')}"
                    raise ValueError(f"{flag} {value} must be divisible by every world size {resolved.worlds}")

    def resolve(self) -> BenchConfig:
        """The config with every 'none' filled from the ``--size`` preset (and the default output folder)."""
        preset = {k: v for k, v in PRESETS[self.size].items() if getattr(self, k) is None}
        return replace(self, **preset, output_dir=self.output_dir or "benchmarks/results")

    def reps_for(self, world: int) -> int:
        """Timed repetitions of the world of ``world`` ranks: ``--reps``, else the preset's."""
        return self.reps if self.reps is not None else _PRESET_REPS[self.size].get(world, 3)

    def loss_rounds(self) -> int:
        """Timed rounds of the tiled-loss section: ``--reps``, else the preset's."""
        return self.reps if self.reps is not None else _PRESET_LOSS_ROUNDS[self.size]

    def gpu_settings(self) -> dict[str, Any]:
        """The GPU mode's keyword arguments (:func:`ulysses_sp.bench.gpu.run_gpu`) from the flags."""
        return {
            "gpu_memory_bytes": parse_flag_bytes("gpu_memory", self.gpu_memory) if self.gpu_memory else None,
            "host_memory_bytes": parse_flag_bytes("host_memory", self.host_memory),
            "step_budget_s": self.gpu_step_budget_s,
        }

    @property
    def markdown_path(self) -> str | None:
        """Where the markdown report goes (None: not written)."""
        return "BENCHMARKS.md" if self.markdown is True else (self.markdown or None)


def check_head_splits(config: BenchConfig, where: str) -> None:
    """ValueError naming ``--memory-sp`` or ``--worlds`` when one of its degrees does not split the heads of a model
    its section runs, before any rank starts (``config`` resolved; ``where``: how its model was chosen, for the
    message). The memory section and the step-time worlds run ``config.model`` at sp = the degree; the head-chunk
    section runs its own model in its chunks at sp = each world. The rules are the library's
    (:func:`ulysses_sp.layout.check_heads_split`, :func:`ulysses_sp.head_split.check_head_chunks`)."""
    from ulysses_sp.head_split import check_head_chunks
    from ulysses_sp.layout import check_heads_split, sp_degrees_for
    from ulysses_sp.shapes import SHAPES

    from .headchunks import HEAD_CHUNK_MODEL, HEAD_CHUNKS

    def heads(model: str) -> tuple[int, int]:
        return SHAPES[model]["num_attention_heads"], SHAPES[model]["num_key_value_heads"]

    def splits(sp: int, model: str, chunks: int = 1) -> bool:
        try:
            check_heads_split(*heads(model), sp)
            check_head_chunks(chunks, *heads(model), sp)
        except ValueError:
            return False
        return True

    def refuse(flag: str, sp: int, what: str, good: list[int]) -> ValueError:
        return ValueError(
            f"{flag} {sp} does not split the heads of {what} over sp={sp} ranks; {flag} values that work: "
            f"{', '.join(str(p) for p in good)}"
        )

    num_heads, num_kv_heads = heads(config.model)
    model = f"{config.model} ({where}: {num_heads} heads, {num_kv_heads} kv heads)"
    memory_good = sp_degrees_for(num_heads, num_kv_heads)
    for sp in config.memory_sp:
        if not splits(sp, config.model):
            raise refuse("--memory-sp", sp, model, memory_good)
    chunks = HEAD_CHUNKS[-1]
    world_good = [p for p in memory_good if splits(p, HEAD_CHUNK_MODEL, chunks)]
    chunk_heads = "{} heads, {} kv heads".format(*heads(HEAD_CHUNK_MODEL))
    for world in config.worlds:
        if not splits(world, config.model):
            raise refuse("--worlds", world, f"{model}, the step-time worlds' model,", world_good)
        if not splits(world, HEAD_CHUNK_MODEL, chunks):
            what = f"{HEAD_CHUNK_MODEL} (the head-chunk section's model: {chunk_heads}) in {chunks} chunks"
            raise refuse("--worlds", world, what, world_good)


def _values(value: int | tuple[int, ...]) -> tuple[int, ...]:
    return value if isinstance(value, tuple) else (value,)
