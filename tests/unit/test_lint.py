"""Style is enforced by the suite: ruff must report nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean() -> None:
    ruff = Path(sys.executable).parent / "ruff"
    res = subprocess.run(
        [str(ruff), "check", "hybridpd", "services", "launch", "tests", "bench", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_clean() -> None:
    mypy = Path(sys.executable).parent / "mypy"
    res = subprocess.run([str(mypy)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
