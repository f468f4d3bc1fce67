"""The envelope decoder under many thousands of generated inputs: it raises ``DecodeError`` or
returns a valid envelope, nothing else (the coverage-guided twin is ``benchmarks/fuzz_envelope``).

Three generators, from blind to structure-aware: arbitrary bytes; a well-formed header with
every field drawn at random (so most inputs reach the varint, name and payload checks); valid
messages with bytes flipped, cut, inserted or spliced.
"""

from __future__ import annotations

import contextlib
import random
import struct

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddnn import envelope as env
from ddnn.codec import CODECS
from ddnn.envelope import DecodeError, MessageType

FUZZ = settings(max_examples=5000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def flat_shape(codec: str, payload: int) -> tuple[int, ...]:
    """A shape whose packed size could be ``payload`` bytes (the receiver's bundle gives it)."""
    return {"binary": (payload * 8,), "int8": (max(payload - 4, 0),),
            "float16": (payload // 2,), "float32": (payload // 4,),
            "bits2": (payload * 4,), "bits4": (payload * 2,)}[codec]


def check(data: bytes) -> None:
    """Decode, and decode the tensor when there is one: DecodeError or a consistent result."""
    try:
        e = env.decode(data, now=1.7e9)
    except DecodeError:
        return
    assert env.encode(e) == bytes(data), "a decoded message re-encodes to the same bytes"
    if e.codec is not None:
        shape = flat_shape(e.codec, len(e.payload))
        with contextlib.suppress(DecodeError):
            x = e.tensor(shape)
            assert x.shape == shape and x.dtype == np.float32
            assert np.isfinite(x).all()


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data):
    check(data)


# Valid and invalid names, lengths that fit and lengths that overrun the message.
NAMES = [b"tiny", b"1", b"default", b"cam0", b"a" * 64, b"a" * 65, b"", b"bad/name", b"+",
         b"caf\xc3\xa9", b"\x00", b"-lead", b"x" * 200]
VARINTS = [b"\x00", b"\x07", b"\x80\x01", b"\xff" * 9 + b"\x01", b"\xff" * 9 + b"\x02",
           b"\x80\x00", b"\xff" * 11, b"\x80"]


@FUZZ
@given(seed=st.integers(0, 2**32 - 1), valid_format=st.booleans())
def test_structured_headers(seed, valid_format):
    # Every field drawn from values around its limits; seeded, so drawing stays cheap.
    rng = random.Random(seed)
    first = env.FORMAT if valid_format else rng.choice([0xD1, 0xDF, rng.randrange(256)])
    head = rng.randrange(6) << 4 | rng.choice([0, 8]) | rng.randrange(8)
    parts = [bytes([first, head]), rng.choice(VARINTS), rng.randbytes(rng.choice([4, 4, 2]))]
    for _ in range(rng.choice([1, 1, 4, 4, 0, 2, 3, 5])):
        s = rng.choice(NAMES)
        parts += [bytes([min(len(s), 255) if rng.random() < 0.9 else rng.randrange(256)]), s]
    parts.append(rng.randbytes(rng.choice([0, 1, 6, 32, 255, 300])))
    check(b"".join(parts))


_MESSAGES = {}


def _message(kind: MessageType, codec: str) -> bytes:
    if (kind, codec) not in _MESSAGES:
        tensor = None if kind == MessageType.ABSENT else np.linspace(
            -1, 1, 16, dtype=np.float32).reshape(1, 4, 2, 2)
        _MESSAGES[kind, codec] = env.encode(env.pack(
            kind, model="tiny", version="1", deployment="default", device="cam0", frame=7,
            tensor=tensor, codec=None if tensor is None else codec, timestamp=1.7e9))
    return _MESSAGES[kind, codec]


@FUZZ
@given(kind=st.sampled_from(list(MessageType)), codec=st.sampled_from(CODECS),
       seed=st.integers(0, 2**32 - 1))
def test_mutated_valid_messages(kind, codec, seed):
    # A seeded mutator: cheap to generate, so the examples go to decoding, not to drawing.
    rng = random.Random(seed)
    msg = bytearray(_message(kind, codec))
    for _ in range(rng.randint(1, 6)):
        op = rng.choice(["set", "cut", "insert", "splice", "bitflip"])
        i = rng.randrange(max(len(msg), 1))
        if op == "set" and msg:
            msg[i] = rng.randrange(256)
        elif op == "bitflip" and msg:
            msg[i] ^= 1 << rng.randrange(8)
        elif op == "cut":
            del msg[i : i + rng.randint(1, 16)]
        elif op == "insert":
            msg[i:i] = rng.randbytes(rng.randint(1, 16))
        else:  # a run of bytes from another valid message
            other = _message(rng.choice(list(MessageType)), rng.choice(CODECS))
            j = rng.randrange(len(other))
            msg[i : i + 8] = other[j : j + 8]
    check(bytes(msg))


def test_int8_scale_that_overflows_is_a_decode_error():
    """Found by the atheris harness: a huge int8 scale decoded to infinities."""
    data = bytearray(_message(MessageType.FEATURES, "int8"))
    start = len(data) - 20  # the payload: float32 scale, then 16 int8 values
    data[start : start + 4] = struct.pack("<f", 4.3e37)
    data[start + 4] = 127
    with contextlib.suppress(DecodeError):
        env.decode(bytes(data)).tensor((1, 4, 2, 2))
        raise AssertionError("an overflowing int8 scale must be refused")
