"""The GPU mode of ``ulysses-sp bench`` point by point, each (model, sp) planned for its own GPU memory.

A step at the planner's longest sequence for a whole H100/H200 runs for many minutes (attention is quadratic in
the sequence), longer than a GPU lease allows; planning for less memory than the card has (the allocator is
capped at it, see ``ulysses_sp.simulate.memory_cap``) keeps each step short while checking the same claim: the
step fits at the predicted maximum, not 10% above it, and the measured peak is within 10% of the prediction.

    python benchmarks/gpu_validation.py --point llama-3.1-8b:8:14GiB qwen3-4b:1:14GiB --out results/gpu

Each point is ``model:sp:gpu-memory``; results are written (JSON) after every point, so a run cut off by a time
limit keeps what it measured, and a table is printed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from ulysses_sp.cli import use_expandable_segments

use_expandable_segments(os.environ)  # before torch touches CUDA: the allocator `ulysses-sp train` runs, as planned
import torch  # noqa: E402
import transformers  # noqa: E402

from ulysses_sp.bench.gpu import run_gpu  # noqa: E402
from ulysses_sp.bench.report import gpu_table  # noqa: E402
from ulysses_sp.features import Features  # noqa: E402
from ulysses_sp.plan.units import parse_flag_bytes  # noqa: E402
from ulysses_sp.simulate import allocator_settings  # noqa: E402


def _environment() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "allocator": allocator_settings(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--point", nargs="+", required=True, help="model:sp:gpu-memory, e.g. llama-3.1-8b:8:14GiB")
    parser.add_argument("--host-memory", default="120GiB", help="this host's memory (per GPU of the layout)")
    parser.add_argument("--step-budget-s", type=float, default=240.0, help="skip points estimated to take longer")
    parser.add_argument("--throughput-seq-len", type=int, default=65536)
    parser.add_argument("--granularity", type=int, default=8192, help="planned lengths are multiples of this x sp")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--device", default=None, help="default cuda:0 (a CPU runs it too: the tests)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu_validation"))
    args = parser.parse_args(argv)
    points = []
    for spec in args.point:
        parts = spec.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            raise ValueError(f"--point {spec!r}: expected model:sp:gpu-memory, e.g. llama-3.1-8b:8:14GiB")
        points.append((parts[0], int(parts[1]), parts[2]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"environment": _environment(), "host_memory": args.host_memory, "points": []}
    print(json.dumps(results["environment"]), flush=True)
    for model, sp, gpu_memory in points:
        result = run_gpu(
            models=(model,),
            sp_sizes=(sp,),
            gpu_memory_bytes=parse_flag_bytes("gpu_memory", gpu_memory),
            host_memory_bytes=parse_flag_bytes("host_memory", args.host_memory),
            throughput_seq_len=args.throughput_seq_len,
            granularity=args.granularity,
            step_budget_s=args.step_budget_s,
            features=Features(cpu_offload_optimizer=True, dtype=args.dtype),
            device=args.device,
            log=lambda line: print(line, flush=True),
        )
        if "skipped" in result:
            raise SystemExit(f"gpu_validation: {result['skipped']}")
        results["points"].append({"model": model, "sp": sp, "gpu_memory": gpu_memory, "result": result})
        (out / "gpu_validation.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    env = results["environment"]
    lines = [
        f"{env['device']}, torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, Python "
        f"{env['python']}, {env['date']}; host memory {args.host_memory} per GPU of the layout."
    ]
    for entry in results["points"]:
        lines += ["", f"### {entry['model']}, sp={entry['sp']}, planned for {entry['gpu_memory']}", ""]
        lines += gpu_table(entry["result"])
    table = "\n".join(lines) + "\n"
    (out / "gpu_validation.md").write_text(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
