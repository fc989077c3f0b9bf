"""``ulysses-sp bench`` at tiny sizes, as a subprocess: the files it writes and the sanity of their numbers.

DeepSpeed is optional: where it is not installed the DeepSpeed rows must be absent and the report must say
so; where it is, its rows are checked too.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from ulysses_sp.bench.deepspeed_ref import deepspeed_available

pytestmark = pytest.mark.slow

TIMEOUT = 240


def _bench(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "ulysses_sp", "bench", *args]
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"ulysses-sp bench {' '.join(args)} did not finish in {TIMEOUT} s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bench")
    result = _bench(["--size", "tiny", "--gpu", "off", "--output-dir", "out", "--markdown", "REPORT.md"], root)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return root, json.loads((root / "out" / "results.json").read_text())


def test_writes_json_plots_and_markdown(run):
    root, results = run
    for name in ("memory.png", "comm.png", "steptime.png"):
        data = (root / "out" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 200_000, (name, len(data))
    report = (root / "REPORT.md").read_text()
    assert "ulysses-sp bench --size tiny" in report  # the command that made it
    for section in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "Machine:", "Versions:", "Date:", "Load average"):
        assert section in report, section
    assert "](out/memory.png)" in report  # image links relative to the report
    assert results["environment"]["torch"] and results["environment"]["date"]
    assert results["gpu"] == {"skipped": "--gpu off"}


def test_memory_falls_with_sp_and_matches_a_real_rank(run):
    _, results = run
    rows = {(r["sp"], r["seq_len"]): r for r in results["memory"]}
    seq_lens = sorted({n for _, n in rows})
    for n in seq_lens:
        saved = [rows[sp, n]["saved_bytes"] for sp in (1, 2, 4)]
        assert saved[0] > saved[1] > saved[2] > 0, saved
        assert all(rows[sp, n]["peak_bytes"] >= rows[sp, n]["saved_bytes"] for sp in (1, 2, 4))
    assert rows[1, seq_lens[1]]["saved_bytes"] > rows[1, seq_lens[0]]["saved_bytes"]
    world = results["worlds"]["2"]
    # One process standing in for rank 1 of 2 saves exactly what the real gloo rank 0 saves.
    assert world["rank_memory"]["saved_bytes"] == rows[2, world["seq_len"]]["saved_bytes"]


def test_collectives_and_agreement(run):
    _, results = run
    comm = {(r["sp"], r["implementation"]): r for r in results["comm"]}
    ours = comm[2, "ulysses-sp"]
    assert ours["all_to_all_per_layer"] == 4  # fused q/k/v + output, forward and backward
    assert ours["all_to_all_bytes_per_layer"] == comm[2, "ulysses formula"]["all_to_all_bytes_per_layer"]
    assert ours["all_gather_per_step"] == 2  # shapes + positions, once per forward
    assert comm[2, "ring attention"]["p2p_bytes_per_layer"] > 0
    ring, formula = comm[2, "ulysses-sp ring"], comm[2, "ring attention"]
    assert ring["source"] == "measured" and ring["all_to_all_per_layer"] == 0
    assert ring["p2p_bytes_per_layer"] == formula["p2p_bytes_per_layer"]  # the ring sends what its formula says
    assert ring["p2p_sends_per_layer"] == formula["p2p_sends_per_layer"]
    world = results["worlds"]["2"]
    for name in ("ulysses-sp", "ulysses-sp ring"):
        agreement = world["agreement"][f"{name} vs one process"]
        assert agreement["loss_abs_diff"] < 1e-5 and agreement["grad_max_rel_diff"] < 1e-4, (name, agreement)
    assert "ulysses-sp ring / ulysses-sp" in world["ratios"]
    for ratio in world["ratios"].values():
        assert math.isfinite(ratio["median"]) and 0.05 < ratio["median"] < 20, ratio
        assert ratio["reps"] == 3
    if deepspeed_available():
        ds = comm[2, "deepspeed"]
        assert ds["all_to_all_per_layer"] == 8  # q, k, v, out, forward and backward
        assert ds["all_gather_per_step"] == world["num_layers"]  # position_ids in every layer
        assert world["agreement"]["ulysses-sp vs deepspeed"]["grad_max_rel_diff"] < 1e-4
        assert "deepspeed / ulysses-sp" in world["ratios"]
    else:
        assert (2, "deepspeed") not in comm and "deepspeed / ulysses-sp" not in world["ratios"]
        assert "deepspeed is not installed" in results["deepspeed_skipped"]


def test_head_chunk_step_time(run):
    """Section 6: C=4 over C=1 step-time ratios (plain and checkpointed layers), the same loss for all four
    models, the exchange wait of a C=4 step, the same ratios of the CPU time summed over the ranks and of one
    process standing in for rank 0 with no exchange (compute alone), and the table in the report."""
    root, results = run
    world = results["head_chunks"]["2@512"]
    plain = {"C=4 / C=1", "C=4 / C=1, checkpointed layers"}
    suffixes = ("", ", CPU over the ranks", ", compute alone")
    assert set(world["ratios"]) == {name + suffix for name in plain for suffix in suffixes}
    assert all(len(times) == 3 for times in world["compute_alone_s"].values()), world["compute_alone_s"]
    # the ranks' CPU per step, summed: some, and no more than the cores give in the step's wall time (a little slack:
    # each rank's window is its own, rank 0's wall time is between its barriers)
    for name, cpu in world["cpu_s"].items():
        wall = world["step_times_s"][name]
        assert len(cpu) == 3 and all(0 < c < 1.25 * world["cores"] * w for c, w in zip(cpu, wall, strict=True)), name
    for ratio in world["ratios"].values():
        assert math.isfinite(ratio["median"]) and 0.05 < ratio["median"] < 20 and ratio["reps"] == 3, ratio
    losses = list(world["losses"].values())
    assert len(losses) == 4 and max(losses) - min(losses) < 1e-5, world["losses"]
    assert 0 <= world["exposed_wait_s"] < max(ratio["median_time_s"] for ratio in world["ratios"].values())
    report = (root / "REPORT.md").read_text()
    assert "## 6. Head-chunked attention" in report and "| 2 | 512 | C=4 / C=1 |" in report
    assert "| 2 | 512 | C=4 / C=1, compute alone |" in report
    assert "| 2 | 512 | C=4 / C=1, CPU over the ranks |" in report and "CPU s over the 2 ranks on" in report


def test_tiled_loss_against_the_plain_loss(run):
    """Section 7: the tiled loss (and its recompute form) against the plain loss, one row per chunk size, each
    ratio taken against the plain loss of its own round, and the table in the report."""
    root, results = run
    found = results["tiled_loss"]
    assert found["setup"]["tokens"] == 256 and found["setup"]["vocab"] == 2048 and found["setup"]["rounds"] == 3
    assert [row["chunk_tokens"] for row in found["rows"]] == [256, 256]  # the default and 512, capped at the tokens
    for row in found["rows"]:
        for clock in ("wall", "cpu"):
            assert row[f"{clock}_ratio"]["plain"] == 1.0, row
            for name in ("tiled", "recompute"):
                low, high = row[f"{clock}_ratio_range"][name]
                assert 0.01 < low <= row[f"{clock}_ratio"][name] <= high < 100, (clock, name, row)
    report = (root / "REPORT.md").read_text()
    assert "## 7. Tiled lm_head + loss against the plain loss" in report and "| cpu | 256 | 1 |" in report


def test_bad_flag_exits_2_naming_it(tmp_path, capsys):
    from ulysses_sp.bench.runner import main

    out = tmp_path / "out"
    assert main(["--size", "tiny", "--seq-len", "513", "--output-dir", str(out), "--no-markdown"]) == 2
    assert "--seq-len 513" in capsys.readouterr().err and not out.exists()
    with mock.patch("ulysses_sp.bench.runner.run_bench", side_effect=AssertionError("it went on to measure")):
        assert main(["--size", "tiny", "--gpu-memory", "0GiB", "--output-dir", str(out), "--no-markdown"]) == 2
    assert "--gpu-memory must be more than 0" in capsys.readouterr().err and not out.exists()  # (a cap of 0 bytes)


@pytest.mark.parametrize("where", ["--output-dir", "--markdown"])
def test_an_output_path_it_cannot_write_exits_2_before_measuring(where, tmp_path, capsys):
    """A results folder or a markdown report under a file (or anywhere it cannot write): refused at once, naming
    the flag. The report used to fail only after every section was measured (--markdown), the folder with a
    traceback (--output-dir)."""
    from ulysses_sp.bench.runner import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    paths = {"--output-dir": str(tmp_path / "out"), "--markdown": str(tmp_path / "B.md")}
    paths[where] = str(blocker / ("B.md" if where == "--markdown" else "out"))
    args = ["--size", "tiny", "--output-dir", paths["--output-dir"], "--markdown", paths["--markdown"]]
    with mock.patch("ulysses_sp.bench.runner.run_bench", side_effect=AssertionError("it went on to measure")):
        assert main(args) == 2
    err = capsys.readouterr().err
    assert f"ulysses-sp bench: error: {where}" in err and "a-file" in err and "Traceback" not in err, err


def test_an_sp_degree_the_heads_do_not_split_exits_2_before_any_rank(tmp_path):
    """--memory-sp 3 of a 4-head model: argparse's exit 2 and one error line naming the flag and the values that
    work, before anything is measured or written (it was a rank's traceback with library advice, exit 1)."""
    result = _bench(["--size", "tiny", "--no-markdown", "--memory-sp", "3", "--output-dir", "out"], tmp_path)
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ulysses-sp bench: error: --memory-sp 3 ") and last.endswith("values that work: 1, 2, 4")
    assert "Traceback" not in result.stderr and not result.stdout and not (tmp_path / "out").exists()


def test_report_from_redraws_without_measuring(run, tmp_path):
    from ulysses_sp.bench.runner import main

    root, results = run
    source = root / "out" / "results.json"
    report = tmp_path / "AGAIN.md"
    assert main(["--report-from", str(source), "--markdown", str(report), "--output-dir", str(tmp_path / "png")]) == 0
    text = report.read_text()
    assert "--report-from" in text and f"{results['memory'][0]['saved_bytes'] / 2**20:,.2f}" in text
    assert (tmp_path / "png" / "memory.png").is_file()
