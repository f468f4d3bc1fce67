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

import numpy as np
from flwr.app import Array, ArrayRecord

CONFIG, ARRAYS, METRICS, COUNTS = "config", "arrays", "metrics", "counts"
STACKING, CONTROL = "stacking", "control"


def to_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def from_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in record.items()}


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
