"""The code base stays ruff-clean (lint and format, configured in pyproject.toml); ruff comes with the test extra."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    result = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_source_files_stay_small():
    """One idea per module: no source file of the package grows past 450 lines."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "src").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert not long, long
