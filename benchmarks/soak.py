"""Soak: the full hierarchy at a steady rate for minutes, with every process's memory sampled.

A broker, the cloud, the edge and one device per view run as ``ddnn`` processes (as in
``ddnn demo``). The devices replay the test file, repeated as often as the run needs (frames
numbered on), at a steady frame rate; the resident memory of every process is read from
``/proc`` once a second, and every frame's outcome (its exit tier, degraded or not, or no
result) is recorded. Not part of the test suite:

    python -m ddnn.benchmarks.soak --bundle B --data D --out docs/benchmarks [--minutes 5] [--quick]

writes ``soak.json`` (per-process RSS series with start, end and growth, per-frame outcomes,
counts) and ``soak.png`` (RSS over time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ddnn.benchmarks.common import pyplot

DEPLOYMENT = "soak"


def rss_mib(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB, from /proc (None once it has exited)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False, minutes: float = 5.0,
        fps: float = 10.0, logs_dir: Path | None = None) -> dict:
    import numpy as np

    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.tools.broker import free_port, start_broker
    from ddnn.tools.demo import Processes, _wait_http

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seconds = 30.0 if quick else minutes * 60
    m = load_bundle(bundle).manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    frames = int(seconds * fps)
    # Logs and the replay file are working data (hundreds of MB), kept out of the docs.
    logs = Path(logs_dir) if logs_dir else Path("runs/soak")
    logs.mkdir(parents=True, exist_ok=True)
    # The replay file, the test file repeated to the run's length (one device process each).
    idx = np.arange(frames) % ds.num_samples
    data = logs / "soak.npz"
    np.savez(data, X=ds.X[idx], y=ds.y[idx], label=ds.label[idx])
    n_file = frames
    results_path = logs / "results.jsonl"
    results_path.unlink(missing_ok=True)
    procs = Processes(logs)
    broker = start_broker()
    samples: dict[str, list[tuple[float, float]]] = {}
    t0 = time.monotonic()
    try:
        cloud_port, edge_port = free_port(), free_port()
        cloud = procs.start("cloud", "cloud", "--bundle", str(bundle), "--port", str(cloud_port))
        _wait_http(f"http://127.0.0.1:{cloud_port}/v2/health/ready", cloud)
        edge = procs.start("edge", "edge", "--bundle", str(bundle), "--broker", broker.url,
                           "--cloud", f"http://127.0.0.1:{cloud_port}", "--deployment",
                           DEPLOYMENT, "--http-port", str(edge_port), "--results-out",
                           str(results_path))
        _wait_http(f"http://127.0.0.1:{edge_port}/healthz", edge)
        for view in range(m.views):
            procs.start(f"device-{view}", "device", "--bundle", str(bundle), "--broker",
                        broker.url, "--view", str(view), "--data", str(data), "--fps", str(fps),
                        "--limit", str(min(frames, n_file)), "--deployment", DEPLOYMENT,
                        "--wait-peers", "60")
        watched = {"broker": broker.proc.pid, **{n: p.pid for n, p in procs.children}}
        t0 = time.monotonic()
        budget = min(frames, n_file) / fps + 60
        while time.monotonic() - t0 < budget:
            now = time.monotonic() - t0
            for name, pid in watched.items():
                r = rss_mib(pid)
                if r:  # None once exited, 0 for a zombie
                    samples.setdefault(name, []).append((round(now, 2), round(r, 2)))
            devices_done = all(p.poll() is not None for n, p in procs.children
                               if n.startswith("device"))
            if devices_done:
                break
            time.sleep(1.0)  # the sampling period
        edge_metrics = _metrics(f"http://127.0.0.1:{edge_port}/metrics")
    finally:
        procs.stop_all()
        broker.stop()
    results = [json.loads(line) for line in results_path.read_text().splitlines()
               if line.endswith("}")] if results_path.exists() else []
    sent = min(frames, n_file)
    outcome: dict[int, str] = {i: "lost" for i in range(sent)}
    for r in results:
        outcome[r["frame"]] = f"{r['exit']}{' (degraded)' if r['degraded'] else ''}"
    counts: dict[str, int] = {}
    for v in outcome.values():
        counts[v] = counts.get(v, 0) + 1
    rss = {}
    for name, s in samples.items():
        # Growth from the first sample after start-up (imports, model loading) to the last.
        warm = next((v for t, v in s if t >= 5.0), s[0][1]) if s else 0.0
        if s:
            rss[name] = {"start_mib": warm, "end_mib": s[-1][1], "max_mib": max(v for _, v in s),
                         "growth_mib": round(s[-1][1] - warm, 2), "series": s}
    result = {
        "frames_sent": sent, "fps": fps, "seconds": round(time.monotonic() - t0, 1),
        "answered": len({r["frame"] for r in results}), "duplicates": len(results) -
        len({r["frame"] for r in results}), "outcomes": counts, "rss": rss,
        "edge_dropped": {k: v for k, v in edge_metrics.items() if "dropped" in k},
        "frame_outcomes": [outcome[i] for i in range(sent)],
        "summary": {name: f"{v['start_mib']:.0f} -> {v['end_mib']:.0f} MiB"
                    for name, v in rss.items()},
    }
    (out_dir / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(out_dir / "soak.png", rss)
    return result


def _metrics(url: str) -> dict[str, float]:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


def _plot(path: Path, rss: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, v in sorted(rss.items()):
        t, mib = zip(*v["series"], strict=True)
        ax.plot(t, mib, label=name)
    ax.set(title="resident memory during the soak", xlabel="seconds", ylabel="RSS (MiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddnn.benchmarks.soak", description=__doc__)
    p.add_argument("--bundle", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--fps", type=float, default=10.0)
    p.add_argument("--logs", default="runs/soak", help="process logs and the replay file")
    p.add_argument("--quick", action="store_true", help="30 seconds")
    args = p.parse_args(argv)
    r = run(Path(args.out), Path(args.bundle), Path(args.data), args.quick, args.minutes,
            args.fps, logs_dir=Path(args.logs))
    print(json.dumps({k: r[k] for k in ("frames_sent", "answered", "outcomes", "summary")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
