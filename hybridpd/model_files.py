"""Where built models live, how they are built safely, and the bundled tokenizer.

Shared by the engines' bundled models (``models/bundled.py``,
``engine/vllm/tiny.py``), so neither imports the other:

* :func:`home`: ``$HYBRIDPD_HOME`` (default ``~/.cache/hybridpd``); built
  models go under ``models/``.
* :func:`build_atomically`: build a directory aside, then rename it.
* :data:`TOKENIZER_DIR`: the committed 2,048-token BPE tokenizer
  (``scripts/train_tokenizer.py``) every bundled model ships.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

#: the committed tokenizer of the bundled models
TOKENIZER_DIR = Path(__file__).parent / "assets"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def home() -> Path:
    return Path(os.environ.get("HYBRIDPD_HOME", Path.home() / ".cache" / "hybridpd"))


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
