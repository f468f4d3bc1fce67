"""The round driver over a Grid whose sites misbehave: one never answers, one sends NaN, one
fails. Rounds go on with the others, bytes are counted both ways, nothing stalls."""

from __future__ import annotations

import json
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


class EvaluatingGrid(FlakyGrid):
    """Sites that evaluate as trainer.evaluate does, from fixed exits of their held-out frames:
    stacked by the architecture they are sent, with the stacking tables when asked."""

    def __init__(self, sites):
        super().__init__()
        self.sites, self.configs = sites, []

    def get_node_ids(self):
        return list(self.sites)

    def send_and_receive(self, messages, *, timeout=None):
        from ddnn.models.calibrate import stacking_tables
        from ddnn.models.federated.calibration import exit_counts
        from ddnn.models.federated.records import COUNTS, STACKING
        from ddnn.stacking import Stacking

        replies = []
        for msg in messages:
            config = dict(msg.content[CONFIG])
            self.configs.append(config)
            own, labels, present = self.sites[msg.metadata.dst_node_id]
            arch = json.loads(config["arch"])
            answers = Stacking.from_dict(arch["stacking"]).apply(own)
            content = RecordDict({
                METRICS: MetricRecord({"samples": float(len(labels)), **{
                    k: float((answers[k].argmax(1) == labels).sum())
                    for k in ("local", "edge", "cloud")}}),
                COUNTS: to_record(exit_counts(answers, labels, present, 11))})
            if config.get("stacking-tables"):
                content[STACKING] = to_record(stacking_tables(own, labels))
            replies.append(Message(content, reply_to=msg))
        return replies


def test_federated_evaluation_refits_the_stacking_and_calibrates_with_it():
    from ddnn.hierarchy import UplinkCost
    from ddnn.models.calibrate import fit_stacking
    from ddnn.models.federated.calibration import add_counts, calibrate_counts, exit_counts
    from ddnn.models.federated.server_app import evaluate_everywhere

    rng = np.random.default_rng(0)
    sites, pooled = {}, []
    for node, n in ((1, 300), (2, 500)):
        labels = rng.integers(0, 4, n)
        own = {}
        for k, p in (("local", 0.6), ("edge", 0.55), ("cloud", 0.8)):
            right = rng.random(n) < p
            x = rng.normal(0, 0.5, (n, 4)).astype(np.float32)
            x[np.arange(n), np.where(right, labels, (labels + 1) % 4)] += np.where(right, 3, 1)
            own[k] = x
        sites[node] = (own, labels, np.ones((n, 3), bool))
        pooled.append((own, labels))
    union = {k: np.concatenate([o[k] for o, _ in pooled]) for k in pooled[0][0]}
    labels = np.concatenate([y for _, y in pooled])
    refit = fit_stacking(union, labels, views=3)
    before = {"edge": 1.0, "cloud": 1.0, "escalated": 1.0}
    assert refit.to_dict() != before  # the sites' data call for other weights
    arch = {"views": 3, "stacking": before}
    s = FederationSettings(bundle="b", out="o", work="w", grid=11)
    grid = EvaluatingGrid(sites)
    exchange = Exchange(grid, s, {"arch": json.dumps(arch)})
    cost = UplinkCost(scores=6, features=32, single_view=False)
    cal, stacking, evaluation = evaluate_everywhere(START, exchange, grid, s, 3, cost, arch)
    assert stacking == refit
    assert evaluation["stacking"] == {"refit": True, "weights": refit.to_dict()}
    # The sites were asked twice: for the tables, then to answer with the refitted stacking.
    assert [c["round"] for c in grid.configs] == [4, 4, 5, 5]
    assert all(json.loads(c["arch"])["stacking"] == refit.to_dict() for c in grid.configs[2:])
    answers = refit.apply(union)
    expected = calibrate_counts(add_counts([exit_counts(answers, labels, np.ones((800, 3), bool),
                                                        11)]), cost)
    assert cal.point == expected.point
    assert evaluation["accuracy"]["edge"] == (answers["edge"].argmax(1) == labels).mean()

    # Already the weights the sites' data call for: one evaluation, nothing changes.
    grid = EvaluatingGrid(sites)
    arch = {"views": 3, "stacking": refit.to_dict()}
    exchange = Exchange(grid, s, {"arch": json.dumps(arch)})
    _, again, _ = evaluate_everywhere(START, exchange, grid, s, 3, cost, arch)
    assert again == refit and len(grid.configs) == 2
