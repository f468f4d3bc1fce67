"""Lossless entropy coding of a payload on the wire: raw DEFLATE (RFC 1951, Python's zlib).

An escalated frame's details are pixels (:mod:`ddnn.hierarchy`): neighbouring values repeat, so
DEFLATE's Huffman codes and back-references shorten them, by about half on the generated scenes
(a 4-bit 3×16×16 detail: 384 B, about 200 deflated; docs/wire-protocol.md). How much depends on
the scene, so nothing assumes a ratio: bytes are counted as they are sent.

A sender deflates a payload only where that makes it shorter, so no payload ever grows. A
receiver inflates with a bound on the output, so a small hostile message cannot expand into a
large allocation, and refuses a stream that is truncated, corrupt or followed by other bytes.
"""

from __future__ import annotations

import zlib

from ddnn.errors import CodecError

LEVEL = 9  # the smallest output; a detail is a few hundred bytes, so time is no concern
_RAW = -15  # window bits: raw DEFLATE, no zlib header or checksum (the envelope frames it)


def deflated(payload: bytes) -> bytes | None:
    """``payload`` as a raw DEFLATE stream where that is shorter, else ``None``.

    Deterministic for one zlib: the sender's bytes are the ones ``ddnn evaluate`` counts."""
    c = zlib.compressobj(LEVEL, zlib.DEFLATED, _RAW)
    data = c.compress(payload) + c.flush()
    return data if len(data) < len(payload) else None


def wire_size(payload: bytes) -> int:
    """Bytes ``payload`` takes on the wire when its sender deflates where that is shorter."""
    data = deflated(payload)
    return len(payload) if data is None else len(data)


def inflate(data: bytes, limit: int) -> bytes:
    """The payload a raw DEFLATE stream holds, at most ``limit`` bytes; raises
    :class:`CodecError` for a stream that is invalid, truncated, trailed by other bytes, or
    that would inflate past ``limit``."""
    d = zlib.decompressobj(_RAW)
    try:
        out = d.decompress(data, limit)
    except zlib.error as e:
        raise CodecError(f"invalid deflate stream: {e}") from None
    if d.unconsumed_tail:
        raise CodecError(f"deflate stream inflates past the limit of {limit} bytes")
    if not d.eof:
        raise CodecError("deflate stream is truncated")
    if d.unused_data:
        raise CodecError(f"{len(d.unused_data)} bytes follow the deflate stream")
    return out
