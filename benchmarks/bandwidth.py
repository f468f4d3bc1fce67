"""Raw offload against the hierarchy over a bandwidth-limited uplink, in one run.

The device side and the edge side each get their own network namespace, joined by a veth pair
whose two ends are both shaped with a token bucket (``tc qdisc … tbf``) at 1 Mbit/s and 250
kbit/s (quick: 1 Mbit/s only). Everything else is real: the cloud service, a Mosquitto broker and
the edge aggregator run as ``ddnn`` processes in the edge namespace, one ``ddnn device`` process
per view runs in the device namespace. For each rate, in the same run:

* **raw offload, FP32**: closed-loop clients in the device namespace POST each frame's views to
  the cloud's ``{name}-full`` model (binary tensors, FP32 — the only dtype it takes);
* **raw offload, 8-bit**: the same, but the clients send the present views as 8-bit images (what
  a camera would send, the ``raw_offload`` accounting of ``ddnn evaluate``) to a small relay in
  the edge namespace, which converts them to FP32 and calls ``{name}-full`` there;
* **hierarchy**: the device processes replay the test split at an offered frame rate; the
  results the edge writes give the achieved frame rate and the capture-to-result latency.

Frames per second, latency p50/p99 and bytes on the wire per frame (veth counters) are written
to ``bandwidth.json`` with a plot ``bandwidth.png``. Needs root (namespaces, qdiscs); otherwise
the benchmark is skipped with the reason in the JSON.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import machine, pyplot, write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.oip import decode_response, encode_request
from ddnn.tools.broker import mosquitto_path

NAME = "bandwidth"
PREFIX = "ddnnbw"  # namespaces are named ddnnbw-<pid>-dev / ddnnbw-<pid>-edge
EDGE_ADDR, DEV_ADDR = "10.213.0.1", "10.213.0.2"
DEV_IF, EDGE_IF = "bwdev", "bwedge"
CLOUD_PORT, RELAY_PORT, BROKER_PORT, EDGE_HTTP_PORT = 8000, 8001, 1883, 9100
RATES = {"1mbit": 1_000_000, "250kbit": 250_000}
TBF_BURST_BYTES = 4500  # three full-size packets: short bursts pass, the mean rate is R
TBF_LATENCY_MS = 200  # queue bound: packets that would wait longer are dropped
RAW_CLIENTS = 2  # enough to keep the link busy: one request is on the wire while one is answered
# The hierarchy as the bundle is calibrated; its worst case for the uplink: no frame exits
# locally (edge ``--local-threshold 0``), so every frame pulls every present view's features;
# and the devices behind one ``ddnn gateway`` (a local broker on their side of the link), which
# sends each frame's messages up as one.
VARIANTS = {"hierarchy": {}, "hierarchy_no_local_exit": {"local_threshold": "0"},
            "hierarchy_gateway": {"gateway": True}}
LOCAL_BROKER_PORT = 1884  # the gateway variant's broker, in the device namespace
# Offered frame rate of the devices per variant and link rate: high enough to be far above raw
# offload, low enough that the link and this machine's CPUs keep up (achieved is reported too).
OFFERED_FPS = {
    "hierarchy": {"1mbit": 100.0, "250kbit": 25.0},
    "hierarchy_gateway": {"1mbit": 100.0, "250kbit": 25.0},
    "hierarchy_no_local_exit": {"1mbit": 50.0, "250kbit": 12.0},
}
REPO = Path(__file__).resolve().parents[1]
CLONE_NEWNET = 0x40000000


# --- namespaces -----------------------------------------------------------------------------


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def _why_not() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not sys.platform.startswith("linux"):
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc qdiscs); run `ddnn bench` as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_ns(ns: str) -> None:
    """Stop what still runs in ``ns`` (it was started by this benchmark) and delete it."""
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _sh("ip", "netns", "del", ns, check=False)


def _remove_stale() -> list[str]:
    """Delete namespaces an earlier, killed run of this benchmark left behind."""
    removed = []
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}-(\d+)-(dev|edge)", ns)
        if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
            _delete_ns(ns)
            removed.append(ns)
    return removed


def _enter(ns: str) -> None:
    """Move the calling thread (only it) into network namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _in_ns(ns: str, fn, *args):
    """Call ``fn(*args)`` in a thread inside ``ns`` and return its result (or raise its error)."""
    box: dict = {}

    def target():
        try:
            _enter(ns)
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass
class Link:
    """Two namespaces joined by a veth pair, each end's egress shaped with tbf."""

    dev_ns: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-dev")
    edge_ns: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-edge")

    def up(self) -> None:
        _sh("ip", "netns", "add", self.dev_ns)
        _sh("ip", "netns", "add", self.edge_ns)
        _sh("ip", "link", "add", DEV_IF, "netns", self.dev_ns, "type", "veth",
            "peer", "name", EDGE_IF, "netns", self.edge_ns)
        for ns, dev, addr in ((self.dev_ns, DEV_IF, DEV_ADDR), (self.edge_ns, EDGE_IF, EDGE_ADDR)):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def shape(self, rate_bits: int) -> None:
        for ns, dev in ((self.dev_ns, DEV_IF), (self.edge_ns, EDGE_IF)):
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{rate_bits}bit", "burst", str(TBF_BURST_BYTES),
                "latency", f"{TBF_LATENCY_MS}ms")

    def counters(self) -> dict[str, int]:
        """Bytes and packets the device end sent (uplink) and received (downlink)."""
        out = _sh("ip", "-n", self.dev_ns, "-s", "-j", "link", "show", "dev", DEV_IF).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"up_bytes": stats["tx"]["bytes"], "up_packets": stats["tx"]["packets"],
                "down_bytes": stats["rx"]["bytes"], "down_packets": stats["rx"]["packets"]}

    def down(self) -> None:
        for ns in (self.dev_ns, self.edge_ns):
            _delete_ns(ns)


# --- processes ------------------------------------------------------------------------------


@dataclass
class Procs:
    """Child processes started inside a namespace; stopped in reverse order."""

    logs: Path
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, ns: str, *cmd: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.children.append((name, proc))
        return proc

    def ddnn(self, name: str, ns: str, *args: str) -> subprocess.Popen:
        return self.start(name, ns, sys.executable, "-m", "ddnn", *args)

    def stop(self, names: set[str] | None = None, timeout: float = 10.0) -> None:
        chosen = [(n, p) for n, p in reversed(self.children) if names is None or n in names]
        for _, p in chosen:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, p in chosen:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.children = [c for c in self.children if c not in chosen]

    def tail(self, name: str, chars: int = 1500) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _wait_http(ns: str, host: str, port: int, path: str, proc: subprocess.Popen,
               timeout: float = 90.0) -> None:
    last = ["no answer"]

    def probe() -> bool:
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection(host, port, timeout=1)
            try:
                conn.request("GET", path)
                resp = conn.getresponse()
                last[0] = f"{resp.status} {resp.read(500)!r}"
                return resp.status == 200
            finally:
                conn.close()
        return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process serving {host}:{port} exited ({proc.returncode})")
        if _in_ns(ns, probe):
            return
        time.sleep(0.1)  # readiness poll
    raise RuntimeError(f"http://{host}:{port}{path} not ready after {timeout:.0f} s (last: "
                       f"{last[0]})")


def _wait_port(ns: str, host: str, port: int, proc: subprocess.Popen, timeout: float = 20.0):
    import socket

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {host}:{port} exited ({proc.returncode})")
        if _in_ns(ns, probe):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


# --- raw offload ----------------------------------------------------------------------------


class _Relay(ThreadingHTTPServer):
    """Edge-side relay for the 8-bit variant: 8-bit views in, FP32 ``{name}-full`` call out."""

    daemon_threads = True

    def __init__(self, model: str, views: int, shape: tuple[int, ...]):
        self.model, self.views, self.shape = model, views, shape
        self.local = threading.local()
        super().__init__((EDGE_ADDR, RELAY_PORT), _RelayHandler)

    def infer(self, body: bytes) -> int:
        present = np.frombuffer(body[: self.views], np.uint8).astype(bool)
        images = np.frombuffer(body[self.views :], np.uint8).reshape(-1, *self.shape)
        if len(images) != present.sum():
            raise ValueError("image count does not match the present mask")
        x = np.zeros((1, self.views, *self.shape), np.float32)
        x[0, present] = images.astype(np.float32) / 255.0
        req, headers = encode_request({"views": x, "present": present[None]})
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(EDGE_ADDR, CLOUD_PORT, timeout=30)
        conn.request("POST", f"/v2/models/{self.model}/infer", body=req, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"cloud answered {resp.status}")
        return int(decode_response(data, dict(resp.getheaders()))["scores"].argmax())


class _RelayHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            out, status = json.dumps({"class": self.server.infer(body)}).encode(), 200
        except Exception as e:  # answered, never fatal to the relay
            out, status = json.dumps({"error": str(e)}).encode(), 500
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def _start_relay(ns: str, model: str, views: int, shape: tuple[int, ...]) -> _Relay:
    relay = _in_ns(ns, _Relay, model, views, shape)  # the listening socket lives in ``ns``

    def serve():
        _enter(ns)  # handler threads inherit this thread's namespace
        relay.serve_forever(poll_interval=0.2)

    threading.Thread(target=serve, daemon=True).start()
    return relay


def _raw_bodies(ds, model: str, count: int, eight_bit: bool) -> list[tuple[str, bytes, dict]]:
    """(path, body, headers) for the first ``count`` frames of ``ds``."""
    out = []
    for i in range(min(count, ds.num_samples)):
        present = ds.present[i]
        if eight_bit:
            images = np.round(np.clip(ds.X[i][present], 0, 1) * 255).astype(np.uint8)
            body = present.astype(np.uint8).tobytes() + images.tobytes()
            out.append(("/relay", body, {"Content-Type": "application/octet-stream"}))
        else:
            views = np.where(present[:, None, None, None], ds.X[i], 0.0).astype(np.float32)
            body, headers = encode_request({"views": views[None], "present": present[None]})
            out.append((f"/v2/models/{model}/infer", body, headers))
    return out


def _raw_phase(link: Link, ds, bodies: list, port: int, duration: float, clients: int) -> dict:
    """Closed-loop clients in the device namespace for ``duration`` seconds."""
    done: list[tuple[float, float, bool]] = []  # (finish time, latency ms, correct)
    errors: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()
    stop_at = start + duration

    def client(k: int) -> None:
        try:
            _enter(link.dev_ns)
            conn = http.client.HTTPConnection(EDGE_ADDR, port, timeout=120)
            i = k
            while time.monotonic() < stop_at:
                path, body, headers = bodies[i % len(bodies)]
                t0 = time.monotonic()
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                t1 = time.monotonic()
                if resp.status != 200:
                    raise RuntimeError(f"answered {resp.status}: {data[:200]!r}")
                if path == "/relay":
                    cls = json.loads(data)["class"]
                else:
                    cls = int(decode_response(data, dict(resp.getheaders()))["scores"].argmax())
                with lock:
                    done.append((t1, (t1 - t0) * 1e3, cls == int(ds.label[i % len(bodies)])))
                i += clients
            conn.close()
        except Exception as e:  # reported in the result
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    before = link.counters()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:  # in-flight requests finish; none starts after ``duration``
        t.join(duration + 120)
    after = link.counters()
    n = len(done)
    elapsed = (max(t for t, _, _ in done) - start) if done else duration
    lat = [ms for _, ms, _ in done]
    return {
        "clients": clients,
        "frames": n,
        "seconds": round(elapsed, 3),
        "fps": n / elapsed if elapsed > 0 else 0.0,
        "latency_ms": _percentiles(lat),
        "accuracy": float(np.mean([c for _, _, c in done])) if done else None,
        "request_bytes_per_frame": float(np.mean([len(b[1]) for b in bodies])),
        "wire": _wire(before, after, n),
        "errors": errors[:5],
    }


# --- hierarchy ------------------------------------------------------------------------------


def _tiled(ds, frames: int, path: Path) -> Path:
    """A replay file of ``frames`` frames (the test split repeated; frame i is sample i mod n)."""
    idx = np.arange(frames) % ds.num_samples
    np.savez(path, X=ds.X[idx], y=ds.y[idx], label=ds.label[idx])
    return path


def _tail_results(path: Path, stop: threading.Event, into: list) -> None:
    """Append (arrival time, result) for every line the edge writes to ``path``."""
    pos, buf = 0, b""
    while not stop.is_set():
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            now = time.monotonic()
            for line in lines:
                with contextlib.suppress(ValueError):
                    into.append((now, json.loads(line)))
        stop.wait(0.05)


def _start_gateway(link: Link, procs: Procs, work: Path, broker: str, deployment: str) -> str:
    """A broker and a ``ddnn gateway`` on the devices' side of the link; the devices' URL."""
    conf = work / "site-mosquitto.conf"
    conf.write_text(f"listener {LOCAL_BROKER_PORT} 127.0.0.1\nallow_anonymous true\n"
                    "persistence false\nmax_inflight_messages 1000\nset_tcp_nodelay true\n")
    exe = mosquitto_path()
    site = (procs.start("site-broker", link.dev_ns, exe, "-c", str(conf)) if exe else
            procs.start("site-broker", link.dev_ns, sys.executable, "-m", "ddnn.tools.broker",
                        "--host", "127.0.0.1", "--port", str(LOCAL_BROKER_PORT)))
    _wait_port(link.dev_ns, "127.0.0.1", LOCAL_BROKER_PORT, site)
    local = f"mqtt://127.0.0.1:{LOCAL_BROKER_PORT}"
    procs.ddnn("gateway", link.dev_ns, "gateway", "--local", local, "--broker", broker,
               "--deployment", deployment)
    return local


def _edge_payload_bytes(ns: str) -> float | None:
    def fetch() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", EDGE_HTTP_PORT, timeout=2)
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    try:
        text = _in_ns(ns, fetch)
    except (OSError, http.client.HTTPException):
        return None
    pattern = r'^ddnn_edge_received_bytes_total\{[^}]*part="payload"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _hierarchy_phase(link: Link, procs: Procs, bundle: Path, replay: Path, ds, views: int,
                     tag: str, variant: dict, fps: float, frames: int, work: Path) -> dict:
    deployment = "bw"  # short, like a real deployment name: it is in every topic and envelope
    results_file = work / f"results-{tag}.jsonl"
    broker = device_broker = f"mqtt://{EDGE_ADDR}:{BROKER_PORT}"
    extra = []
    if "local_threshold" in variant:
        extra += ["--local-threshold", variant["local_threshold"]]
    ids = [f"cam{v}" for v in range(views)]
    if variant.get("gateway"):
        extra += ["--gateways", "gw0=" + "+".join(ids)]
        device_broker = _start_gateway(link, procs, work, broker, deployment)
    edge = procs.ddnn(
        "edge", link.edge_ns, "edge", "--bundle", str(bundle), "--broker", broker,
        "--cloud", f"http://{EDGE_ADDR}:{CLOUD_PORT}", "--deployment", deployment,
        "--http-host", "127.0.0.1", "--http-port", str(EDGE_HTTP_PORT),
        "--results-out", str(results_file), *extra,
    )
    try:
        # Alive, not ready: the previous phase's devices left their retained "offline", and
        # an edge whose every device is offline is rightly not ready until they come.
        _wait_http(link.edge_ns, "127.0.0.1", EDGE_HTTP_PORT, "/livez", edge)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; the edge's log ends:\n{procs.tail('edge')}") from None
    got: list[tuple[float, dict]] = []
    stop = threading.Event()
    tail = threading.Thread(target=_tail_results, args=(results_file, stop, got), daemon=True)
    tail.start()
    before = link.counters()
    devices = {f"device-{v}" for v in range(views)}
    for v in range(views):
        procs.ddnn(
            f"device-{v}", link.dev_ns, "device", "--bundle", str(bundle),
            "--broker", device_broker,
            "--view", str(v), "--data", str(replay), "--fps", f"{fps:g}", "--limit", str(frames),
            "--deployment", deployment, "--wait-peers", "60", "--grace", "1",
        )
    # Devices start replaying together once all are online; then the replay takes frames / fps.
    started = time.monotonic()
    budget = 60 + frames / fps + 20
    while time.monotonic() - started < budget and len(got) < frames:
        if edge.poll() is not None:
            raise RuntimeError(f"edge exited ({edge.returncode}): {procs.tail('edge')}")
        if not got and time.monotonic() - started > 60:
            raise RuntimeError(f"no results after 60 s: {procs.tail('device-0')}")
        if got and time.monotonic() - got[-1][0] > 10:
            break  # nothing more for 10 s: what was lost stays lost
        time.sleep(0.1)
    stop.set()
    tail.join()
    after = link.counters()
    payload = _edge_payload_bytes(link.edge_ns)
    procs.stop(devices | {"edge", "gateway", "site-broker"})
    results = {}
    for t, r in got:
        results.setdefault(int(r["frame"]), (t, r))
    n = len(results)
    times = sorted(t for t, _ in results.values())
    span = times[-1] - times[0] if n > 1 else 0.0
    rs = [r for _, r in results.values()]
    complete = [len(r["views"]) == int(ds.present[r["frame"] % ds.num_samples].sum()) for r in rs]
    correct = [r["class"] == int(ds.label[r["frame"] % ds.num_samples]) for r in rs]
    exits = {t: sum(r["exit"] == t for r in rs) for t in ("local", "edge", "cloud")}
    return {
        "devices": views,
        "offered_fps": fps,
        "frames_offered": frames,
        "frames_answered": n,
        "seconds": round(span, 3),
        "fps": (n - 1) / span if span > 0 else 0.0,
        "latency_ms": _percentiles([r["latency_ms"] for r in rs]),
        "accuracy": float(np.mean(correct)) if correct else None,
        "all_views_fraction": float(np.mean(complete)) if complete else None,
        "degraded": sum(bool(r.get("degraded")) for r in rs),
        "exits": exits,
        "payload_bytes_per_frame": payload / n if payload is not None and n else None,
        "wire": _wire(before, after, n),
    }


# --- the run --------------------------------------------------------------------------------


def _percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "mean": float(np.mean(values))}


def _wire(before: dict, after: dict, frames: int) -> dict:
    d = {k: after[k] - before[k] for k in before}
    per = max(frames, 1)
    return {
        "up_bytes_per_frame": d["up_bytes"] / per,
        "down_bytes_per_frame": d["down_bytes"] / per,
        "up_packets_per_frame": d["up_packets"] / per,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    out_dir, bundle, data = Path(out_dir), Path(bundle).resolve(), Path(data).resolve()
    reason = _why_not()
    if reason:
        print(f"   bandwidth benchmark skipped: {reason}", file=sys.stderr)
        result = {"skipped": reason}
        write_json(out_dir, NAME, result)
        return result
    m = load_bundle(bundle).manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    rates = {"1mbit": RATES["1mbit"]} if quick else RATES
    raw_seconds, hier_seconds = (6.0, 8.0) if quick else (15.0, 20.0)
    work = Path(tempfile.mkdtemp(prefix="ddnn-bw-"))
    logs = work / "logs"
    logs.mkdir()
    frames_needed = int(max(OFFERED_FPS[v][r] for v in VARIANTS for r in rates) * hier_seconds)
    replay = _tiled(ds, frames_needed, work / "replay.npz")
    stale = _remove_stale()
    link, procs, relay = Link(), Procs(logs), None
    measured: dict[str, dict] = {}
    try:
        link.up()
        conf = work / "mosquitto.conf"
        conf.write_text(
            f"listener {BROKER_PORT} {EDGE_ADDR}\nallow_anonymous true\npersistence false\n"
            "max_inflight_messages 1000\nmax_queued_messages 100000\nset_tcp_nodelay true\n"
        )
        exe = mosquitto_path()
        if exe:
            broker = procs.start("broker", link.edge_ns, exe, "-c", str(conf))
        else:
            broker = procs.start("broker", link.edge_ns, sys.executable, "-m", "ddnn.tools.broker",
                                 "--host", EDGE_ADDR, "--port", str(BROKER_PORT))
        cloud = procs.ddnn("cloud", link.edge_ns, "cloud", "--bundle", str(bundle),
                           "--host", EDGE_ADDR, "--port", str(CLOUD_PORT))
        _wait_port(link.edge_ns, EDGE_ADDR, BROKER_PORT, broker)
        _wait_http(link.edge_ns, EDGE_ADDR, CLOUD_PORT, "/v2/health/ready", cloud)
        relay = _start_relay(link.edge_ns, f"{m.name}-full", m.views, tuple(m.input_shape))
        fp32 = _raw_bodies(ds, f"{m.name}-full", 64, eight_bit=False)
        u8 = _raw_bodies(ds, f"{m.name}-full", 64, eight_bit=True)
        for label, bits in rates.items():
            print(f"   {label}: raw FP32, raw 8-bit, hierarchy", file=sys.stderr, flush=True)
            link.shape(bits)
            r = measured[label] = {
                "raw_fp32": _raw_phase(link, ds, fp32, CLOUD_PORT, raw_seconds, RAW_CLIENTS),
                "raw_8bit": _raw_phase(link, ds, u8, RELAY_PORT, raw_seconds, RAW_CLIENTS),
            }
            for variant, how in VARIANTS.items():
                fps = OFFERED_FPS[variant][label]
                r[variant] = _hierarchy_phase(
                    link, procs, bundle, replay, ds, m.views, f"{label}-{len(r)}", how,
                    fps, int(fps * hier_seconds), work,
                )
    finally:
        if relay is not None:
            relay.shutdown()
            relay.server_close()
        procs.stop()
        link.down()
        shutil.rmtree(work, ignore_errors=True)

    ratios, aims = {}, {}
    for label, r in measured.items():
        for kind in r:
            wire_up = r[kind]["wire"]["up_bytes_per_frame"]
            # What the link alone would allow: rate / uplink bytes on the wire per frame.
            r[kind]["link_bound_fps"] = RATES[label] / 8 / wire_up if wire_up else None
        for variant in VARIANTS:
            h = r[variant]["fps"]
            for raw in ("raw_fp32", "raw_8bit"):
                ratios[f"fps_{variant}_over_{raw}_{label}"] = _ratio(h, r[raw]["fps"])
            ratios[f"link_bound_fps_{variant}_over_raw_8bit_{label}"] = _ratio(
                r[variant]["link_bound_fps"], r["raw_8bit"]["fps"]
            )
            wire = r[variant]["wire"]
            ratios[f"wire_up_raw_8bit_over_{variant}_{label}"] = _ratio(
                r["raw_8bit"]["wire"]["up_bytes_per_frame"], wire["up_bytes_per_frame"])
            ratios[f"wire_down_over_up_{variant}_{label}"] = _ratio(
                wire["down_bytes_per_frame"], wire["up_bytes_per_frame"])
    if "1mbit" in measured:
        aims["hierarchy_fps_20x_raw_at_1mbit"] = {
            "target": 20.0,
            "vs_raw_8bit": ratios["fps_hierarchy_over_raw_8bit_1mbit"],
            "vs_raw_fp32": ratios["fps_hierarchy_over_raw_fp32_1mbit"],
            "link_bound_vs_raw_8bit": ratios["link_bound_fps_hierarchy_over_raw_8bit_1mbit"],
        }
        aim = aims["hierarchy_fps_20x_raw_at_1mbit"]
        aim["met_vs_raw_8bit"] = (aim["vs_raw_8bit"] or 0) >= 20
        aim["met_vs_raw_fp32"] = (aim["vs_raw_fp32"] or 0) >= 20
        for variant in ("hierarchy", "hierarchy_gateway"):
            up = ratios[f"wire_up_raw_8bit_over_{variant}_1mbit"] or 0
            down = ratios[f"wire_down_over_up_{variant}_1mbit"]
            aims[f"{variant}_uplink_25x_fewer_wire_bytes_than_raw_8bit_at_1mbit"] = {
                "target": 25.0, "ratio": up, "met": up >= 25}
            aims[f"{variant}_downlink_at_most_a_third_of_uplink_at_1mbit"] = {
                "target": 1 / 3, "ratio": down, "met": down is not None and down <= 1 / 3}
    result = {
        "setup": {
            "link": f"veth between two network namespaces, tbf on both directions' egress "
            f"(burst {TBF_BURST_BYTES} B, latency {TBF_LATENCY_MS} ms)",
            "rates_bit_per_s": rates,
            "raw_clients": RAW_CLIENTS,
            "raw_seconds": raw_seconds,
            "hierarchy_seconds": hier_seconds,
            "views": m.views,
            "input_shape": list(m.input_shape),
            "model": f"{m.name}:{m.version}",
            "stale_namespaces_removed": stale,
        },
        "rates": measured,
        "ratios": ratios,
        "aims": aims,
        "machine": machine(),
        "note": "raw_8bit sends the present views as 8-bit images to a relay beside the cloud "
        "(the cloud's {name}-full takes FP32 only); raw_fp32 sends the FP32 request the cloud "
        "takes. The hierarchy's fps is capped by its offered rate: a ratio is a lower bound "
        "when achieved equals offered; link_bound_fps is the rate over the measured uplink "
        "bytes on the wire per frame.",
    }
    write_json(out_dir, NAME, result)
    _plot(out_dir, measured)
    return result


def _plot(out_dir: Path, measured: dict) -> None:
    plt = pyplot()
    kinds = [("raw_fp32", "raw offload (FP32)", "tab:red"),
             ("raw_8bit", "raw offload (8-bit)", "tab:orange"),
             ("hierarchy", "DDNN hierarchy", "tab:green"),
             ("hierarchy_no_local_exit", "DDNN, no local exit", "tab:olive"),
             ("hierarchy_gateway", "DDNN behind a gateway", "tab:blue")]
    labels = list(measured)
    x = np.arange(len(labels))
    w = 0.16
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (kind, name, color) in enumerate(kinds):
        fps = [measured[lab][kind]["fps"] for lab in labels]
        bars = axes[0].bar(x + (i - (len(kinds) - 1) / 2) * w, fps, w, label=name, color=color)
        axes[0].bar_label(bars, fmt="%.1f", fontsize=8)
        lat = [measured[lab][kind]["latency_ms"] or {"p50": 0, "p99": 0} for lab in labels]
        p50 = np.array([v["p50"] for v in lat])
        p99 = np.array([v["p99"] for v in lat])
        axes[1].bar(x + (i - (len(kinds) - 1) / 2) * w, p50, w, label=name, color=color,
                    yerr=[np.zeros_like(p99), p99 - p50], capsize=3)
    axes[0].set(title="frames per second (uplink shaped with tbf)", yscale="log",
                xticks=x, xticklabels=labels, ylabel="frames/s")
    axes[1].set(title="latency p50 (bar) to p99 (whisker)", yscale="log",
                xticks=x, xticklabels=labels, ylabel="ms")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / f"{NAME}.png", dpi=110)
    plt.close(fig)
