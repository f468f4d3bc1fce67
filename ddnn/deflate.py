"""Lossless entropy coding of a payload on the wire: raw DEFLATE (RFC 1951, Python's zlib),
after PNG's "Up" filter where that codes shorter.

An escalated frame's details are pixels (:mod:`ddnn.hierarchy`): neighbouring values repeat, so
DEFLATE's Huffman codes and back-references shorten them. As PNG does, a sender that knows the
tensor's row length (in bytes) also tries the Up filter: each byte minus the byte one row
above (mod 256), which turns a smooth image into mostly small numbers, then Huffman codes
alone (back-references find little in a few hundred bytes). It keeps the shorter. A 4-bit
3×16×16 detail of the generated scenes: 384 B, 264 deflated, 235 filtered (docs/wire-protocol.md).
How much depends on the scene, so nothing assumes a ratio: bytes are counted as they are sent.

The coded form is one byte, the filter (0: none; ``n`` > 0: Up over rows of ``n`` bytes), then
the raw DEFLATE stream. A sender codes a payload only where that makes it shorter, so no
payload ever grows. A receiver inflates with a bound on the output, so a small hostile message
cannot expand into a large allocation, and refuses a stream that is truncated, corrupt or
followed by other bytes.
"""

from __future__ import annotations

import zlib

import numpy as np

from ddnn.errors import CodecError

LEVEL = 9  # the smallest output; a detail is a few hundred bytes, so time is no concern
_RAW = -15  # window bits: raw DEFLATE, no zlib header or checksum (the envelope frames it)
MAX_ROW = 255  # the filter byte holds the row length


def _deflate(data: bytes, strategy: int) -> bytes:
    c = zlib.compressobj(LEVEL, zlib.DEFLATED, _RAW, 9, strategy)
    return c.compress(data) + c.flush()


def _up(data: bytes, row: int) -> bytes:
    """PNG's Up filter: each byte minus the byte ``row`` before it, mod 256."""
    b = np.frombuffer(data, np.uint8)
    out = b.copy()
    out[row:] -= b[:-row]  # uint8 arithmetic wraps: mod 256
    return out.tobytes()


def _undo_up(data: bytes, row: int) -> bytes:
    n = len(data)
    padded = np.zeros(-(-n // row) * row, np.uint8)
    padded[:n] = np.frombuffer(data, np.uint8)
    # Each column of rows is a running sum, mod 256 (uint8 accumulation wraps).
    return np.cumsum(padded.reshape(-1, row), axis=0, dtype=np.uint8).ravel()[:n].tobytes()


def deflated(payload: bytes, row: int = 0) -> bytes | None:
    """``payload`` coded (the filter byte, then raw DEFLATE) where that is shorter, else
    ``None``. ``row``: the tensor's row length in bytes, to try the Up filter over (0: none).

    Deterministic for one zlib: the sender's bytes are the ones ``ddnn evaluate`` counts."""
    best = b"\x00" + _deflate(payload, zlib.Z_DEFAULT_STRATEGY)
    if 0 < row <= MAX_ROW and row < len(payload):
        filtered = bytes([row]) + _deflate(_up(payload, row), zlib.Z_HUFFMAN_ONLY)
        if len(filtered) < len(best):
            best = filtered
    return best if len(best) < len(payload) else None


def wire_size(payload: bytes, row: int = 0) -> int:
    """Bytes ``payload`` takes on the wire when its sender codes it where that is shorter."""
    data = deflated(payload, row)
    return len(payload) if data is None else len(data)


def inflate(data: bytes, limit: int) -> bytes:
    """The payload a coded stream holds, at most ``limit`` bytes; raises :class:`CodecError`
    for a stream that is empty, invalid, truncated, trailed by other bytes, or that would
    inflate past ``limit``."""
    if not data:
        raise CodecError("empty deflate payload: the filter byte is missing")
    row = data[0]
    d = zlib.decompressobj(_RAW)
    try:
        out = d.decompress(data[1:], limit)
    except zlib.error as e:
        raise CodecError(f"invalid deflate stream: {e}") from None
    if d.unconsumed_tail:
        raise CodecError(f"deflate stream inflates past the limit of {limit} bytes")
    if not d.eof:
        raise CodecError("deflate stream is truncated")
    if d.unused_data:
        raise CodecError(f"{len(d.unused_data)} bytes follow the deflate stream")
    return _undo_up(out, row) if row and out else out
