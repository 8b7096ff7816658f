"""A model's identity: what produced a piece of cached state, not its directory's name.

``model_identity`` is ``<directory name>@<digest>``, the digest (16 hex digits of a
SHA-256) over every file of the model directory (weights, config, tokenizer,
generation config, EAGLE head: the bytes, not their names alone) and the facts
of the engine that shape the state it exports (engine, dtype, block geometry,
:data:`STATE_FORMAT_VERSION`, on vLLM its version and the snapshot's revision).
Every index key, store key and the actors' Ray namespace carry it, so two
deployments that share Redis or Mooncake, or weights changed under the same
directory name, never reuse each other's state (DESIGN §7).

Hashing a large model's files takes a while: a file's digest is remembered per
(path, inode, size, mtime) in this process and, for files of at least
``DISK_CACHE_MIN_BYTES``, in ``~/.cache/hybridpd/file-digests.json`` (best effort);
a Hugging Face cache blob is named by its SHA-256 already.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hybridpd.engine.profile import profile_of

if TYPE_CHECKING:
    from hybridpd.config import HybridPDConfig

logger = logging.getLogger(__name__)

#: the layout of exported KV blocks and recurrent states; bump it when it changes
STATE_FORMAT_VERSION = 1
#: hex digits of the digest in an identity
DIGEST_CHARS = 16

#: files this large have their digest remembered on disk (smaller ones are quick to hash)
DISK_CACHE_MIN_BYTES = 64 << 20
#: entries the disk cache keeps (the newest)
DISK_CACHE_ENTRIES = 4096

_HEX64 = re.compile(r"[0-9a-f]{64}")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})(/|$)")
_lock = threading.Lock()
_known: dict[tuple[str, int, int, int], str] = {}


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hybridpd" / "file-digests.json"


def _load_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store_cache(key: str, digest: str) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_load_cache(), key: digest}
        data = dict(list(data.items())[-DISK_CACHE_ENTRIES:])
        tmp = path.with_name(path.name + ".%d.tmp" % os.getpid())
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:  # a read-only home: the digest is computed again next time
        logger.debug("file digest cache not written", exc_info=True)


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes: a Hugging Face blob's name, a remembered one,
    or read (and remembered)."""
    real = path.resolve()
    if real.parent.name == "blobs" and _HEX64.fullmatch(real.name):
        return real.name  # the hub names LFS blobs by the SHA-256 of their bytes
    st = real.stat()
    key = (str(real), st.st_ino, st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _known:
            return _known[key]
    disk_key = "%s|%d|%d|%d" % key
    on_disk = st.st_size >= DISK_CACHE_MIN_BYTES
    digest = _load_cache().get(disk_key) if on_disk else None
    if digest is None:
        if on_disk:
            logger.info("hashing %s (%.1f GiB) for the model identity", real, st.st_size / (1 << 30))
        with open(real, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if on_disk:
            _store_cache(disk_key, digest)
    with _lock:
        _known[key] = digest
    return digest


def revision(model_dir: Path) -> str | None:
    """The Hugging Face snapshot's commit when ``model_dir`` is one, else None."""
    m = _SNAPSHOT.search(str(model_dir.resolve()) + "/")
    return m.group(1) if m else None


def model_identity(model_dir: Path, facts: Mapping[str, object]) -> str:
    """``<name>@<digest>`` of the files under ``model_dir`` (hidden ones skipped) and
    ``facts`` (JSON-serializable: engine, dtype, geometry, ...), with
    :data:`STATE_FORMAT_VERSION`. Equal bytes and facts give equal identities,
    wherever the directory lies."""
    h = hashlib.sha256()
    files = sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )
    if not files:
        raise FileNotFoundError("no model files under %s" % model_dir)
    for p in files:
        h.update(("%s\0%s\n" % (p.relative_to(model_dir).as_posix(), file_digest(p))).encode())
    h.update(json.dumps({**facts, "state_format": STATE_FORMAT_VERSION}, sort_keys=True, default=str).encode())
    return "%s@%s" % (model_dir.name, h.hexdigest()[:DIGEST_CHARS])


def engine_facts(cfg: HybridPDConfig, model_dir: Path) -> dict[str, object]:
    """What of ``cfg`` shapes the state an engine exports for ``model_dir``: the engine
    and its package's version (its profile's ``package``: vLLM), dtype, device kind,
    block geometry, the snapshot's revision."""
    facts: dict[str, object] = {
        "engine": cfg.engine,
        "dtype": cfg.engine_dtype(),
        "device": cfg.device,
        "unit": cfg.prefix_match_unit,
        "mamba_block": cfg.mamba_block_size,
        "alignment": cfg.checkpoint_alignment,
        "revision": revision(model_dir),
    }
    package = profile_of(cfg).package
    if package is not None:
        facts[package] = importlib.metadata.version(package)
    return facts


def engine_identity(cfg: HybridPDConfig, model_dir: Path) -> str:
    """The identity of the state an engine of ``cfg`` exports for ``model_dir``: every
    engine and the router compute it alike (``launch/stack.py`` compares them)."""
    return model_identity(model_dir, engine_facts(cfg, model_dir))
