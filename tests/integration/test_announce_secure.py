"""``ddnn announce`` on the secure setup: a real Mosquitto with TLS, client certificates, the
password file and the ACL that deploy/make-certs.sh generates. The operator identity it makes
announces; a device's identity cannot (the broker drops its publish, and the command says so)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ddnn.plumbing.mqtt import BrokerRefusedError, MqttClient, MqttOptions, MqttSecurity
from ddnn.plumbing.options import markdown_table
from ddnn.tools.announce import ENV_PREFIX, OPTIONS, AnnounceSettings
from ddnn.tools.broker import mosquitto_path
from ddnn.topics import Topics
from tests.support.brokers import mosquitto_tls

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "plant1"
TOPIC = Topics(DEPLOYMENT).bundle


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out),
                    "--broker-host", "127.0.0.1", "--devices", "cam0,cam1", "--edges", "edge0",
                    "--install-dir", str(out / "clients")],
                   check=True, capture_output=True, text=True)
    shutil.copy(out / "ca.crt", out / "clients")  # where the env files say it is installed
    return out


@pytest.fixture(scope="module")
def broker(pki, tmp_path_factory):
    if mosquitto_path() is None:
        pytest.skip("needs mosquitto")
    with mosquitto_tls(tmp_path_factory.mktemp("broker"), pki / "ca.crt", pki / "broker.crt",
                       pki / "broker.key", pki=_Pki(pki)) as b:
        yield b


class _Pki:  # what mosquitto_tls reads of test_security's Pki
    def __init__(self, path: Path):
        self.dir = path


def env_of(pki: Path, identity: str) -> dict[str, str]:
    """The identity's env file from make-certs, as DDNN_ANNOUNCE_* variables."""
    values = dict(line.split("=", 1) for line in (pki / "env" / f"{identity}.env")
                  .read_text().splitlines())
    return {ENV_PREFIX + k.split("_", 2)[2]: v for k, v in values.items()}


def announce(broker_url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return subprocess.run(
        [sys.executable, "-m", "ddnn", "announce", "--broker", broker_url, "--deployment",
         DEPLOYMENT, "--name", "tiny", "--cloud", "https://cloud.example.org:8000", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env={**clean, **env})


def retained(broker_url: str, pki: Path, identity: str = "cam1") -> dict:
    """The retained announcement, read by a fresh client (a device's identity may read it)."""
    values = dict(line.split("=", 1) for line in (pki / "env" / f"{identity}.env")
                  .read_text().splitlines())
    got: list[bytes] = []
    arrived = threading.Event()

    def on_message(topic: str, payload: bytes) -> None:
        got.append(payload)
        arrived.set()

    security = MqttSecurity(ca_file=str(pki / "ca.crt"),
                            cert_file=str(pki / "clients" / f"{identity}.crt"),
                            key_file=str(pki / "clients" / f"{identity}.key"),
                            username=identity, password=values["DDNN_DEVICE_PASSWORD"])
    client = MqttClient(broker_url, f"reader-{identity}",
                        MqttOptions(subscriptions=[(TOPIC, 1)], security=security),
                        on_message=on_message).start()
    try:
        assert client.wait_connected(10)
        assert arrived.wait(10), "no retained announcement"
    finally:
        client.stop()
    return json.loads(got[0])


def test_make_certs_makes_an_operator_identity_the_acl_lets_announce(pki):
    env = env_of(pki, "operator")
    assert env[ENV_PREFIX + "USERNAME"] == "operator" and env[ENV_PREFIX + "PASSWORD"]
    assert Path(env[ENV_PREFIX + "CERT_FILE"]).is_file()
    assert "operator:" in (pki / "passwd").read_text()
    acl = (pki / "acl").read_text()
    assert re.search(r"^user operator\ntopic readwrite ddnn/\+/bundle$", acl, re.M)


def test_the_operator_announces_and_a_device_cannot(broker, pki):
    done = announce(broker.url, env_of(pki, "operator"), "--version", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "announced tiny:2 to deployment plant1" in done.stdout
    assert env_of(pki, "operator")[ENV_PREFIX + "PASSWORD"] not in done.stderr + done.stdout
    assert retained(broker.url, pki) == {
        "name": "tiny", "version": "2", "url": "https://cloud.example.org:8000/v1/bundles/tiny/2"}

    # cam0's credentials are good for the broker, but its ACL has no write on the bundle topic:
    # Mosquitto acknowledges and drops the publish; the command reads the topic back and fails.
    device = env_of(pki, "cam0")
    done = announce(broker.url, device, "--version", "9", "--timeout", "3")
    assert done.returncode == 1, done.stderr[-2000:]
    assert "did not keep the announcement of tiny:9" in done.stderr
    assert "user 'cam0'" in done.stderr and "Traceback" not in done.stderr
    assert retained(broker.url, pki)["version"] == "2"
    denied = [line for line in broker.log.read_text().splitlines() if "Denied PUBLISH" in line]
    assert len(denied) == 1 and "'ddnn/plant1/bundle'" in denied[0]


def test_a_wrong_password_stops_at_once_with_status_78(broker, pki):
    env = {**env_of(pki, "operator"), ENV_PREFIX + "PASSWORD": "hunter2-wrong"}
    done = announce(broker.url, env, "--version", "3")
    assert done.returncode == BrokerRefusedError.exit_code, done.stderr[-2000:]
    assert "not authorized user 'operator'" in done.stderr and "hunter2" not in done.stderr
    assert "Traceback" not in done.stderr


def test_settings_validate_and_mask_the_password():
    s = AnnounceSettings(broker="mqtts://u:pw@broker:8883", name="tiny", version="2",
                         password="secret", deployment="plant1")
    shown = s.describe()
    assert shown["password"] == "***" and "pw" not in shown["broker"]
    assert s.announcement().url is None
    from ddnn.errors import DdnnError
    for bad in ({"url": "http://a:1", "cloud": "http://b:1"}, {"url": "ftp://x"},
                {"deployment": "a/b"}, {"timeout": 0}):
        with pytest.raises(DdnnError):
            AnnounceSettings(broker="mqtt://b", name="tiny", version="2", **bad).announcement()


def test_the_options_table_in_the_docs_is_current():
    text = (ROOT / "docs" / "security.md").read_text()
    block = re.search(r"<!-- options:announce -->\n(.*?)<!-- /options:announce -->", text, re.S)
    assert block, "docs/security.md: the ddnn announce options table is missing"
    assert block.group(1) == markdown_table(OPTIONS, AnnounceSettings, ENV_PREFIX)
