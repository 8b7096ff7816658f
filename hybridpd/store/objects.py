"""Self-describing, checksummed and tagged byte objects for the store.

Layout of one object::

    +--------+----------+------------------+---------------+---------+
    | "HPD2" | tag (32) | u32 header bytes | header (JSON) | payload |
    +--------+----------+------------------+---------------+---------+
    header = {"v": 2, "model", "kind", "position", "dtype", "shapes", "xxh3"}
    payload = the buffers' bytes, concatenated in order
    tag = HMAC-SHA256 (the deployment key's store-object subkey) of
          u32 name bytes + name + u32 header bytes + header + payload

``name`` is the object's store key, so an object copied to another key (another
prefix's state, say) fails its tag as a forged one does. ``xxh3`` is the
xxh3-64 of the payload (hex): with the tag failing it tells a corrupt object
(checksum fails too) from one written without this deployment's key
(:class:`~hybridpd.integrity.TagError`). JSON, not pickle: nothing read from
the store is ever executed, and nothing is parsed before its tag is checked
(``hybridpd/integrity.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from hybridpd.errors import IntegrityError
from hybridpd.integrity import PUBLIC, STORE_OBJECT, TAG_BYTES, TagError, Tagger

MAGIC = b"HPD2"
FORMAT_VERSION = 2
#: bytes before the header: magic, tag, header length
PREFIX_BYTES = len(MAGIC) + TAG_BYTES + 4
#: the tags of a deployment without a key (tests, benchmarks)
PUBLIC_TAGGER = PUBLIC.tagger(STORE_OBJECT)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    model: str
    kind: str
    position: int
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    xxh3: str


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a tensor (zero-copy for contiguous CPU tensors)."""
    arr: Any = t.detach().cpu().contiguous().view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def checksum(parts: Sequence[torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for t in parts:
        h.update(raw_bytes(t))
    return h.hexdigest()


def _named(name: str) -> bytes:
    n = name.encode()
    return struct.pack("<I", len(n)) + n


def encode(
    model: str,
    kind: str,
    position: int,
    buffers: Sequence[torch.Tensor],
    *,
    name: str = "",
    tagger: Tagger = PUBLIC_TAGGER,
) -> list[memoryview | bytes]:
    """Prefix and payload parts of the object stored under ``name`` (the parts are
    concatenated by the store); tagged with ``tagger`` (the store-object subkey)."""
    dtype = str(buffers[0].dtype).removeprefix("torch.")
    header = {
        "v": FORMAT_VERSION,
        "model": model,
        "kind": kind,
        "position": position,
        "dtype": dtype,
        "shapes": [list(b.shape) for b in buffers],
        "xxh3": checksum(buffers),
    }
    hj = json.dumps(header, separators=(",", ":")).encode()
    head = struct.pack("<I", len(hj)) + hj
    payload = [raw_bytes(b) for b in buffers]
    tag = tagger.tag(_named(name), head, *payload)
    return [MAGIC + tag + head, *payload]


def _header(data: bytes) -> tuple[ObjectHeader, int, dict[str, Any]]:
    """The header, where the payload starts, and the raw header mapping."""
    (hlen,) = struct.unpack("<I", data[PREFIX_BYTES - 4 : PREFIX_BYTES])
    try:
        h = json.loads(data[PREFIX_BYTES : PREFIX_BYTES + hlen])
        header = ObjectHeader(
            h["model"], h["kind"], int(h["position"]), h["dtype"], tuple(tuple(s) for s in h["shapes"]), h["xxh3"]
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError("corrupt object header: %s" % exc) from None
    return header, PREFIX_BYTES + hlen, h


def decode(
    data: bytes, model: str, kind: str, *, name: str = "", tagger: Tagger = PUBLIC_TAGGER
) -> tuple[ObjectHeader, list[torch.Tensor]]:
    """Verify and parse the object stored under ``name``: its tag first (TagError when the
    checksum holds but the tag fails: not written with this deployment's key, or under
    another name), then its header and checksum; IntegrityError on any mismatch."""
    if len(data) < PREFIX_BYTES or data[: len(MAGIC)] != MAGIC:
        raise IntegrityError("not a hybridpd object (bad magic)")
    view = memoryview(data)
    if not tagger.valid(bytes(view[len(MAGIC) : len(MAGIC) + TAG_BYTES]), _named(name), view[PREFIX_BYTES - 4 :]):
        header, start, _ = _header(data)  # corrupt, or made without the key: the checksum tells
        if xxhash.xxh3_64_hexdigest(view[start:]) != header.xxh3:
            raise IntegrityError("checksum mismatch in %s object at position %d" % (kind, header.position))
        raise TagError(
            "%s object at position %d: valid checksum but its keyed tag fails (written without this"
            " deployment's key, or under another name)" % (header.kind, header.position)
        )
    header, start, h = _header(data)
    if h.get("v") != FORMAT_VERSION:
        raise IntegrityError("unsupported object format %r" % h.get("v"))
    if header.model != model or header.kind != kind:
        raise IntegrityError("object is %s of %s, expected %s of %s" % (header.kind, header.model, kind, model))
    payload = view[start:]
    if xxhash.xxh3_64_hexdigest(payload) != header.xxh3:
        raise IntegrityError("checksum mismatch in %s object at position %d" % (kind, header.position))
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise IntegrityError("unknown dtype %r" % header.dtype)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, off = [], 0
    item = torch.empty((), dtype=dtype).element_size()
    for shape in header.shapes:
        n = item
        for d in shape:
            n *= d
        if off + n > flat.numel():
            raise IntegrityError("payload shorter than its shapes")
        out.append(flat[off : off + n].view(dtype).view(shape))
        off += n
    if off != flat.numel():
        raise IntegrityError("payload longer than its shapes")
    return header, out
