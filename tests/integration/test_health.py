"""Health that can fail, with reasons, against a real Mosquitto: the edge's /healthz turns 503
when its broker goes away and 200 when it is back (the same port), and when every device is
offline; a device's /healthz does the same for its uplink and for a source that stalls, and
its /metrics counts what it sent."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np

from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import BrokerProcess, start_broker
from ddnn.topics import Topics
from tests.support.polling import wait_for

DEPLOYMENT = "health"


def get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def status_is(url: str, status: int, reason: str | None = None):
    def check():
        got, body = get(url)
        if got != status:
            return False
        return reason is None or any(reason in r for r in body["reasons"])
    return check


def restart(broker: BrokerProcess) -> None:
    """The same broker again, on the same port (a fresh process: nothing retained)."""
    fresh = start_broker(broker.host, broker.port, prefer="mosquitto")
    broker.proc, broker.workdir = fresh.proc, fresh.workdir


def fake_devices(broker: str, ids: list[str]) -> list[MqttClient]:
    """Clients that say "online" as the devices would (again after every reconnection)."""
    topics = Topics(DEPLOYMENT)
    return [MqttClient(broker, f"fake-{d}", MqttOptions(keepalive=1, reconnect_max=1),
                       status_topic=topics.device(d, "status"), status_info={"device": d}).start()
            for d in ids]


def test_edge_health_follows_its_broker_and_its_devices(mosquitto, tiny_bundle):
    settings = EdgeSettings(bundle=tiny_bundle, broker=mosquitto.url, deployment=DEPLOYMENT,
                            http_port=0, health_grace=0.5, keepalive=1, reconnect_max=1)
    devices = fake_devices(mosquitto.url, ["cam0", "cam1", "cam2"])
    with EdgeService.from_settings(settings) as edge:
        url = edge.http.url
        wait_for(lambda: get(f"{url}/healthz")[1]["devices"]["cam2"] == "online", 20,
                 "the devices' statuses")
        status, body = get(f"{url}/readyz")
        assert status == 200 and body["status"] == "ok" and body["reasons"] == []
        assert body["devices"] == {"cam0": "online", "cam1": "online", "cam2": "online"}
        assert get(f"{url}/livez")[0] == 200

        mosquitto.stop()
        wait_for(status_is(f"{url}/healthz", 503, "unreachable"), 20, "503: broker gone")
        status, body = get(f"{url}/healthz")
        assert body["status"] == "unhealthy" and not body["broker_connected"]
        assert get(f"{url}/livez")[0] == 200, "alive all along: nothing to restart"

        restart(mosquitto)
        wait_for(status_is(f"{url}/healthz", 200), 30, "200: broker back")

        for d in devices:
            d.stop()  # each says "offline" on its way out
        wait_for(status_is(f"{url}/healthz", 503, "every device is offline"), 20,
                 "503: no device")
        assert get(f"{url}/livez")[0] == 200


def write_png(path, value: int) -> None:
    from PIL import Image

    tmp = path.with_name("." + path.name)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp, format="PNG")
    tmp.rename(path)


def metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_device_health_and_metrics(mosquitto, tiny_bundle, tmp_path):
    folder = tmp_path / "capture"
    folder.mkdir()
    settings = DeviceSettings(bundle=tiny_bundle, view=0, broker=mosquitto.url,
                              deployment=DEPLOYMENT, images=folder, follow=True,
                              after_send="delete", fps=0, wait_peers=0, http_port=0,
                              health_grace=0.5, stall_after=1.0, keepalive=1, reconnect_max=1,
                              spool=tmp_path / "spool")
    service = DeviceService.from_settings(settings)
    with service:
        url = service.http.url
        runner = threading.Thread(target=service.run, daemon=True)
        runner.start()
        for i in range(3):
            write_png(folder / f"{i:03d}.png", 50 + i)
        wait_for(lambda: service.agent.stats.frames == 3, 20, "3 frames")
        wait_for(status_is(f"{url}/healthz", 200), 10, "a healthy device")
        text = get(f"{url}/metrics")[1]
        assert metric(text, "ddnn_device_frames_total") == 3
        assert metric(text, 'ddnn_device_messages_total{kind="scores"}') + \
            metric(text, 'ddnn_device_messages_total{kind="absent"}') == 3
        assert metric(text, "ddnn_device_broker_connected") == 1
        assert 'ddnn_device_bundle_info{model="tiny",version="1"} 1.0' in text
        wait_for(lambda: not list(folder.iterdir()), 10, "sent images deleted")

        # No new image for longer than --stall-after: the source stalled.
        wait_for(status_is(f"{url}/healthz", 503, "source stalled"), 10, "503: stalled")
        write_png(folder / "003.png", 60)
        wait_for(status_is(f"{url}/healthz", 200), 10, "200: frames again")

        mosquitto.stop()
        write_png(folder / "004.png", 70)  # kept in the spool meanwhile
        wait_for(status_is(f"{url}/healthz", 503, "uplink unreachable"), 20, "503: no broker")
        assert metric(get(f"{url}/metrics")[1], "ddnn_device_broker_connected") == 0
        restart(mosquitto)
        write_png(folder / "005.png", 80)
        wait_for(status_is(f"{url}/healthz", 200), 30, "200: broker back")
        wait_for(lambda: len(service.outbox) == 0, 20, "the spool delivered")
        assert get(f"{url}/livez")[0] == 200
        service.stop_event.set()
        runner.join(30)
