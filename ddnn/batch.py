"""A gateway's batch: several devices' envelopes in one MQTT message up the constrained link.

Devices behind one gateway (``ddnn gateway``) publish on the gateway's local broker; the gateway
forwards what they send for the same frame as one message, so the uplink pays one MQTT and one
TCP/IP header per frame instead of one per device. Layout (see ``docs/wire-protocol.md``)::

    u8 format 0xE2 | entries: u8 length + ASCII device id | varint length | envelope bytes

Each entry is one device message exactly as the device made it (``ddnn.envelope``); the edge
checks the device id against the devices it lets this gateway speak for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from ddnn.envelope import MAX_MESSAGE, DecodeError, Reader, name_bytes, varint_bytes
from ddnn.errors import CodecError
from ddnn.names import MAX_NAME

FORMAT = 0xE2  # a batch of version-2 envelopes
MAX_ENTRIES = 256  # per batch: bounds the work one message can cause
# The largest envelope a batch can carry alone: the format byte, the longest device id (its
# length byte and MAX_NAME characters), and the varint of the envelope's length.
MAX_ENTRY = MAX_MESSAGE - 1 - (1 + MAX_NAME) - len(varint_bytes(MAX_MESSAGE))

Entry = TypeVar("Entry", bound=tuple)  # (device id, envelope bytes, anything else...)


def _entry_head(device: str, envelope: bytes) -> bytes:
    """What precedes an envelope in a batch: its device id, and its length as a varint."""
    return name_bytes(device) + varint_bytes(len(envelope))


def pack_batch(entries: Iterable[tuple[str, bytes]]) -> bytes:
    """One batch of ``(device id, envelope bytes)``; raises :class:`CodecError` when it does
    not fit the format (too many entries, too large, a bad device id)."""
    parts, n = [bytes([FORMAT])], 0
    for device, envelope in entries:
        parts += [_entry_head(device, envelope), envelope]
        n += 1
    if not 0 < n <= MAX_ENTRIES:
        raise CodecError(f"a batch holds 1 to {MAX_ENTRIES} messages, not {n}")
    data = b"".join(parts)
    if len(data) > MAX_MESSAGE:
        raise CodecError(f"batch of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    return data


def batches(entries: Sequence[Entry]) -> list[list[Entry]]:
    """``entries`` — ``(device id, envelope, ...)``, what follows the envelope is the caller's —
    cut, in order, into as few runs as fit one batch each (:data:`MAX_ENTRIES`,
    :data:`MAX_MESSAGE`). An envelope over :data:`MAX_ENTRY` fits no batch: the caller refuses
    it before it gets here."""
    out: list[list[Entry]] = []
    size = 1  # the format byte
    for e in entries:
        n = len(_entry_head(e[0], e[1])) + len(e[1])
        if not out or len(out[-1]) == MAX_ENTRIES or size + n > MAX_MESSAGE:
            out.append([])
            size = 1
        out[-1].append(e)
        size += n
    return out


def unpack_batch(data: bytes) -> list[tuple[str, bytes]]:
    """The ``(device id, envelope bytes)`` entries of a batch; raises :class:`DecodeError` for
    anything malformed (the envelopes themselves are decoded by the receiver, one by one)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE:
        raise DecodeError(f"batch of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    if not data or data[0] != FORMAT:
        raise DecodeError("not a ddnn batch (bad format byte)")
    r, entries = Reader(data, pos=1), []
    while r.pos < len(data):
        if len(entries) == MAX_ENTRIES:
            raise DecodeError(f"batch of more than {MAX_ENTRIES} messages")
        device = r.name("device id")
        n = r.varint("entry length")
        entries.append((device, r.take(n, "entry")))
    if not entries:
        raise DecodeError("empty batch")
    return entries
