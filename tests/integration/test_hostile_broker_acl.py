"""The deployed access list against hostile clients: a real Mosquitto with TLS, passwords and
the ACL that deploy/make-certs.sh writes (what deploy/mosquitto/secure.conf sets up).

* a device can retain messages only on its own few topics of the named deployments (a retained
  message survives a broker restart: with ``devices/%u/#`` and a ``+`` deployment it could make
  any number of them);
* only the edge publishes results: a one-view device sends its own result on its own topic and
  the edge, having checked it, publishes it; a result a device sends for another is dropped;
* a gateway (``ddnn gateway``) reaches a site broker with TLS, passwords and the ACL (its
  ``--local-*`` options) and relays a one-view device's result only if it is that device's own;
* with ``use_identity_as_username`` a certificate is its identity: cam0's certificate is cam0
  whatever username it sends.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import ssl
import threading

import paho.mqtt.client as paho
import pytest

from ddnn.bundle import load_bundle
from ddnn.result import Result
from ddnn.tools.broker import mosquitto_path
from ddnn.topics import Topics
from tests.support.brokers import Pki, make_pki, mosquitto_tls
from tests.support.polling import wait_for

DEPLOYMENT = "acl"
TOPICS = Topics(DEPLOYMENT)

pytestmark = pytest.mark.skipif(
    mosquitto_path() is None or shutil.which("mosquitto_passwd") is None
    or shutil.which("openssl") is None, reason="needs mosquitto, mosquitto_passwd and openssl")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    """make-certs.sh's PKI and ACL, plus an auditor (reads everything; not part of a
    deployment) to see what the broker keeps and delivers."""
    out = tmp_path_factory.mktemp("pki")
    pki = make_pki(out, "--broker-host", "127.0.0.1", "--devices", "cam0,cam1,gw0", "--edges",
                   "edge0", "--operators", "operator,auditor", "--deployments", DEPLOYMENT)
    acl = (out / "acl").read_text()
    assert acl.endswith(f"user auditor\ntopic readwrite ddnn/{DEPLOYMENT}/bundle\n")
    # As a site broker's ACL: its gateway repeats the edge's pulls, status and bundle.
    (out / "acl").write_text(acl + "topic read #\ntopic write audit/sentinel\n\nuser gw0\n"
                             + "".join(f"topic {rule} {TOPICS.root}/{topic}\n" for rule, topic in (
                                 ("read", "devices/#"), ("write", "edges/edge0/requests"),
                                 ("write", "edges/edge0/status"), ("write", "bundle"))))
    return pki


@pytest.fixture(scope="module")
def broker(pki, tmp_path_factory):
    with mosquitto_tls(tmp_path_factory.mktemp("broker"), pki.ca, pki.dir / "broker.crt",
                       pki.dir / "broker.key", pki=pki) as b:
        yield b


_ids = itertools.count()


class Peer:
    """A bare paho client over TLS (no ddnn-side filtering: the broker is what is under test);
    ``messages`` holds (topic, payload, retained)."""

    def __init__(self, url: str, pki: Pki, user: str, cert: str | None = None,
                 subscribe: str | None = None):
        self.messages: list[tuple[str, bytes, bool]] = []
        self.ready = threading.Event()
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"peer{next(_ids)}")
        crt, key = pki.client(cert or user)
        c.tls_set(ca_certs=str(pki.ca), certfile=str(crt), keyfile=str(key),
                  tls_version=ssl.PROTOCOL_TLS_CLIENT)
        c.username_pw_set(user, pki.passwords[user])
        c.on_message = lambda _c, _u, m: self.messages.append((m.topic, m.payload, m.retain))
        c.on_connect = lambda cl, *_: cl.subscribe(subscribe, 1) if subscribe else self.ready.set()
        c.on_subscribe = lambda *_: self.ready.set()
        host, port = url.removeprefix("mqtts://").rsplit(":", 1)
        c.connect(host, int(port), keepalive=30)
        c.loop_start()
        self.client = c
        assert self.ready.wait(10), f"{user} did not connect"

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, 1, retain).wait_for_publish(10)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.client._reset_sockets()  # paho's wake-up socket pair, closed only when collected


@pytest.fixture
def peers(broker, pki):
    made: list[Peer] = []

    def make(user: str, **kwargs) -> Peer:
        made.append(Peer(broker.url, pki, user, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.stop()


def audited(auditor: Peer, topic: str = "#") -> list[tuple[str, bytes, bool]]:
    """What the auditor (subscribed to ``#``) got on ``topic``, once a sentinel it publishes
    after everything else is back."""
    auditor.publish("audit/sentinel", b"end")
    wait_for(lambda: ("audit/sentinel", b"end", False) in auditor.messages, what="the sentinel")
    return [m for m in auditor.messages[:-1] if topic in ("#", m[0])]


def test_a_device_retains_only_on_its_own_few_topics(peers):
    cam0 = peers("cam0")
    own = [TOPICS.device("cam0", kind) for kind in ("status", "scores")]
    for topic in own:
        cam0.publish(topic, b"kept", retain=True)
    for i in range(20):  # other levels under its prefix, other deployments, not its own topics
        cam0.publish(f"ddnn/{DEPLOYMENT}/devices/cam0/scores/{i}", b"junk", retain=True)
        cam0.publish(f"ddnn/d{i}/devices/cam0/scores", b"junk", retain=True)
        cam0.publish(f"ddnn/{DEPLOYMENT}/devices/cam1/status", b"junk", retain=True)
    # Retained messages go to a new subscriber at once, before any message published later.
    kept = audited(peers("auditor", subscribe="#"))
    assert sorted(t for t, _, retained in kept if retained) == sorted(own), kept


def test_only_the_edge_publishes_results(peers):
    reader = peers("auditor", subscribe="#")
    peers("cam0").publish(TOPICS.results, b"forged by cam0")
    peers("edge0").publish(TOPICS.results, b"from the edge")
    assert [p for _, p, _ in audited(reader, TOPICS.results)] == [b"from the edge"]


def result_of(bundle, device: str, frame: int) -> bytes:
    label = load_bundle(bundle).manifest.classes[0]
    return Result(frame=frame, cls=0, label=label, exit="local", entropy=0.1, views=(device,),
                  latency_ms=1.0).to_json()


def test_a_one_view_devices_results_reach_the_results_topic_through_the_edge(
        broker, pki, peers, one_view_bundle):
    """The device decides every frame itself (local threshold 1): its results go on its own
    topic, the edge checks each and publishes it. A result cam1 sends as cam0's is dropped."""
    from dataclasses import asdict

    from ddnn.device.service import DeviceService
    from ddnn.device.settings import DeviceSettings
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    frames = 6
    reader = peers("auditor", subscribe=TOPICS.results)
    edge = EdgeService.from_settings(EdgeSettings(
        bundle=one_view_bundle, broker=broker.url, **asdict(pki.security("edge0")),
        deployment=DEPLOYMENT, keepalive=5, reconnect_max=1))
    with contextlib.ExitStack() as stack:
        stack.enter_context(edge)
        assert edge.mqtt.wait_subscribed(10)
        forged = result_of(one_view_bundle, "cam0", 999)  # by cam1, on its own topic
        peers("cam1").publish(TOPICS.device("cam1", "results"), forged)
        wait_for(lambda: edge.metrics.dropped.value(reason="forbidden") == 1,
                 what="the forged result to be dropped")
        device = stack.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=one_view_bundle, view=0, device_id="cam0", deployment=DEPLOYMENT,
            broker=broker.url, **asdict(pki.security("cam0")),
            data=one_view_bundle.parent / "train.npz", limit=frames, fps=0, local_threshold=1.0,
            wait_peers=0, keepalive=5, reconnect_max=1, drain_timeout=30)))
        device.run()
        wait_for(lambda: len(reader.messages) >= frames, what="every frame's result")
    results = [Result.from_json(p) for _, p, _ in reader.messages]
    assert sorted(r.frame for r in results) == list(range(frames))
    assert {(r.exit, tuple(r.views)) for r in results} == {("local", ("cam0",))}


def test_a_gateway_on_a_secure_site_broker_relays_only_each_devices_own_result(
        broker, pki, peers, mosquitto, one_view_bundle):
    """The site broker (devices, gateway) has TLS, passwords and the ACL; the edge's broker is
    another. cam1 sends, on its own topic, a result that names cam0: the gateway drops it (the
    edge trusts the gateway for all its devices, so the gateway checks who sent what)."""
    from ddnn.device.gateway.service import GatewayService
    from ddnn.device.gateway.settings import GatewaySettings
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings
    from ddnn.plumbing.mqtt import MqttClient, MqttOptions

    got: list[bytes] = []
    reader = MqttClient(mosquitto.url, "reader", MqttOptions(subscriptions=[(TOPICS.results, 1)]),
                        on_message=lambda _t, p: got.append(p)).start()
    edge = EdgeService.from_settings(EdgeSettings(
        bundle=one_view_bundle, broker=mosquitto.url, deployment=DEPLOYMENT,
        gateways=(("gw0", ("cam0",)),)))
    gateway = GatewayService(GatewaySettings(
        local=broker.url, local_security=pki.security("gw0"), broker=mosquitto.url,
        deployment=DEPLOYMENT, forward_results=True, reconnect_max=1))
    try:
        with edge, gateway:
            assert reader.wait_subscribed(10) and edge.mqtt.wait_subscribed(10)
            assert gateway.local.wait_subscribed(10), gateway.local.refused
            peers("cam1").publish(TOPICS.device("cam1", "results"),
                                  result_of(one_view_bundle, "cam0", 2))
            peers("cam0").publish(TOPICS.device("cam0", "results"),
                                  result_of(one_view_bundle, "cam0", 1))
            wait_for(lambda: got, what="cam0's result through the gateway and the edge")
            assert gateway.forwarded["dropped"] == 1
    finally:
        reader.stop()
    assert [Result.from_json(p).frame for p in got] == [1]


@pytest.fixture
def identity_broker(pki, tmp_path):
    """secure.conf with ``use_identity_as_username true``: no passwords, the certificate's CN is
    the username the ACL sees."""
    with mosquitto_tls(tmp_path, pki.ca, pki.dir / "broker.crt", pki.dir / "broker.key",
                       pki=pki, identity=True) as b:
        yield b


def test_a_certificate_is_its_own_identity_with_use_identity_as_username(identity_broker, pki):
    made = []
    try:
        made.append(reader := Peer(identity_broker.url, pki, "auditor", subscribe="#"))
        made.append(Peer(identity_broker.url, pki, "edge0", cert="cam0"))  # claims to be edge0
        made.append(Peer(identity_broker.url, pki, "edge0"))
        made[1].publish(TOPICS.results, b"forged with cam0's certificate")
        made[2].publish(TOPICS.results, b"from the edge")
        assert [p for _, p, _ in audited(reader, TOPICS.results)] == [b"from the edge"]
    finally:
        for p in made:
            p.stop()
