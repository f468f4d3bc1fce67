"""Coded payloads on the wire: never longer, the Up filter where it helps, and inflating is
bounded and strict."""

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddnn.deflate import deflated, inflate, wire_size
from ddnn.errors import CodecError


@given(st.binary(max_size=2048) | st.binary(max_size=64).map(lambda b: b * 8),
       st.sampled_from([0, 1, 3, 8, 16, 255, 256, 4096]))
def test_round_trip_and_never_longer(payload, row):
    data = deflated(payload, row)
    assert wire_size(payload, row) <= len(payload)
    if data is None:
        assert wire_size(payload, row) == len(payload)
    else:
        assert len(data) < len(payload) and wire_size(payload, row) == len(data)
        assert data[0] in (0, row)  # the filter byte: none, or Up over the rows asked for
        assert inflate(data, len(payload)) == payload


def test_a_smooth_image_codes_shorter_with_the_up_filter():
    """Rows of a vertical gradient differ by about a constant: the Up filter makes that plain."""
    rng = np.random.default_rng(0)
    image = (np.arange(32)[:, None] * 3 + rng.integers(0, 3, (32, 32))).astype(np.uint8)
    payload = image.tobytes()
    filtered = deflated(payload, 32)
    assert filtered is not None and filtered[0] == 32
    assert len(filtered) < len(deflated(payload)) < len(payload)
    assert inflate(filtered, len(payload)) == payload


def test_repetitive_payloads_shrink():
    payload = bytes(range(16)) * 24  # 384 bytes, like a 4-bit 3x16x16 detail
    assert wire_size(payload) < 100


@pytest.mark.parametrize(("stream", "limit", "message"), [
    (deflated(bytes(1000)), 999, "past the limit"),
    (b"", 2000, "filter byte is missing"),
    (deflated(bytes(1000))[:-2], 2000, "truncated"),
    (deflated(bytes(1000)) + b"\x00", 2000, "follow the deflate stream"),
    (b"\x00\xff\xff\xff", 2000, "invalid deflate stream"),
    (b"\x00" + zlib.compress(bytes(100)), 2000, "invalid deflate stream"),  # not raw DEFLATE
])
def test_bad_streams_raise_codec_error(stream, limit, message):
    with pytest.raises(CodecError, match=message):
        inflate(stream, limit)


def test_the_limit_is_inclusive():
    assert inflate(deflated(bytes(1000)), 1000) == bytes(1000)


@pytest.mark.parametrize(("codec", "shape", "row"), [
    ("bits4", (1, 3, 16, 16), 8), ("bits2", (1, 3, 16, 16), 4), ("binary", (1, 16, 4, 4), 0),
    ("int8", (1, 3, 16, 16), 16), ("float16", (2, 5), 10), ("float32", (7,), 0),
])
def test_a_row_is_counted_in_whole_bytes(codec, shape, row):
    from ddnn.codec import FeatureCodec

    assert FeatureCodec(codec).row_bytes(shape) == row
