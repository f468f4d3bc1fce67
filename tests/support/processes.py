"""The tiers as real ``ddnn`` processes: started in their own process group, stopped with
SIGTERM, read through their HTTP endpoints and their JSON-lines results."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.status import status_fields
from ddnn.tools.broker import free_port
from ddnn.topics import Topics
from tests.support.polling import wait_for

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def ddnn_process(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m ddnn ARGS`` in its own process group, output to ``log``."""
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "ddnn", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in ``timeout``; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def start_cloud_repository(repo: Path, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """``ddnn cloud`` serving a repository on a loopback port, ready when this returns."""
    proc = ddnn_process(["cloud", "--repository", str(repo), "--host", "127.0.0.1", "--port",
                         str(port), "--ort-threads", "1", "--poll-interval", "0", *extra], log)
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/v2/models/tiny-cloud/versions/3/ready"),
               60, "cloud ready", [proc])
    return proc


def metric(text: str, series: str) -> float:
    """The value of ``series`` (``name{a="x",b="y"}``, labels in any order); 0 if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    name, _, rest = series.partition("{")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def frames_of(results: list[dict]) -> list[int]:
    """The frame ids of ``results``, sorted (each once when every frame was answered once)."""
    return sorted(r["frame"] for r in results)


DEPLOYMENT = "faults"


class Deployment:
    """An edge (restartable) and device processes on one broker; results in one JSON-lines file
    that every edge process of the test appends to."""

    def __init__(self, tmp: Path, bundle: Path, broker: str, cloud: str, *,
                 thresholds: dict[str, float], deadline_ms: int = 1000,
                 feature_deadline_ms: int = 2000, deployment: str = DEPLOYMENT):
        self.tmp, self.bundle, self.broker = tmp, bundle, broker
        self.deployment = deployment
        self.results_path = tmp / "results.jsonl"
        self.edge_args = [
            "edge", "--bundle", str(bundle), "--broker", broker, "--cloud", cloud,
            "--deployment", deployment, "--deadline-ms", str(deadline_ms),
            "--feature-deadline-ms", str(feature_deadline_ms), "--results-out",
            str(self.results_path), "--keepalive", "2", "--reconnect-max", "1",
            "--local-threshold", repr(thresholds["local"]),
            "--edge-threshold", repr(thresholds["edge"])]
        self.edges: list[subprocess.Popen] = []
        self.devices: list[subprocess.Popen] = []
        self.http = ""

    @property
    def edge(self) -> subprocess.Popen:
        return self.edges[-1]

    def start_edge(self) -> subprocess.Popen:
        self.http = f"http://127.0.0.1:{free_port()}"
        n = len(self.edges)
        proc = ddnn_process([*self.edge_args, "--http-port", self.http.rsplit(":", 1)[1]],
                            self.tmp / f"edge{n}.log")
        self.edges.append(proc)
        wait_for(lambda: http_ok(f"{self.http}/healthz"), 60, "edge ready", [proc])
        return proc

    def start_device(self, view: int, data: Path, fps: float, *extra: str) -> subprocess.Popen:
        proc = ddnn_process(["device", "--bundle", str(self.bundle), "--broker", self.broker,
                             "--view", str(view), "--data", str(data), "--fps", str(fps),
                             "--deployment", self.deployment, "--grace", "3", "--keepalive", "1",
                             "--reconnect-max", "1", *extra], self.tmp / f"device{view}.log")
        self.devices.append(proc)
        return proc

    @property
    def procs(self) -> list[subprocess.Popen]:
        return [self.edge, *self.devices]

    def results(self) -> list[dict]:
        return read_results(self.results_path)

    def wait(self, condition, what: str, timeout: float = 120) -> None:
        wait_for(lambda: condition(self.results()), timeout, what, self.procs)

    def wait_devices(self, timeout: float = 60) -> None:
        for d in self.devices:
            assert d.wait(timeout) == 0, self.log(f"device{self.devices.index(d)}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.http}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        for p in [*self.devices, *self.edges]:
            stop_process(p)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


class Statuses:
    """The retained status of every device of the deployment."""

    def __init__(self, broker: str):
        self.seen: dict[str, dict] = {}
        self._lock = threading.Lock()
        topics = Topics(DEPLOYMENT)
        self.client = MqttClient(broker, "ota-status-listener",
                                 MqttOptions(subscriptions=[(topics.all_devices("status"), 1)]),
                                 on_message=self._on)
        self.client.start()

    def _on(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self.seen[topic.split("/")[-2]] = status_fields(payload)

    def models(self) -> set[str]:
        with self._lock:
            return {s.get("model") for s in self.seen.values() if s.get("state") == "online"}


def announce(broker: str, version: str, cloud: str) -> None:
    subprocess.run([sys.executable, "-m", "ddnn", "announce", "--broker", broker,
                    "--deployment", DEPLOYMENT, "--name", "tiny", "--version", version,
                    "--cloud", cloud], check=True, env=ENV, timeout=60)


