"""The edge's hot path reads a compact scores message in place (``ddnn.edge.ingest.ScoresReader``);
whatever it takes, the full decoder takes with the same frame, time and values, and (float16,
the bundles' scores codec) it takes everything the full decoder takes for that version."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddnn import envelope as env
from ddnn.edge.ingest import ScoresReader
from ddnn.envelope import DecodeError, MessageType

FUZZ = settings(max_examples=3000, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Every float16 value is sent by test_every_score_value; the search over frames, sizes,
# versions and codecs needs fewer examples (hypothesis spends most of a run on finding new
# ones in so small a space).
FEW = settings(FUZZ, max_examples=400)
NOW = 1.7e9
CLASSES = 3


def full_path(data: bytes, version: str, codec: str) -> tuple[int, float, np.ndarray] | None:
    """What the full decoder makes of ``data`` for a reader of (version, codec), or None."""
    try:
        e = env.decode(data, now=NOW)
        if (e.kind != MessageType.SCORES or e.has_identity or e.version != version
                or e.codec != codec):
            return None
        return e.frame, e.timestamp, e.tensor((1, CLASSES))[0]
    except DecodeError:
        return None


def agree(data: bytes, version: str = "1", codec: str = "float16") -> None:
    fast = ScoresReader(version, codec, CLASSES).read(data)
    full = full_path(data, version, codec)
    if fast is None:
        # float16 values cannot overflow the finiteness sum: nothing valid is left to the
        # slow path (float32 may be, which is only slower).
        assert full is None or codec != "float16", "a valid message missed the fast path"
        return
    assert full is not None, "the fast path took a message the decoder refuses"
    frame, ticks, x = fast
    assert frame == full[0]
    assert env.capture_time(ticks, NOW) == full[1]
    assert np.asarray(x, np.float32).tobytes() == full[2].tobytes()


def message(frame: int, scores, version: str = "1", codec: str = "float16", **ids) -> bytes:
    return env.encode(env.pack(MessageType.SCORES, version=version, frame=frame,
                               tensor=np.asarray(scores, np.float32).reshape(1, -1),
                               codec=codec, timestamp=NOW - 0.25, **ids))


def test_the_hot_message_is_read_in_place():
    data = message(300, [1.5, -2.0, 0.25])
    frame, ticks, x = ScoresReader("1", "float16", CLASSES).read(data)
    assert frame == 300 and x == (1.5, -2.0, 0.25)
    assert abs(env.capture_time(ticks, NOW) - (NOW - 0.25)) < 1e-3


def test_anything_else_is_left_to_the_full_path():
    r = ScoresReader("1", "float16", CLASSES)
    assert r.read(message(1, [1, 2, 3], version="2")) is None  # another version
    assert r.read(message(1, [1, 2, 3], model="m", deployment="d", device="cam0")) is None
    assert r.read(message(1, [1, 2, 3, 4])) is None  # another size
    assert r.read(message(1, [1, 2, 3], codec="float32")) is None
    nan = bytearray(message(1, [1, 2, 3]))
    nan[-2:] = np.array([np.nan], "<f2").tobytes()
    assert r.read(bytes(nan)) is None
    assert ScoresReader("1", "int8", CLASSES).read(message(1, [1, 2, 3], codec="int8")) is None
    assert r.read(b"") is None and r.read(b"\xd2") is None


@pytest.mark.parametrize("codec", ["float16", "float32"])
def test_every_score_value(codec):
    """Each of the 65,536 float16 bit patterns (NaNs, infinities, subnormals, -0) once, three
    to a message, under frame ids of every varint length."""
    values = np.arange(1 << 16, dtype=np.uint16).view("<f2")
    values = np.concatenate([values, values[:-len(values) % CLASSES]])
    wide = values.astype("<f2" if codec == "float16" else "<f4").reshape(-1, CLASSES)
    for i, row in enumerate(wide):
        frame = i * 0x9E3779B97F4A7C15 % (1 << 64)  # spread over the 64 bits
        agree(env.encode(env.Envelope(MessageType.SCORES, "1", frame, NOW, codec,
                                      row.tobytes())), "1", codec)


@FEW
@given(st.integers(0, (1 << 64) - 1), st.lists(st.floats(width=16), min_size=1, max_size=5),
       st.sampled_from(["1", "12", "v2.0"]), st.sampled_from(["float16", "float32"]))
def test_valid_messages(frame, values, version, codec):
    data = env.encode(env.Envelope(MessageType.SCORES, version, frame, NOW, codec,
                                   np.asarray(values, "<f2" if codec == "float16" else "<f4")
                                   .tobytes()))
    agree(data, "1", codec)
    agree(data, version, codec)


@FUZZ
@given(st.binary(max_size=40))
def test_arbitrary_bytes(data):
    agree(b"\xd2\x31" + data)
    agree(data)


@FUZZ
@given(st.integers(0, 1 << 20), st.randoms(use_true_random=False))
def test_mutated_messages(frame, rnd: random.Random):
    data = bytearray(message(frame, [rnd.uniform(-9, 9) for _ in range(CLASSES)]))
    for _ in range(rnd.randint(1, 3)):
        op, i = rnd.randrange(4), rnd.randrange(len(data))
        if op == 0:
            data[i] = rnd.randrange(256)
        elif op == 1:
            del data[i]
        elif op == 2:
            data.insert(i, rnd.randrange(256))
        else:
            data[i] ^= 1 << rnd.randrange(8)
    agree(bytes(data))
