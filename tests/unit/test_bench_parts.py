"""Parts of the benchmark that need no second process: the collective counter, the max-sequence search, the
per-rank stand-in and the formulas."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ulysses_sp
from ulysses_sp.bench.collectives import CollectiveCounter
from ulysses_sp.bench.gpu import run_gpu
from ulysses_sp.bench.models import bench_model
from ulysses_sp.memory import SavedActivations
from ulysses_sp.plan import search_longest
from ulysses_sp.shapes import SHAPES
from ulysses_sp.standin import StandIn, fake_world, measure_step, random_batch
from ulysses_sp.traffic import ring_p2p_per_layer, ulysses_bytes_per_layer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("capacity", [0, 5000, 8192, 20000, 100_000, 10**9])
def test_search_finds_the_largest_length_that_fits(capacity):
    found, trials, complete = search_longest(lambda n: n <= capacity, start=8192, limit=1 << 20, granularity=1024)
    assert complete
    assert found == min(capacity // 1024 * 1024, 1 << 20)
    assert len(trials) <= 12 + 10  # doublings + bisection steps


def test_search_stops_when_the_budget_is_spent():
    found, trials, complete = search_longest(
        lambda n: None if n > 40_000 else True, start=8192, limit=1 << 20, granularity=1024
    )
    assert (found, complete) == (32768, False) and [t for t, _ in trials] == [8192, 16384, 32768]


def test_counter_sees_every_collective_and_the_stand_in_matches_the_formula():
    # The fake backend's own group: its collectives go through the c10d operators the counter sees (the
    # stand-in's simulated SP group is a Python process group, which bypasses them).
    shape = SHAPES["llama-bench-tiny"]
    with fake_world(4, rank=3):
        layout = ulysses_sp.ParallelLayout.from_groups(dist.group.WORLD)
        assert dist.get_world_size() == 4 and layout.sp == 4
        model = ulysses_sp.parallelize(bench_model("llama-bench-tiny", 512), layout)
        shard = ulysses_sp.shard_batch(random_batch(shape["vocab_size"], 512), layout)
        with CollectiveCounter() as counter:
            ulysses_sp.causal_lm_loss(model, shard, layout).backward()
        stats = ulysses_sp.ulysses_context(model).stats
    assert not dist.is_initialized()
    layers = shape["num_hidden_layers"]
    assert counter.calls["all_to_all"] == 4 * layers == stats.calls["all_to_all"]
    assert counter.bytes["all_to_all"] == stats.bytes["all_to_all"]
    expected = ulysses_bytes_per_layer(
        batch=1, seq_len=512, sp=4, heads=4, kv_heads=2, head_dim=16, element_size=4
    )  # kv heads (2) < sp (4): each kv head goes to 2 ranks
    assert counter.bytes["all_to_all"] == layers * expected
    assert counter.calls["all_reduce"] == 2  # the token-weighted loss, forward and backward


@pytest.mark.parametrize("sp,heads,kv_heads", [(2, 16, 4), (4, 16, 4), (2, 8, 8), (4, 8, 2)])
def test_head_chunk_traffic_is_the_formula_and_the_plan_reports_it(sp, heads, kv_heads):
    """Every all-to-all of one layer's forward and backward with the heads in C chunks, counted on a stand-in rank,
    is what the formula says, and the plan reports it for the C it plans. Chunks send more than C = 1 (each sends
    its q/k/v again in backward); where they share the kv heads (fewer per chunk than ranks) the same for any C: the
    kv heads go once each way, as without chunks, and the output's row sums travel with its gradient instead of the
    output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ulysses_sp.head_split import ChunkHeads, head_chunk_choices
    from ulysses_sp.plan import plan_memory

    config = LlamaConfig(
        hidden_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, intermediate_size=64,
        num_hidden_layers=1, vocab_size=64, attn_implementation="sdpa",
    )  # fmt: skip
    sent, shared = {}, {}
    for chunks in head_chunk_choices(heads, kv_heads, sp)[:3]:
        with StandIn(sp=sp, sp_rank=sp - 1) as rank:
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            stats = ulysses_sp.CommStats()
            ulysses_sp.parallelize(model, rank.layout, head_chunks=chunks, stats=stats)
            shard = rank.shard(random_batch(64, 256))
            model.model(
                input_ids=shard["input_ids"], position_ids=shard["position_ids"]
            ).last_hidden_state.sum().backward()
        want = ulysses_bytes_per_layer(
            batch=1, seq_len=256, sp=sp, heads=heads, kv_heads=kv_heads, head_dim=16, element_size=4, chunks=chunks
        )
        assert stats.bytes["all_to_all"] == want, (chunks, stats.bytes, want)
        shared[chunks] = ChunkHeads(heads, kv_heads, chunks, sp).shared_kv
        # per chunk 2 forward, 2 backward (its q/k/v with the output's gradient in one, then their gradients); shared
        # kv heads travel with chunk 0's q (forward and backward) and their gradients with the last chunk's
        assert stats.calls["all_to_all"] == (4 if chunks == 1 else 4 * chunks)
        features = ulysses_sp.Features(head_chunks=chunks, dtype="fp32")
        plan = plan_memory(config, seq_len=256, sp=sp, features=features, device="cpu")
        assert plan.head_chunks == chunks and plan.comm_bytes_per_layer["all_to_all"] == want
        sent[chunks] = want
    assert len(sent) > 1
    assert all(sent[c] > sent[1] for c in sent if c > 1), sent
    # sharing the kv heads, every C sends the same: 1.5x C = 1's less the output the backward no longer sends
    # (its row sums instead: one element per head instead of head_dim)
    out = 256 // sp * heads * 16 * 4  # one forward's output bytes on this rank (b n H d, fp32)
    assert all(2 * sent[c] == 3 * sent[1] - 2 * out * (1 - 1 / 16) for c in sent if shared[c]), (sent, shared)


def test_stand_in_memory_scales_with_the_shard():
    shape = SHAPES["llama-bench-tiny"]
    saved = {}
    for sp in (1, 2):
        with StandIn(sp=sp, sp_rank=sp - 1) as rank:
            model = ulysses_sp.parallelize(bench_model("llama-bench-tiny", 512), rank.layout)
            shard = rank.shard(random_batch(shape["vocab_size"], 512))
            saved[sp] = measure_step(model, shard, rank.layout)["saved_bytes"]
    assert 0.45 < saved[2] / saved[1] < 0.6, saved  # half the tokens per rank, plus full-length attention stats


def test_saved_activations_dedupes_storages_and_skips_parameters():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedActivations(torch.nn.Linear(1, 1)) as saved_all:
        y = x @ weight
        (y * y).sum()  # y saved twice (one storage)
    assert saved_all.bytes == x.numel() * 4 + weight.numel() * 4 + y.numel() * 4
    module = torch.nn.Linear(8, 8, bias=False)
    with SavedActivations(module) as saved:
        module(x).sum()
    assert saved.bytes == x.numel() * 4  # the weight is a parameter, not an activation


def test_ring_formula():
    ring = ring_p2p_per_layer(batch=1, seq_len=1024, ring=4, kv_heads=2, head_dim=16, element_size=2)
    kv = 2 * 2 * 256 * 16
    assert ring == {
        "forward_bytes": 3 * kv * 2,
        "backward_bytes": 3 * kv * 2 + 4 * kv * 4,
        "forward_sends": 3,
        "backward_sends": 7,  # k/v 3 times, their gradients 4 hops
    }
    assert (
        ring_p2p_per_layer(batch=1, seq_len=1024, ring=1, kv_heads=2, head_dim=16, element_size=2)["forward_bytes"] == 0
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
def test_gpu_mode_skips_cleanly_without_cuda():
    assert run_gpu() == {"skipped": "no CUDA device"}


def test_gpu_mode_measures_at_the_planned_maximum_and_skips_what_would_run_too_long():
    """The GPU mode's steps, run on the CPU (where a step fits when its measured peak is within the planned
    memory): a first step at the throughput length, then the planner's longest sequence and 10% more; a point
    whose estimated step time is over the budget is skipped, naming the estimate; the report has a row a point."""
    from ulysses_sp.bench.report import _gpu
    from ulysses_sp.features import Features

    settings = dict(models=("llama-bench-tiny",), sp_sizes=(2,), gpu_memory_bytes=9 << 20, device="cpu")
    settings.update(granularity=256, throughput_seq_len=512, features=Features(dtype="fp32"))
    found = run_gpu(**settings, step_budget_s=600)
    row = found["models"]["llama-bench-tiny"]["layouts"]["2"]
    longest, points = row["predicted_max_seq_len"], row["points"]
    assert [points[p]["seq_len"] for p in ("throughput", "max")] == [512, longest] and longest > 512
    assert points["over"]["seq_len"] >= longest * 1.1 and points["over"]["seq_len"] % 512 == 0
    assert points["max"]["fits"] and points["max"]["predicted_fits"] and not points["over"]["predicted_fits"]
    assert 0.9 <= points["max"]["ratio"] <= 1.1 and points["throughput"]["tokens_per_s"] > 0
    # TFLOPs are per GPU: the sequence's model FLOPs over the step and the 2 ranks (an H200 read MFU 1.65 at sp=8
    # when they were the whole sequence's over one GPU's peak)
    from ulysses_sp.shapes import random_model, shape_config
    from ulysses_sp.train.model_factory import training_flops_per_token

    at = points["throughput"]
    meta = random_model(shape_config("llama-bench-tiny"), device="meta")
    flops = training_flops_per_token(meta, 512) * 512
    assert at["tflops"] == pytest.approx(flops / at["step_s"] / 2 / 1e12, rel=1e-9)
    table = [line for line in _gpu({"gpu": found}, None) if line.startswith("| llama-bench-tiny")]
    assert len(table) == 3 and "planned max + 10%" in table[2]
    hurried = run_gpu(**settings, step_budget_s=1e-3)["models"]["llama-bench-tiny"]["layouts"]["2"]["points"]
    assert hurried["throughput"]["fits"] and hurried["max"]["skipped"].startswith("estimated")


def test_an_out_of_memory_point_says_by_how_much_from_torchs_message():
    """The H200's first GPU-mode run logged only "out of memory" at the planned maximum; the line now carries what
    torch's message says (the request, what PyTorch held, what the allocator reserved unused)."""
    from ulysses_sp.bench.gpu import _out_of_memory_summary

    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which 120.31 GiB "
        "is free. Including non-PyTorch memory, this process has 19.40 GiB memory in use. Of the allocated memory "
        "8.61 GiB is allocated by PyTorch, with 0 bytes allocated in private pools (e.g., CUDA Graphs), and 344.00 "
        "MiB is reserved by PyTorch but unallocated."
    )
    assert _out_of_memory_summary(message) == (
        " (tried to allocate 2.00 GiB; 8.61 GiB allocated by PyTorch; 344.00 MiB reserved but unallocated)"
    )
    assert _out_of_memory_summary("CUDA out of memory.") == ""


def test_the_stand_in_rank_sees_the_documents_of_the_full_row():
    """The simulated SP group answers Ulysses' position all-gather with each peer's own shard, so the stand-in
    rank works out the documents of the whole row, as a real rank does (not one document per shard)."""
    batch = random_batch(SHAPES["llama-bench-tiny"]["vocab_size"], 256)
    batch["position_ids"] = torch.cat([torch.arange(100), torch.arange(156)])[None]  # two packed documents
    with StandIn(sp=2, sp_rank=1) as rank:
        model = ulysses_sp.parallelize(bench_model("llama-bench-tiny", 256), rank.layout)
        shard = rank.shard(batch)
        context = ulysses_sp.ulysses_context(model)
        context.begin_forward(shard["position_ids"], None, 1, 128, input_ids=shard["input_ids"])
        segments = context.segments_for(shard["position_ids"])
    assert segments.spans == [[(0, 100), (100, 256)]]
    assert torch.equal(shard["position_ids"], torch.arange(28, 156)[None])  # sp_rank 1's half of the row


def test_the_default_features_are_what_train_turns_on():
    from ulysses_sp.features import Features, apply_features
    from ulysses_sp.offload import offload_store
    from ulysses_sp.tiled_loss import tiled_loss_enabled
    from ulysses_sp.tiling import enable_tiled_mlp

    model = bench_model("llama-bench-tiny", 64)
    features = apply_features(model, Features(), "cpu")  # the GPU mode applies Features() the same way on CUDA
    assert (features.tiled_loss, features.tiled_mlp, features.activation_checkpointing) == (True, True, "checkpoint")
    assert Features().resolve("cuda").activation_checkpointing == "offload"
    assert tiled_loss_enabled(model) and offload_store(model) is None  # checkpoints stay on a CPU device
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    with pytest.raises(ValueError, match="already tiled"):
        enable_tiled_mlp(model)


def test_gpu_validation_script_runs_each_point_with_its_own_memory(tmp_path):
    """benchmarks/gpu_validation.py (the GPU session's driver), run on the CPU: each model:sp:memory point is planned
    for its own memory and measured at the planned maximum and 10% above; JSON and a table a point are written; a
    malformed point is refused naming it."""
    spec = importlib.util.spec_from_file_location("gpu_validation", ROOT / "benchmarks" / "gpu_validation.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(ValueError, match="llama-bench-tiny:two"):
        script.main(["--point", "llama-bench-tiny:two:9MiB", "--out", str(tmp_path)])
    argv = ["--point", "llama-bench-tiny:2:9MiB", "llama-bench-tiny:2:12MiB", "--device", "cpu", "--dtype", "fp32"]
    # no step budget: on a loaded CPU the over-point's estimated step time can pass the default 240 s and be skipped
    # (the budget's skip is tested with run_gpu above)
    argv += ["--granularity", "256", "--throughput-seq-len", "512", "--step-budget-s", "1e9", "--out", str(tmp_path)]
    found = script.main(argv)
    rows = [p["result"]["models"]["llama-bench-tiny"]["layouts"]["2"] for p in found["points"]]
    assert rows[1]["predicted_max_seq_len"] > rows[0]["predicted_max_seq_len"] > 512
    for row in rows:
        assert row["points"]["max"]["fits"] and not row["points"]["over"]["predicted_fits"]
    table = (tmp_path / "gpu_validation.md").read_text()
    assert table.count("| llama-bench-tiny | 2 | planned max + 10% |") == 2 and "planned for 12MiB" in table
    assert json.loads((tmp_path / "gpu_validation.json").read_text())["environment"]["torch"] == torch.__version__


def test_bench_lengths_are_checked_per_value_naming_the_flag():
    """Every length of a tuple flag must be >= 1 and split over every world; the error names the flag and value."""
    from ulysses_sp.bench.config import BenchConfig

    BenchConfig(head_chunk_seq_lens=(4096, 8192), worlds=(2, 4)).validate()
    for bad, message in [
        (dict(head_chunk_seq_lens=(4096, 4098), worlds=(2, 4)), "--head-chunk-seq-lens 4098 must be divisible"),
        (dict(head_chunk_seq_lens=(0,)), "--head-chunk-seq-lens must be >= 1"),
        (dict(memory_seq_lens=(512, -1)), "--memory-seq-lens must be >= 1"),
        (dict(loss_tokens=-1), "--loss-tokens must be >= 0"),
        (dict(loss_vocab=0), "--loss-vocab must be >= 1"),
        (dict(worlds=(0,)), "--worlds must be >= 1"),
        (dict(worlds=(2, -2)), "--worlds must be >= 1"),
        (dict(memory_sp=(0,)), "--memory-sp must be >= 1"),
        (dict(gpu_step_budget_s=float("nan")), "--gpu-step-budget-s must be > 0"),
        (dict(gpu_step_budget_s=float("inf")), "--gpu-step-budget-s must be > 0 and finite, got inf"),
    ]:
        with pytest.raises(ValueError, match=message):
            BenchConfig(**bad).validate()


def test_bench_help_says_what_each_preset_fills_in():
    """`ulysses-sp bench --help` showed '(default: none)' for every flag the --size preset fills in, and not what
    each preset puts there; it now names the value of each preset."""
    from ulysses_sp.bench.config import PRESETS, BenchConfig
    from ulysses_sp.cli_config import build_parser

    parser = build_parser(BenchConfig, prog="ulysses-sp bench", description="x")
    helps = {action.dest: " ".join(action.help.split()) for action in parser._actions if action.help}
    for name in PRESETS["small"]:
        for size, preset in PRESETS.items():
            value = preset[name]
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            assert f"{size} {shown}" in helps[name], (name, helps[name])
    assert "small 11 at 2 ranks, 7 at 4 ranks, 7 rounds; tiny 3 at 2 ranks, 3 rounds" in helps["reps"], helps["reps"]


def test_the_report_redraws_from_its_results_json_as_it_stands():
    """BENCHMARKS.md says it was redrawn by `ulysses-sp bench --report-from benchmarks/results/results.json`, but that
    command dropped 51 of its lines: section 5's record of the H200 lease and the notes under sections 6 and 7,
    written into the markdown alone. They live in results.json's "notes" now, and the command gives the file back."""
    from ulysses_sp.bench.report import render_markdown

    results = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())
    results["rendered_by"] = "ulysses-sp bench --report-from benchmarks/results/results.json"  # as rerender sets it
    assert render_markdown(results, "benchmarks/results") == (ROOT / "BENCHMARKS.md").read_text()


def test_report_from_a_file_that_is_not_a_results_json_exits_2_naming_it(tmp_path, capsys):
    from ulysses_sp.bench.runner import main

    for name, text in (("empty.json", "{}"), ("broken.json", "{"), ("list.json", "[1]")):
        path = tmp_path / name
        path.write_text(text)
        assert main(["--report-from", str(path)]) == 2
        assert f"--report-from {path}: not a results.json" in capsys.readouterr().err


def test_head_chunk_table_reads_runs_of_several_lengths_and_of_one():
    """Section 6's rows by P then tokens, whether the runs are keyed 'P@tokens' (several lengths) or 'P' (a
    results.json of before several lengths), from the runs of benchmarks/results/results.json."""
    from ulysses_sp.bench.report_chunks import head_chunks_section

    runs = json.loads((ROOT / "benchmarks" / "results" / "results.json").read_text())["head_chunks"]
    one_length = {str(r["world"]): r for r in runs.values() if r["seq_len"] == 4096}
    several = {f"{r['world']}@{r['seq_len']}": r for r in runs.values()}
    assert set(one_length) == {"2", "4"} and len(several) == 4, list(runs)
    for section in (one_length, dict(reversed(several.items()))):
        lines = head_chunks_section({"head_chunks": section})
        rows = [line.split(" | ")[:3] for line in lines if line.startswith("| 2 ") or line.startswith("| 4 ")]
        keys = [(int(p.strip("| ")), int(t.replace(",", ""))) for p, t, _ in rows]
        assert keys == sorted(keys) and len(keys) == sum(len(r["ratios"]) for r in section.values()), keys


def test_chunk_fixed_cost_script_tables_each_length(tmp_path):
    """benchmarks/chunk_fixed_cost.py: a row per length and layer setting, each from interleaved steps of C=1 and
    C=4 on the stand-in rank; a length the ranks cannot split is refused naming it."""
    spec = importlib.util.spec_from_file_location("chunk_fixed_cost", ROOT / "benchmarks" / "chunk_fixed_cost.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(ValueError, match="--seq-lens 130 must be a positive multiple of --sp 4"):
        script.main(["--seq-lens", "130", "--out", str(tmp_path)])
    found = script.main(["--sp", "2", "--seq-lens", "64", "128", "--reps", "2", "--out", str(tmp_path)])
    assert [(r["tokens"], r["layers"]) for r in found["rows"]] == [
        (64, "plain"), (64, "checkpointed"), (128, "plain"), (128, "checkpointed")
    ]  # fmt: skip
    for row in found["rows"]:
        assert row["c1_ms"] > 0 and row["c4_ms"] > 0 and row["ratio_min"] <= row["ratio"] <= row["ratio_max"], row
    assert "| 128 | checkpointed |" in (tmp_path / "chunk_fixed_cost_sp2.md").read_text()


def test_tiled_loss_measurement_and_its_script(tmp_path):
    """The tiled-loss measurement (bench section 7) on a tiny case: a row per chunk size, the plain loss the ratio 1
    of every round, bad sizes refused naming them; benchmarks/tiled_loss_speed.py tables the same rows."""
    from ulysses_sp.bench.tiledloss import measure_chunks

    rows = measure_chunks(64, 16, 128, [0, 16], 2, "fp32", "cpu")
    assert [(row["chunk_tokens"], row["chunks"]) for row in rows] == [(64, 1), (16, 4)], rows
    assert all(row["cpu_ratio"]["plain"] == 1.0 and row["wall_median_s"]["tiled"] > 0 for row in rows)
    with pytest.raises(ValueError, match="got tokens 0, hidden 16, vocab 128"):
        measure_chunks(0, 16, 128, [0], 2, "fp32", "cpu")
    spec = importlib.util.spec_from_file_location("tiled_loss_speed", ROOT / "benchmarks" / "tiled_loss_speed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = ["--tokens", "64", "--hidden", "16", "--vocab", "128", "--rounds", "2", "--chunk-tokens", "0", "16"]
    result = script.main([*argv, "--name", str(tmp_path / "loss")])
    assert len(result["rows"]) == 2 and "| cpu | 16 | 4 |" in (tmp_path / "loss.md").read_text()


def test_markdown_none_writes_no_report():
    """--markdown is a bool-or-path flag like train's --resume: 'none' is no report, not a file named none."""
    from ulysses_sp.bench.config import BenchConfig
    from ulysses_sp.cli_config import parse_config

    def markdown_path(*argv: str) -> str | None:
        return parse_config(BenchConfig, argv, prog="ulysses-sp bench", description="").markdown_path

    assert markdown_path("--markdown", "none") is None and markdown_path("--no-markdown") is None
    assert markdown_path() == "BENCHMARKS.md" and markdown_path("--markdown", "R.md") == "R.md"


def test_sp_degrees_are_checked_against_the_heads_of_the_model_they_run(capsys):
    """--memory-sp and --worlds are refused before any rank starts when a degree does not split the heads of a model
    its section runs (the benchmark model; for --worlds also the head-chunk model in 4 chunks), naming the flag, the
    value and the values that work; the CLI exits 2 with argparse's one error line."""
    from ulysses_sp.bench.config import BenchConfig
    from ulysses_sp.cli_config import parse_config

    BenchConfig(size="tiny", memory_sp=(1, 2, 4), worlds=(2, 4)).validate()
    for bad, message in [
        (dict(memory_sp=(1, 3)), r"--memory-sp 3 does not split the heads of llama-bench-tiny \(the --size tiny"),
        (dict(memory_sp=(8,)), r"--memory-sp 8 .*; --memory-sp values that work: 1, 2, 4$"),
        (dict(worlds=(3,)), r"--worlds 3 does not split the heads of llama-bench-tiny.*values that work: 1, 2, 4$"),
        (dict(model="llama-bench-small", worlds=(8,)), r"--worlds 8 .* llama-bench-heads .* in 4 chunks .*: 1, 2, 4$"),
    ]:
        with pytest.raises(ValueError, match=message):
            BenchConfig(size="tiny", **bad).validate()
    BenchConfig(size="tiny", model="llama-bench-small", memory_sp=(8,)).validate()  # 8 heads, 4 kv heads
    with pytest.raises(SystemExit) as exit_:
        parse_config(BenchConfig, ["--size", "tiny", "--memory-sp", "3"], prog="ulysses-sp bench", description="")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ulysses-sp bench: error: --memory-sp 3") and "ParallelLayout" not in err, err


class _Measured(Exception):
    """Raised by a stand-in first section: run_bench got as far as measuring."""


def _stop_at_measuring(monkeypatch) -> None:
    from ulysses_sp.bench import runner

    def measure(*_args) -> None:
        raise _Measured

    monkeypatch.setattr(runner, "_memory_section", measure)


def test_a_markdown_file_bench_did_not_write_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """The markdown target may be absent or a report bench wrote (the repository's BENCHMARKS.md included); anything
    else is refused, naming the path and the ways on, before any measuring, by main, --report-from and run_bench."""
    from ulysses_sp.bench.config import BenchConfig
    from ulysses_sp.bench.runner import main, run_bench

    _stop_at_measuring(monkeypatch)
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "BENCHMARKS.md"  # the default path, here
    notes.write_text("# Benchmarks\n\nmy precious notes\n")
    out = tmp_path / "out"
    source = ROOT / "benchmarks" / "results" / "results.json"
    assert main(["--report-from", str(source), "--output-dir", str(out)]) == 2
    assert main(["--size", "tiny", "--output-dir", str(out)]) == 2
    for err in capsys.readouterr().err.strip().split("\n"):
        assert err.startswith("ulysses-sp bench: error: the markdown report's path BENCHMARKS.md exists"), err
        assert "--markdown PATH" in err and "--no-markdown" in err, err
    with pytest.raises(ValueError, match="BENCHMARKS.md exists"):
        run_bench(BenchConfig(size="tiny", output_dir=str(out)), log=lambda _: None)
    assert notes.read_text() == "# Benchmarks\n\nmy precious notes\n" and not out.exists()

    from ulysses_sp.bench.report import GENERATED_BY, check_markdown_target

    check_markdown_target(tmp_path / "NEW.md")
    check_markdown_target(ROOT / "BENCHMARKS.md")
    ours = tmp_path / "OURS.md"
    ours.write_text(f"# Benchmarks\n\n{GENERATED_BY} (src/ulysses_sp/bench); ...\n")
    check_markdown_target(ours)
    with pytest.raises(ValueError, match="was not written by ulysses-sp bench"):
        check_markdown_target(tmp_path)  # a folder
    with pytest.raises(_Measured):  # a file bench wrote is rewritten as before
        run_bench(BenchConfig(size="tiny", output_dir=str(out), markdown=str(ours)), log=lambda _: None)


def test_a_skipped_deepspeed_comparison_is_said_on_the_console(monkeypatch, tmp_path):
    """Without deepspeed (or with --no-deepspeed) the console says the DeepSpeed comparison is skipped, why and how
    to install it, before the measuring starts."""
    from ulysses_sp.bench import deepspeed_ref
    from ulysses_sp.bench.config import BenchConfig
    from ulysses_sp.bench.runner import run_bench

    _stop_at_measuring(monkeypatch)
    monkeypatch.setattr(deepspeed_ref, "deepspeed_available", lambda: False)
    for deepspeed, reason in (
        (True, "deepspeed is not installed (pip install 'ulysses-sp[deepspeed]'"),
        (False, "--no-deepspeed"),
    ):
        lines: list[str] = []
        with pytest.raises(_Measured):
            run_bench(
                BenchConfig(size="tiny", deepspeed=deepspeed, markdown=False, output_dir=str(tmp_path)),
                log=lines.append,
            )
        assert [line for line in lines if "DeepSpeed comparison skipped" in line and reason in line], lines


def test_head_chunk_ratio_pools_every_runs_repetitions_and_keeps_a_cut_off_run(tmp_path):
    """benchmarks/head_chunk_ratio.py reads issue 18's goal on the median of all runs' per-repetition ratios (not the
    median of the runs' medians), and a run cut off after its first world still reports that world."""
    spec = importlib.util.spec_from_file_location("head_chunk_ratio", ROOT / "benchmarks" / "head_chunk_ratio.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def world(four: list[float], one: list[float]) -> dict:
        times = {"C=4": four, "C=1": one, "C=4 checkpointed": four, "C=1 checkpointed": one}
        return {"step_times_s": times, "cpu_s": times, "compute_alone_s": times, "cores": 2}

    runs = [
        {"4@64": world([1.0, 1.1, 1.2], [1.0, 1.0, 1.0]), "2@64": world([1.0], [1.0])},
        {"4@64": world([1.04, 1.03], [1.0, 1.0])},  # cut off before its 2-rank world
    ]
    pooled = script.pooled(runs, "4@64", "step_times_s", checkpointed=True)
    assert pooled["reps"] == 5 and pooled["median"] == pytest.approx(1.04)  # of 1.0, 1.1, 1.2, 1.04, 1.03
    assert pooled["run_medians"] == pytest.approx([1.1, 1.035])  # (their median would be 1.0675)
    args = script.argparse.Namespace(worlds=[4, 2], seq_len=64, runs=2, reps=None, name="t", out=tmp_path)
    env = {"machine": "m", "torch": "t", "ulysses_sp_commit": "c", "date": "d", "load_average_start": None}
    result = script._result(env, 0.0, args, runs)
    assert list(result["pooled"]) == ["4@64", "2@64"] and result["pooled"]["2@64"]["step time"]["reps"] == 1
    rows = [line for line in script._markdown(result).splitlines() if line.startswith("| 4 | 64 | step time |")]
    assert rows[0].startswith("| 4 | 64 | step time | **1.040** |") and rows[0].endswith("| met |"), rows
