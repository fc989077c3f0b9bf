"""``ulysses-sp plan``: per-GPU memory, the longest trainable sequence and recommended settings.

Reads a model (built-in shape name, config.json, directory or cached hub id), the cluster (GPUs per node,
nodes, GPU and host memory), the layout and the features; prints the breakdown of the predicted peak
(:func:`ulysses_sp.plan.plan_memory`), the longest sequence for those settings and a recommendation.
``--simulate`` also runs one real step as rank 0 of the layout on one device
(:func:`ulysses_sp.simulate.simulate_step`) and prints the measured peak next to the prediction.
``--json`` prints one JSON object instead. Exit status: 0 done (whether or not the plan fits), 2 invalid
flags (the message names the flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .plan import (
    CHECKPOINT_MODES,
    DTYPES,
    LOSS_BUDGET_BYTES,
    PARALLEL_MODES,
    Features,
    MemoryPlan,
    format_bytes,
    load_model_config,
    max_seq_len,
    parse_bytes,
    plan_memory,
    recommend,
)

__all__ = ["build_parser", "plan_command"]


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``ulysses-sp plan`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="ulysses-sp plan",
        description="Predict per-GPU memory and the longest trainable sequence; recommend settings.",
    )
    add = parser.add_argument
    add(
        "--model",
        required=True,
        help="Built-in shape (qwen3-4b, llama-3.1-8b), a config.json, a model "
        "directory, or a Hugging Face id in the local cache.",
    )
    add("--seq-len", type=_positive, required=True, help="Tokens per sequence (before the split over --sp).")
    add("--gpus-per-node", type=_positive, default=8, help="GPUs per node (default: 8).")
    add("--nodes", type=_positive, default=1, help="Nodes (default: 1); world = --gpus-per-node x --nodes.")
    add(
        "--gpu-memory",
        type=_size,
        default=parse_bytes("80GiB"),
        help="Memory of one GPU, e.g. 80GiB, 141GB (default: 80GiB).",
    )
    add(
        "--host-memory",
        type=_size,
        default=0,
        help="Host memory per node, e.g. 1TiB; 0 = do not check "
        "(default: 0). Offloaded optimizer states and activations must fit in it.",
    )
    add("--sp", type=_positive, default=1, help="Sequence-parallel degree (default: 1).")
    add(
        "--dp",
        type=_positive,
        default=None,
        help="Data-parallel degree (default: world / --sp); --sp x --dp must equal the world size.",
    )
    add("--micro-batch", type=_positive, default=1, help="Sequences per micro-batch per SP group (default: 1).")
    add(
        "--tiled-loss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lm_head + cross-entropy in chunks recomputed in backward (default: on).",
    )
    add(
        "--loss-chunk-mib",
        type=_positive,
        default=LOSS_BUDGET_BYTES >> 20,
        help="The logits working set of one loss chunk in MiB, as `ulysses-sp train --loss-chunk-mib` "
        f"(default: {LOSS_BUDGET_BYTES >> 20}).",
    )
    add(
        "--loss-chunk-tokens",
        type=_positive,
        default=None,
        help="Tokens per loss chunk, instead of --loss-chunk-mib (default: from --loss-chunk-mib).",
    )
    add(
        "--tiled-mlp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MLP over sequence chunks with recompute (default: on, as in `ulysses-sp train`).",
    )
    add(
        "--mlp-chunk-tokens",
        type=_positive,
        default=None,
        help="Tokens per MLP chunk (default: max(1024, hidden size)).",
    )
    add(
        "--activation-checkpointing",
        choices=CHECKPOINT_MODES,
        default="offload",
        help="none | checkpoint (layer inputs on the GPU) | offload (layer inputs in host memory) "
        "(default: offload, what `ulysses-sp train` does on a GPU).",
    )
    add(
        "--cpu-offload-optimizer",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="FSDP2 keeps sharded params, grads and AdamW states in host memory (default: off).",
    )
    add("--parallel", choices=PARALLEL_MODES, default="fsdp2", help="fsdp2 or ddp (default: fsdp2).")
    add("--dtype", choices=DTYPES, default="bf16", help="bf16 (autocast, fp32 masters) or fp32 (default: bf16).")
    add(
        "--simulate",
        action="store_true",
        help="Also run one real step as rank 0 of this layout on one device "
        "(fake process group) and report the measured peak next to the prediction.",
    )
    add("--device", default=None, help="Device for --simulate (default: cuda if available, else cpu).")
    add("--json", action="store_true", help="Print one JSON object instead of the table.")
    return parser


def _features(args: argparse.Namespace) -> Features:
    return Features(
        tiled_loss=args.tiled_loss,
        loss_chunk_tokens=args.loss_chunk_tokens,
        loss_budget_bytes=args.loss_chunk_mib << 20,
        tiled_mlp=args.tiled_mlp,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        activation_checkpointing=args.activation_checkpointing,
        cpu_offload_optimizer=args.cpu_offload_optimizer,
        parallel=args.parallel,
        dtype=args.dtype,
    )


def _describe(features: Features) -> str:
    parts = [
        "tiled loss" if features.tiled_loss else "plain loss",
        "tiled MLP" if features.tiled_mlp else "plain MLP",
        f"activation checkpointing {features.activation_checkpointing}",
        "optimizer on CPU" if features.cpu_offload_optimizer else "optimizer on GPU",
        features.parallel.upper(),
        features.dtype,
    ]
    return ", ".join(parts)


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
        host = format_bytes(plan.host_memory_bytes) if plan.host_memory_bytes else "unchecked"
        lines.append(
            f"host memory per node: {format_bytes(plan.host_bytes_per_node)} of {host}"
            + ("" if plan.fits_host else ": DOES NOT FIT")
        )
    return "\n".join(lines)


def plan_command(argv: Sequence[str]) -> int:
    """Run ``ulysses-sp plan``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    world = args.gpus_per_node * args.nodes
    dp = args.dp if args.dp is not None else world // args.sp
    if args.sp * dp != world:
        flag = "--dp" if args.dp is not None else "--sp"
        parser.error(
            f"{flag}: --sp {args.sp} x --dp {dp} must equal the world size {world} "
            f"(--gpus-per-node {args.gpus_per_node} x --nodes {args.nodes})"
        )
    try:
        features = _features(args)
    except ValueError as error:
        parser.error(f"--cpu-offload-optimizer: {error}")
    try:
        config, name = load_model_config(args.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    common: dict[str, Any] = dict(
        gpu_memory_bytes=args.gpu_memory,
        host_memory_bytes=args.host_memory,
        gpus_per_node=args.gpus_per_node,
        micro_batch=args.micro_batch,
    )
    try:
        plan = plan_memory(config, seq_len=args.seq_len, sp=args.sp, dp=dp, features=features, **common)
    except ValueError as error:
        flag = "--seq-len" if "seq_len" in str(error) else "--sp"
        parser.error(f"{flag}: {error}")
    longest = max_seq_len(config, sp=args.sp, dp=dp, features=features, **common)
    advice = recommend(config, seq_len=args.seq_len, world_size=world, features=features, **common)
    simulated = None
    if args.simulate:
        import torch

        from .simulate import simulate_step

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        simulated = simulate_step(
            config,
            seq_len=args.seq_len,
            sp=args.sp,
            dp=dp,
            device=device,
            features=features,
            micro_batch=args.micro_batch,
            gpu_memory_bytes=args.gpu_memory,
        )
    if args.json:
        out = {"model": name, "plan": plan.to_dict(), "max_seq_len": longest, "recommendation": advice.to_dict()}
        if simulated is not None:
            out["simulate"] = simulated
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"ulysses-sp plan: {name}, seq_len {args.seq_len:,} = sp {args.sp} x {plan.tokens_per_rank:,} tokens "
        f"per rank, dp {dp}, micro-batch {args.micro_batch}, {world} GPUs"
    )
    print(f"features: {_describe(features)}")
    print(_table(plan))
    print(f"longest trainable sequence with these settings: {longest:,} tokens ({longest // args.sp:,} per rank)")
    reach = "reaches" if advice.reaches_target else "cannot reach"
    print(
        f"recommendation ({reach} {args.seq_len:,}): sp {advice.sp}, dp {advice.dp}, {_describe(advice.features)}"
        f"; longest with it: {advice.max_seq_len:,} tokens, peak {format_bytes(advice.plan.peak_bytes)}"
    )
    if simulated is not None:
        print(
            f"simulate on {simulated['device']}: measured peak {format_bytes(simulated['measured_peak_bytes'])}, "
            f"predicted {format_bytes(simulated['predicted_peak_bytes'])} (predicted / measured = "
            f"{simulated['ratio']:.3f})"
        )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_command(sys.argv[1:]))
