"""The README and docs/ stay true to the code: every flag they name exists, every link resolves."""

import re
from pathlib import Path

from ulysses_sp.bench.config import BenchConfig
from ulysses_sp.cli_config import build_parser
from ulysses_sp.plan.cli import PlanConfig
from ulysses_sp.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Flags of other tools the docs show next to ours (pip, torchrun, Slurm).
OTHER_TOOLS = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--signal"}


def _our_flags() -> set[str]:
    flags = set()
    for config in (TrainConfig, PlanConfig, BenchConfig):
        parser = build_parser(config, prog="x", description="x")
        flags |= {option for action in parser._actions for option in action.option_strings}
    return flags


def test_every_flag_named_in_the_docs_exists():
    ours = _our_flags()
    for path in DOCS:
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", path.read_text()))
        unknown = sorted(named - ours - OTHER_TOOLS)
        assert not unknown, f"{path.relative_to(ROOT)} names flags that no command has: {unknown}"


def test_links_resolve_and_the_readme_stays_short():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"
    assert len((ROOT / "README.md").read_text().splitlines()) < 150
    linked = set(re.findall(r"\]\(docs/([^)]+)\)", (ROOT / "README.md").read_text()))
    assert linked == {p.name for p in (ROOT / "docs").glob("*.md")}, "every docs page is linked from the README"


def test_a_glob_given_to_a_flag_is_quoted():
    """`--dataset data/*.jsonl` unquoted reaches the command as one word per matching file, which no flag takes
    (the README and docs/train.md showed it so): a glob in a flag's value is quoted in the docs."""
    for path in DOCS:
        unquoted = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[ =][^\s'\"`]*\*\S*", path.read_text())
        assert not unquoted, f"{path.relative_to(ROOT)} gives an unquoted glob to a flag: {unquoted} (quote it)"


def test_the_plan_commands_in_the_docs_run_as_written():
    """Each `ulysses-sp plan ...` of the docs parses as `plan` parses it: docs/ring.md showed
    `ulysses-sp plan --sp 64 --gpus-per-node 8 --nodes 8`, which exits 2 ('--model, --seq-len are required')."""
    from ulysses_sp.cli_config import parse_config

    for path in DOCS:
        for line in re.findall(r"ulysses-sp plan ([^`#\n]*)", path.read_text()):
            argv = line.split()
            if "--help" in argv or any(arg.startswith("path/to/") for arg in argv):  # (a placeholder path)
                continue
            parse_config(PlanConfig, argv, prog="ulysses-sp plan", description=f"{path.name}: {line}")
