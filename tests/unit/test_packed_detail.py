"""An escalated frame's details packed for the WAN: one row per slot in the detail codec with
which slots hold one, unpacked bit for bit; the average filter; the lean frame's layout (round trip,
every malformed frame refused with a typed error); the packed escalated model's checks; the
edge's reading of both models' metadata."""

import json
import zlib

import numpy as np
import pytest

from ddnn import oip
from ddnn.codec import FeatureCodec
from ddnn.edge.cloud_escalated import advertised_way
from ddnn.errors import CodecError
from ddnn.packed_detail import (
    DETAIL_PACKING_CODECS,
    FILTER_BITS,
    DetailPacking,
    EscalatedFrame,
    EscalatedInputs,
)

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
    packing = advertised_way("packed", json.dumps(_metadata()).encode(),
                                    FeatureCodec("int8"))
    assert type(packing) is EscalatedInputs
    assert packing.detail == DetailPacking.of("bits4", (SLOTS * VIEW[0], 4, 4), SLOTS)
    x = _features()
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
    lambda d: d["inputs"][0].update(name="features"),
])
def test_metadata_the_edge_cannot_use_means_fp32(spoil):
    doc = _metadata()
    spoil(doc)
    assert advertised_way("packed", json.dumps(doc).encode(), FeatureCodec("int8")) is None


def _features(frames: int = 3) -> np.ndarray:
    """Edge features (B, 8, 2, 2) as they leave the int8 codec."""
    codec = FeatureCodec("int8")
    return np.stack([codec.decode(codec.encode(v), (8, 2, 2))
                     for v in np.random.default_rng(1).normal(size=(frames, 8, 2, 2))])


@pytest.mark.parametrize("kind", DETAIL_PACKING_CODECS)
def test_the_filter_is_lossless_on_any_bytes(kind):
    packing = DetailPacking.of(kind, (SLOTS * VIEW[0], *VIEW[1:]), SLOTS)
    rows = np.random.default_rng(2).integers(0, 256, (4, SLOTS, packing.row_bytes), np.uint8)
    coded, _ = packing.pack(_details(kind, PRESENT))
    np.testing.assert_array_equal(packing.unfilter(packing.filter(coded)), coded)
    if kind in FILTER_BITS and packing.row_bytes * 8 == np.prod(VIEW) * FILTER_BITS[kind]:
        # (no padding bits: those come back zero)
        np.testing.assert_array_equal(packing.filter(packing.unfilter(rows)), rows)
    if kind not in FILTER_BITS:  # int8, float16: no levels to difference
        assert packing.filter(rows) is rows


def test_the_filter_differences_each_level_from_the_mean_of_its_left_and_upper_neighbours():
    packing = DetailPacking.of("bits4", (2, 2, 2), 1)
    # levels (channel, row, column), most significant nibble first:
    # [[1, 2], [4, 3]], [[15, 0], [1, 1]]
    rows = np.array([[[0x12, 0x43, 0xF0, 0x11]]], np.uint8)
    # 1 - 0, 2 - 1 (left), 4 - 1 (above), 3 - (4 + 2) // 2; 15, 0 - 15, 1 - 15, 1 - (1 + 0) // 2
    want = np.array([[[0x11, 0x30, 0xF1, 0x21]]], np.uint8)  # (mod 16)
    np.testing.assert_array_equal(packing.filter(rows), want)
    np.testing.assert_array_equal(packing.unfilter(want), rows)


def test_filtered_smooth_details_deflate_smaller():
    view = (3, 16, 16)
    packing = DetailPacking.of("bits4", view, 1)
    y, x = np.mgrid[0:16, 0:16] / 15.0
    smooth = np.stack([np.sin(3 * x + 2 * y + c) * 0.8 for c in range(3)])
    codec = FeatureCodec("bits4")
    detail = codec.decode(codec.encode(smooth), view)[None].astype(np.float32)
    rows, _ = packing.pack(detail)
    assert (len(zlib.compress(packing.filter(rows).tobytes()))
            < len(zlib.compress(rows.tobytes())))


def _frame() -> EscalatedFrame:
    return EscalatedFrame(FeatureCodec("int8"), (8, 2, 2),
                          DetailPacking.of("bits4", (SLOTS * VIEW[0], *VIEW[1:]), SLOTS))


def test_an_escalated_frame_round_trips_bit_for_bit():
    frame, x, detail = _frame(), _features(), _details("bits4", PRESENT)
    frames = frame.pack(x, detail)
    assert frames.dtype == np.uint8 and frames.shape == (3, frame.frame_bytes)
    assert frame.frame_bytes == 4 + 32 + SLOTS * (1 + 16)  # features, flags, detail rows
    f = frame.features_bytes
    np.testing.assert_array_equal(frames[:, f:f + SLOTS], PRESENT.astype(np.uint8))
    features, back = frame.unpack(frames)
    assert features.tobytes() == x.tobytes() and back.tobytes() == detail.tobytes()
    assert frame.pack(x + 1e-3, detail) is None  # features that did not come through the codec
    assert frame.pack(x, detail + 1e-3) is None
    assert frame.pack(x[:2], detail) is None  # frames disagree


@pytest.mark.parametrize(("spoil", "why"), [
    (lambda f: f[:, :-1], "must be uint8"),
    (lambda f: np.concatenate([f, f[:, :1]], axis=1), "must be uint8"),
    (lambda f: f.astype(np.int16), "must be uint8"),
    (lambda f: f.reshape(-1), "must be uint8"),
    (lambda f: f[:0].reshape(0, 0), "must be uint8"),
])
def test_a_malformed_escalated_frame_is_refused(spoil, why):
    frames = _frame().pack(_features(), _details("bits4", PRESENT))
    with pytest.raises(CodecError, match=why):
        _frame().unpack(spoil(frames))


def test_any_bytes_of_whole_frames_unpack():
    # (a client that knows only the metadata, sending random bytes, gets an answer)
    frame = _frame()
    frames = np.random.default_rng(3).integers(0, 256, (5, frame.frame_bytes), np.uint8)
    frames[:, 36] = 0  # the first slot of each frame is empty; any other byte flags a detail
    features, detail = frame.unpack(frames)
    assert np.isfinite(features).all() and np.isfinite(detail).all()
    slots = detail.reshape(5, SLOTS, -1)
    assert not slots[:, 0].any() and slots[:, 1:].all()  # 4-bit levels are never 0


def _lean_metadata(frame: EscalatedFrame) -> dict:
    return {"inputs": [{"name": oip.ESCALATED_FRAME, "datatype": "UINT8",
                        "shape": [-1, frame.frame_bytes], "parameters": frame.parameters()}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]}],
            "parameters": {"lean": True}}


def test_the_edge_reads_the_lean_escalated_models_metadata():
    doc = json.dumps(_lean_metadata(_frame())).encode()
    assert advertised_way("lean", doc, FeatureCodec("int8")) == _frame()
    assert advertised_way("lean", doc, FeatureCodec("binary")) is None


@pytest.mark.parametrize("spoil", [
    lambda d: d["inputs"][0].update(shape=[-1, 7]),
    lambda d: d["inputs"][0]["parameters"].update(layout="ddnn-escalated-frame-2"),
    lambda d: d["inputs"][0]["parameters"].update(detail_filter="none"),
    lambda d: d["inputs"][0]["parameters"].update(slots=2),
    lambda d: d["inputs"][0]["parameters"].pop("features_codec"),
    lambda d: d["inputs"][0].update(datatype="INT8"),
    lambda d: d["parameters"].update(lean=False),
    lambda d: d["outputs"].reverse() or d["outputs"][0].update(name="entropy"),
    lambda d: d["inputs"].append(d["inputs"][0]),
])
def test_lean_metadata_the_edge_cannot_use_is_refused(spoil):
    doc = _lean_metadata(_frame())
    spoil(doc)
    with pytest.raises(CodecError):
        EscalatedFrame.from_metadata(doc)
    assert advertised_way("lean", json.dumps(doc).encode(), FeatureCodec("int8")) is None


def test_a_negotiation_interrupted_by_a_cloud_error_is_asked_again():
    """The lean model's metadata answers 503 (a cloud restarting) and the packed model's 200:
    that request goes packed, but the way is not remembered; once both answer, it is."""
    from ddnn.edge.cloud_escalated import EscalatedRoute

    lean_status = [503]
    asked = []

    def request(method, path, body, headers):
        asked.append((method, path))
        if method == "GET" and path.endswith("-lean/versions/1"):
            return lean_status[0], b"no", {}
        if method == "GET":
            return 200, json.dumps(_metadata()).encode(), {}
        return 200, b"scores", {}

    route = EscalatedRoute("m-escalated", "/", FeatureCodec("int8"), request)
    x, d = _features(), _details("bits4", PRESENT)
    assert route.send(x, d, "1")[3] is False and route.way("1") is None
    assert asked[-1] == ("POST", "/v2/models/m-escalated-packed/versions/1/infer")
    lean_status[0] = 404  # the cloud is back: it serves no lean model
    route.send(x, d, "1")
    assert route.way("1") == "packed"
    gets = sum(m == "GET" for m, _ in asked)
    route.send(x, d, "1")
    assert sum(m == "GET" for m, _ in asked) == gets  # remembered: no more questions
