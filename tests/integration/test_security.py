"""Security end to end: a real Mosquitto with TLS, passwords and the ACL from deploy/make-certs.sh;
the cloud over HTTPS with a bearer token; signed bundles. Every refusal is checked for its effect
and for the one clear log line (or exit status) it must produce.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from ddnn.bundle import load_bundle
from ddnn.errors import BundleError, ConfigError, DdnnError
from ddnn.plumbing.mqtt import BrokerRefusedError, MqttClient, MqttOptions, MqttSecurity
from ddnn.signing import generate_keypair, sign_bundle
from ddnn.tools.broker import mosquitto_path
from ddnn.topics import Topics, default_device_ids
from tests.support.brokers import Pki, mosquitto_tls
from tests.support.cloud import cloud_wait_ready
from tests.support.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = "sec"
TOPICS = Topics(DEPLOYMENT)

pytestmark = [
    pytest.mark.skipif(mosquitto_path() is None or shutil.which("openssl") is None,
                       reason="needs mosquitto and openssl"),
]


# --- certificates -------------------------------------------------------------------------------

def _write_cert(path: Path, key_path: Path, cn: str, *, issuer_cert=None, issuer_key=None,
                days: tuple[int, int] = (-1, 30), server: bool = False) -> None:
    """A certificate with chosen validity days relative to now (self-signed without issuer)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = dt.datetime.now(dt.timezone.utc)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder()
               .subject_name(name)
               .issuer_name(issuer_cert.subject if issuer_cert else name)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now + dt.timedelta(days=days[0]))
               .not_valid_after(now + dt.timedelta(days=days[1]))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        import ipaddress
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    """The deployment's CA, certificates, password file and ACL, made by deploy/make-certs.sh;
    plus certificates the broker or the clients must refuse (expired, self-signed)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out),
                    "--broker-host", "127.0.0.1", "--broker-host", "localhost",
                    "--devices", "cam0,cam1,cam2", "--edges", "edge0",
                    "--cloud-host", "127.0.0.1", "--install-dir", str(out)],
                   check=True, capture_output=True, text=True)
    passwords = {}
    for env in (out / "env").glob("*.env"):
        values = dict(line.split("=", 1) for line in env.read_text().splitlines())
        # DDNN_DEVICE_*, DDNN_EDGE_* or (operators) DDNN_ANNOUNCE_*
        user = next(v for k, v in values.items() if k.endswith("_USERNAME"))
        passwords[user] = next(v for k, v in values.items() if k.endswith("_PASSWORD"))
    ca_cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    clients = out / "clients"
    # cam0's identity, but expired yesterday; and one signed by nobody the broker knows.
    _write_cert(clients / "expired.crt", clients / "expired.key", "cam0", issuer_cert=ca_cert,
                issuer_key=ca_key, days=(-30, -1))
    _write_cert(clients / "selfsigned.crt", clients / "selfsigned.key", "cam0")
    # Broker certificates a client holding the deployment's CA must refuse.
    _write_cert(out / "rogue-selfsigned.crt", out / "rogue-selfsigned.key", "127.0.0.1",
                server=True)
    _write_cert(out / "rogue-expired.crt", out / "rogue-expired.key", "127.0.0.1",
                issuer_cert=ca_cert, issuer_key=ca_key, days=(-30, -1), server=True)
    return Pki(out, passwords)


# --- brokers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broker(pki, tmp_path_factory):
    with mosquitto_tls(tmp_path_factory.mktemp("broker"), pki.ca, pki.dir / "broker.crt",
                       pki.dir / "broker.key", pki=pki) as b:
        yield b


@pytest.fixture
def clients():
    """Factory of started MQTT clients, all stopped after the test."""
    made: list[MqttClient] = []

    def make(url: str, cid: str, security: MqttSecurity, subscriptions=(), on_message=None,
             wait: bool = True) -> MqttClient:
        opts = MqttOptions(keepalive=5, reconnect_max=1, subscriptions=list(subscriptions),
                           security=security)
        c = MqttClient(url, f"test-{cid}-{len(made)}", opts, on_message=on_message)
        made.append(c)
        c.start()
        if wait:
            assert c.wait_subscribed(10)
        return c

    yield make
    for c in made:
        c.stop()


def refusal(client: MqttClient) -> BrokerRefusedError:
    with pytest.raises(BrokerRefusedError) as info:
        client.wait_connected(10)
    wait_for(lambda: client._client._thread is None, 5, "paho's loop to end (no retry loop)")
    return info.value


def error_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "ddnn.plumbing.mqtt" and r.levelno >= logging.ERROR]


# --- MQTT: credentials, certificates, access lists ----------------------------------------------

def test_valid_credentials_connect(broker, pki, clients):
    for cid in ("cam0", "edge0"):
        assert clients(broker.url, cid, pki.security(cid)).connected.is_set()


@pytest.mark.parametrize("user,password", [("cam0", "wrong"), ("nobody", "x")])
def test_wrong_credentials_are_refused_once(broker, pki, clients, caplog, user, password):
    sec = pki.security(user, password=password, cert="cam0")
    with caplog.at_level(logging.INFO, logger="ddnn.plumbing.mqtt"):
        error = refusal(clients(broker.url, user, sec, wait=False))
    assert "not authorized" in str(error) and f"user {user!r}" in str(error)
    lines = error_lines(caplog)
    assert len(lines) == 1 and "not retrying" in lines[0] and password not in lines[0]


def test_a_device_cannot_publish_under_another_devices_topic(broker, pki, clients):
    """Mosquitto drops a publish the ACL forbids without telling the publisher: the edge must
    never see it, while the same device's own messages (sent after it) arrive."""
    got: list[tuple[str, bytes]] = []
    clients(broker.url, "edge0", pki.security("edge0"),
            subscriptions=[(TOPICS.all_devices("scores"), 1)],
            on_message=lambda t, p: got.append((t, p)))
    cam0 = clients(broker.url, "cam0", pki.security("cam0"))
    cam1 = clients(broker.url, "cam1", pki.security("cam1"))

    def probe() -> bool:  # until the edge's subscription is live
        cam1.publish(TOPICS.device("cam1", "scores"), b"probe").wait_for_publish(5)
        return any(p == b"probe" for _, p in got)

    wait_for(probe, what="the edge's subscription")
    cam0.publish(TOPICS.device("cam1", "scores"), b"forged by cam0").wait_for_publish(5)
    cam0.publish(TOPICS.device("cam0", "scores"), b"own").wait_for_publish(5)
    wait_for(lambda: (TOPICS.device("cam0", "scores"), b"own") in got, what="cam0's own message")
    assert all(p != b"forged by cam0" for _, p in got)


def test_a_device_reads_only_what_it_needs(broker, pki, clients):
    """cam0 may read peers' status and the edge's pulls, not another device's features."""
    seen: list[tuple[str, bytes]] = []
    clients(broker.url, "cam0", pki.security("cam0"),
            subscriptions=[(TOPICS.all_devices("features"), 1),
                           (TOPICS.all_devices("status"), 1), (TOPICS.requests("edge0"), 1)],
            on_message=lambda t, p: seen.append((t, p)))
    cam1 = clients(broker.url, "cam1", pki.security("cam1"))
    edge = clients(broker.url, "edge0", pki.security("edge0"))

    def probe() -> bool:
        cam1.publish(TOPICS.device("cam1", "status"), b"online").wait_for_publish(5)
        return any(t == TOPICS.device("cam1", "status") for t, _ in seen)

    wait_for(probe, what="cam0's subscriptions")
    cam1.publish(TOPICS.device("cam1", "features"), b"secret").wait_for_publish(5)
    edge.publish(TOPICS.requests("edge0"), b"pull").wait_for_publish(5)
    wait_for(lambda: (TOPICS.requests("edge0"), b"pull") in seen, what="the edge's pull")
    assert all(p != b"secret" for _, p in seen)


@pytest.mark.parametrize("cert,why", [("expired", "certificate expired"),
                                      ("selfsigned", "unknown ca")])
def test_broker_refuses_a_bad_client_certificate(broker, pki, clients, caplog, cert, why):
    with caplog.at_level(logging.INFO, logger="ddnn.plumbing.mqtt"):
        error = refusal(clients(broker.url, "cam0", pki.security("cam0", cert=cert), wait=False))
    assert "refused this client's TLS certificate" in str(error) and why in str(error)
    assert len(error_lines(caplog)) == 1


@pytest.mark.parametrize("cert,why", [("rogue-selfsigned", "self-signed certificate"),
                                      ("rogue-expired", "certificate has expired")])
def test_client_refuses_an_untrusted_broker(pki, clients, caplog, tmp_path, cert, why):
    crt, key = pki.dir / f"{cert}.crt", pki.dir / f"{cert}.key"
    with mosquitto_tls(tmp_path, crt, crt, key) as rogue, \
            caplog.at_level(logging.INFO, logger="ddnn.plumbing.mqtt"):
        error = refusal(clients(rogue.url, "cam0", pki.security("cam0"), wait=False))
    assert "is not trusted" in str(error) and why in str(error)
    assert len(error_lines(caplog)) == 1


def test_tls_files_need_an_mqtts_url(pki):
    with pytest.raises(ConfigError, match="use mqtts://"):
        MqttClient("mqtt://127.0.0.1:1883", "x", MqttOptions(security=pki.security("cam0")))
    with pytest.raises(ConfigError, match="cannot load the MQTT TLS files"):
        MqttClient("mqtts://127.0.0.1:8883", "x",
                   MqttOptions(security=MqttSecurity(ca_file=str(pki.dir / "missing.crt"))))


def test_hierarchy_runs_under_tls_passwords_and_the_acl(broker, pki, tiny_bundle, tiny_data):
    """The generated ACL lets the real device agents and edge do their whole job (pull mode)."""
    from dataclasses import asdict

    from ddnn.device.service import DeviceService
    from ddnn.device.settings import DeviceSettings
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    frames = 12
    b = load_bundle(tiny_bundle)
    ids = default_device_ids(b.manifest.views)
    edge = EdgeService.from_settings(EdgeSettings(
        bundle=tiny_bundle, broker=broker.url, **asdict(pki.security("edge0")),
        deployment=DEPLOYMENT, deadline_ms=2000.0, feature_deadline_ms=2000.0,
        local_threshold=0.0, edge_threshold=1.0, expect_frames=frames, keepalive=5,
        reconnect_max=1)).start()
    agg = edge.aggregator
    services = []
    stack = contextlib.ExitStack()
    try:
        assert edge.mqtt.wait_subscribed(10)
        for view, cid in enumerate(ids):
            settings = DeviceSettings(
                bundle=tiny_bundle, view=view, device_id=cid, deployment=DEPLOYMENT,
                broker=broker.url, **asdict(pki.security(cid)), data=tiny_data.test,
                limit=frames, fps=0, buffer=1000, grace=0.5, drain_timeout=30,
                peers=tuple(ids), wait_peers=20, keepalive=5, reconnect_max=1)
            services.append(stack.enter_context(DeviceService.from_settings(settings)))
        threads = [threading.Thread(target=s.run) for s in services]
        for t in threads:
            t.start()
        assert agg.done.wait(60), f"{agg.answered} of {frames} frames answered"
        for t in threads:
            t.join(60)
    finally:
        stack.close()
        edge.stop()
    exits = {r["exit"] for r in agg.results}
    assert agg.answered == frames and "edge" in exits  # features were pulled through the ACL
    assert sum(s.agent.stats.pulls_answered for s in services) > 0


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddnn", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


@pytest.mark.parametrize("role", ["device", "edge"])
def test_cli_exits_once_with_a_clear_line_on_wrong_credentials(broker, pki, tiny_bundle,
                                                                tiny_data, role):
    crt, key = pki.client("cam0")
    prefix = f"DDNN_{role.upper()}_"
    env = {prefix + "CA_FILE": str(pki.ca), prefix + "CERT_FILE": str(crt),
           prefix + "KEY_FILE": str(key), prefix + "USERNAME": "cam0",
           prefix + "PASSWORD": "hunter2-wrong"}
    extra = (["--view", "0", "--data", str(tiny_data.test), "--fps", "0"] if role == "device"
             else ["--devices", "cam0,cam1,cam2"])
    done = _cli(role, "--bundle", str(tiny_bundle), "--broker", broker.url, *extra, env=env)
    assert done.returncode == BrokerRefusedError.exit_code, done.stderr[-2000:]
    assert "ddnn: error: broker" in done.stderr and "not authorized user 'cam0'" in done.stderr
    assert done.stderr.count("not retrying") == 1
    assert "hunter2" not in done.stderr and "Traceback" not in done.stderr


# --- HTTP: bearer tokens and TLS between edge and cloud -----------------------------------------

def test_edge_reaches_the_cloud_over_tls_with_its_token(cloud_server, tiny_bundle, pki, caplog):
    import numpy as np

    from ddnn.edge.cloud_client import CloudClient, CloudError

    url = cloud_server(bundle=tiny_bundle, token="s3cret", poll_interval=0, wait_ready=False,
                       ssl_certfile=pki.dir / "cloud.crt", ssl_keyfile=pki.dir / "cloud.key")
    assert url.startswith("https://")
    cloud_wait_ready(url, verify=ssl.create_default_context(cafile=str(pki.ca)))
    shape = load_bundle(tiny_bundle).manifest.cloud.inputs[0].sample_shape
    features = np.zeros((2, *shape), np.float32)

    good = CloudClient(url, "tiny-cloud", token="s3cret", ca_file=str(pki.ca))
    assert good.infer(features)[0].shape == (2, 3)
    good.close()
    with caplog.at_level(logging.WARNING):
        for token in (None, "wrong"):
            client = CloudClient(url, "tiny-cloud", token=token, ca_file=str(pki.ca))
            with pytest.raises(CloudError, match="refused the edge's bearer token"):
                client.infer(features)
            client.close()
    refused = [r.getMessage() for r in caplog.records if r.name == "ddnn.cloud.app"]
    assert len(refused) == 2 and "missing bearer token" in refused[0]
    assert "invalid bearer token" in refused[1]
    untrusting = CloudClient(url, "tiny-cloud", token="s3cret")  # system CAs only
    with pytest.raises(CloudError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting.infer(features)
    untrusting.close()


def test_edge_http_ingest_needs_its_token(tiny_bundle, caplog):
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    edge = EdgeService.from_settings(EdgeSettings(bundle=tiny_bundle, http_port=0,
                                                  http_token="t0ken")).start()
    try:
        url = edge.http.url + "/v1/ingest"
        with caplog.at_level(logging.WARNING, logger="ddnn.edge.http"):
            assert httpx.post(url, content=b"x").status_code == 401
            r = httpx.post(url, content=b"x", headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401 and r.json() == {"error": "invalid bearer token"}
        r = httpx.post(url, content=b"x", headers={"Authorization": "Bearer t0ken"})
        assert r.status_code == 400  # past the token: refused for the malformed body only
    finally:
        edge.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "ddnn.edge.http"]
    assert len(lines) == 2 and "missing bearer token" in lines[0]


# --- bundles: signatures -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def signed(tiny_bundle, tmp_path_factory):
    """(signed bundle copy, unsigned copy, public key, private key)."""
    root = tmp_path_factory.mktemp("signed")
    priv, pub = generate_keypair(root / "keys")
    s, u = root / "signed", root / "unsigned"
    shutil.copytree(tiny_bundle, s)
    shutil.copytree(tiny_bundle, u)
    sign_bundle(s, priv)
    return s, u, pub, priv


def test_signed_bundle_loads_and_unsigned_or_tampered_is_refused(signed, tmp_path):
    s, u, pub, _ = signed
    assert load_bundle(s, public_key=pub).manifest.name == "tiny"
    with pytest.raises(BundleError, match="unsigned"):
        load_bundle(u, public_key=pub)
    load_bundle(u)  # without a key, signatures are not required
    t = tmp_path / "tampered"
    shutil.copytree(s, t)
    mf = t / "manifest.json"
    manifest = json.loads(mf.read_text())
    # "let more frames exit on the devices": any change to the signed bytes must be refused
    old = manifest["exits"]["local"]["threshold"]
    manifest["exits"]["local"]["threshold"] = 0.99 if old != 0.99 else 0.98
    mf.write_text(json.dumps(manifest, indent=2) + "\n")
    with pytest.raises(BundleError, match="bad signature"):
        load_bundle(t, public_key=pub)
    shutil.copytree(s, tmp_path / "onnx")
    onnx = next((tmp_path / "onnx").glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes() + b"\0")  # the signature holds, the checksum does not
    with pytest.raises(BundleError, match="checksum mismatch"):
        load_bundle(tmp_path / "onnx", public_key=pub)


def test_bundle_cli_keygen_sign_verify(tiny_bundle, tmp_path, capsys):
    from ddnn.cli import main

    b = tmp_path / "b"
    shutil.copytree(tiny_bundle, b)
    assert main(["bundle", "keygen", "--out", str(tmp_path / "k")]) == 0
    key, pub = tmp_path / "k" / "bundle-signing.key", tmp_path / "k" / "bundle-signing.pub"
    assert main(["bundle", "verify", "--bundle", str(b), "--key", str(pub)]) == 1
    assert "unsigned" in capsys.readouterr().err
    assert main(["bundle", "sign", "--bundle", str(b), "--key", str(key)]) == 0
    assert main(["bundle", "verify", "--bundle", str(b), "--key", str(pub)]) == 0
    assert "signature and checksums OK" in capsys.readouterr().out


def test_device_cli_refuses_an_unsigned_bundle(signed, tiny_data):
    _, u, pub, _ = signed
    done = _cli("device", "--bundle", str(u), "--view", "0", "--data", str(tiny_data.test),
                "--broker", "mqtt://127.0.0.1:1", env={"DDNN_DEVICE_BUNDLE_KEY": str(pub)})
    assert done.returncode == 1 and "unsigned" in done.stderr and "Traceback" not in done.stderr


def test_cloud_serves_only_signed_bundles(cloud_server, signed):
    s, u, pub, _ = signed
    with pytest.raises(DdnnError, match="unsigned"):
        cloud_server(bundle=u, bundle_key=pub, poll_interval=0)
    url = cloud_server(bundle=s, bundle_key=pub, poll_interval=0)
    assert httpx.get(url + "/v2/models/tiny-cloud/ready").status_code == 200
