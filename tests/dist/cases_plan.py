"""2-rank gloo case: the measured peak of one real FSDP2 + Ulysses step, written for the parent to compare."""

import json
import os

import ulysses_sp as U
from tests.unit.test_plan import tiny
from ulysses_sp import ParallelLayout
from ulysses_sp.features import Features
from ulysses_sp.simulate import sharded_step_peak
from ulysses_sp.standin import random_batch

SEQ_LEN = 2048
FEATURES = {
    "fp32-plain": Features(tiled_loss=False, tiled_mlp=False, activation_checkpointing="checkpoint", dtype="fp32"),
    "bf16-tiled": Features(
        tiled_loss=True, loss_chunk_tokens=256, tiled_mlp=False, activation_checkpointing="checkpoint", dtype="bf16"
    ),
}


def world2() -> dict[str, str]:
    layout = ParallelLayout.from_env(sp=2)
    results, measured = {}, {}
    for name, features in FEATURES.items():
        try:
            shard = U.shard_batch(random_batch(512, SEQ_LEN, seed=0), layout)
            measured[name] = sharded_step_peak(tiny("qwen3", kv=2), layout, shard, features=features)["peak_bytes"]
            results[name] = "ok"
        except Exception as error:  # reported to the parent
            results[name] = repr(error)
    with open(os.path.join(os.environ["PLAN_RESULTS_DIR"], f"rank{layout.rank}.json"), "w") as handle:
        json.dump(measured, handle)
    return results
