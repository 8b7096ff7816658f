"""Self-describing, checksummed byte objects for the store.

Layout of one object::

    +--------+------------------+--------------------+---------------------+
    | "HPD1" | u32 header bytes | header (JSON)      | payload             |
    +--------+------------------+--------------------+---------------------+
    header = {"v": 1, "model", "kind", "position", "dtype", "shapes", "xxh3"}
    payload = the buffers' bytes, concatenated in order

``xxh3`` is the xxh3-64 of the payload (hex). JSON, not pickle: nothing read
from the store is ever executed.
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

MAGIC = b"HPD1"
FORMAT_VERSION = 1
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


def encode(model: str, kind: str, position: int, buffers: Sequence[torch.Tensor]) -> list[memoryview | bytes]:
    """Header and payload parts of one object (the parts are concatenated by the store)."""
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
    return [MAGIC + struct.pack("<I", len(hj)) + hj, *(raw_bytes(b) for b in buffers)]


def decode(data: bytes, model: str, kind: str) -> tuple[ObjectHeader, list[torch.Tensor]]:
    """Parse and verify one object; raise IntegrityError on any mismatch."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise IntegrityError("not a hybridpd object (bad magic)")
    (hlen,) = struct.unpack("<I", data[4:8])
    try:
        h = json.loads(data[8 : 8 + hlen])
        header = ObjectHeader(
            h["model"], h["kind"], int(h["position"]), h["dtype"], tuple(tuple(s) for s in h["shapes"]), h["xxh3"]
        )
        if h["v"] != FORMAT_VERSION:
            raise IntegrityError("unsupported object format %r" % h["v"])
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError("corrupt object header: %s" % exc) from None
    if header.model != model or header.kind != kind:
        raise IntegrityError("object is %s of %s, expected %s of %s" % (header.kind, header.model, kind, model))
    payload = memoryview(data)[8 + hlen :]
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
