"""A gateway's batch: exact round trips, bounds, and nothing but DecodeError on bad bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddnn.batch import FORMAT, MAX_ENTRIES, pack_batch, unpack_batch
from ddnn.envelope import MAX_MESSAGE, DecodeError
from ddnn.errors import CodecError

names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)


@given(st.lists(st.tuples(names, st.binary(max_size=300)), min_size=1, max_size=20))
def test_round_trip(entries):
    data = pack_batch(entries)
    assert unpack_batch(data) == entries
    # one byte of format, then per entry: name, varint length, the bytes
    assert len(data) == 1 + sum(1 + len(d) + (1 if len(e) < 128 else 2) + len(e)
                                for d, e in entries)


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_raise_only_decode_error(data):
    try:
        entries = unpack_batch(bytes([FORMAT]) + data)
    except DecodeError:
        return
    assert pack_batch(entries) == bytes([FORMAT]) + data


@pytest.mark.parametrize(("data", "message"), [
    (b"", "bad format byte"),
    (b"\xd2\x01", "bad format byte"),  # an envelope is not a batch
    (bytes([FORMAT]), "empty batch"),
    (bytes([FORMAT]) + b"\x04cam0\x05abc", "truncated inside its entry"),
    (bytes([FORMAT]) + b"\x04CAM0\x00", "invalid device id"),
    (bytes([FORMAT]) + b"\x00", "invalid device id length 0"),
])
def test_malformed_batches_are_refused(data, message):
    with pytest.raises(DecodeError, match=message):
        unpack_batch(data)


def test_bounds_hold_both_ways():
    with pytest.raises(CodecError, match="1 to 256"):
        pack_batch([])
    with pytest.raises(CodecError, match="1 to 256"):
        pack_batch([("cam0", b"x")] * (MAX_ENTRIES + 1))
    with pytest.raises(CodecError, match="exceeds"):
        pack_batch([("cam0", bytes(MAX_MESSAGE))])
    many = bytes([FORMAT]) + b"\x04cam0\x00" * (MAX_ENTRIES + 1)
    with pytest.raises(DecodeError, match="more than 256"):
        unpack_batch(many)
