"""What decode reads a NIXL handoff by: the descriptor, its keyed tag, and
``HandoffError`` for one that cannot be read. Torch-free: the router imports
``HandoffError`` (``services/router/dispatch.py``), and the tag is checked before
any tensor exists.

Chunks: a buffer offered with ``chunk_rows = r`` is checksummed in chunks of
``r`` rows (dim 0), and a reader may skip any chunk it holds already (a decode
engine skips the KV blocks its prefix cache has: a *delta* handoff). A READ
moves only the byte ranges it keeps (consecutive chunks as one range):
:meth:`BufferSpec.kept_ranges`.

Keyed tag: the descriptor carries an HMAC-SHA256 tag (the deployment key's
handoff subkey, ``hybridpd/integrity.py``) of every field that says what to
read and from whom (agent name and metadata, addresses, shapes, sizes, every
checksum, expiry) and of the caller's ``context`` (the engine's ticket
metadata: request id, first token, buffer metas, block hashes). Decode checks
it before it touches the remote agent: a descriptor not offered with this
deployment's key, or changed on the way, raises
:class:`~hybridpd.integrity.TagError` (an ``IntegrityError``) and is never
read. The bytes themselves are checked by their xxh3 checksums, which the tag
covers.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass

from hybridpd.errors import HybridPDError
from hybridpd.integrity import Tagger


class HandoffError(HybridPDError):
    """The handoff cannot be read (expired, freed, or the transfer failed)."""


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One offered buffer: its shape, where it lives on the prefill side, and its
    checksum (``xxh3``, whole buffer) or its chunks' (``chunk_xxh3``, one per
    ``chunk_rows`` rows; ``xxh3`` is then empty)."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    xxh3: str
    addr: int = 0
    dev_id: int = 0
    chunk_rows: int = 0
    chunk_xxh3: tuple[str, ...] = ()

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``c`` in the buffer."""
        r = self.chunk_rows
        return c * r * self.row_bytes, min((c + 1) * r * self.row_bytes, self.nbytes)

    def kept_ranges(self, skip: frozenset[int]) -> list[tuple[int, int]]:
        """The byte ranges a reader skipping chunks ``skip`` moves (merged)."""
        if not self.chunk_rows:
            return [(0, self.nbytes)] if self.nbytes else []
        out: list[tuple[int, int]] = []
        for c in range(len(self.chunk_xxh3)):
            if c in skip:
                continue
            a, b = self.chunk_range(c)
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out


@dataclass(frozen=True, slots=True)
class HandoffDescriptor:
    """Everything decode needs to read one handoff (plain data, no pickles)."""

    handoff_id: str
    agent_name: str
    agent_metadata: bytes
    mem_type: str  # "DRAM" or "VRAM"
    buffers: tuple[BufferSpec, ...]
    expires_at: float  # wall clock (time.time())
    #: keyed tag of the fields above and the offer's context (:func:`tag_descriptor`)
    tag: bytes = b""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def read_bytes(self, skip_chunks: frozenset[int] = frozenset()) -> int:
        """Bytes a fetch skipping ``skip_chunks`` moves."""
        return sum(b - a for spec in self.buffers for a, b in spec.kept_ranges(skip_chunks))


def _signed(desc: HandoffDescriptor, context: bytes) -> tuple[bytes, ...]:
    """What a descriptor's tag covers: every field but the tag, then ``context``
    (lengths first, so no two different inputs concatenate alike)."""
    specs = [
        [list(b.shape), b.dtype, b.nbytes, b.xxh3, b.addr, b.dev_id, b.chunk_rows, list(b.chunk_xxh3)]
        for b in desc.buffers
    ]
    body = json.dumps(
        [desc.handoff_id, desc.agent_name, desc.mem_type, desc.expires_at, specs], separators=(",", ":")
    ).encode()
    return struct.pack("<QQQ", len(body), len(desc.agent_metadata), len(context)), body, desc.agent_metadata, context


def tag_descriptor(desc: HandoffDescriptor, tagger: Tagger, context: bytes = b"") -> HandoffDescriptor:
    """``desc`` with its keyed tag over its fields and ``context``."""
    return dataclasses.replace(desc, tag=tagger.tag(*_signed(desc, context)))


def check_descriptor(desc: HandoffDescriptor, tagger: Tagger, context: bytes = b"") -> None:
    """TagError unless ``desc``'s tag is this key's over its fields and ``context``."""
    tagger.check(desc.tag, *_signed(desc, context), what="handoff %s" % desc.handoff_id)
