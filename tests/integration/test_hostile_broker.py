"""Brokers against hostile MQTT clients, with real Mosquitto: the test/demo broker of
``ddnn.tools.broker`` and the deployed configurations of ``deploy/mosquitto`` (and the embedded
amqtt broker where it has the same bound).

* a packet larger than one envelope needs never reaches a subscriber (``max_packet_size``);
* with ``secure.conf``'s ``use_username_as_clientid``, a device's credentials cannot take over
  the edge's client id (and so disconnect the edge);
* what a broker queues for an absent persistent client (the edge) is bounded, in messages and
  bytes: one client flooding while the edge is away cannot grow the broker without bound;
* a retained message on a kind ddnn never retains (scores) is dropped by its receivers and not
  kept by the embedded broker (the deployed ACL bounds the topics it can be on:
  ``test_hostile_broker_acl.py``).
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
import threading
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from ddnn.envelope import MAX_MESSAGE
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import (
    MAX_PACKET,
    MAX_QUEUED_BYTES,
    free_port,
    mosquitto_path,
    start_broker,
    wait_for_port,
)
from ddnn.topics import Topics
from tests.support.brokers import needs_embedded_broker
from tests.support.polling import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "mosquitto"

pytestmark = pytest.mark.skipif(mosquitto_path() is None, reason="mosquitto is not installed")


class Client:
    """A bare paho client (no ddnn-side size checks: the broker is what is under test)."""

    def __init__(self, port: int, client_id: str, username: str | None = None,
                 password: str | None = None, subscribe: str | None = None,
                 persistent: bool = False):
        self.messages: list[tuple[str, int]] = []  # (topic, payload length)
        self.connected = threading.Event()
        self.disconnected = threading.Event()
        self.refused: list = []
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                        clean_session=not persistent)
        if username:
            c.username_pw_set(username, password)

        def on_connect(client, _userdata, _flags, reason, _props):
            if reason.is_failure:
                self.refused.append(reason)
                return
            if subscribe:
                client.subscribe(subscribe, qos=1)
            self.connected.set()

        def on_disconnect(*_args):
            self.disconnected.set()

        c.on_connect = on_connect
        c.on_disconnect = on_disconnect
        c.on_subscribe = lambda *a: self.subscribed.set()
        c.on_message = lambda _c, _u, m: self.messages.append((m.topic, len(m.payload)))
        self.subscribed = threading.Event()
        self.stopped = False
        self.client = c
        c.connect("127.0.0.1", port, keepalive=30)
        c.loop_start()
        assert self.connected.wait(10), f"{client_id} did not connect: {self.refused}"
        if subscribe:
            assert self.subscribed.wait(10)

    def publish(self, topic: str, size: int, qos: int = 1):
        return self.client.publish(topic, bytes(size), qos=qos)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.client.disconnect()
            self.client.loop_stop()
            # paho's wake-up socket pair is closed only when the client is collected.
            self.client._reset_sockets()


@pytest.fixture
def clients():
    made: list[Client] = []

    def make(*args, **kwargs) -> Client:
        made.append(Client(*args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.stop()


def run_mosquitto(workdir: Path, lines: list[str]) -> tuple[int, subprocess.Popen]:
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text("\n".join([f"listener {port} 127.0.0.1", "persistence false",
                               f"user {getpass.getuser()}", *lines]) + "\n")
    proc = subprocess.Popen([mosquitto_path(), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_port("127.0.0.1", port, 10, proc)
    return port, proc


def deployed(name: str, drop: tuple[str, ...]) -> list[str]:
    """The deployed configuration's lines, minus those naming files or ports of a real host."""
    out = []
    for line in (DEPLOY / name).read_text().splitlines():
        word = line.split(" ", 1)[0]
        if line and not line.startswith("#") and word not in drop:
            out.append(line)
    return out


HOST_LINES = ("listener", "cafile", "certfile", "keyfile", "tls_version", "require_certificate",
              "password_file", "acl_file", "persistence", "persistence_location")


def check_oversize_is_dropped(port: int, clients) -> None:
    sub = clients(port, "listener", subscribe="ddnn/t/#")
    pub = clients(port, "vandal")
    other = clients(port, "bystander")
    # The largest envelope a receiver accepts arrives: the bound is not too tight.
    pub.publish("ddnn/t/devices/cam0/features", MAX_MESSAGE).wait_for_publish(10)
    wait_for(lambda: ("ddnn/t/devices/cam0/features", MAX_MESSAGE) in sub.messages,
             what="a MAX_MESSAGE payload at the subscriber")
    # One packet over the bound: the broker drops the client, and routes nothing.
    pub.publish("ddnn/t/devices/cam0/features", MAX_PACKET, qos=0)
    assert pub.disconnected.wait(10), "the broker accepted a packet over max_packet_size"
    pub.stop()  # no reconnection
    other.publish("ddnn/t/sentinel", 1).wait_for_publish(10)
    wait_for(lambda: ("ddnn/t/sentinel", 1) in sub.messages, what="the sentinel")
    assert [n for _, n in sub.messages] == [MAX_MESSAGE, 1]


def test_the_test_broker_never_delivers_a_packet_over_the_bound(mosquitto, clients):
    assert mosquitto.kind == "mosquitto"
    check_oversize_is_dropped(mosquitto.port, clients)


def test_the_deployed_config_never_delivers_a_packet_over_the_bound(tmp_path, clients):
    lines = deployed("mosquitto.conf", HOST_LINES)
    assert f"max_packet_size {MAX_PACKET}" in lines
    port, proc = run_mosquitto(tmp_path, lines)
    try:
        check_oversize_is_dropped(port, clients)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="no mosquitto_passwd")
def test_a_device_cannot_take_over_the_edges_client_id(tmp_path, clients):
    passwd = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(passwd), "edge0", "edge-pw"], check=True)
    subprocess.run(["mosquitto_passwd", "-b", str(passwd), "cam0", "cam0-pw"], check=True)
    lines = deployed("secure.conf", HOST_LINES)
    assert "use_username_as_clientid true" in lines
    port, proc = run_mosquitto(tmp_path, [*lines, f"password_file {passwd}"])
    try:
        edge = clients(port, "ddnn-plant-edge0", "edge0", "edge-pw", subscribe="ddnn/#")
        # cam0's leaked credentials, asking for the edge's client id.
        cam0 = clients(port, "ddnn-plant-edge0", "cam0", "cam0-pw")
        cam0.publish("ddnn/plant/devices/cam0/status", 3).wait_for_publish(10)
        wait_for(lambda: ("ddnn/plant/devices/cam0/status", 3) in edge.messages,
                 what="the edge still receiving")
        assert not edge.disconnected.is_set(), "the edge was taken over"
        cam0.stop()
    finally:
        proc.terminate()
        proc.wait(10)


# --- what a broker queues for an absent client ------------------------------------------------

@pytest.fixture(params=["test-mosquitto", "deployed-mosquitto.conf", "amqtt"])
def any_broker(request, tmp_path):
    """The port of a broker ddnn ships: the test and demo Mosquitto, Mosquitto with the deployed
    mosquitto.conf (secure.conf has the same bounds), and the embedded amqtt."""
    if request.param == "deployed-mosquitto.conf":
        for name in ("mosquitto.conf", "secure.conf"):
            assert f"max_queued_bytes {MAX_QUEUED_BYTES}" in deployed(name, HOST_LINES), name
        port, proc = run_mosquitto(tmp_path, deployed("mosquitto.conf", HOST_LINES))
        yield port
        proc.terminate()
        proc.wait(10)
        return
    if request.param == "amqtt":
        needs_embedded_broker()
    broker = start_broker(prefer=request.param.removeprefix("test-"))
    yield broker.port
    broker.stop()


def test_an_absent_clients_queue_is_bounded(any_broker, clients):
    """While the edge (a persistent session) is away, a client publishes 1 MiB envelopes, 8 MiB
    more than the bound: the edge gets at most the bound when it is back (it got them all, and
    the broker grew by as much, before the bound)."""
    topic = "ddnn/t/devices/cam0/features"
    edge = clients(any_broker, "edge0", subscribe="ddnn/t/devices/#", persistent=True)
    edge.stop()
    vandal = clients(any_broker, "vandal")
    for _ in range(MAX_QUEUED_BYTES // MAX_MESSAGE + 8):
        vandal.publish(topic, MAX_MESSAGE).wait_for_publish(10)
    edge = clients(any_broker, "edge0", persistent=True)  # the session resumes, queue and all
    vandal.publish("ddnn/t/devices/cam1/scores", 1).wait_for_publish(10)  # after the queue
    wait_for(lambda: ("ddnn/t/devices/cam1/scores", 1) in edge.messages, what="the edge's queue")
    queued = sum(n for t, n in edge.messages if t == topic)
    assert 0 < queued <= MAX_QUEUED_BYTES, f"{queued >> 20} MiB queued for the absent edge"


# --- retained messages ---------------------------------------------------------------------------

def test_receivers_drop_retained_messages_of_kinds_never_retained(mosquitto, clients):
    """A device's retained scores would be taken again by every edge that subscribes, long after
    their frame; ddnn retains only status and bundle announcements, and its MQTT client drops a
    retained message on any other kind of topic."""
    topics = Topics("t")
    vandal = clients(mosquitto.port, "vandal")
    vandal.client.publish(topics.device("cam0", "scores"), b"stale", 1, True).wait_for_publish(10)
    vandal.client.publish(topics.device("cam0", "status"), b"{}", 1, True).wait_for_publish(10)
    got: list[tuple[str, bytes]] = []
    edge = MqttClient(mosquitto.url, "edge0", MqttOptions(subscriptions=[
        (topics.all_devices("scores"), 1), (topics.all_devices("status"), 1)]),
        on_message=lambda t, p: got.append((t, p))).start()
    try:
        assert edge.wait_subscribed(10)
        vandal.publish(topics.device("cam0", "scores"), 3).wait_for_publish(10)  # a live one
        wait_for(lambda: (topics.device("cam0", "scores"), bytes(3)) in got, what="live scores")
        assert (topics.device("cam0", "status"), b"{}") in got  # retained where ddnn retains
        assert (topics.device("cam0", "scores"), b"stale") not in got
        assert edge.inbox.retained_dropped == 1
    finally:
        edge.stop()


def test_the_embedded_broker_retains_only_where_ddnn_retains(clients):
    """Mosquitto keeps a retained message on any topic a client may write (the ACL names those:
    a few per device); the embedded amqtt, which has no ACL, keeps one only on the kinds ddnn
    retains."""
    needs_embedded_broker()
    topics = Topics("t")
    with start_broker(prefer="amqtt") as broker:
        vandal = clients(broker.port, "vandal")
        for kind in ("scores", "features", "status"):
            vandal.client.publish(topics.device("cam0", kind), kind.encode(), 1,
                                  True).wait_for_publish(10)
        reader = clients(broker.port, "reader", subscribe="ddnn/t/#")
        vandal.publish("ddnn/t/sentinel", 1).wait_for_publish(10)
        wait_for(lambda: ("ddnn/t/sentinel", 1) in reader.messages, what="the sentinel")
        assert [t for t, _ in reader.messages] == [topics.device("cam0", "status"),
                                                   "ddnn/t/sentinel"]
