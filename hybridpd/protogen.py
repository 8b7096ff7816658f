"""Generate the Python gRPC code from ``proto/`` (``make proto``).

The generated modules are committed under ``hybridpd/v1/``; a unit test runs
:func:`generate` into a temporary directory and fails if the result differs,
so a changed ``.proto`` without regenerated code cannot land.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc for every ``.proto`` into ``out_dir`` (python, grpc, pyi).

    NOTE: protoc runs in a child process. ``grpc_tools.protoc`` carries its own
    libprotobuf, and once loaded it makes a later ``import nixl`` in the same
    process abort (munmap_chunk(): invalid pointer).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("grpc_tools")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("grpc_tools is not installed (pip install grpcio-tools)")
    include = Path(next(iter(spec.submodule_search_locations))) / "_proto"
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I%s" % PROTO_DIR,
        "-I%s" % include,
        "--python_out=%s" % out_dir,
        "--grpc_python_out=%s" % out_dir,
        "--pyi_out=%s" % out_dir,
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError("protoc failed (%d): %s" % (res.returncode, res.stderr))


def main() -> int:
    generate(ROOT)
    print("generated into %s" % (ROOT / "hybridpd" / "v1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
