"""Generate the Python gRPC code from ``proto/`` (``make proto``).

The generated modules are committed under ``hybridpd/v1/``; a unit test runs
:func:`generate` into a temporary directory and fails if the result differs,
so a changed ``.proto`` without regenerated code cannot land.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    """Run protoc for every ``.proto`` into ``out_dir`` (python, grpc, pyi)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        "-I%s" % PROTO_DIR,
        "-I%s" % include,
        "--python_out=%s" % out_dir,
        "--grpc_python_out=%s" % out_dir,
        "--pyi_out=%s" % out_dir,
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError("protoc failed with exit code %d" % rc)


def main() -> int:
    generate(ROOT)
    print("generated into %s" % (ROOT / "hybridpd" / "v1"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
