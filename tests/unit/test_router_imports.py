"""The router imports no torch: its types and errors come from torch-free
modules (``engine/base.py`` names tensors for type checkers only; the handoff's
error is in ``transfer/handoff_descriptor.py``). Checked in a child process, so
whatever this test process has imported already does not hide an import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_router_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import services.router.server, services.router.dispatch\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('torch modules:', loaded)\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, "the router imported torch: %s %s" % (res.stdout[-2000:], res.stderr[-2000:])
