"""The round driver over a Grid whose sites misbehave: one never answers, one sends NaN, one
fails. Rounds go on with the others, bytes are counted both ways, nothing stalls."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from ddnn.models.federated.records import (
    ARRAYS,
    CONFIG,
    CONTROL,
    METRICS,
    from_record,
    to_record,
)
from ddnn.models.federated.server_app import Exchange, run_rounds
from ddnn.models.federated.settings import FederationSettings

START = {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)}
# The grids below answer as plain FedAvg sites (no SCAFFOLD variate), hence scaffold=0 where a
# test runs rounds; ScaffoldGrid answers with variates.


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
        self.sent, self.returned = [], []  # every message each way, to count their bytes
        self.pending: list[Message] = []  # the replies the next pull returns

    def get_node_ids(self):
        return [1, 2, 3, 4]

    def push_messages(self, messages):
        """The sites answer at once (``send_and_receive``: what they answer); the next pull
        returns the replies. Message ids as Flower gives them: each message's object id."""
        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
        self.pending += self.send_and_receive(messages)
        return [msg.metadata.message_id for msg in messages]

    def pull_messages(self, message_ids):
        replies = [r for r in self.pending if r.metadata.reply_to_message_id in message_ids]
        self.pending = [r for r in self.pending if r not in replies]
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        self.sent += messages
        replies = self._replies(messages)
        self.returned += replies
        return replies

    def _replies(self, messages):
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


def test_rounds_go_on_without_the_silent_the_failing_and_the_bad_site(caplog):
    caplog.set_level(logging.WARNING, "ddnn.federate")
    # Site 3 never answers: each round waits out its (short) timeout for it.
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, scaffold=0, round_timeout=0.3)
    grid = FlakyGrid()
    exchange = Exchange(grid, s, {"arch": "{}"})
    seen = []
    strategy, history = run_rounds(grid, s, exchange, START, seen.append)
    assert [h["round"] for h in history] == [1, 2] and seen == history
    assert all(h["replied"] == 2 and h["accepted"] == 1 for h in history)
    assert all(2 in h["refused"] and "NaN" in h["refused"][2] for h in history)
    np.testing.assert_allclose(strategy.model["w"], 1.02, rtol=1e-6)  # site 1's two steps
    # Every message counted whole, as Flower sends it: its objects, each once, serialized.
    assert exchange.bytes_down == sum(map(wire_bytes, grid.sent))
    assert exchange.bytes_up == sum(map(wire_bytes, grid.returned))  # the error reply too
    per_model = to_record(START).count_bytes()
    assert exchange.bytes_down > 2 * 4 * per_model  # the models, and the config with them
    assert exchange.bytes_up > 2 * 2 * per_model  # the models, and the metrics with them
    assert "no answer from site 3" in caplog.text and "site 4 failed: out of memory" in caplog.text
    assert CONFIG  # the records' names are the ones the ClientApp reads


def wire_bytes(message) -> int:
    """Flower's own traversal of what it sends for a message: every object of its tree once."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(o.deflate()) for o in get_all_nested_objects(message).values())


class HostileGrid(FlakyGrid):
    """Sites 1 to 3 train well; site 4 answers with ``reply(weights)``, a reply's content."""

    def __init__(self, reply):
        super().__init__()
        self.reply = reply

    def _replies(self, messages):
        out = []
        for msg in messages:
            weights = from_record(msg.content[ARRAYS])
            if msg.metadata.dst_node_id == 4:
                content = self.reply(weights)
            else:
                content = RecordDict({ARRAYS: to_record({k: v + 0.01 for k, v in weights.items()}),
                                      METRICS: MetricRecord({"examples": 10.0, "loss": 0.5})})
            out.append(Message(content, reply_to=msg))
        return out


def _sent(metrics: dict, arrays=None):
    """A reply's content: ``arrays`` (the shared weights moved a little by default)."""
    def reply(weights):
        content = RecordDict({METRICS: MetricRecord(metrics)})
        content[ARRAYS] = (arrays(weights) if arrays is not None
                           else to_record({k: v + 0.01 for k, v in weights.items()}))
        return content
    return reply


def _undecodable(weights):
    return ArrayRecord({k: Array(dtype="float32", shape=tuple(v.shape), stype="numpy.ndarray",
                                 data=b"\x93NUMPY?") for k, v in weights.items()})


MALFORMED = {
    "list-in-metrics": (_sent({"examples": 10.0, "loss": [1.0, 2.0]}), "'loss' is a list"),
    "list-count": (_sent({"examples": [10.0]}), "'examples' is a list"),
    "nan-in-metrics": (_sent({"examples": 10.0, "loss": float("nan")}), "'loss' is nan"),
    "no-count": (_sent({"loss": 0.5}), "example count None"),
    "count-2**62": (_sent({"examples": float(2**62)}), "out of range"),
    "negative-count": (_sent({"examples": -10.0}), "out of range"),
    "fractional-count": (_sent({"examples": 10.5}), "not a whole number"),
    "undecodable-arrays": (_sent({"examples": 10.0}, _undecodable), "do not decode"),
    "other-serialization": (_sent({"examples": 10.0}, lambda w: ArrayRecord({
        k: Array(dtype="float32", shape=tuple(v.shape), stype="torch.Tensor", data=v.tobytes())
        for k, v in w.items()})), "do not decode"),
    "arrays-not-arrays": (_sent({"examples": 10.0}, lambda w: MetricRecord({"w": 1.0})),
                          "not an array record"),
    "config-as-metrics": (lambda w: RecordDict({METRICS: ConfigRecord({"examples": "ten"}),
                                                ARRAYS: to_record(w)}), "no metrics record"),
    "wrong-names": (_sent({"examples": 10.0}, lambda w: to_record({"x": w["w"]})), "missing"),
    "wrong-shapes": (_sent({"examples": 10.0}, lambda w: to_record({**w, "w": w["w"][:2]})),
                     "expected float32[4, 4]"),
    "nan-arrays": (_sent({"examples": 10.0}, lambda w: to_record(
        {k: np.full_like(v, np.nan) for k, v in w.items()})), "NaN"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_reply_is_refused_and_the_round_goes_on(kind, caplog):
    """Whatever one site sends, the run does not end: its reply is refused with the reason,
    logged and counted in the round's record, and the others' updates make the model."""
    reply, reason = MALFORMED[kind]
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, scaffold=0)
    grid = HostileGrid(reply)
    exchange = Exchange(grid, s, {"arch": "{}"})
    strategy, history = run_rounds(grid, s, exchange, START, lambda e: None)
    for h in history:
        assert h["replied"] == 4 and h["accepted"] == 3 and list(h["refused"]) == [4]
        assert reason in h["refused"][4], h["refused"][4]
    assert f"site 4: {history[0]['refused'][4]}" in caplog.text  # logged as refused
    np.testing.assert_allclose(strategy.model["w"], 1.02, rtol=1e-6)  # the other three's
    json.dumps(history)  # the round's record stays plain JSON


class SlowGrid(FlakyGrid):
    """Sites 1 and 2 train well; site 1's reply arrives only at the third pull, site 2's never."""

    def __init__(self):
        super().__init__()
        self.pulls = 0

    def get_node_ids(self):
        return [1, 2]

    def pull_messages(self, message_ids):
        self.pulls += 1
        if self.pulls < 3:
            return []
        return [r for r in super().pull_messages(message_ids) if r.metadata.src_node_id == 1]


def test_replies_are_pulled_until_all_came_or_the_round_timeout_passed():
    from ddnn.models.federated.server_app import send_and_receive

    grid = SlowGrid()
    messages = [Message(RecordDict({ARRAYS: to_record(START)}), dst_node_id=n,
                        message_type="train") for n in (1, 2)]
    replies = send_and_receive(grid, messages, timeout=0.5, poll=0.01)
    assert [r.metadata.src_node_id for r in replies] == [1]  # site 1's late reply, once
    assert grid.pulls > 3  # asked again for site 2's until the timeout
    grid = SlowGrid()
    grid.get_node_ids = lambda: [1]
    replies = send_and_receive(grid, messages[:1], timeout=60.0, poll=0.01)
    assert [r.metadata.src_node_id for r in replies] == [1] and grid.pulls == 3  # no more


def test_fewer_good_replies_than_min_sites_leave_the_model_as_it_was():
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, scaffold=0, min_sites=4)
    grid = HostileGrid(MALFORMED["list-in-metrics"][0])
    strategy, history = run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START,
                                   lambda e: None)
    assert all(h["accepted"] == 0 and 4 in h["refused"] for h in history)
    np.testing.assert_array_equal(strategy.model["w"], START["w"])


class EvaluatingGrid(FlakyGrid):
    """Sites that evaluate as trainer.evaluate does, from fixed exits of their held-out frames:
    stacked by the architecture they are sent, with the stacking tables when asked. Sites in
    ``old`` send no stacking tables; ``silent_after`` exchanges, no site answers."""

    def __init__(self, sites, old=(), silent_after=None, tamper=None):
        super().__init__()
        self.sites, self.old, self.silent_after = sites, set(old), silent_after
        self.tamper = tamper or {}  # node -> what it does to its reply's content
        self.configs, self.exchanges = [], 0

    def get_node_ids(self):
        return list(self.sites)

    def send_and_receive(self, messages, *, timeout=None):
        from ddnn.models.calibrate import stacking_tables
        from ddnn.models.federated.calibration import exit_counts
        from ddnn.models.federated.records import COUNTS, STACKING
        from ddnn.stacking import Stacking

        self.exchanges += 1
        if self.silent_after is not None and self.exchanges > self.silent_after:
            return []
        replies = []
        for msg in messages:
            config = dict(msg.content[CONFIG])
            self.configs.append({**config, "weights sent": ARRAYS in msg.content})
            node = msg.metadata.dst_node_id
            own, labels, present = self.sites[node]
            stacking = json.loads(config["arch"])["stacking"]
            answers = Stacking.from_dict(stacking).apply(own) if stacking else own
            content = RecordDict({
                METRICS: MetricRecord({"samples": float(len(labels)), **{
                    k: float((answers[k].argmax(1) == labels).sum())
                    for k in ("local", "edge", "cloud", "escalated") if k in answers}}),
                COUNTS: to_record(exit_counts(answers, labels, present, 11))})
            if config.get("stacking-tables") and node not in self.old:
                content[STACKING] = to_record(stacking_tables(own, labels))
            if node in self.tamper:
                self.tamper[node](content, self.exchanges)
            replies.append(Message(content, reply_to=msg))
        return replies


def _evaluating_sites():
    """Two sites whose pooled held-out frames call for weights other than 1 (each tier's own)."""
    rng = np.random.default_rng(0)
    sites = {}
    for node, n in ((1, 300), (2, 500)):
        labels = rng.integers(0, 4, n)
        own = {}
        for k, p in (("local", 0.6), ("edge", 0.55), ("cloud", 0.8)):
            right = rng.random(n) < p
            x = rng.normal(0, 0.5, (n, 4)).astype(np.float32)
            x[np.arange(n), np.where(right, labels, (labels + 1) % 4)] += np.where(right, 3, 1)
            own[k] = x
        sites[node] = (own, labels, np.ones((n, 3), bool))
    union = {k: np.concatenate([sites[n][0][k] for n in sites]) for k in ("local", "edge",
                                                                          "cloud")}
    return sites, union, np.concatenate([sites[n][1] for n in sites])


OWN = {"edge": 1.0, "cloud": 1.0, "escalated": 1.0}  # a stacking of each tier's own answers
ARCH = {"views": 3, "config": {"escalate": "none"}}


def _evaluate(grid, arch, detail: int = 0, level: int = 0):
    from ddnn.hierarchy import UplinkCost
    from ddnn.models.federated.server_app import evaluate_everywhere

    # A silent grid is waited for round_timeout (short: the fakes answer at once or never).
    s = FederationSettings(bundle="b", out="o", work="w", grid=11, round_timeout=0.3)
    exchange = Exchange(grid, s, {"arch": json.dumps(arch)})
    cost = UplinkCost(scores=6, features=32, single_view=False, detail=detail)
    return (*evaluate_everywhere(START, exchange, grid, s, 3, cost, arch, level=level), cost)


def test_an_escalating_bundle_is_calibrated_at_level_1_from_the_sites_tables(caplog):
    """Sites of a bundle that escalates send level 1's tables too (the escalated exit's
    answers, their details' bytes): the federation picks the level as ``ddnn train`` would on
    the union of their held-out frames. A site claiming more detail bytes than its devices can
    send is left out."""
    from ddnn.models.federated.calibration import add_counts, calibrate_counts, exit_counts

    sites, _, labels = _evaluating_sites()
    rng = np.random.default_rng(1)
    for own, y, present in sites.values():
        x = rng.normal(0, 0.5, (len(y), 4)).astype(np.float32)
        x[np.arange(len(y)), y] += 3 * (rng.random(len(y)) < 0.95)  # right on about 95 %
        own["escalated"] = x
        own["detail_bytes"] = present.sum(1) * rng.integers(150, 250, len(y))
    arch = {"views": 3, "config": {"escalate": "view"}, "stacking": None}
    cal, _, evaluation, cost = _evaluate(EvaluatingGrid(sites), arch, detail=384)
    pooled = {k: np.concatenate([sites[n][0][k] for n in sites]) for k in sites[1][0]}
    expected = calibrate_counts(add_counts([exit_counts(pooled, labels, np.ones((800, 3), bool),
                                                        11)]), cost)
    assert cal.point == expected.point and cal.point.level == 1 and evaluation["sites"] == 2
    assert evaluation["accuracy"]["escalated"] == (pooled["escalated"].argmax(1) == labels).mean()
    assert cal.point.bytes_per_frame > 6 * 3 + 200  # some frames' details counted

    liar = _tampered("counts", lambda c: {**c, "details_1": c["details_1"] + 10**6})
    cal2, _, evaluation2, _ = _evaluate(EvaluatingGrid(sites, tamper={2: liar}), arch, 384)
    assert "left the evaluation of site 2 out: more detail bytes" in caplog.text
    assert evaluation2["sites"] == 1 and evaluation2["samples"] == 300
    own, y, present = sites[1]
    assert cal2.point == calibrate_counts(exit_counts(own, y, present, 11), cost).point


def test_federated_evaluation_refits_the_stacking_and_calibrates_with_it():
    from ddnn.models.calibrate import fit_stacking
    from ddnn.models.federated.calibration import add_counts, calibrate_counts, exit_counts

    sites, union, labels = _evaluating_sites()
    refit = fit_stacking(union, labels, views=3)
    assert refit.to_dict() != OWN  # the sites' data call for other weights
    grid = EvaluatingGrid(sites)
    cal, stacking, evaluation, cost = _evaluate(grid, {**ARCH, "stacking": OWN})
    assert stacking == refit
    assert evaluation["stacking"] == {"refit": True, "changed": True, "sites": 2,
                                      "weights": refit.to_dict()}
    # The sites were asked twice: for the tables, then to answer with the refitted stacking.
    assert [c.get("stacking-tables", False) for c in grid.configs] == [True, True, False, False]
    assert [c["weights sent"] for c in grid.configs] == [True, True, False, False]  # kept there
    assert all(json.loads(c["arch"])["stacking"] == refit.to_dict() for c in grid.configs[2:])
    answers = refit.apply(union)
    expected = calibrate_counts(add_counts([exit_counts(answers, labels, np.ones((800, 3), bool),
                                                        11)]), cost)
    assert cal.point == expected.point
    assert evaluation["accuracy"]["edge"] == (answers["edge"].argmax(1) == labels).mean()

    # Already the weights the sites' data call for: one evaluation, nothing changes.
    grid = EvaluatingGrid(sites)
    _, again, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": refit.to_dict()})
    assert again == refit and len(grid.configs) == 2
    assert evaluation["stacking"]["refit"] is True and evaluation["stacking"]["changed"] is False


def test_the_bundles_stacking_stays_where_the_refit_cannot_be_trusted_or_evaluated(caplog):
    from ddnn.hierarchy import UplinkCost
    from ddnn.models.federated.calibration import add_counts, calibrate_counts, exit_counts
    from ddnn.stacking import Stacking

    sites, union, labels = _evaluating_sites()
    first = calibrate_counts(add_counts([exit_counts(Stacking.from_dict(OWN).apply(union), labels,
                                                     np.ones((800, 3), bool), 11)]),
                             UplinkCost(scores=6, features=32, single_view=False))
    # A site too old to send stacking tables; no site answering the second evaluation.
    for grid in (EvaluatingGrid(sites, old={2}), EvaluatingGrid(sites, silent_after=1)):
        cal, stacking, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": OWN})
        assert stacking is None and evaluation["stacking"]["refit"] is False
        assert evaluation["stacking"]["weights"] == OWN and not evaluation["stacking"]["changed"]
        assert cal.point == first.point  # calibrated on the first evaluation, as the bundle was
    assert "site 2 sent no stacking tables" in caplog.text
    assert "no site evaluated the refitted stacking" in caplog.text
    # An unstacked bundle: no tables asked for, no stacking in the record.
    grid = EvaluatingGrid(sites)
    _, stacking, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": None})
    assert stacking is None and "stacking" not in evaluation
    assert [c["stacking-tables"] for c in grid.configs] == [False, False]


def _tampered(record: str, change, exchanges=None):
    """A site's change to its answer (at the given exchanges: all by default)."""
    from ddnn.models.federated.records import COUNTS

    def tamper(content, exchange):
        if exchanges is not None and exchange not in exchanges:
            return
        if record == METRICS:
            content[METRICS] = MetricRecord({**dict(content[METRICS]), **change})
        elif record == "undecodable":
            content[COUNTS] = ArrayRecord({"correct": Array(dtype="float64", shape=(3,),
                                                            stype="numpy.ndarray", data=b"?")})
        elif record == "dropped":
            del content[COUNTS]
        else:
            counts = from_record(content[COUNTS])
            content[COUNTS] = to_record(change(counts))
    return tamper


@pytest.mark.parametrize("tamper", [
    _tampered(METRICS, {"samples": [1.0, 2.0]}),
    _tampered(METRICS, {"samples": float("nan")}),
    _tampered(METRICS, {"cloud": 1e9}),
    _tampered("counts", lambda c: {**c, "correct": c["correct"][:5]}),
    _tampered("counts", lambda c: {**c, "correct": c["correct"] * -1}),
    _tampered("counts", lambda c: {**c, "correct": c["correct"].astype(np.float64) + 0.5}),
    _tampered("counts", lambda c: {**c, "local_exits": c["local_exits"] + 10**6}),
    _tampered("counts", lambda c: {**c, "samples": c["samples"] * 2}),
    _tampered("counts", lambda c: {k: v for k, v in c.items() if k != "views"}),
    _tampered("counts", lambda c: {k: v for k, v in c.items() if k != "agree_edge"}),
    _tampered("counts", lambda c: {**c, "views": c["views"] * 10}),
    _tampered("undecodable", None),
    _tampered("dropped", None),
], ids=["samples-list", "samples-nan", "right-beyond", "shape", "negative", "fractions",
        "beyond-seen", "samples-mismatch", "missing", "some-agreement", "views-beyond",
        "undecodable", "no-tables"])
def test_an_evaluation_whose_numbers_cannot_be_true_is_left_out(tamper, caplog):
    from ddnn.models.federated.calibration import add_counts, calibrate_counts, exit_counts

    sites, _, _ = _evaluating_sites()
    honest = EvaluatingGrid({1: sites[1]})
    cal, _, evaluation, cost = _evaluate(honest, {**ARCH, "stacking": None})
    grid = EvaluatingGrid(sites, tamper={2: tamper})
    cal2, _, evaluation2, _ = _evaluate(grid, {**ARCH, "stacking": None})
    assert "left the evaluation of site 2 out" in caplog.text
    assert evaluation2 == evaluation and cal2.point == cal.point  # site 1's alone
    own, labels, present = sites[1]
    assert cal.point == calibrate_counts(add_counts([exit_counts(own, labels, present, 11)]),
                                         cost).point


def test_sites_that_held_no_frame_out_leave_the_thresholds_as_they_were():
    """Tables of no held-out frame pass the checks (honest: a site with too little data holds
    none out) but cannot calibrate anything: the federation keeps the bundle's thresholds."""
    sites, _, _ = _evaluating_sites()
    empty = {n: ({k: v[:0] for k, v in own.items()}, y[:0], p[:0])
             for n, (own, y, p) in sites.items()}
    cal, _, evaluation, _ = _evaluate(EvaluatingGrid(empty), {**ARCH, "stacking": None})
    assert cal is None and evaluation == {"sites": 2, "samples": 0, "accuracy": {}}


def test_honest_odd_answers_are_kept_and_a_changed_second_answer_is_not(caplog):
    """An older site without agreement tables and a site whose frames no camera saw are
    evaluated; a site whose second answer claims other samples is left out of that one."""
    from ddnn.models.calibrate import fit_stacking

    sites, union, labels = _evaluating_sites()
    own, y, present = sites[2]
    sites[3] = (own, y, np.zeros_like(present))  # no view present in any frame
    old = _tampered("counts", lambda c: {k: v for k, v in c.items()
                                         if not k.startswith("agree_")})
    grid = EvaluatingGrid(sites, tamper={2: old})
    _, _, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": None})
    assert evaluation["sites"] == 3 and "left the evaluation" not in caplog.text
    assert "calibrating on accuracy alone" in caplog.text  # the older site's tables count

    del sites[3]
    more = {"samples": 600.0}  # the second time, as if the site held 100 more frames out
    metrics = _tampered(METRICS, more, exchanges={2})
    counts = _tampered("counts", lambda c: {**c, "samples": c["samples"] + 100}, exchanges={2})
    grid = EvaluatingGrid(sites, tamper={2: lambda c, e: (metrics(c, e), counts(c, e))})
    _, stacking, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": OWN})
    assert stacking == fit_stacking(union, labels, views=3)  # refitted on both sites' tables
    assert evaluation["sites"] == 1  # the second evaluation: site 1 alone
    assert "other held-out samples than in the first evaluation" in caplog.text


def test_a_site_keeps_the_model_for_the_second_evaluation_only(tiny_bundle, tiny_data):
    from flwr.app import ConfigRecord, Context, MessageType

    from ddnn.bundle import load_bundle
    from ddnn.models.federated import client_app
    from ddnn.models.federated.records import COUNTS, STACKING
    from ddnn.models.federated.weights import architecture, model_from_bundle, model_weights

    arch = architecture(load_bundle(tiny_bundle))
    weights = model_weights(model_from_bundle(tiny_bundle))
    context = Context(run_id=1, node_id=1, node_config={"data": str(tiny_data.train)},
                      state=RecordDict(), run_config={})
    base = {"arch": json.dumps(arch), "holdout": 0.25, "seed": 0, "grid": 11, "threads": 1}

    def ask(config: dict, with_weights: bool):
        content = RecordDict({CONFIG: ConfigRecord({**base, **config})})
        if with_weights:
            content[ARRAYS] = to_record(weights)
        msg = Message(content, dst_node_id=1, message_type=MessageType.EVALUATE)
        return client_app.evaluate(msg, context).content

    first = ask({"stacking-tables": True}, with_weights=True)
    assert STACKING in first.array_records and client_app.EVALUATED in context.state
    again = json.dumps({**arch, "stacking": {"edge": 0.0, "cloud": 0.0, "escalated": 0.0}})
    second = ask({"arch": again}, with_weights=False)  # the kept model, with other weights
    assert COUNTS in second.array_records and client_app.EVALUATED not in context.state
    assert dict(second[METRICS])["samples"] == dict(first[METRICS])["samples"]
    with pytest.raises(ValueError, match="none kept"):
        ask({}, with_weights=False)  # used once: nothing is kept any longer
    ask({}, with_weights=True)  # no stacking tables asked for: no second evaluation follows
    assert client_app.EVALUATED not in context.state


class ScaffoldGrid(FlakyGrid):
    """SCAFFOLD sites: the honest ones send control variates of 0.1 x their node id; site
    ``hostile`` sends ``variate(round)`` (None: none at all; "silent": no reply)."""

    def __init__(self, variate, hostile: int | set[int] = 4):
        super().__init__()
        self.variate = variate
        self.hostile = hostile if isinstance(hostile, set) else {hostile}

    def _replies(self, messages):
        out = []
        for msg in messages:
            node, rnd = msg.metadata.dst_node_id, int(msg.content[CONFIG]["round"])
            weights = from_record(msg.content[ARRAYS])
            control = (self.variate(rnd) if node in self.hostile
                       else {k: np.full_like(v, 0.1 * node) for k, v in START.items()})
            if isinstance(control, str) and control == "silent":
                continue
            content = RecordDict({ARRAYS: to_record({k: v + 0.01 for k, v in weights.items()}),
                                  METRICS: MetricRecord({"examples": 10.0})})
            if control is not None:
                content[CONTROL] = to_record(control)
            out.append(Message(content, reply_to=msg))
        return out


@pytest.mark.parametrize("hostile, variate, why", [
    (4, lambda rnd: {k: np.full_like(v, 1e6) for k, v in START.items()}, "model-relative"),
    (4, lambda rnd: {"w": np.ones((2, 2), np.float32), "b": START["b"]},
     "control variate: w is float32[2, 2]"),
    (4, lambda rnd: {k: np.full_like(v, np.nan) for k, v in START.items()}, "NaN"),
    (4, lambda rnd: None, "no control variate"),
    # The arrays a variate holds are the server's to name: a site that answers first with
    # fewer (or none) cannot make the others' look wrong.
    (1, lambda rnd: {"b": START["b"]}, "control variate: arrays differ from the model's"),
    (1, lambda rnd: {}, "control variate: arrays differ from the model's"),
    (4, lambda rnd: dict(reversed(list(START.items()))), "another order"),
])
def test_scaffold_sends_the_sites_combined_control_and_refuses_a_bad_one(hostile, variate, why,
                                                                        caplog):
    caplog.set_level(logging.WARNING, "ddnn.federate")
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, scaffold=1)
    grid = ScaffoldGrid(variate, hostile)
    strategy, history = run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START, [].append)
    assert all(h["accepted"] == 3 and list(h["refused"]) == [hostile] and
               why in h["refused"][hostile] for h in history)
    # Round 1 starts from no variate (zeros at the sites); round 2 sends the honest mean.
    honest = np.mean([0.1 * n for n in (1, 2, 3, 4) if n != hostile])
    first, second = grid.sent[:4], grid.sent[4:]
    assert all(CONTROL not in m.content for m in first)
    assert all(np.allclose(from_record(m.content[CONTROL])["w"], honest) for m in second)
    np.testing.assert_allclose(strategy.model["w"], 1.02, rtol=1e-6)  # the honest sites' steps
    assert f"refused the update of site {hostile}" in caplog.text


@pytest.mark.parametrize("round_2, share", [
    ("silent", 0.25),  # its round-1 variate (0.4) still counts in round 3, as in the paper
    (None, 0.2),  # refused: its earlier variate no longer speaks for it
    ({"w": np.full((4, 4), np.nan, np.float32), "b": START["b"]}, 0.2)])
def test_a_silent_site_keeps_its_share_of_the_combined_variate_and_a_refused_one_loses_it(
        round_2, share):
    s = FederationSettings(bundle="b", out="o", work="w", rounds=3, scaffold=1,
                           round_timeout=0.3)  # a silent site is waited for that long
    grid = ScaffoldGrid(lambda rnd: round_2 if rnd == 2 else
                        {k: np.full_like(v, 0.4) for k, v in START.items()})
    run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START, [].append)
    third = grid.sent[8:]
    assert len(third) == 4
    assert all(np.allclose(from_record(m.content[CONTROL])["w"], share) for m in third)


def test_a_site_that_leaves_takes_its_variate_with_it():
    from ddnn.models.federated.strategy import FedAvg, Reply

    fedavg = FedAvg(START, scaffold=True)
    fedavg.aggregate(1, [Reply(n, START, 10, control={k: np.full_like(v, 0.1 * n)
                                                      for k, v in START.items()})
                         for n in (1, 2, 3, 4)])
    assert np.allclose(fedavg.configure(2, [1, 2, 3, 4])[1].control["w"], 0.25)
    assert np.allclose(fedavg.configure(3, [1, 2, 3])[1].control["w"], 0.2)
    assert set(fedavg.site_controls) == {1, 2, 3}


def test_sites_that_send_no_control_variate_are_told_to_run_without_scaffold(caplog):
    caplog.set_level(logging.WARNING, "ddnn.federate")
    s = FederationSettings(bundle="b", out="o", work="w", rounds=1, scaffold=1)
    grid = ScaffoldGrid(lambda rnd: None, {1, 2, 3, 4})
    strategy, history = run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START, [].append)
    assert history[0]["accepted"] == 0 and strategy.model["w"][0, 0] == 1.0
    assert all("--no-scaffold" in why for why in history[0]["refused"].values())
    assert "--no-scaffold" in caplog.text


def test_scaffold_is_fedavgs_alone():
    from ddnn.errors import ConfigError

    with pytest.raises(ConfigError, match="FedAvg's"):
        FederationSettings(bundle="b", out="o", work="w", strategy="dma", scaffold=1)


def test_a_scaffold_site_corrects_its_steps_and_keeps_its_variate(tiny_bundle, tiny_data):
    from flwr.app import ConfigRecord, Context, MessageType

    from ddnn.bundle import load_bundle
    from ddnn.models.federated import client_app
    from ddnn.models.federated.weights import (
        architecture,
        build_model,
        model_from_bundle,
        model_weights,
    )

    arch = architecture(load_bundle(tiny_bundle))
    weights = model_weights(model_from_bundle(tiny_bundle))
    params = [n for n, _ in build_model(arch).named_parameters()]
    context = Context(run_id=1, node_id=1, node_config={"data": str(tiny_data.train)},
                      state=RecordDict(), run_config={})
    config = {"arch": json.dumps(arch), "holdout": 0.25, "seed": 0, "threads": 1,
              "strategy": "fedavg", "scaffold": 1, "epochs": 1.0, "lr": 0.01,
              "batch-size": 32, "round": 1}

    def train(control=None):
        content = RecordDict({CONFIG: ConfigRecord(config), ARRAYS: to_record(weights)})
        if control is not None:
            content[CONTROL] = to_record(control)
        msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
        return client_app.train(msg, context).content

    first = train()  # no variate yet on either side: plain steps
    own = from_record(context.state[client_app.OWN_CONTROL])
    sent = from_record(first[CONTROL])
    assert list(sent) == params and all(np.array_equal(sent[n], own[n]) for n in params)
    # The same round again with the sites' variate equal to its own: no correction, same steps.
    same = train(own)
    assert all(np.array_equal(from_record(same[ARRAYS])[n], from_record(first[ARRAYS])[n])
               for n in params)
    # A shared variate far above the site's own pushes every weight down: the correction is
    # the shared variate less the site's own, added to each gradient.
    other = train({n: v + 1e3 for n, v in own.items()})
    trained = from_record(other[ARRAYS])
    assert all((trained[n] < weights[n]).all() for n in params)


def test_a_variate_over_the_models_norm_is_refused_though_such_an_update_is_not():
    """Updates may move the model by up to 2 x its norm; a variate (a mean gradient, about a
    third of the model's norm on the benchmark) stays bounded by 1 x: it steers every site."""
    from ddnn.models.federated.strategy import FedAvg, Reply

    norm = float(np.sqrt(sum(np.square(v).sum() for v in START.values())))  # 4.0
    step = {k: v + 1.5 * norm / 4.0 for k, v in START.items() if k == "w"}  # 1.5 x the norm
    model = {**START, **step}
    big = {k: np.full_like(v, 1.5 * norm / np.sqrt(20.0)) for k, v in START.items()}
    small = {k: np.full_like(v, 0.1) for k, v in START.items()}
    fedavg = FedAvg(START, scaffold=True)
    out = fedavg.aggregate(1, [Reply(1, model, 10, control=small),
                               Reply(2, model, 10, control=big)])
    assert out.accepted == (1,) and "control variate norm" in out.refused[2]


class StepsGrid(FlakyGrid):
    """Four sites of 640 examples (at most 60 steps in a round of 6 epochs of 64) that
    report the steps they ran (site n: 10 n), no variate; site 4 claims ``claim`` steps."""

    def __init__(self, claim: float = 40.0):
        super().__init__()
        self.claim = claim

    def _replies(self, messages):
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            weights = from_record(msg.content[ARRAYS])
            steps = self.claim if node == 4 else 10.0 * node
            content = RecordDict({ARRAYS: to_record({k: v + 0.01 for k, v in weights.items()}),
                                  METRICS: MetricRecord({"examples": 640.0, "steps": steps})})
            out.append(Message(content, reply_to=msg))
        return out


@pytest.mark.parametrize("claim, span", [  # the round's median claim: 25, 15, 25
    (40.0, 25.0), (1.0, 0.25 * (10 + 20 + 30 + 15 / 4)), (1e12, 0.25 * (10 + 20 + 30 + 60))])
def test_derived_variates_travel_as_a_span_alone_and_a_site_cannot_set_it(claim, span):
    """SCAFFOLD's option II: no variate goes either way; round 2 tells each site the mean
    steps round 1's shared step covered, each claim held within what its example count allows
    (60) and within 4 x the round's median."""
    s = FederationSettings(bundle="b", out="o", work="w", rounds=2, scaffold=1,
                           variates="derived")
    grid = StepsGrid(claim)
    strategy, history = run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START, [].append)
    assert all(h["accepted"] == 4 for h in history)
    assert all(CONTROL not in m.content for m in grid.sent + grid.returned)
    first, second = grid.sent[:4], grid.sent[4:]
    assert all(float(m.content[CONFIG]["span"]) == 0.0 for m in first)
    assert all(float(m.content[CONFIG]["span"]) == pytest.approx(span) for m in second)
    np.testing.assert_allclose(strategy.model["w"], 1.02, rtol=1e-6)


def test_of_two_sites_neither_sets_the_span_by_its_claim():
    """Two sites: the median is their mean, so only the bound an example count sets holds an
    inflated claim (a claimed count weighs at most twice the median's, so its bound too)."""
    from ddnn.models.federated.strategy import FedAvg, Reply

    model = {k: v + 0.01 for k, v in START.items()}
    # Site 2 claims 10^6 examples, counted as 600 (twice the median claim): 60 steps at most.
    for claim, span in ((1e12, (300 * 30 + 600 * 60) / 900), (30.0, 30.0)):
        fedavg = FedAvg(START, scaffold=True, derived=True, local_steps=(6.0, 64))
        fedavg.aggregate(1, [Reply(1, model, 300, {"steps": 30.0}),
                             Reply(2, model, 10**6, {"steps": claim})])
        assert fedavg.span == pytest.approx(span)
        assert fedavg.configure(2, [1, 2])[1].span == fedavg.span
    # A reply without a claim counts as the most its examples allow.
    fedavg = FedAvg(START, scaffold=True, derived=True, local_steps=(6.0, 64))
    fedavg.aggregate(1, [Reply(1, model, 300, {"steps": 30.0}), Reply(2, model, 300, {})])
    assert fedavg.span == pytest.approx(30.0)
    with pytest.raises(ValueError, match="momentum"):
        FedAvg(START, scaffold=True, derived=True, momentum=0.5)


def test_derived_variates_leave_the_models_alone_on_the_wire():
    arrays = {}
    for variates in ("sent", "derived"):
        s = FederationSettings(bundle="b", out="o", work="w", rounds=3, scaffold=1,
                               variates=variates)
        grid = (ScaffoldGrid(lambda rnd: {k: np.full_like(v, 0.1) for k, v in START.items()})
                if variates == "sent" else StepsGrid())
        run_rounds(grid, s, Exchange(grid, s, {"arch": "{}"}), START, [].append)
        arrays[variates] = sum(sum(v.nbytes for v in from_record(m.content[name]).values())
                               for m in grid.sent + grid.returned for name in (ARRAYS, CONTROL)
                               if name in m.content)
    # Option I: a variate beside every model but round 1's downloads (11 models' worth a site
    # over 3 rounds); option II: the models alone (6).
    model = sum(v.nbytes for v in START.values())
    assert (arrays["sent"], arrays["derived"]) == (4 * 11 * model, 4 * 6 * model)


def test_a_derived_variate_site_reads_the_federations_step_off_the_model_it_is_sent(
        tiny_bundle, tiny_data):
    from flwr.app import Context, MessageType

    from ddnn.bundle import load_bundle
    from ddnn.models.federated import client_app
    from ddnn.models.federated.trainer import LocalTraining, fit, load_site
    from ddnn.models.federated.weights import (
        architecture,
        build_model,
        model_from_bundle,
        model_weights,
    )

    def model_parameters(arch):
        return build_model(arch).named_parameters()

    arch = architecture(load_bundle(tiny_bundle))
    weights = model_weights(model_from_bundle(tiny_bundle))
    context = Context(run_id=1, node_id=1, node_config={"data": str(tiny_data.train)},
                      state=RecordDict(), run_config={})
    config = {"arch": json.dumps(arch), "holdout": 0.25, "seed": 0, "threads": 1,
              "strategy": "fedavg", "scaffold": 1, "variates": "derived", "epochs": 1.0,
              "batch-size": 32}
    site = load_site(arch, tiny_data.train, holdout=0.25, seed=0)

    lrs = {1: 0.01, 2: 0.004, 3: 0.02, 5: 0.01}  # each round its own (the cosine's)

    def local(rnd):
        return LocalTraining(epochs=1.0, lr=lrs[rnd], batch_size=32)

    def train(start, rnd, span):
        content = RecordDict({CONFIG: ConfigRecord({**config, "round": rnd, "span": span,
                                                    "lr": lrs[rnd]}),
                              ARRAYS: to_record(start)})
        reply = client_app.train(Message(content, dst_node_id=1,
                                         message_type=MessageType.TRAIN), context).content
        assert CONTROL not in reply  # nothing but the model goes back
        return from_record(reply[ARRAYS]), int(reply[METRICS]["steps"])

    def same(a, b, atol=0.0):
        return all(np.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)

    first, steps = train(weights, 1, 0.0)  # round 1: nothing to correct by
    assert same(first, fit(arch, weights, site, local(1), 1).weights)
    # A site alone in its federation: the shared step is its own (read with round 1's rate,
    # not round 2's), so it corrects nothing.
    alone, steps = train(first, 2, float(steps))
    assert same(alone, fit(arch, first, site, local(2), 2).weights, atol=1e-5)
    # Sent a model the others moved further (every weight up by 0.05 past its own step), it
    # steers the same way: each step moves up by 0.05 / its span more than it would alone.
    params = [n for n, _ in model_parameters(arch)]
    moved = {k: v + 0.05 if k in params else v for k, v in alone.items()}
    steered, _ = train(moved, 3, float(steps))
    plain = fit(arch, moved, site, local(3), 3).weights
    shift = np.concatenate([(steered[n] - plain[n]).ravel() for n in params])
    expected = 0.05 / (steps * lrs[2]) * steps * lrs[3]  # the correction over round 3's span
    assert np.median(shift) == pytest.approx(expected, rel=0.05)
    # After a round it did not run (round 4 missed), it runs uncorrected.
    late, _ = train(steered, 5, float(steps))
    assert same(late, fit(arch, steered, site, local(5), 5).weights)


def _taught(content, exchange):
    """A site that held out experience: every held-out frame labelled by the cloud."""
    content[METRICS] = MetricRecord({**dict(content[METRICS]),
                                     "teacher-labelled": content[METRICS]["samples"]})


def test_frames_the_cloud_labelled_calibrate_only_where_no_site_held_out_true_labels(caplog):
    """Held-out experience is labelled by the cloud's answers: beside a site with labelled
    held-out frames it is left out of the calibration (it would pull the thresholds toward
    the cloud's mistakes); alone, it calibrates, and the summary says the cloud labelled it."""
    import logging

    sites, _, _ = _evaluating_sites()
    alone, _, labelled, _ = _evaluate(EvaluatingGrid({1: sites[1]}), {**ARCH, "stacking": None})
    with caplog.at_level(logging.INFO):
        mixed, _, evaluation, _ = _evaluate(EvaluatingGrid(sites, tamper={2: _taught}),
                                            {**ARCH, "stacking": None})
    assert mixed.point == alone.point and evaluation == labelled
    assert "held-out experience of site(s) 2, labelled by the cloud, is left out" in caplog.text
    taught, _, evaluation, _ = _evaluate(EvaluatingGrid({2: sites[2]}, tamper={2: _taught}),
                                         {**ARCH, "stacking": None})
    untaught, _, _, _ = _evaluate(EvaluatingGrid({2: sites[2]}), {**ARCH, "stacking": None})
    assert taught.point == untaught.point
    assert evaluation["teacher_labelled"] == evaluation["samples"] == 500
    # Experience counts level 0 alone: for a bundle that escalates it calibrates and refits
    # nothing (the bundle's thresholds, level and stacking stay); labelled frames without
    # level-1 tables (a site too old to count them) still calibrate, at level 0.
    grid = EvaluatingGrid({2: sites[2]}, tamper={2: _taught})
    kept, stacking, evaluation, _ = _evaluate(grid, {**ARCH, "stacking": OWN}, level=1)
    assert kept is None and stacking is None and "level 1" in evaluation["calibration_kept"]
    assert evaluation["stacking"] == {"refit": False, "reason": evaluation["calibration_kept"],
                                      "changed": False, "weights": OWN}
    assert len(grid.configs) == 1  # no second evaluation
    on_labels, _, evaluation, _ = _evaluate(EvaluatingGrid({2: sites[2]}),
                                            {**ARCH, "stacking": None}, level=1)
    assert on_labels.level == 0 and "calibration_kept" not in evaluation

    def beyond(content, exchange):
        content[METRICS] = MetricRecord({**dict(content[METRICS]), "teacher-labelled": 1e6})

    cal, _, evaluation, _ = _evaluate(EvaluatingGrid(sites, tamper={2: beyond}),
                                      {**ARCH, "stacking": None})
    assert cal.point == alone.point and "left the evaluation of site 2 out" in caplog.text
