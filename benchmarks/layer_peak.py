"""The recompute + backward peak of ONE checkpointed decoder layer on one rank of sp, with the heads in chunks.

One process stands in for rank 0 of ``--sp`` ranks (:class:`ulysses_sp.standin.StandIn`: a fake process
group; the all-to-alls hand back this rank's own tensor, which memory does not depend on). A one-layer Llama
(sdpa, causal; the final norm removed) is parallelized with ``head_chunks=C``; its decoder layer is
checkpointed, so its forward keeps only its input. ``PeakMemory`` then measures the backward: the layer's
recompute and its gradients. Parameter gradients and the output's gradient are allocated before (they are the
step's, not the layer's). Peaks are in ``[local tokens, hidden]`` fp32 tensors. Rows:

* ``plain``: untiled MLP and norms, heads unchunked (C=1);
* ``tiled MLP``: the tiled MLP alone, C=1 (the path before head chunks and the tiled layer);
* ``tiled layer, C=c``: tiled MLP, tiled norms and their projections, heads in c chunks.

Prints a table with each row's peak per phase (head chunks: the attention's recompute, the MLP's recompute and
backward, the attention's backward) and its composition at its peak (the largest live tensors, by the code that
made them), and saves Markdown + JSON under ``benchmarks/results/``::

    python benchmarks/layer_peak.py                      # hidden 512, 8 heads, 2 kv heads, 16K tokens, sp=2
    python benchmarks/layer_peak.py --mlp-chunk-tokens 512 --out layer_peak_mlp512
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from ulysses_sp import parallelize
from ulysses_sp.features import Features, apply_features
from ulysses_sp.head_chunks import HeadChunkedFunction
from ulysses_sp.memory import _StorageTracker
from ulysses_sp.standin import StandIn, random_batch

RESULTS = Path(__file__).parent / "results"
_OWN = ("ulysses_sp", "transformers")


class _Composition(_StorageTracker):
    """The tracker of ``PeakMemory`` (CPU), also noting which code made each storage and what was live at the peak."""

    def __init__(self, large: int) -> None:
        super().__init__("cpu")
        self.large = large  # storages at least this big are attributed to the code that made them
        self.made: dict[int, str] = {}
        self.at_peak: list[tuple[str, int]] = []
        self.phase = "layer"  # the part of the layer's backward running now (see _phases)
        self.phase_peaks: dict[str, int] = {}

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        for storage in self._storages(tensor):
            if storage._cdata not in self._counted and storage.nbytes() >= self.large:
                self.made[storage._cdata] = _maker(tuple(tensor.shape))
        super()._track(tensor, inputs)

    def _count(self, key: int, storage: torch.UntypedStorage) -> None:
        peak = self.peak
        super()._count(key, storage)
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.current)
        if self.peak > peak:
            self.at_peak = [(self.made.get(k, "smaller tensors"), n) for k, (_, n) in self._counted.items() if n]


@contextlib.contextmanager
def _phases(tracker: _Composition) -> Iterator[None]:
    """Name the parts of a head-chunked layer's backward in ``tracker``: the attention's recompute, then the MLP's
    recompute and backward, then the attention's backward (a layer whose heads are not in chunks stays "layer")."""
    forward, backward = HeadChunkedFunction.forward, HeadChunkedFunction.backward

    def run_forward(ctx: Any, *args: Any) -> Any:
        tracker.phase = "attention recompute"
        out = forward(ctx, *args)
        tracker.phase = "MLP"
        return out

    def run_backward(ctx: Any, *args: Any) -> Any:
        tracker.phase = "attention backward"
        return backward(ctx, *args)

    HeadChunkedFunction.forward, HeadChunkedFunction.backward = staticmethod(run_forward), staticmethod(run_backward)
    try:
        yield
    finally:
        HeadChunkedFunction.forward, HeadChunkedFunction.backward = staticmethod(forward), staticmethod(backward)


def _maker(shape: tuple[int, ...]) -> str:
    """``shape`` and the innermost ulysses_sp / transformers function that made it."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if any(f"/{name}/" in frame.filename for name in _OWN):
            return f"{list(shape)} {Path(frame.filename).stem}.{frame.name}"
    return f"{list(shape)} autograd"


def layer_backward_peak(
    features: Features,
    chunks: int,
    *,
    sp: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    tokens: int,
    seed: int = 0,
) -> dict:
    """The decoder layer's recompute + backward peak on rank 0 of ``sp`` (fp32, CPU), in ``[t, h]`` tensors, and
    what was live at it."""
    with StandIn(sp=sp, sp_rank=0) as rank:
        torch.manual_seed(seed)
        config = LlamaConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=intermediate,
            num_hidden_layers=1,
            vocab_size=64,
            max_position_embeddings=tokens,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config)
        apply_features(model, features, "cpu")
        parallelize(model, rank.layout, head_chunks=chunks)
        model.model.norm = nn.Identity()  # the decoder's output is the layer's
        model.train()
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        shard = rank.shard(random_batch(config.vocab_size, tokens))
        out = model.model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]).last_hidden_state
        grad_out = torch.randn_like(out)  # [b, t, h]
        one = out.numel() * out.element_size()  # one [t, h] tensor
        tracker = _Composition(large=one // 8)
        tracker.__enter__()
        try:
            with _phases(tracker):
                out.backward(grad_out)
        finally:
            tracker.__exit__(None, None, None)
    parts: dict[str, float] = {}
    for name, nbytes in tracker.at_peak:
        parts[name] = parts.get(name, 0.0) + nbytes / one
    top = sorted(parts.items(), key=lambda item: -item[1])
    phases = {name: round(nbytes / one, 3) for name, nbytes in tracker.phase_peaks.items()}
    peak = round(tracker.peak / one, 3)
    return {"peak_bytes": tracker.peak, "tokens_x_hidden": peak, "phases": phases, "at_peak": top}


def _rows(chunks: list[int], mlp_chunk: int | None) -> list[tuple[str, Features, int]]:
    common = dict(tiled_loss=False, activation_checkpointing="checkpoint", mlp_chunk_tokens=mlp_chunk)
    rows = [
        ("plain", Features(tiled_mlp=False, tiled_norms=False, **common), 1),
        ("tiled MLP", Features(tiled_norms=False, **common), 1),
    ]
    return rows + [(f"tiled layer, C={c}", Features(**common), c) for c in chunks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("heads", 8), ("kv-heads", 2), ("intermediate", 1408), ("sp", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--tokens", type=int, default=16384, help="the whole sequence (each rank holds 1/sp)")
    parser.add_argument("--head-chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mlp-chunk-tokens", type=int, default=None, help="default: the tiled MLP's own")
    parser.add_argument("--out", default="layer_peak", help="file stem under benchmarks/results/")
    args = parser.parse_args()
    shape = dict(
        sp=args.sp,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        tokens=args.tokens,
    )
    results = {}
    for label, features, chunks in _rows(args.head_chunks, args.mlp_chunk_tokens):
        results[label] = layer_backward_peak(features, chunks, **shape)
        print(f"{label}: {results[label]['tokens_x_hidden']} [t, h]", flush=True)
    base = results["tiled MLP"]["peak_bytes"]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {when}"
    lines = [
        f"Decoder-layer recompute + backward peak, rank 0 of sp={args.sp} (stand-in): Llama hidden {args.hidden}, "
        f"{args.heads} heads, {args.kv_heads} kv heads, intermediate {args.intermediate}, {args.tokens} tokens "
        f"({args.tokens // args.sp} per rank), fp32, MLP chunk "
        f"{args.mlp_chunk_tokens or 'default'} tokens; {machine}. Unit: one [local tokens, hidden] fp32 tensor.",
        "",
        "| path | peak [t, h] | tiled MLP / this | peak by phase | largest at the peak |",
        "|---|---:|---:|---|---|",
    ]
    for label, row in results.items():
        largest = "; ".join(f"{share:.2f} {name}" for name, share in row["at_peak"][:6])
        phases = "; ".join(f"{name} {value:.2f}" for name, value in row["phases"].items() if name != "layer") or "-"
        lines.append(
            f"| {label} | {row['tokens_x_hidden']:.2f} | {base / row['peak_bytes']:.2f}x | {phases} | {largest} |"
        )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(table + "\n")
    payload = {"shape": shape, "mlp_chunk_tokens": args.mlp_chunk_tokens, "machine": machine, "rows": results}
    (RESULTS / f"{args.out}.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
