"""How long the edge's ``/livez`` takes while 80 connections pipeline GETs and never read.

The attack of issue 40 (round 3): 80 connections each send hundreds of ``GET`` requests at once
with a 4 KiB receive buffer and read nothing, to hold the edge's 64 connection slots and its
threads. The edge runs in its own process (as in a deployment: the attackers and the probe do
not share its interpreter), its ring filled with 1000 results so ``/v1/results?after=-1``
answers a full page. Each round opens the 80 connections and probes ``/livez`` on fresh
connections, one after another, for a few seconds; then closes them. Reported per target path:
the worst and median probe over every round, and the rounds whose worst probe is over a second
or that failed (no ``200`` within the probe timeout).

The same rounds run against the code of :data:`BEFORE` (the revision before the fixed send
buffer and the closing ``429``), exported with ``git archive`` and served from its own tree,
side by side in one run, when this is a git checkout that has it.

    ddnn bench --only livez_under_load [--quick]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddnn.benchmarks.common import write_json

BEFORE = "adbb28d"  # the last revision whose /livez stalled (issue 40, item 4)
CONNECTIONS = 80
PIPELINED = 400  # GETs each connection sends at once (what its socket buffers take)
RCVBUF = 4096  # the attackers' receive buffer: their kernel takes little of an answer
PROBE_TIMEOUT = 10.0  # a probe without an answer by then counts as failed
# What the attackers pipeline: large answers (a page of 100 results, rate-limited per address)
# and the metrics text (not limited).
PATHS = {"results_page": "/v1/results?after=-1", "metrics": "/metrics"}

# The edge, in a child process: the ring filled, the port on stdout, served until stdin closes.
_SERVE = """
import sys
from pathlib import Path
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.result import Result

service = EdgeService.from_settings(EdgeSettings(bundle=Path(sys.argv[1]), http_port=0))
with service:
    views = tuple(f"cam{i}" for i in range(6))
    for frame in range(1000):
        service.aggregator.recent.publish(Result(
            frame=frame, cls=frame % 3, label="car", exit="cloud", entropy=0.25,
            views=views[:5], missing={"cam5": "late"}, latency_ms=12.5))
    print(service.http.port, flush=True)
    sys.stdin.read()
"""


def attack(port: int, path: str) -> list[socket.socket]:
    """:data:`CONNECTIONS` connections, each pipelining :data:`PIPELINED` GETs of ``path`` and
    reading nothing."""
    out = []
    request = f"GET {path} HTTP/1.1\r\nHost: edge\r\n\r\n".encode() * PIPELINED
    for _ in range(CONNECTIONS):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.settimeout(PROBE_TIMEOUT)
        try:
            s.connect(("127.0.0.1", port))
            s.setblocking(False)  # the server stops reading once its writes block
            with contextlib.suppress(BlockingIOError):
                s.send(request)
        except OSError:
            pass  # refused or reset: the server's business, still an attacker's try
        out.append(s)
    return out


def probe(port: int) -> float | None:
    """Seconds until ``/livez`` answered ``200`` on a fresh connection; None: it did not."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as s:
            s.settimeout(max(0.1, PROBE_TIMEOUT - (time.perf_counter() - start)))
            s.sendall(b"GET /livez HTTP/1.1\r\nHost: edge\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):  # (the server closes: Connection: close)
                answer += chunk
    except OSError:
        return None
    return time.perf_counter() - start if answer.startswith(b"HTTP/1.1 200") else None


def rounds(port: int, path: str, n: int, window: float) -> list[list[float | None]]:
    """``n`` rounds of the attack on ``path``, each probing for ``window`` seconds."""
    out = []
    for _ in range(n):
        attackers = attack(port, path)
        try:
            times: list[float | None] = []
            end = time.monotonic() + window
            while time.monotonic() < end:
                times.append(probe(port))
        finally:
            for s in attackers:
                s.close()
        out.append(times)
        time.sleep(1.0)  # the server drops the closed connections before the next round
    return out


def summary(per_round: list[list[float | None]]) -> dict:
    answered = [t for r in per_round for t in r if t is not None]
    worst_by_round = [None if None in r else max(r) for r in per_round]
    return {
        "rounds": len(per_round),
        "probes": sum(len(r) for r in per_round),
        "failed_probes": sum(t is None for r in per_round for t in r),
        "worst_s": None if None in worst_by_round else max(worst_by_round),
        "median_s": statistics.median(answered) if answered else None,
        "worst_by_round_s": worst_by_round,
        "rounds_over_1s": sum(w is None or w > 1.0 for w in worst_by_round),
    }


@contextlib.contextmanager
def serving(bundle: Path, source: Path | None = None):
    """The edge in a child process (``source``: a tree laid out by :func:`export`), its port."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source)  # (before the installed package on sys.path)
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(bundle)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"the edge did not start (exit code {proc.wait(30)})")
        yield int(line)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def export(revision: str, into: Path) -> Path | None:
    """The ``ddnn`` package of ``revision`` under ``into``, laid out as installed (the tiers'
    folders as its subpackages); None when this is not a git checkout that has it."""
    repo = Path(__file__).resolve().parent.parent
    src = into / "src"
    src.mkdir(parents=True)
    try:
        tar = subprocess.run(["git", "-C", str(repo), "archive", revision], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    package = into / "pkg" / "ddnn"
    shutil.copytree(src / "ddnn", package)
    for tier in ("edge", "device", "cloud", "models", "benchmarks"):
        (package / tier).symlink_to(src / tier, target_is_directory=True)
    return package.parent


def run(out: Path, bundle: Path, test: Path | None = None, quick: bool = False) -> dict:
    n, window = (3, 2.0) if quick else (10, 3.0)
    result: dict = {"connections": CONNECTIONS, "pipelined": PIPELINED, "rounds": n,
                    "window_s": window, "paths": PATHS, "before_revision": BEFORE,
                    "after": {}, "before": {}}
    with tempfile.TemporaryDirectory() as tmp:
        old = export(BEFORE, Path(tmp))
        for name, source in (("before", old), ("after", None)):
            if name == "before" and source is None:
                result["before"] = {"skipped": f"revision {BEFORE} not available"}
                continue
            with serving(bundle, source) as port:
                for target, path in PATHS.items():
                    result[name][target] = summary(rounds(port, path, n, window))
    for target in PATHS:
        for name in ("before", "after"):
            if r := result[name].get(target):
                print(f"{target:<14}{name:<8}worst {_s(r['worst_s'])}  median {_s(r['median_s'])}"
                      f"  failed {r['failed_probes']}/{r['probes']}", file=sys.stderr)
    write_json(out, "livez_under_load", result)
    return result


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"
