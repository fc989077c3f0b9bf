"""Longest sequence per rank before and after the long-sequence features, from the planner (and simulate).

For Qwen3-4B and Llama-3.1-8B on 80 GiB GPUs, at sp=1 (one GPU) and sp=8 (one node of 8), it prints and
saves (benchmarks/results/max_seq_len.json and .md) the planner's longest trainable sequence:
* before: plain loss and MLP, gradient checkpointing, FSDP2 with the optimizer on CPU (the measured
  baseline: Qwen3-4B stopped at 36K tokens on one H100);
* after: tiled loss, tiled MLP, tiled norms, head chunks, optimizer on CPU, and the checkpoints where the planner
  places them from the host memory (every layer's input, or 1 in k, on the host or the GPU), as ``train`` does.
Host memory: a DGX H100 node (2 TiB for 8 GPUs); the one-GPU rows use one GPU of such a node.
``--simulate`` also runs one real step at each found length as rank 0 of the layout on the local GPU and
records the measured peak; without a GPU, ``--simulate-cpu`` runs it for a small model on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch
import transformers

from ulysses_sp.plan import Features, GiB, max_seq_len, plan_memory

MODELS = ("qwen3-4b", "llama-3.1-8b")
HOST = 2 << 40  # 2 TiB per 8-GPU node
GPU = 80 * GiB


def rows(simulate: bool) -> list[dict]:
    out = []
    for model in MODELS:
        for sp in (1, 8):
            row = {"model": model, "sp": sp, "gpus_per_node": sp}
            for label, features in (
                ("before", Features.baseline()),
                ("after", Features.all_on(activation_checkpointing="auto")),
            ):
                longest = max_seq_len(
                    model, sp=sp, features=features, gpu_memory_bytes=GPU, host_memory_bytes=HOST, gpus_per_node=sp
                )
                plan = plan_memory(
                    model,
                    seq_len=longest,
                    sp=sp,
                    features=features,
                    gpu_memory_bytes=GPU,
                    host_memory_bytes=HOST,
                    gpus_per_node=sp,
                )
                row[label] = {
                    "max_seq_len": longest,
                    "per_rank": longest // sp,
                    "peak_gib": plan.peak_bytes / GiB,
                    "phase": plan.phase,
                    "features": features.__dict__,
                }
                if simulate:
                    from ulysses_sp.simulate import simulate_step

                    result = simulate_step(model, seq_len=longest, sp=sp, device="cuda", features=features)
                    row[label]["simulated_peak_gib"] = result["measured_peak_bytes"] / GiB
            out.append(row)
    return out


def cpu_simulate() -> dict:
    """simulate vs planner for a small Llama on the CPU (no GPU here)."""
    from transformers import LlamaConfig

    from ulysses_sp.simulate import simulate_step

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1 << 16,
    )
    result = simulate_step(
        config,
        seq_len=8192,
        sp=4,
        dp=2,
        features=Features(tiled_mlp=False, activation_checkpointing="checkpoint", dtype="bf16"),
    )
    return {
        k: result[k] for k in ("seq_len", "sp", "dp", "device", "measured_peak_bytes", "predicted_peak_bytes", "ratio")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="run simulate_step on the local GPU too")
    parser.add_argument("--simulate-cpu", action="store_true", help="run a small simulate on the CPU")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="output folder")
    args = parser.parse_args()
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "assumptions": {"gpu_memory": "80 GiB (75 GiB usable)", "host_memory_per_node": "2 TiB", "dtype": "bf16"},
        "rows": rows(args.simulate),
    }
    if args.simulate_cpu:
        record["cpu_simulate"] = cpu_simulate()
    lines = [
        "| model | GPUs (sp) | before: max seq | after: max seq | after: per rank | after: peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        lines.append(
            f"| {row['model']} | {row['sp']} | {row['before']['max_seq_len']:,} | "
            f"{row['after']['max_seq_len']:,} | {row['after']['per_rank']:,} | "
            f"{row['after']['peak_gib']:.1f} |"
        )
    table = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "max_seq_len.json").write_text(json.dumps(record, indent=2))
    (out / "max_seq_len.md").write_text(f"Planner, {record['date']}, torch {record['torch']}\n\n{table}\n")
    print(table)
    if "cpu_simulate" in record:
        print("cpu simulate:", record["cpu_simulate"])


if __name__ == "__main__":
    main()
