"""The edge's side of a gateway: whose entries it takes, and batches left for the next edge."""

from __future__ import annotations

import json

import numpy as np

from ddnn import envelope as env
from ddnn.batch import pack_batch
from ddnn.edge.gateways import GatewayIngest
from ddnn.edge.ingest import Ingest
from ddnn.envelope import MessageType
from ddnn.topics import Topics
from tests.support.events import RecordedEvents

T = Topics("site")


class FakeIngest:
    """Records what the gateway ingest hands on."""

    def __init__(self, known=()):
        self.accepted, self.statuses, self.draining, self.declined = [], [], False, 0
        self.assembler = type("A", (), {"knows": lambda _, f: f in known})()

    handled_here = Ingest.handled_here  # the real rule, on the fake assembler above

    def accept(self, payload, device):
        self.accepted.append((device, env.decode(payload).frame))

    def on_status(self, device, payload):
        self.statuses.append((device, json.loads(payload)["state"]))


def scores(frame: int) -> bytes:
    return env.encode(env.pack(MessageType.SCORES, version="1", frame=frame,
                               tensor=np.zeros((1, 3), np.float32), codec="float16"))


def test_entries_go_on_only_for_the_gateway_s_own_devices():
    ingest, events = FakeIngest(), RecordedEvents()
    g = GatewayIngest(ingest, T, {"gw0": ("cam0", "cam1")}, events)
    batch = pack_batch([("cam0", scores(4)), ("cam2", scores(4)), ("cam1", scores(4))])
    assert g.on_message(T.gateway("gw0", "messages"), batch) is None
    assert ingest.accepted == [("cam0", 4), ("cam1", 4)]
    assert events.of("on_dropped") == [("unknown_device",)]
    g.on_message(T.gateway("gw0", "messages"), b"\xe2\x01")
    assert events.of("on_dropped")[-1] == ("malformed",)
    assert g.on_message(T.device("cam0", "scores"), scores(1)) is None and not g.handles(
        T.device("cam0", "scores"))


def test_statuses_fan_out_and_the_last_will_takes_every_device_offline():
    ingest = FakeIngest()
    g = GatewayIngest(ingest, T, {"gw0": ("cam0", "cam1")})
    status = {"state": "online", "devices": {"cam0": {"state": "online"}, "cam9": {}}}
    g.on_message(T.gateway("gw0", "status"), json.dumps(status).encode())
    assert ingest.statuses == [("cam0", "online"), ("cam1", "offline")]
    g.on_message(T.gateway("gw0", "status"), b'{"state": "offline"}')
    assert ingest.statuses[2:] == [("cam0", "offline"), ("cam1", "offline")]


def test_a_draining_edge_leaves_batches_of_new_frames_to_the_next_one():
    ingest = FakeIngest(known={4})
    g = GatewayIngest(ingest, T, {"gw0": ("cam0", "cam1")})
    ingest.draining = True
    new = pack_batch([("cam0", scores(4)), ("cam1", scores(5))])
    assert g.on_message(T.gateway("gw0", "messages"), new) is False
    assert ingest.accepted == [] and ingest.declined == 1
    under_way = pack_batch([("cam0", scores(4)), ("cam1", scores(4))])
    assert g.on_message(T.gateway("gw0", "messages"), under_way) is None
    assert ingest.accepted == [("cam0", 4), ("cam1", 4)]
