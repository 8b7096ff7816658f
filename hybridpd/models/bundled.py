"""The bundled tiny models: built from the repo on first use.

``resolve_model_dir(name)`` returns a directory under ``$HYBRIDPD_HOME``
(default ``~/.cache/hybridpd``) holding ``config.json``, ``model.safetensors``,
the committed tokenizer and an EAGLE head ``draft.safetensors``:

* ``tiny``: the trained model (``scripts/train_tiny.py``): the committed
  bf16 weights ``assets/tiny.safetensors`` (written out as fp32; an engine
  with ``dtype: bfloat16`` rounds them back exactly) and its draft head
  ``assets/draft.safetensors`` (``scripts/train_eagle.py``).
* ``tiny-random``: seeded random weights (:data:`TINY_CONFIG`, 8 layers) and
  the head distilled on them (``assets/draft-random.safetensors``); for tests
  that need speed or the original model.

The directory name carries a digest of everything that goes into it, so a
change of config, seed or assets builds a fresh one.

    python -m hybridpd.models.bundled [--model tiny|tiny-random] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
from pathlib import Path

from safetensors.torch import load_file

from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.weights import init_weights, save_weights, weights_digest
from hybridpd.model_files import TOKENIZER_DIR, TOKENIZER_FILES, build_atomically, home

logger = logging.getLogger(__name__)

TINY_SEED = 1234
#: ``tiny-random``: seeded random weights (fast tests; the original bundled model).
TINY_CONFIG = HybridModelConfig()
#: ``tiny``: trained by ``scripts/train_tiny.py``; weights committed in ``assets/tiny.safetensors``.
TRAINED_CONFIG = HybridModelConfig(num_layers=4)
ASSETS = Path(__file__).parent / "assets"
#: bundled model name -> (config, committed weights or None for seeded random, committed draft head)
BUNDLED = {
    "tiny": (TRAINED_CONFIG, "tiny.safetensors", "draft.safetensors"),
    "tiny-random": (TINY_CONFIG, None, "draft-random.safetensors"),
}


def _digest(model: str) -> str:
    cfg, weights, draft = BUNDLED[model]
    h = hashlib.sha256(cfg.to_json().encode() + str(TINY_SEED).encode())
    for name in TOKENIZER_FILES:
        h.update((TOKENIZER_DIR / name).read_bytes())
    for asset in (weights, draft):
        p = ASSETS / asset if asset else None
        if p is not None and p.exists():
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def build_tiny(out: Path, model: str = "tiny") -> Path:
    """Write a bundled model into ``out`` (atomically: built aside, then renamed)."""
    cfg, weights_file, draft = BUNDLED[model]

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(cfg.to_json())
        if weights_file is None:
            weights = init_weights(cfg, TINY_SEED)
        else:
            weights = {k: v.float() for k, v in load_file(str(ASSETS / weights_file)).items()}
        save_weights(tmp / "model.safetensors", weights, {"sha256": weights_digest(weights)})
        for name in TOKENIZER_FILES:
            shutil.copy(TOKENIZER_DIR / name, tmp / name)
        if (ASSETS / draft).exists():
            shutil.copy(ASSETS / draft, tmp / "draft.safetensors")

    return build_atomically(out, write)


def resolve_model_dir(model: str) -> Path:
    """'tiny' / 'tiny-random' -> the built bundled model (built now if missing); else a directory."""
    if model in BUNDLED:
        out = home() / "models" / ("%s-%s" % (model, _digest(model)))
        if not (out / "model.safetensors").exists():
            logger.info("building the %s model into %s", model, out)
            build_tiny(out, model)
        return out
    path = Path(model)
    if not (path / "config.json").exists():
        from hybridpd.errors import ConfigError

        raise ConfigError(
            "model", "%s is not a model directory (no config.json); use 'tiny', 'tiny-random' or a path" % model
        )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(BUNDLED), default="tiny")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    print(build_tiny(args.out, args.model) if args.out else resolve_model_dir(args.model))


if __name__ == "__main__":
    main()
