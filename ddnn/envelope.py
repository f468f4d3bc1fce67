"""The message envelope: one compact, versioned binary frame per MQTT or HTTP message.

Layout (see ``docs/wire-protocol.md`` for the byte-by-byte table)::

    u8 format (0xD0 | envelope version)
    | u8 deflate flag << 7 | codec << 4 | identity flag << 3 | message type
    | frame id (unsigned LEB128 varint) | u32 capture time (100 µs ticks of Unix time, mod 2**32)
    | u8 length + ASCII model version
    | [identity: 3 × (u8 length + ASCII): model name, deployment, device id]
    | payload (the tensor packed by :class:`ddnn.codec.FeatureCodec`, to the end; coded by
      :mod:`ddnn.deflate` where the deflate flag is set: a filter byte, then raw DEFLATE)

What never changes on a channel is not repeated per message: an MQTT topic names the deployment
and the device (the edge for a request), the device's retained status names its model, and the
bundle of the version gives each message type's tensor shape. The identity block is for
channels that name nobody (the HTTP fallback), so a message there still says who sent it.

Decoding validates every field and raises :class:`DecodeError` (a :class:`CodecError`) for
anything else, so a receiver can count and drop a bad message with one ``except``.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ddnn.codec import CODECS, FeatureCodec
from ddnn.deflate import deflated, inflate
from ddnn.errors import CodecError
from ddnn.names import MAX_NAME, RULE, is_name

VERSION = 2
FORMAT = 0xD0 | VERSION  # the first byte: a ddnn envelope of this version
_FAMILY = 0xD0  # high nibble of every ddnn envelope from version 2 on
_V1_MAGIC = b"DDNN"  # what version 1 envelopes began with (refused by name)
MAX_MESSAGE = 1 << 20  # bytes: bounds what a sender can make a receiver hold or decode
MAX_STRING = MAX_NAME  # the only strings are names
MAX_VARINT = 10  # bytes of a 64-bit LEB128 value
TICK = 1e-4  # seconds per capture-time tick
_WRAP = 1 << 32  # ticks before the capture time wraps: about 4.97 days
_TIME = struct.Struct("<I")
_IDENTITY = 0x08
_DEFLATED = 0x80  # the high bit of the codec nibble: the payload travels deflated
# Codec ids on the wire (three bits: the fourth is the deflate flag); 0 means "no tensor".
_CODEC_IDS = {name: i + 1 for i, name in enumerate(CODECS)}
assert max(_CODEC_IDS.values()) < 8, "codec ids have three bits on the wire"
_CODEC_NAMES = {i: name for name, i in _CODEC_IDS.items()}


class DecodeError(CodecError):
    """Bytes that are not a valid envelope of this version."""


class MessageType(enum.IntEnum):
    """What a message carries."""

    SCORES = 1  # a device's class scores for one frame (1, C)
    FEATURES = 2  # a device's packed features for one frame (1, F, h, w)
    ABSENT = 3  # "this view sees nothing in this frame": no tensor, so nobody waits for it
    REQUEST = 4  # the edge pulls features of a frame; tensor = binary mask (V,) of views asked
    # Escalation (bundles with an escalated cloud): for a frame still unsure after the edge
    # exit, the edge pulls the senders' detail, which goes on up to the cloud.
    DETAIL = 5  # a device's detail of one frame (1, c, r, r): its view at reduced resolution
    DETAIL_REQUEST = 6  # the edge pulls details of a frame; tensor = binary mask (V,), as REQUEST
    # "this device could not process this frame in time" (it fell behind its source and dropped
    # it, as a leaky camera queue does): no tensor, so nobody waits for it; the frame's result
    # names the view as missing, "skipped". (The last of the header's 3 bits of type.)
    SKIPPED = 7


@dataclass(frozen=True)
class Envelope:
    """One message; ``payload`` holds the packed tensor bytes (empty for no tensor).

    ``model``, ``deployment`` and ``device`` are ``None`` when the message left them to its
    channel (:meth:`bound` fills them in from there).
    """

    kind: MessageType
    version: str
    frame: int
    timestamp: float = 0.0
    codec: str | None = None
    payload: bytes = b""
    model: str | None = None
    deployment: str | None = None
    device: str | None = None
    # The payload travels deflated where that is shorter (and a decoded one did): pixels do
    # (an escalated frame's detail); features of a few bits a value seldom shrink.
    deflate: bool = False
    # The tensor's row length in bytes, for the filter deflate tries (:mod:`ddnn.deflate`);
    # how a payload was coded, not what it says, so it takes no part in equality.
    row: int = field(default=0, compare=False)

    @property
    def has_identity(self) -> bool:
        return self.device is not None

    def bound(self, *, model: str, deployment: str, device: str) -> Envelope:
        """This message with the identity its channel gives (fields it carries are kept)."""
        return replace(self, model=self.model or model, deployment=self.deployment or deployment,
                       device=self.device or device)

    def tensor(self, shape: tuple[int, ...]) -> np.ndarray:
        """The decoded float32 tensor of ``shape`` (the bundle's, for this message type);
        raises :class:`DecodeError` for a message without one or of another size."""
        if self.codec is None:
            raise DecodeError(f"{self.kind.name.lower()} message carries no tensor")
        try:
            return _codec(self.codec).decode(self.payload, tuple(shape))
        except DecodeError:
            raise
        except CodecError as e:
            raise DecodeError(str(e)) from None


def pack(
    kind: MessageType,
    *,
    version: str,
    frame: int,
    tensor: np.ndarray | None = None,
    codec: str | None = None,
    timestamp: float | None = None,
    model: str | None = None,
    deployment: str | None = None,
    device: str | None = None,
    deflate: bool = False,
) -> Envelope:
    """Build an envelope, packing ``tensor`` with ``codec`` (both or neither). Give ``model``,
    ``deployment`` and ``device`` together to carry the identity in the message; ``deflate``:
    send the payload deflated where that is shorter (:mod:`ddnn.deflate`)."""
    if (tensor is None) != (codec is None):
        raise CodecError("give both a tensor and its codec, or neither")
    if len({model is None, deployment is None, device is None}) != 1:
        raise CodecError("give the model, deployment and device together, or none of them")
    payload = b"" if tensor is None else _codec(codec).encode(tensor)
    ts = time.time() if timestamp is None else float(timestamp)
    deflate = deflate and bool(payload)
    row = _codec(codec).row_bytes(np.shape(tensor)) if deflate else 0
    kind = kind if type(kind) is MessageType else MessageType(kind)
    return Envelope(kind, version, int(frame), ts, codec, payload, model, deployment, device,
                    deflate, row)


@functools.cache
def _codec(kind: str) -> FeatureCodec:
    """One codec object per kind (a device packs a few messages a frame); an unknown kind
    raises, and is not kept."""
    return FeatureCodec(kind)


def encode(env: Envelope) -> bytes:
    """Serialize an envelope; raises :class:`CodecError` for fields the format cannot hold."""
    if not 0 <= env.frame < 1 << 64:
        raise CodecError(f"frame id {env.frame} does not fit 64 bits")
    if not math.isfinite(env.timestamp):
        raise CodecError("timestamp is not a finite number")
    codec_id = 0 if env.codec is None else _CODEC_IDS.get(env.codec)
    if codec_id is None:
        raise CodecError(f"unknown codec {env.codec!r}")
    if bool(codec_id) != bool(env.payload):  # what decode would refuse
        raise CodecError("a tensor needs a codec and a payload, no tensor neither")
    flags = _IDENTITY if env.has_identity else 0
    payload = deflated(env.payload, env.row) if env.deflate and env.payload else None
    if payload is None:
        payload = env.payload
    else:
        flags |= _DEFLATED
    parts = [bytes([FORMAT, codec_id << 4 | flags | int(env.kind)]), varint_bytes(env.frame),
             _TIME.pack(round(env.timestamp / TICK) % _WRAP), name_bytes(env.version)]
    if env.has_identity:
        parts += [name_bytes(env.model), name_bytes(env.deployment), name_bytes(env.device)]
    parts.append(payload)
    data = b"".join(parts)
    if len(data) > MAX_MESSAGE:
        raise CodecError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    return data


def varint_bytes(n: int) -> bytes:
    """``n`` ≥ 0 as an unsigned LEB128 varint (7 bits per byte, low bits first)."""
    if n < 0:
        raise CodecError(f"a varint cannot hold {n}")
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def name_bytes(s: str | None) -> bytes:
    """A name (:mod:`ddnn.names` rule) as u8 length + ASCII."""
    if not isinstance(s, str) or not is_name(s):
        raise CodecError(f"invalid name {s!r:.80}: use {RULE}")
    return bytes([len(s)]) + s.encode()


def capture_time(ticks: int, now: float) -> float:
    """The Unix time of ``ticks`` (mod 2**32) nearest to ``now``: exact while sender and
    receiver agree within half the wrap (about 2.5 days, delay and clock skew together)."""
    base = round(now / TICK)
    delta = (ticks - base) % _WRAP
    if delta >= _WRAP // 2:
        delta -= _WRAP
    return (base + delta) * TICK


def frame_header(data: bytes) -> tuple[int, int]:
    """``(frame id, offset of the capture time)`` of an encoded envelope, read without decoding
    the rest: for tools that time or stamp messages in place (the capture time is a u32 of
    :data:`TICK` at that offset). Raises :class:`DecodeError` where no frame id can be read."""
    r = Reader(data, pos=2)  # after the format and the header byte
    return r.varint("frame id"), r.pos


class Reader:
    """Bounds-checked reads over one message (from ``pos``), each failure a DecodeError."""

    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            raise DecodeError(f"message truncated inside its {what}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def varint(self, what: str) -> int:
        value = 0
        for i in range(MAX_VARINT):
            byte = self.take(1, what)[0]
            value |= (byte & 0x7F) << (7 * i)
            if not byte & 0x80:
                if value >= 1 << 64:
                    raise DecodeError(f"{what} does not fit 64 bits")
                if byte == 0 and i:  # one value, one encoding: messages re-encode exactly
                    raise DecodeError(f"{what} varint is not minimal")
                return value
        raise DecodeError(f"{what} is longer than {MAX_VARINT} bytes")

    def name(self, what: str) -> str:
        n = self.take(1, what)[0]
        if n == 0 or n > MAX_STRING:
            raise DecodeError(f"invalid {what} length {n}")
        try:
            s = self.take(n, what).decode("ascii")
        except UnicodeDecodeError:
            raise DecodeError(f"{what} must be ASCII") from None
        if not is_name(s):
            raise DecodeError(f"invalid {what} {s!r}: use {RULE}")
        return s


def decode(data: bytes, now: float | None = None) -> Envelope:
    """Parse and validate one message; raises :class:`DecodeError` on any inconsistency.

    ``now``: the receiver's Unix time, to place the capture time (default: this clock).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_MESSAGE:
        raise DecodeError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE}")
    _check_format(data)
    r = Reader(data, pos=1)
    head = r.take(1, "header")[0]
    codec_id, identity, kind = (head >> 4) & 0x07, head & _IDENTITY, head & 0x07
    is_deflated = bool(head & _DEFLATED)
    try:
        kind = MessageType(kind)
    except ValueError:
        raise DecodeError(f"unknown message type {kind}") from None
    if codec_id != 0 and codec_id not in _CODEC_NAMES:
        raise DecodeError(f"unknown codec id {codec_id}")
    frame = r.varint("frame id")
    (ticks,) = _TIME.unpack(r.take(_TIME.size, "capture time"))
    version = r.name("model version")
    ids = {}
    if identity:
        ids = {k: r.name(k) for k in ("model", "deployment", "device")}
    payload = data[r.pos:]
    codec = _CODEC_NAMES.get(codec_id)
    if codec is None and payload:
        raise DecodeError("a message without a codec cannot carry a tensor")
    if codec is not None and not payload:
        raise DecodeError(f"a {codec} tensor needs a payload")
    if is_deflated:
        if codec is None:
            raise DecodeError("a message without a tensor cannot be deflated")
        row = payload[0]  # the filter the sender chose (0: none)
        try:  # bounded: a few hostile bytes cannot inflate past what a message may hold
            payload = inflate(payload, MAX_MESSAGE)
        except CodecError as e:
            raise DecodeError(f"{kind.name.lower()} payload: {e}") from None
        if not payload:
            raise DecodeError(f"a {codec} tensor needs a payload")
    ts = capture_time(ticks, time.time() if now is None else now)
    return Envelope(kind, version, frame, ts, codec, payload, **ids, deflate=is_deflated,
                    row=row if is_deflated else 0)


def payload_offset(data: bytes) -> int:
    """Where the payload of an encoded envelope starts: its bytes on the wire are the rest
    (deflated or not), its header the bytes before. Raises :class:`DecodeError`."""
    _check_format(data)
    r = Reader(data, pos=1)
    identity = r.take(1, "header")[0] & _IDENTITY
    r.varint("frame id")
    r.take(_TIME.size, "capture time")
    for what in ("model version", *(("model", "deployment", "device") if identity else ())):
        r.name(what)
    return r.pos


def _check_format(data: bytes) -> None:
    if data[:4] == _V1_MAGIC:
        old = data[4] if len(data) > 4 else "?"
        raise DecodeError(f"envelope version {old} (the 'DDNN' format) is no longer accepted; "
                          f"this receiver speaks version {VERSION}: update the sender")
    if not data:
        raise DecodeError("empty message")
    if data[0] & 0xF0 != _FAMILY:
        raise DecodeError("not a ddnn message (bad format byte)")
    if data[0] != FORMAT:
        raise DecodeError(f"envelope version {data[0] & 0x0F} is not supported (this is "
                          f"{VERSION})")
