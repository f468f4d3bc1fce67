"""Real processes for the hierarchy's end-to-end tests: the cloud, an edge, V devices."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddnn.tools.broker import free_port

STREAM = 300  # frames of stream_data: long enough to restart a tier in the middle
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


def wait_until(condition, timeout: float, what: str, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"{what}: {p.args[3:5]} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling readiness or progress, not guessing a duration


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


@pytest.fixture(scope="module")
def cloud_url(tiny_bundle, tmp_path_factory) -> Iterator[str]:
    """The cloud tier: a real ``ddnn cloud`` process on a free loopback port, ready before the
    test starts."""
    logs = tmp_path_factory.mktemp("cloud")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ddnn_process(["cloud", "--bundle", str(tiny_bundle), "--host", "127.0.0.1",
                         "--port", str(port), "--ort-threads", "1"], logs / "cloud.log")
    wait_until(lambda: http_ok(f"{url}/v2/health/ready"), 60, "ddnn cloud ready", [proc])
    yield url
    stop_process(proc)


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory) -> Path:
    """A longer test replay than ``tiny_data.test``, in the same layout (3 views, 3 classes)."""
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    path = tmp_path_factory.mktemp("stream") / "stream.npz"
    save_dataset(path, synthesize(STREAM, SceneConfig(views=3, classes=3, size=16), seed=3))
    return path
