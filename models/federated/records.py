"""What travels in a federation's Flower messages, in one place: the record names and the
conversions between a model's named numpy arrays and Flower's ``ArrayRecord``.

Server to site: ``config`` (a ``ConfigRecord``: the round, the local-training settings, the
network's architecture as JSON) and, when the site is to start from them, ``arrays`` (the
shared model). Site to server: ``metrics`` (a ``MetricRecord``: examples, steps, loss,
held-out results) and, when it has something to send, ``arrays``; under SCAFFOLD, ``control``
both ways (the sites' combined control variate down, the site's own up); after evaluation,
``counts`` (the calibration tables) and, for stacked exits, ``stacking`` (the tables that refit
their weights). Only these arrays and numbers leave a site.
"""

from __future__ import annotations

import json
import math

import numpy as np
from flwr.app import Array, ArrayRecord

from ddnn import bounded_json

CONFIG, ARRAYS, METRICS, COUNTS = "config", "arrays", "metrics", "counts"
STACKING, CONTROL = "stacking", "control"
# A record's arrays travel packed: their bytes back to back in one array, and an index (each
# one's name, dtype and shape, as JSON) in another. Flower sends every array of a record as
# objects of its own, each one HTTP request to the SuperLink with the node's signature: the
# network's 68 arrays made about 120 requests a record, a packed record a handful.
PACKED, INDEX = "ddnn-packed", "ddnn-index"
MAX_INDEX = 1 << 20  # bytes of index JSON (a model has a few kB)
MAX_ARRAYS = 4096  # arrays a record may name (the network has 68)
MAX_DIMS = 8
KINDS = "fiub"  # float, signed and unsigned integer, bool: never objects


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """The named arrays as one packed record (see :data:`PACKED`)."""
    index, parts = [], []
    for name, value in arrays.items():
        a = np.asarray(value)
        index.append([name, a.dtype.str, list(a.shape)])
        parts.append(a.tobytes())  # C order, whatever the array's layout
    text = np.frombuffer(json.dumps(index).encode(), np.uint8)
    data = np.frombuffer(b"".join(parts), np.uint8)
    return ArrayRecord({INDEX: Array(text), PACKED: Array(data)})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The named arrays of a record, packed (checked: a bad index, or a byte count that does not
    add up, raises ``ValueError``) or one Array each (as Flower's own apps send)."""
    if len(record) > MAX_ARRAYS:
        raise ValueError(f"{len(record)} arrays in one record, over {MAX_ARRAYS}")
    if set(record.keys()) == {INDEX, PACKED}:
        try:
            return _unpack(record[INDEX].numpy(), record[PACKED].numpy())
        except TypeError as e:  # a dtype numpy rejects
            raise ValueError(f"a packed record that does not parse ({type(e).__name__})") from e
    return {k: a.numpy() for k, a in record.items()}


def _unpack(text: np.ndarray, data: np.ndarray) -> dict[str, np.ndarray]:
    if text.dtype != np.uint8 or text.ndim != 1 or text.size > MAX_INDEX:
        raise ValueError("the index is not a byte string of at most 1 MiB")
    if data.dtype != np.uint8 or data.ndim != 1:
        raise ValueError("the packed data is not a byte string")
    try:
        index = bounded_json.loads(text.tobytes(), max_depth=3)  # [[name, dtype, [dims]], ...]
    except ValueError as e:
        raise ValueError(f"the index does not parse ({e})") from None
    if not isinstance(index, list) or len(index) > MAX_ARRAYS:
        raise ValueError(f"the index is not a list of at most {MAX_ARRAYS} arrays")
    out: dict[str, np.ndarray] = {}
    offset = 0
    for entry in index:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and isinstance(entry[2], list)
                and len(entry[2]) <= MAX_DIMS
                and all(type(d) is int and d >= 0 for d in entry[2])):
            raise ValueError(f"bad index entry {str(entry)[:60]}")
        name, dtype, shape = entry[0], np.dtype(entry[1]), tuple(entry[2])
        if dtype.kind not in KINDS or not dtype.isnative or name in out:
            raise ValueError(f"array {name[:40]!r}: dtype {dtype.str} (numbers in this machine's "
                             "byte order only) or a repeated name")
        size = dtype.itemsize * math.prod(shape)  # Python ints: no overflow
        if offset + size > data.size:
            raise ValueError(f"array {name[:40]!r} runs past the packed data")
        out[name] = data[offset:offset + size].view(dtype).reshape(shape).copy()
        offset += size
    if offset != data.size:
        raise ValueError(f"{data.size - offset} packed bytes belong to no array")
    return out


def message_bytes(message) -> int:
    """The bytes a Flower message takes as it travels (what ``communicated_bytes`` adds up):
    Flower sends a message as a tree of objects (the message with its metadata and any error,
    its records, each array and the chunks of its data), each serialized on its own and sent
    once however often it occurs; this is the sum of their serialized sizes. Arrays, tables,
    metrics and config alike: everything the server and a site exchange in that message."""
    sizes: dict[str, int] = {}

    def visit(obj) -> None:
        if obj.object_id not in sizes:
            sizes[obj.object_id] = len(obj.deflate())
            for child in (obj.children or {}).values():
                visit(child)

    visit(message)
    return sum(sizes.values())
