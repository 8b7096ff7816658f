"""The bundled tiny model: built reproducibly from the repo on first use.

``resolve_model_dir("tiny")`` returns a directory under ``$HYBRIDPD_HOME``
(default ``~/.cache/hybridpd``) holding ``config.json``, seeded
``model.safetensors``, the committed tokenizer and the committed EAGLE head
(``assets/``). The directory name carries a digest of everything that goes
into it, so a change of config, seed or assets builds a fresh one.

    python -m hybridpd.engine.native.tiny [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.weights import init_weights, save_weights, weights_digest

logger = logging.getLogger(__name__)

TINY_SEED = 1234
TINY_CONFIG = HybridModelConfig()
ASSETS = Path(__file__).parent / "assets"
ASSET_FILES = ("tokenizer.json", "tokenizer_config.json", "draft.safetensors")


def home() -> Path:
    return Path(os.environ.get("HYBRIDPD_HOME", Path.home() / ".cache" / "hybridpd"))


def _digest() -> str:
    h = hashlib.sha256(TINY_CONFIG.to_json().encode() + str(TINY_SEED).encode())
    for name in ASSET_FILES:
        p = ASSETS / name
        if p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def build_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)`` beside ``out``, then rename it to ``out`` (a concurrent
    builder that wins the race is kept; ours is dropped)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".build-"))
    try:
        write(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny(out: Path) -> Path:
    """Write the tiny model into ``out`` (atomically: built aside, then renamed)."""

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(TINY_CONFIG.to_json())
        weights = init_weights(TINY_CONFIG, TINY_SEED)
        save_weights(tmp / "model.safetensors", weights, {"sha256": weights_digest(weights)})
        for name in ASSET_FILES:
            if (ASSETS / name).exists():
                shutil.copy(ASSETS / name, tmp / name)

    return build_atomically(out, write)


def resolve_model_dir(model: str) -> Path:
    """'tiny' -> the built tiny model (built now if missing); else a directory."""
    if model == "tiny":
        out = home() / "models" / ("tiny-" + _digest())
        if not (out / "model.safetensors").exists():
            logger.info("building the tiny model into %s", out)
            build_tiny(out)
        return out
    path = Path(model)
    if not (path / "config.json").exists():
        from hybridpd.errors import ConfigError

        raise ConfigError("model", "%s is not a model directory (no config.json); use 'tiny' or a path" % model)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(build_tiny(args.out) if args.out else resolve_model_dir("tiny"))


if __name__ == "__main__":
    main()
