"""Keyed integrity: one deployment key, HMAC-SHA256 tags, one subkey per purpose.

What hybridpd writes for itself and reads back from a place others can reach
carries a tag made with the deployment's key: store objects
(``store/objects.py``: name, header and payload), NIXL handoff descriptors
(``transfer/handoff_descriptor.py``: where to read, shapes, checksums and the
ticket's metadata) and decode's token frames to the router
(``services/worker/token_channel.py``: request id, sequence number, tokens).
A checksum (xxh3) stops accidents; a tag stops a peer that can reach the store
or the sink but does not hold the key. Tags are compared in constant time.

The key: the bytes of ``integrity_key_file`` (surrounding whitespace stripped,
at least :data:`MIN_KEY_BYTES`), read once when a component starts. Without
one, :data:`PUBLIC_KEY` keeps the same code paths but stops accidents only.
``hybridpd up`` writes a random key for a local stack (:func:`stack_key`). With
a key, the native engine's block-hash seed derives from it (:func:`block_hash_seed`).
The key is never logged: :class:`IntegrityKey` and :class:`Tagger` hide their
bytes from ``repr``.

Purposes (:data:`PURPOSES`) get their own subkeys, ``HMAC(key, "hybridpd/" +
purpose)``, so a tag made for one use never passes as another's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hybridpd.errors import ConfigError, IntegrityError

if TYPE_CHECKING:  # only the type: callers pass their config in
    from hybridpd.config import HybridPDConfig

logger = logging.getLogger(__name__)

#: bytes of one tag (HMAC-SHA256)
TAG_BYTES = 32
MIN_KEY_BYTES = 16
#: the key of a deployment without ``integrity_key_file``: public, so its tags stop accidents only
PUBLIC_KEY = b"hybridpd: no integrity_key_file, a public key"
STORE_OBJECT = "store-object"
HANDOFF = "handoff"
TOKEN_FRAME = "token-frame"
HASH_SEED = "hash-seed"
PURPOSES = (STORE_OBJECT, HANDOFF, TOKEN_FRAME, HASH_SEED)


class TagError(IntegrityError):
    """A keyed tag failed: the bytes were not made with this deployment's key (or
    were changed after). Mapped as :class:`IntegrityError`."""


@dataclass(frozen=True, slots=True)
class Tagger:
    """Tags for one purpose (its subkey)."""

    purpose: str
    subkey: bytes = field(repr=False)

    def tag(self, *parts: bytes | memoryview) -> bytes:
        """The tag of ``parts`` concatenated (callers make the concatenation unambiguous)."""
        h = hmac.new(self.subkey, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def valid(self, tag: bytes, *parts: bytes | memoryview) -> bool:
        """Whether ``tag`` is the tag of ``parts`` (constant-time compare)."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, self.tag(*parts))

    def check(self, tag: bytes, *parts: bytes | memoryview, what: str) -> None:
        """TagError naming ``what`` unless ``tag`` is the tag of ``parts``."""
        if not self.valid(tag, *parts):
            raise TagError("%s: its keyed tag fails (not made with this deployment's key)" % what)


@dataclass(frozen=True, slots=True)
class IntegrityKey:
    """The deployment key; ``keyed`` is False for :data:`PUBLIC_KEY`."""

    secret: bytes = field(repr=False)
    keyed: bool = True

    def tagger(self, purpose: str) -> Tagger:
        if purpose not in PURPOSES:
            raise ValueError("unknown tag purpose %r" % purpose)
        return Tagger(purpose, hmac.digest(self.secret, b"hybridpd/" + purpose.encode(), "sha256"))


#: the key of a deployment without ``integrity_key_file``
PUBLIC = IntegrityKey(PUBLIC_KEY, keyed=False)


def read_key(path: str | Path) -> IntegrityKey:
    """The key in ``path``; ConfigError (field ``integrity_key_file``) if it cannot be read
    or is too short."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        hint = " (every machine of a Ray cluster needs the same file)" if isinstance(exc, FileNotFoundError) else ""
        raise ConfigError("integrity_key_file", "cannot read %s: %s%s" % (path, exc.strerror or exc, hint)) from None
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(
            "integrity_key_file",
            "%s holds %d bytes; a key needs at least %d (e.g. `head -c 32 /dev/urandom | base64`)"
            % (path, len(secret), MIN_KEY_BYTES),
        )
    return IntegrityKey(secret)


def load_key(cfg: HybridPDConfig) -> IntegrityKey:
    """The deployment key of ``cfg`` (:data:`PUBLIC` without ``integrity_key_file``)."""
    return PUBLIC if cfg.integrity_key_file is None else read_key(cfg.integrity_key_file)


def write_key_file(path: Path) -> Path:
    """Write a new random key to ``path`` (mode 0600; the file must not exist)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def stack_key(cfg: HybridPDConfig, workdir: Path) -> HybridPDConfig:
    """``cfg`` as ``hybridpd up`` runs it: without ``integrity_key_file``, a local stack
    (``actor_placement: any``: its actors are its own) gets a new random key, written
    0600 as ``<workdir>/integrity.key`` and named in the config its actors get.
    Shared (worker_groups) actors need the one key every router holds: without a file
    they run on the public key (a warning says so). ConfigError for a bad key file."""
    if cfg.integrity_key_file is None and cfg.actor_placement == "any":
        path = workdir / "integrity.key"
        path.unlink(missing_ok=True)  # a new key per start
        cfg = cfg.model_copy(update={"integrity_key_file": str(write_key_file(path))})
    elif cfg.integrity_key_file is None:
        logger.warning(
            "no integrity_key_file: store objects, handoffs and token frames carry tags of a public key,"
            " which stop accidents only"
        )
    load_key(cfg)  # a bad key file fails here, not in every actor
    return cfg


def block_hash_seed(cfg: HybridPDConfig, key: IntegrityKey | None = None) -> str:
    """The seed of the block-hash chain (``NONE_HASH``) the router and the engines use.

    With a deployment key, on an engine whose hashing is our own
    (``EngineProfile.keyed_hash_seed``), a tag of ``hash_seed`` under the key: the
    chain hashes (index and store keys) cannot be computed from a prompt without the
    key. Otherwise ``hash_seed`` itself (vLLM: its ``NONE_HASH`` comes from
    ``PYTHONHASHSEED``, which its hashes must equal)."""
    from hybridpd.engine.profile import profile_of  # NOTE: lazy: the profile module imports config types

    key = load_key(cfg) if key is None else key
    if not key.keyed or not profile_of(cfg).keyed_hash_seed:
        return cfg.hash_seed
    return "hpd-" + key.tagger(HASH_SEED).tag(cfg.hash_seed.encode()).hex()
