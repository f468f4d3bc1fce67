"""The round driver over a Grid whose sites misbehave: one never answers, one sends NaN, one
fails. Rounds go on with the others, bytes are counted both ways, nothing stalls."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from ddnn.models.federated.records import ARRAYS, CONFIG, METRICS, from_record, to_record
from ddnn.models.federated.server_app import Exchange, run_rounds
from ddnn.models.federated.settings import FederationSettings

START = {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)}


@pytest.fixture(autouse=True)
def task_identity():
    """What a ServerApp process has set when it builds messages."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


class FlakyGrid(Grid):
    """Site 1 trains well, site 2 sends NaN, site 3 never answers, site 4 fails."""

    def __init__(self):
        self.timeouts: list[float | None] = []

    def get_node_ids(self):
        return [1, 2, 3, 4]

    def send_and_receive(self, messages, *, timeout=None):
        self.timeouts.append(timeout)
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            weights = from_record(msg.content[ARRAYS])
            if node == 1:
                sent = {k: v + 0.01 for k, v in weights.items()}
            elif node == 2:
                sent = {k: np.full_like(v, np.nan) for k, v in weights.items()}
            elif node == 4:
                replies.append(Message(Error(code=0, reason="out of memory"), reply_to=msg))
                continue
            else:
                continue
            content = RecordDict({ARRAYS: to_record(sent),
                                  METRICS: MetricRecord({"examples": 10.0})})
            replies.append(Message(content, reply_to=msg))  # from the node it was sent to
        return replies

    def set_run(self, run_id):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    def get_nodes(self):
        raise NotImplementedError

    def push_messages(self, messages):
        raise NotImplementedError

    def pull_messages(self, message_ids):
        raise NotImplementedError


def test_rounds_go_on_without_the_silent_the_failing_and_the_bad_site(caplog):
    caplog.set_level(logging.WARNING, "ddnn.federate")
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, round_timeout=7.0)
    grid = FlakyGrid()
    exchange = Exchange(grid, s, {"arch": "{}"})
    seen = []
    strategy, history = run_rounds(grid, s, exchange, START, seen.append)
    assert [h["round"] for h in history] == [1, 2] and seen == history
    assert all(h["replied"] == 2 and h["accepted"] == 1 for h in history)
    assert all(2 in h["refused"] and "NaN" in h["refused"][2] for h in history)
    np.testing.assert_allclose(strategy.model["w"], 1.02, rtol=1e-6)  # site 1's two steps
    assert grid.timeouts == [7.0, 7.0]
    per_model = to_record(START).count_bytes()
    assert exchange.bytes_down == 2 * 4 * per_model and exchange.bytes_up == 2 * 2 * per_model
    assert "no answer from site 3" in caplog.text and "site 4 failed: out of memory" in caplog.text
    assert CONFIG  # the records' names are the ones the ClientApp reads
