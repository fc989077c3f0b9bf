"""Planner vs simulate (fake world, one process) vs a real 2-rank gloo step, on the same tiny Qwen3."""

import json

import pytest

from tests.dist.cases_plan import FEATURES, SEQ_LEN
from tests.helpers.harness import assert_case, run_world
from tests.unit.test_plan import tiny
from ulysses_sp.plan import plan_memory
from ulysses_sp.simulate import simulate_step


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    import os

    folder = tmp_path_factory.mktemp("plan")
    os.environ["PLAN_RESULTS_DIR"] = str(folder)
    results = run_world(2, "tests.dist.cases_plan:world2")
    with open(folder / "rank0.json") as handle:
        return results, json.load(handle)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_plan_and_simulate_agree_with_a_real_two_rank_step(measured, name):
    results, peaks = measured
    assert_case(results, name, 2)
    real = peaks[name]
    features = FEATURES[name]
    simulated = simulate_step(tiny("qwen3", kv=2), seq_len=SEQ_LEN, sp=2, dp=1, features=features)
    predicted = plan_memory(tiny("qwen3", kv=2), seq_len=SEQ_LEN, sp=2, dp=1, features=features, device="cpu")
    print(f"{name}: measured {real}, simulated {simulated['measured_peak_bytes']}, predicted {predicted.peak_bytes}")
    assert simulated["measured_peak_bytes"] == pytest.approx(real, rel=0.15)
    assert predicted.peak_bytes == pytest.approx(real, rel=0.15)
