"""2-rank gloo case: the measured peak of one real FSDP2 + Ulysses step, written for the parent to compare."""

import json
import os

from tests.unit.test_plan import tiny
from ulysses_sp import ParallelLayout
from ulysses_sp.plan import Features
from ulysses_sp.simulate import measure_step

SEQ_LEN = 2048
FEATURES = {
    "fp32-plain": Features(tiled_loss=False, dtype="fp32"),
    "bf16-tiled": Features(tiled_loss=True, loss_chunk_tokens=256, dtype="bf16"),
}


def world2() -> dict[str, str]:
    layout = ParallelLayout.from_env(sp=2)
    results, measured = {}, {}
    for name, features in FEATURES.items():
        try:
            measured[name] = measure_step(tiny("qwen3", kv=2), layout, seq_len=SEQ_LEN, features=features)["peak_bytes"]
            results[name] = "ok"
        except Exception as error:  # reported to the parent
            results[name] = repr(error)
    with open(os.path.join(os.environ["PLAN_RESULTS_DIR"], f"rank{layout.rank}.json"), "w") as handle:
        json.dump(measured, handle)
    return results
