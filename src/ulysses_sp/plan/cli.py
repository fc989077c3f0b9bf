"""``ulysses-sp plan``: per-GPU memory, the longest trainable sequence and recommended settings.

Reads a model, the cluster, the layout and the features (:class:`PlanConfig`, the same feature flags as
``ulysses-sp train``); prints the breakdown of the predicted peak, the longest sequence for those settings
and a recommendation. ``--simulate`` also runs one real step as rank 0 of the layout on one device and
prints the measured peak next to the prediction. ``--json`` prints one JSON object instead. Exit status: 0
done (whether or not the plan fits), 2 invalid flags (the message names the flag).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..cli_config import option, parse_config
from ..features import Features
from ..head_split import check_head_chunks
from .shape import load_model_config
from .units import format_bytes, parse_flag_bytes

if TYPE_CHECKING:  # the memory model imports torch: only once the flags parsed (a fast --help and bad flag)
    from .memory import MemoryPlan

__all__ = ["PlanConfig", "plan_command"]

MAX_WORLD = 1 << 20  # GPUs: past this the planner's search over the divisors of the world is not worth running


@dataclass(kw_only=True)
class PlanConfig(Features):
    """What ``ulysses-sp plan`` predicts for; each field is a flag (the memory features' come from Features)."""

    model: str = option(
        help="Built-in shape (qwen3-4b, llama-3.1-8b, llama-tiny, ...), a config.json, a model directory, or a "
        "Hugging Face id in the local cache."
    )
    seq_len: int = option(help="Tokens per sequence (before the split over --sp).")
    gpus_per_node: int = option(8, help="GPUs per node.")
    nodes: int = option(1, help="Nodes; world = --gpus-per-node x --nodes.")
    gpu_memory: str = option("80GiB", help="Memory of one GPU, e.g. 80GiB, 140GiB (GB: 10^9 bytes, GiB: 2^30).")
    host_memory: str = option(
        "0",
        help="Host memory per node, e.g. 1TiB; 0 = do not check. Offloaded optimizer states and activations "
        "must fit in it.",
    )
    sp: int = option(1, help="Sequence-parallel degree (ulysses x ring).")
    ring: int | None = option(
        None,
        help="Ring degree inside --sp; 'none' = as `ulysses-sp train` chooses: the largest Ulysses degree the heads "
        "allow whose groups stay inside a node (--gpus-per-node), the ring across nodes.",
    )
    dp: int | None = option(None, help="Data-parallel degree; 'none' = world / --sp. --sp x --dp = the world size.")
    micro_batch: int = option(1, help="Sequences per micro-batch per SP group.")
    simulate: bool = option(
        False,
        help="Also run one real step as rank 0 of this layout on one device (fake process group) and report the "
        "measured peak next to the prediction.",
    )
    device: str | None = option(None, help="Device for --simulate; 'none' = cuda if available, else cpu.")
    json: bool = option(False, help="Print one JSON object instead of the table.")

    def validate(self) -> None:
        """ValueError naming the flag of a value that cannot be planned."""
        super().validate()
        self.check_flags_apply()
        for name in ("seq_len", "gpus_per_node", "nodes", "sp", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.world_size > MAX_WORLD:
            raise ValueError(
                f"--gpus-per-node {self.gpus_per_node} x --nodes {self.nodes} = {self.world_size:,} GPUs; the planner "
                f"takes at most {MAX_WORLD:,}"
            )
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"--gpu-memory must be more than 0, got {self.gpu_memory!r}")
        self.host_memory_bytes  # noqa: B018 (parses, naming the flag on error)
        if self.dp is None and self.world_size % self.sp:
            raise ValueError(
                f"--sp {self.sp} does not divide the world size {self.world_size} (--gpus-per-node "
                f"{self.gpus_per_node} x --nodes {self.nodes}); data parallelism takes world / sp SP groups"
            )
        if self.sp * self.data_parallel != self.world_size:
            flag = "--dp" if self.dp is not None else "--sp"
            raise ValueError(
                f"{flag}: --sp {self.sp} x --dp {self.data_parallel} must equal the world size {self.world_size} "
                f"(--gpus-per-node {self.gpus_per_node} x --nodes {self.nodes})"
            )
        if self.seq_len < self.sp:
            raise ValueError(f"--seq-len {self.seq_len} must be >= --sp {self.sp} (every rank holds a token)")
        if self.device is not None:
            _check_device(self.device, self.simulate)
        if self.simulate and self.seq_len % self.sp:  # (the plan pads it; the simulated step does not)
            raise ValueError(f"--simulate needs a --seq-len divisible by --sp {self.sp}, got {self.seq_len}")
        if self.simulate and self.parallel != "fsdp2":
            raise ValueError(f"--simulate measures FSDP2's step only; drop --parallel {self.parallel} or --simulate")
        from ..hf import head_counts

        ring = _check_heads(self.model_config[0], self.sp, self.ring, self.gpus_per_node)
        try:
            check_head_chunks(self.head_chunks, *head_counts(self.model_config[0]), self.sp // ring)
        except ValueError as error:
            raise ValueError(f"--head-chunks {self.head_chunks} with --sp {self.sp}: {error}") from None

    @functools.cached_property
    def model_config(self) -> tuple[Any, str]:
        """``(transformers config, name)`` of ``--model``; ValueError naming ``--model`` when it cannot load."""
        try:
            return load_model_config(self.model)
        except ValueError as error:
            raise ValueError(f"--model: {error}") from None

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def data_parallel(self) -> int:
        return self.dp if self.dp is not None else self.world_size // self.sp

    @property
    def gpu_memory_bytes(self) -> int:
        return parse_flag_bytes("gpu_memory", self.gpu_memory)

    @property
    def host_memory_bytes(self) -> int:
        return parse_flag_bytes("host_memory", self.host_memory)


def _table(plan: MemoryPlan) -> str:
    lines = [f"per-GPU memory at the peak ({plan.phase}):"]
    for name, value in plan.breakdown().items():
        lines.append(f"  {name.replace('_', ' '):<20} {format_bytes(value):>14}")
    verdict = "fits" if plan.fits_gpu else "DOES NOT FIT"
    lines.append(
        f"  {'total':<20} {format_bytes(plan.peak_bytes):>14}  of {format_bytes(plan.usable_bytes)} usable "
        f"({format_bytes(plan.gpu_memory_bytes)} GPU): {verdict}"
    )
    if plan.host_bytes_per_node:
        given = plan.host_memory_bytes
        host = f"of {format_bytes(given)}" if given else "(not checked: no --host-memory)"
        parts = ", ".join(f"{name} {format_bytes(value)}" for name, value in plan.host_bytes_per_rank.items() if value)
        lines.append(
            f"host memory per node: {format_bytes(plan.host_bytes_per_node)} {host}"
            + ("" if plan.fits_host else ": DOES NOT FIT")
            + (f" (a rank: {parts}; pinned states in power-of-two blocks)" if parts else "")
        )
    sent = ", ".join(
        f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in plan.comm_bytes_per_layer.items()
    )
    lines.append(f"sent per attention layer and rank (forward + backward): {sent}")
    return "\n".join(lines)


def _check_device(device: str, simulate: bool) -> None:
    if not simulate:
        raise ValueError(f"--device {device}: the device is for --simulate's step; add --simulate or drop --device")
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device; use --device cpu (or leave it out)")


def _check_heads(config: Any, sp: int, ring: int | None, gpus_per_node: int) -> int:
    """The ring degree for ``sp`` (``ring`` or as train chooses it); ValueError naming the flags."""
    from ..hf import head_counts
    from ..layout import resolve_ring_degree

    try:
        return resolve_ring_degree(sp, ring, *head_counts(config), gpus_per_node)
    except ValueError as error:
        raise ValueError(f"--sp {sp}" + (f" --ring {ring}" if ring else "") + f": {error}") from None


def _simulated_line(simulated: dict[str, Any], planned: Features) -> str:
    """What ``--simulate`` measured, against the prediction, and whether the step fit the planned GPU; the step's
    own features where they are not the table's (``planned``): a CPU's, or 'auto' as fp32 on a GPU without bf16."""
    where = f"simulate on {simulated['device']} ({format_bytes(simulated['gpu_memory_bytes'])} planned)"
    features = Features(**simulated["plan"]["features"])
    if simulated["device"].startswith("cpu"):
        where += f", the step as it runs on a CPU ({features.describe()}; all of the planned memory usable there)"
    elif features != planned:
        where += f", the step as it runs on this GPU ({features.describe()}), its own prediction"
    predicted = format_bytes(simulated["predicted_peak_bytes"])
    if simulated["out_of_memory"]:
        return f"{where}: OUT OF MEMORY (does not fit; predicted peak {predicted})"
    verdict = "fits" if simulated["fits"] else "DOES NOT FIT the usable memory"
    ratio = simulated["ratio"]
    off = "" if 0.9 <= ratio <= 1.1 else f"; the prediction is off by {abs(1 - ratio):.0%}: trust the measured peak"
    return (
        f"{where}: {verdict}; measured peak {format_bytes(simulated['measured_peak_bytes'])}, predicted {predicted} "
        f"(predicted / measured = {ratio:.3f}{off}); step {simulated['step_s']:.1f} s, "
        f"{simulated['tokens_per_s']:,.0f} tokens/s"
    )


def plan_command(argv: Sequence[str]) -> int:
    """Run ``ulysses-sp plan``; returns the exit status (2, naming the flag, on bad input)."""
    args: PlanConfig = parse_config(
        PlanConfig,
        argv,
        prog="ulysses-sp plan",
        description="Predict per-GPU memory and the longest trainable sequence; recommend settings.",
    )
    from .memory import plan_memory
    from .recommendation import recommend
    from .search import max_seq_len
    from .shape import model_shape

    config, name = args.model_config
    shape = model_shape(config)  # once (an MoE or MLA model's parameters are counted on it built on the meta device)
    features, dp = args.features(), args.data_parallel
    common: dict[str, Any] = dict(
        gpu_memory_bytes=args.gpu_memory_bytes,
        host_memory_bytes=args.host_memory_bytes,
        gpus_per_node=args.gpus_per_node,
        micro_batch=args.micro_batch,
    )
    plan = plan_memory(shape, seq_len=args.seq_len, sp=args.sp, dp=dp, ring=args.ring, features=features, **common)
    longest = max_seq_len(shape, sp=args.sp, dp=dp, ring=args.ring, features=features, **common)
    advice = recommend(shape, seq_len=args.seq_len, world_size=args.world_size, features=features, **common)
    simulated = None
    if args.simulate:
        import torch

        from ..simulate import simulate_step

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:  # (a step the host cannot hold is refused: it would swap or be killed, not measured)
            simulated = simulate_step(
                config,
                seq_len=args.seq_len,
                sp=args.sp,
                dp=dp,
                ring=plan.ring,
                device=device,
                features=features,
                micro_batch=args.micro_batch,
                gpu_memory_bytes=args.gpu_memory_bytes,
                host_memory_bytes=args.host_memory_bytes,
                gpus_per_node=args.gpus_per_node,
            )
        except ValueError as error:
            print(f"ulysses-sp plan: error: --simulate: {error}", file=sys.stderr)
            return 2
    if args.json:
        out = {"model": name, "plan": plan.to_dict(), "max_seq_len": longest, "recommendation": advice.to_dict()}
        out["notes"] = list(shape.notes)
        if simulated is not None:
            out["simulate"] = simulated
        print(json.dumps(out, indent=2))
        return 0
    padded = args.sp * plan.tokens_per_rank // args.micro_batch  # one sequence's tokens over the SP group
    split = f"= sp {args.sp} x" if padded == args.seq_len else f"padded to {padded:,} = sp {args.sp} x"
    rows = f" ({args.micro_batch} sequences)" if args.micro_batch > 1 else ""
    print(
        f"ulysses-sp plan: {name}, seq_len {args.seq_len:,} {split} {padded // args.sp:,} tokens per rank{rows}, "
        f"dp {dp}, micro-batch {args.micro_batch}, {args.world_size} GPU{'s' * (args.world_size != 1)}"
    )
    for note in shape.notes:
        print(f"note: {note}")
    print(f"layout: {plan.layout_reason}")
    print(f"features: {plan.features.describe()}")
    sliced = f", its core in {plan.core_slices} slices of heads" if plan.core_slices > 1 else ""
    print(f"attention: heads in {plan.head_chunks} chunk{'s' if plan.head_chunks > 1 else ''}{sliced}")
    if plan.checkpoint_choice:
        print(f"checkpoints: {plan.checkpoint_choice}")
    print(_table(plan))
    print(f"longest trainable sequence with these settings: {longest:,} tokens ({longest // args.sp:,} per rank)")
    reach = "reaches" if advice.reaches_target else "cannot reach"
    ring = advice.plan.ring
    layout = f"sp {advice.sp}" + (f" (ulysses {advice.sp // ring} x ring {ring}, --ring {ring})" if ring > 1 else "")
    print(
        f"recommendation ({reach} {args.seq_len:,}): {layout}, dp {advice.dp}, {advice.plan.features.describe()}"
        f"; longest with it: {advice.max_seq_len:,} tokens, peak {format_bytes(advice.plan.peak_bytes)}"
    )
    if simulated is not None:
        print(_simulated_line(simulated, plan.features))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_command(sys.argv[1:]))
