"""An escalated frame's details packed for the WAN: one row per slot in the detail codec with
which slots hold one, unpacked bit for bit; the packed escalated model's checks; the edge's
reading of its metadata."""

import json

import numpy as np
import pytest

from ddnn import oip
from ddnn.codec import FeatureCodec
from ddnn.edge.cloud_client import _advertised_escalated, _EscalatedPacking
from ddnn.errors import CodecError
from ddnn.packed_detail import DETAIL_PACKING_CODECS, DetailPacking

SLOTS, VIEW = 3, (2, 4, 4)


def _details(kind: str, present: np.ndarray, seed: int = 0) -> np.ndarray:
    """Details (B, S·c, r, r) as they leave ``kind``'s codec, zeros in an empty slot."""
    rng = np.random.default_rng(seed)
    codec = FeatureCodec(kind)
    views = rng.uniform(-1, 1, (*present.shape, *VIEW)).astype(np.float32)
    coded = np.stack([[codec.decode(codec.encode(v), VIEW) for v in frame] for frame in views])
    coded[~present] = 0.0
    return coded.reshape(len(present), SLOTS * VIEW[0], *VIEW[1:])


PRESENT = np.array([[True, False, True], [False, False, True], [True, True, True]])


@pytest.mark.parametrize("kind", DETAIL_PACKING_CODECS)
def test_coded_details_pack_and_unpack_bit_for_bit(kind):
    packing = DetailPacking.of(kind, (SLOTS * VIEW[0], *VIEW[1:]), SLOTS)
    detail = _details(kind, PRESENT)
    packed = packing.pack(detail)
    assert packed is not None
    rows, present = packed
    assert rows.shape == (3, SLOTS, FeatureCodec(kind).payload_size(VIEW))
    np.testing.assert_array_equal(present, PRESENT)
    assert not rows[~PRESENT].any()  # an empty slot's row is zeros (deflate makes it cheap)
    assert packing.unpack(rows, present).tobytes() == detail.tobytes()


def test_four_bit_details_take_an_eighth_of_their_fp32_bytes():
    packing = DetailPacking.of("bits4", (SLOTS * VIEW[0], *VIEW[1:]), SLOTS)
    rows, _ = packing.pack(_details("bits4", PRESENT))
    assert rows[0, 0].nbytes * 8 == np.zeros(VIEW, np.float32).nbytes


def test_details_that_did_not_come_through_the_codec_do_not_pack():
    packing = DetailPacking.of("bits4", (SLOTS * VIEW[0], *VIEW[1:]), SLOTS)
    detail = _details("bits4", PRESENT)
    detail[0, 0, 0, 0] = 0.5  # not a 4-bit level
    assert packing.pack(detail) is None
    assert packing.pack(detail[:, 1:]) is None  # not the layout
    assert packing.pack(detail.astype(np.float64)) is None


def test_the_server_unpacks_any_bytes_and_refuses_a_wrong_layout():
    packing = DetailPacking.of("int8", (SLOTS * VIEW[0], *VIEW[1:]), SLOTS)
    rows = np.full((2, SLOTS, packing.row_bytes), 255, np.uint8)  # NaN scales
    out = packing.unpack(rows, np.ones((2, SLOTS), bool))
    assert out.shape == (2, *packing.sample_shape) and np.isfinite(out).all()
    empty = packing.unpack(rows, np.zeros((2, SLOTS), bool))  # no slot holds a detail
    assert empty.shape == (2, *packing.sample_shape) and not empty.any()
    with pytest.raises(CodecError, match="packed details"):
        packing.unpack(rows[:, 1:], np.ones((2, SLOTS - 1), bool))
    with pytest.raises(CodecError, match="packed details"):
        packing.unpack(rows, np.ones((2, SLOTS), np.uint8))


@pytest.mark.parametrize(("kind", "shape", "slots"), [
    ("float32", (6, 4, 4), 3), ("bits4", (7, 4, 4), 3), ("bits4", (6, 4, 4), 0)])
def test_a_layout_or_codec_that_cannot_pack_is_refused(kind, shape, slots):
    with pytest.raises(CodecError):
        DetailPacking.of(kind, shape, slots)


def _metadata(detail_codec: str = "bits4", features_codec: str = "int8") -> dict:
    f_row = FeatureCodec(features_codec).payload_size((8, 2, 2))
    d_row = FeatureCodec(detail_codec).payload_size(VIEW)
    return {"inputs": [
        {"name": oip.EDGE_FEATURES_PACKED, "datatype": "UINT8", "shape": [-1, f_row],
         "parameters": {"codec": features_codec, "unpacked_shape": [-1, 8, 2, 2]}},
        {"name": oip.DEVICE_DETAIL_PACKED, "datatype": "UINT8", "shape": [-1, SLOTS, d_row],
         "parameters": {"codec": detail_codec, "unpacked_shape": [-1, SLOTS * VIEW[0], 4, 4]}},
        {"name": oip.DETAIL_PRESENT, "datatype": "BOOL", "shape": [-1, SLOTS]}]}


def test_the_edge_reads_the_packed_escalated_models_metadata():
    packing = _advertised_escalated(json.dumps(_metadata()).encode(), FeatureCodec("int8"))
    assert isinstance(packing, _EscalatedPacking)
    assert packing.detail == DetailPacking.of("bits4", (SLOTS * VIEW[0], 4, 4), SLOTS)
    features = FeatureCodec("int8")
    x = np.stack([features.decode(features.encode(v), (8, 2, 2))
                  for v in np.random.default_rng(1).normal(size=(3, 8, 2, 2))])
    inputs = packing.pack(x, _details("bits4", PRESENT))
    assert inputs is not None and set(inputs) == {oip.EDGE_FEATURES_PACKED,
                                                  oip.DEVICE_DETAIL_PACKED, oip.DETAIL_PRESENT}
    assert packing.pack(x + 1e-3, _details("bits4", PRESENT)) is None  # features not coded


@pytest.mark.parametrize("spoil", [
    lambda d: d["inputs"].pop(),
    lambda d: d["inputs"][1]["parameters"].update(codec="float32"),
    lambda d: d["inputs"][1].update(shape=[-1, SLOTS, 1]),
    lambda d: d["inputs"][2].update(datatype="UINT8"),
    lambda d: d["inputs"][0]["parameters"].update(codec="binary"),  # not the edge's codec
])
def test_metadata_the_edge_cannot_use_means_fp32(spoil):
    doc = _metadata()
    spoil(doc)
    assert _advertised_escalated(json.dumps(doc).encode(), FeatureCodec("int8")) is None
