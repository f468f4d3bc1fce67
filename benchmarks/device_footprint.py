"""Device footprint: segment size, per-frame latency on one thread, agent memory, no torch.

Baselines in the same run: the raw 8-bit image a device would otherwise send, and the resident
memory of a bare Python process that imports torch (what the agent would cost with torch).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.runtime import BundleRuntime
from ddnn.tools.broker import start_broker


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _mapped_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _watch(proc: subprocess.Popen) -> tuple[int, bool]:
    """Peak resident memory (KiB) and whether torch was ever mapped, sampled until exit."""
    peak, torch_seen = 0, False
    while proc.poll() is None:
        try:
            peak = max(peak, _peak_rss_kib(proc.pid))
            torch_seen = torch_seen or _mapped_torch(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.05)
    return peak, torch_seen


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    b = load_bundle(bundle)
    m = b.manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    rt = BundleRuntime(b, threads=1)
    frames = ds.X[: (50 if quick else 300), 0]
    rt.device(0, frames[:1])  # session creation and first-run allocation are not per frame
    times = []
    for x in frames:
        start = time.perf_counter()
        rt.device(0, x[None])
        times.append((time.perf_counter() - start) * 1e3)

    n = 50 if quick else 300
    with start_broker() as broker:
        agent = subprocess.Popen(
            [sys.executable, "-m", "ddnn", "device", "--bundle", str(bundle), "--broker",
             broker.url, "--view", "0", "--data", str(data), "--fps", "200", "--limit", str(n),
             "--grace", "0.5", "--threads", "1", "--wait-peers", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        agent_rss, agent_torch = _watch(agent)
    torch_proc = subprocess.Popen([sys.executable, "-c", "import torch, time; time.sleep(1)"])
    torch_rss, _ = _watch(torch_proc)

    seg = m.devices[0]
    result = {
        "segment_file_bytes": (bundle / seg.file).stat().st_size,
        "per_frame_ms_one_thread": {"p50": statistics.median(times),
                                    "p99": float(np.percentile(times, 99))},
        "agent_peak_rss_mib": agent_rss / 1024,
        "agent_imported_torch": agent_torch,
        "baseline_python_with_torch_rss_mib": torch_rss / 1024,
        "raw_frame_bytes": int(np.prod(m.input_shape)),
        "ratios": {"torch_process_over_agent_rss": torch_rss / max(agent_rss, 1)},
    }
    write_json(out_dir, "device_footprint", result)
    return result
