"""Cloud service throughput and latency, with dynamic batching on and off, against the limit.

One run, one model: the real server (``ddnn cloud`` in a subprocess on a free loopback port) is
driven by a bounded closed-loop load generator — ``c`` clients, each sending one-sample binary
requests back to back over a keep-alive connection for a fixed time — at concurrency 1, 16 and
64, once with dynamic batching and once without (the plain one-request-one-run endpoint). The
limit is in-process ONNX Runtime running the same model's ``predict`` on batches of the same
sizes, measured in the same run. Results are medians over repeats; nothing is asserted.

    ddnn bench --only cloud_throughput [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ddnn import oip
from ddnn.benchmarks.common import pyplot, stop_process, write_json
from ddnn.tools.broker import free_port

CONCURRENCY = (1, 16, 64)
HOST = "127.0.0.1"


# --- a minimal HTTP/1.1 keep-alive client: the load generator must cost less than the server ---


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> _Connection:
        return cls(*await asyncio.open_connection(HOST, port))

    async def post(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                      if k.strip().lower() == "content-length")
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _http_request(port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {HOST}:{port}", f"Content-Length: {len(body)}",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _drive(port: int, request: bytes, concurrency: int, seconds: float
                 ) -> tuple[int, float, list[float]]:
    """Closed loop: ``concurrency`` clients for ``seconds``; (answers, elapsed, latencies)."""
    conns = [await _Connection.open(port) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    deadline = start + seconds

    async def client(conn: _Connection) -> None:
        nonlocal errors
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            status, _ = await conn.post(request)
            latencies.append(time.perf_counter() - t)
            errors += status != 200

    try:
        await asyncio.gather(*(client(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    if errors:
        raise RuntimeError(f"{errors} requests failed during the benchmark")
    return len(latencies), time.perf_counter() - start, latencies


def _stats(samples: int, elapsed: float, latencies: list[float]) -> dict:
    ms = np.asarray(latencies) * 1000.0
    return {"throughput": samples / elapsed, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "requests": len(latencies)}


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# --- the server under test ----------------------------------------------------------------------


def start_server(bundle: Path, port: int, batching: bool, ort_threads: int | None
                 ) -> subprocess.Popen:
    """``ddnn cloud`` serving ``bundle`` on a loopback ``port``, in a child process."""
    cmd = [sys.executable, "-m", "ddnn", "--log-level", "WARNING", "cloud", "--bundle",
           str(bundle), "--port", str(port), "--batching", str(batching).lower(),
           "--poll-interval", "0", "--max-batch-size", "64", "--max-queue-delay-ms", "2",
           "--ort-threads", str(ort_threads or "none")]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Poll the server's readiness route until it answers 200."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/v2/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)  # polling readiness
    raise RuntimeError("server not ready in time")



def _serve_and_drive(bundle: Path, model: str, sample: dict, batching: bool, seconds: float,
                     repeats: int, ort_threads: int | None) -> dict[int, dict]:
    port = free_port()
    body, headers = oip.encode_request(sample, binary=True, binary_outputs=True)
    request = _http_request(port, f"/v2/models/{model}/infer", body, headers)
    proc = start_server(bundle, port, batching, ort_threads)
    try:
        wait_ready(port, proc)
        asyncio.run(_drive(port, request, 16, min(seconds, 1.0)))  # warm-up
        return {c: _median([_stats(*asyncio.run(_drive(port, request, c, seconds)))
                            for _ in range(repeats)]) for c in CONCURRENCY}
    finally:
        stop_process(proc)


# --- the limit: in-process ONNX Runtime on the same batches -------------------------------------


def _in_process(bundle: Path, kind: str, sample: dict, seconds: float, ort_threads: int | None
                ) -> dict[int, dict]:
    from ddnn.bundle import load_bundle
    from ddnn.cloud.models import CloudModel, FullModel
    from ddnn.runtime import BundleRuntime

    runtime = BundleRuntime(load_bundle(bundle), threads=ort_threads)
    runtime.load_all()
    model = (CloudModel if kind == "cloud" else FullModel)(runtime)
    out = {}
    for b in CONCURRENCY:
        batch = {k: np.repeat(v, b, axis=0) for k, v in sample.items()}
        model.predict(batch)  # warm-up
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 5:
            t = time.perf_counter()
            model.predict(batch)
            times.append(time.perf_counter() - t)
        ms = np.asarray(times) * 1000.0
        out[b] = {"throughput": b / float(np.median(times)), "p50_ms": float(np.median(ms)),
                  "p99_ms": float(np.percentile(ms, 99)), "requests": len(times)}
    return out


def _sample(bundle: Path, kind: str) -> dict[str, np.ndarray]:
    from ddnn.bundle import load_bundle

    m = load_bundle(bundle).manifest
    rng = np.random.default_rng(0)
    if kind == "cloud":
        shape = (1, *m.cloud.inputs[0].sample_shape)
        return {"edge_features": np.sign(rng.standard_normal(shape)).astype(np.float32)}
    return {"views": rng.random((1, m.views, *m.input_shape), dtype=np.float32),
            "present": np.ones((1, m.views), bool)}


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(CONCURRENCY))
    series = [("in-process ORT (same batches)", "in_process", "tab:gray"),
              ("server, batching on", "batching", "tab:blue"),
              ("server, batching off", "no_batching", "tab:orange")]
    for i, (label, key, color) in enumerate(series):
        rows = [result["results"][key][str(c)] for c in CONCURRENCY]
        ax1.bar(x + (i - 1) * 0.27, [r["throughput"] for r in rows], 0.27, label=label,
                color=color)
        if key != "in_process":
            ax2.plot(CONCURRENCY, [r["p99_ms"] for r in rows], "o-", color=color,
                     label=f"{label}, p99")
            ax2.plot(CONCURRENCY, [r["p50_ms"] for r in rows], "x--", color=color,
                     label=f"{label}, p50")
    ax1.set(xticks=x, xticklabels=[str(c) for c in CONCURRENCY], xlabel="concurrent clients",
            ylabel="samples / s", yscale="log", title=f"{result['model']}: throughput")
    ax2.set(xlabel="concurrent clients", ylabel="latency (ms)", xscale="log", yscale="log",
            title="request latency")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, bundle: Path, quick: bool = False, kind: str = "full",
        ort_threads: int | None = 1) -> dict:
    """Benchmark ``{name}-{kind}`` of ``bundle``; writes ``cloud_throughput.json`` and a plot.

    ``ort_threads`` (ONNX Runtime intra-op threads) applies to the server and the in-process
    limit alike.
    """
    from ddnn.bundle import load_bundle

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bundle = Path(bundle)
    model = f"{load_bundle(bundle).manifest.name}-{kind}"
    seconds, repeats = (1.0, 1) if quick else (3.0, 3)
    sample = _sample(bundle, kind)
    results = {
        "in_process": _in_process(bundle, kind, sample, seconds, ort_threads),
        "batching": _serve_and_drive(bundle, model, sample, True, seconds, repeats, ort_threads),
        "no_batching": _serve_and_drive(bundle, model, sample, False, seconds, repeats,
                                        ort_threads),
    }
    results = {k: {str(c): v for c, v in r.items()} for k, r in results.items()}
    ratios = {str(c): {
        "batching_vs_in_process": results["batching"][str(c)]["throughput"]
        / results["in_process"][str(c)]["throughput"],
        "batching_vs_no_batching": results["batching"][str(c)]["throughput"]
        / results["no_batching"][str(c)]["throughput"],
    } for c in CONCURRENCY}
    result = {
        "benchmark": "cloud_throughput", "model": model, "bundle": str(bundle),
        "quick": quick, "seconds_per_point": seconds, "repeats": repeats,
        "request": "one sample per request, binary tensors in and out",
        "server": {"max_batch_size": 64, "max_queue_delay_ms": 2.0, "ort_threads": ort_threads,
                   "inference_threads": 1},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "results": results, "ratios": ratios,
    }
    write_json(out_dir, "cloud_throughput", result)
    # matplotlib comes with the train extra; the numbers stand without it.
    with contextlib.suppress(ImportError):
        _plot(result, out_dir / "cloud_throughput.png")
    return result
