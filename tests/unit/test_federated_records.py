"""What a federation's messages carry: a record's arrays packed in one, read back checked."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord

from ddnn.models.federated.records import INDEX, PACKED, from_record, to_record


def test_named_arrays_travel_packed_and_come_back_alike():
    arrays = {"conv.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4).transpose(2, 0, 1),
              "bn.num_batches_tracked": np.asarray(7, np.int64), "empty": np.zeros(0, np.float64),
              "mask": np.array([True, False])}
    record = to_record(arrays)
    assert set(record.keys()) == {INDEX, PACKED}  # two Arrays, whatever the model holds
    back = from_record(record)
    assert list(back) == list(arrays)
    for name, value in arrays.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
        assert back[name].flags.writeable  # torch.from_numpy takes it without a warning


def test_a_record_of_one_array_each_still_reads():
    record = ArrayRecord({"w": Array(np.ones((2, 2), np.float32))})
    np.testing.assert_array_equal(from_record(record)["w"], np.ones((2, 2), np.float32))


def _packed(index, data: bytes) -> ArrayRecord:
    text = index if isinstance(index, bytes) else json.dumps(index).encode()
    return ArrayRecord({INDEX: Array(np.frombuffer(text, np.uint8)),
                        PACKED: Array(np.frombuffer(data, np.uint8))})


@pytest.mark.parametrize("index, data, why", [
    ([["a", "<f4", [2]]], bytes(7), "runs past"),
    ([["a", "<f4", [2]]], bytes(9), "belong to no array"),
    ([["a", "|O", [1]]], bytes(8), "dtype |O"),
    ([["a", ">f4", [1]]], bytes(4), "byte order"),
    ([["a", "no such dtype", [1]]], b"", "does not parse"),
    (b"[" * 100_000 + b"]" * 100_000, b"", "not a list|does not parse"),
    ([["a", "<f4", [0]]] * 5000, b"", "at most 4096"),
    ([["a", "<f4", [-1]]], b"", "bad index entry"),
    ([["a", "<f4", [1.5]]], bytes(4), "bad index entry"),
    ({"a": 1}, b"", "not a list"),
    ([["a", "<f4", [1]], ["a", "<f4", [1]]], bytes(8), "repeated name"),
    ([["a", "<f4", [2**40, 2**40]]], b"", "runs past"),  # no overflow to a size of 0
    (b"not json", b"", "Expecting value"),
])
def test_a_packed_record_that_does_not_add_up_is_refused(index, data, why):
    with pytest.raises(ValueError, match=why):
        from_record(_packed(index, data))


def test_a_site_whose_packed_arrays_do_not_parse_is_refused_not_raised():
    from flwr.app import MetricRecord, RecordDict

    from ddnn.models.federated.records import ARRAYS, METRICS
    from ddnn.models.federated.server_app import decode_reply

    for index in ([["a", "no such dtype", [1]]], b"[" * 100_000):
        content = RecordDict({METRICS: MetricRecord({"examples": 10.0}),
                              ARRAYS: _packed(index, b"")})
        reason = decode_reply(7, content)
        assert isinstance(reason, str) and "do not decode" in reason
