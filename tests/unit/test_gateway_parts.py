"""The gateway's bounds against a hostile site broker, without brokers."""

from __future__ import annotations

import json

import numpy as np

from ddnn import envelope as env
from ddnn.batch import MAX_ENTRIES, MAX_ENTRY, batches, pack_batch, unpack_batch
from ddnn.device.gateway.roster import SiteRoster
from ddnn.device.gateway.service import GatewayService
from ddnn.device.gateway.settings import MAX_DEVICES, GatewaySettings
from ddnn.envelope import MAX_MESSAGE, MessageType


def _gateway(**settings) -> GatewayService:
    return GatewayService(GatewaySettings(local="mqtt://127.0.0.1:1", broker="mqtt://127.0.0.1:2",
                                          **settings))


def test_batches_stay_within_the_format_s_bounds():
    small = [("cam0", b"x" * 10, i) for i in range(MAX_ENTRIES + 10)]
    assert [len(b) for b in batches(small)] == [MAX_ENTRIES, 10]
    big = [(f"cam{i}", bytes(MAX_ENTRY * 2 // 3), i) for i in range(5)]  # one per batch
    cut = batches(big)
    assert [len(b) for b in cut] == [1, 1, 1, 1, 1]
    for b in cut:  # each packs, and round-trips
        data = pack_batch((d, e) for d, e, _ in b)
        assert len(data) <= MAX_MESSAGE and unpack_batch(data)[0][0] == b[0][0]
    assert len(pack_batch([("a" * 64, bytes(MAX_ENTRY))])) <= MAX_MESSAGE


def test_only_pull_masks_are_remembered_and_they_are_bounded():
    roster = SiteRoster(max_pulls=100)
    scores = env.encode(env.pack(MessageType.SCORES, version="1", frame=1,
                                 tensor=np.zeros((1, 3), np.float32), codec="float16"))
    huge = env.encode(env.pack(MessageType.REQUEST, version="1", frame=2,
                               tensor=np.ones(4096, np.float32), codec="binary"))
    mask = env.encode(env.pack(MessageType.REQUEST, version="1", frame=3,
                               tensor=np.array([1, -1, 1], np.float32), codec="binary"))
    for payload in (scores, huge, mask, b"junk"):
        roster.remember_pull(payload)
    assert roster.pulled == {3: bytes([0b10100000])}
    for frame in range(roster.max_pulls + 5):
        roster.remember_pull(env.encode(env.pack(MessageType.REQUEST, version="1", frame=frame,
                                                 tensor=np.ones(3, np.float32), codec="binary")))
    assert len(roster.pulled) == roster.max_pulls
    # the gateway's coalescer holds as many groups as its roster remembers pulls
    g = _gateway()
    assert g.coalescer.max_groups == g.roster.max_pulls


def test_a_features_group_waits_for_the_online_devices_the_edge_pulled():
    roster = SiteRoster()
    for device, view, state in (("cam0", 0, "online"), ("cam1", 1, "online"),
                                ("cam2", 2, "offline"), ("cam3", 3, "online")):
        roster.status(device, json.dumps({"state": state, "view": view}).encode())
    assert roster.expected(("scores", 7)) == {"cam0", "cam1", "cam3"}
    assert roster.expected(("features", 7)) == set(), "no pull seen: wait for the window"
    roster.remember_pull(env.encode(env.pack(MessageType.REQUEST, version="1", frame=7,
                                             tensor=np.array([1, -1, 1, -1], np.float32),
                                             codec="binary")))
    assert roster.expected(("features", 7)) == {"cam0"}, "cam2 pulled but offline"
    roster.sent(("features", 7))
    assert roster.pulled == {}


def test_statuses_keep_what_the_edge_reads_for_a_bounded_set_of_devices():
    roster = SiteRoster()
    noisy = {"state": "online", "view": 1, "mode": "pull", "junk": "x" * 10_000}
    assert roster.status("cam1", json.dumps(noisy).encode())
    assert not roster.status("cam1", json.dumps(noisy).encode()), "nothing new to send up"
    assert roster.statuses == {"cam1": {"state": "online", "view": 1, "mode": "pull"}}
    for i in range(MAX_DEVICES + 50):
        if roster.forwards(f"fake{i}"):
            roster.status(f"fake{i}", b"online")
    assert len(roster.statuses) == MAX_DEVICES
    listed = _gateway(devices=("cam0",)).roster
    assert listed.forwards("cam0") and not listed.forwards("cam1")


def test_a_batch_the_edge_s_broker_refused_stays_on_the_site_broker():
    g = _gateway()
    acked = []
    g.local.inbox.ack = acked.append
    g._batches = {5: [(50, 1), (51, 1)], 6: [(60, 1)]}
    for ack in ((5, False), (6, True), None):
        g._acks.put(ack)
    g._acknowledge()
    assert acked == [(60, 1)] and g.forwarded["refused"] == 2 and not g._batches
