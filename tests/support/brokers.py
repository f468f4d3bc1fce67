"""Mosquitto with TLS, and with a deployment's PKI its passwords and ACL too (what
deploy/mosquitto/secure.conf sets up), on a free loopback port; the PKI made by
deploy/make-certs.sh."""

from __future__ import annotations

import contextlib
import getpass
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddnn.plumbing.mqtt import MqttSecurity
from ddnn.tools.broker import free_port, mosquitto_path, wait_for_port
from ddnn.tools.embedded_broker import embedded_broker_python


def needs_embedded_broker() -> None:
    """Skip (fail on CI) where no environment runs the embedded amqtt broker."""
    if embedded_broker_python() is None:
        message = "no environment with amqtt (`make setup` makes .venv-broker)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the embedded broker's tests, not skip them
        pytest.skip(message)


@dataclass(frozen=True)
class Pki:
    dir: Path
    passwords: dict[str, str]

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def client(self, cid: str) -> tuple[Path, Path]:
        return self.dir / "clients" / f"{cid}.crt", self.dir / "clients" / f"{cid}.key"

    def security(self, cid: str, password: str | None = None, cert: str | None = None,
                 ca: Path | None = None) -> MqttSecurity:
        crt, key = self.client(cert or cid)
        return MqttSecurity(ca_file=str(ca or self.ca), cert_file=str(crt), key_file=str(key),
                            username=cid, password=self.passwords[cid] if password is None
                            else password)


MAKE_CERTS = Path(__file__).resolve().parents[2] / "deploy" / "make-certs.sh"


def make_pki(out: Path, *args: str) -> Pki:
    """deploy/make-certs.sh OUT ARGS..., with every identity's password read back from its env
    file (DDNN_DEVICE_*, DDNN_EDGE_* or, for operators, DDNN_ANNOUNCE_*)."""
    done = subprocess.run(["bash", str(MAKE_CERTS), str(out), *args], capture_output=True,
                          text=True)
    if done.returncode:
        sys.stderr.write(done.stderr)
        done.check_returncode()
    passwords = {}
    for env in (out / "env").glob("*.env"):
        values = dict(line.split("=", 1) for line in env.read_text().splitlines())
        if user := next((v for k, v in values.items() if k.endswith("_USERNAME")), None):
            passwords[user] = next(v for k, v in values.items() if k.endswith("_PASSWORD"))
    return Pki(out, passwords)


@dataclass
class SecureBroker:
    url: str
    proc: subprocess.Popen
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def mosquitto_tls(workdir: Path, ca: Path, cert: Path, key: Path, *, pki: Pki | None = None,
                  identity: bool = False):
    """Mosquitto on a free loopback port: TLS, and with ``pki`` client certificates, the password
    file and the ACL required (what deploy/mosquitto/secure.conf sets up); with ``identity``,
    the certificate's CN is the username instead of a password (its use_identity_as_username)."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = [f"listener {port} 127.0.0.1", f"cafile {ca}", f"certfile {cert}", f"keyfile {key}",
            "tls_version tlsv1.2", "persistence false", "set_tcp_nodelay true",
            f"log_dest file {workdir / 'broker.log'}", "log_type all",
            # As root Mosquitto drops to user "mosquitto", who could not read the tmp files.
            f"user {getpass.getuser()}"]
    if pki is not None:
        conf += ["require_certificate true", "allow_anonymous false",
                 f"acl_file {pki.dir / 'acl'}",
                 "use_identity_as_username true" if identity
                 else f"password_file {pki.dir / 'passwd'}"]
    else:
        conf += ["allow_anonymous true"]
    (workdir / "mosquitto.conf").write_text("\n".join(conf) + "\n")
    proc = subprocess.Popen([mosquitto_path(), "-c", str(workdir / "mosquitto.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    broker = SecureBroker(f"mqtts://127.0.0.1:{port}", proc, workdir / "broker.log")
    try:
        wait_for_port("127.0.0.1", port, 10, proc)
        yield broker
    finally:
        broker.stop()


