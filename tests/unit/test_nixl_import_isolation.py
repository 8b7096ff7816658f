"""Codegen must never load grpc_tools' protoc into our process: it makes a
later `import nixl` abort. Run in a child so a regression fails, not crashes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_protogen_then_nixl_in_one_process(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from hybridpd.protogen import generate\n"
        "generate(Path(%r))\n"
        "from nixl._api import nixl_agent\n"
        "print('ok')\n" % str(tmp_path)
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
