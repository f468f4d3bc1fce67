"""Device footprint: segment size, per-frame latency on one thread, agent memory, no torch.

Baselines in the same run: the raw 8-bit image a device would otherwise send; the floor of the
agent's memory, a process that only imports numpy, ONNX Runtime and paho (``imports``) and one
that also runs the device segment once in its one-thread session (``session``); and a bare
Python process that imports torch (what the agent would cost with torch). The agent replays a
view of the test file. Memory is measured on this machine and, when ``make test-arm64`` has built
the emulated arm64 userland (benchmarks/arm64.py, root only), on aarch64 too, with the same
wheel of this working tree. Under qemu a process's resident memory also holds the emulator (its
translated-code cache and heap): ``guest`` is what the program itself maps, what a board would
hold, read from the process's smaps. Per-frame times under emulation say nothing about a board
and are not taken there.
"""

from __future__ import annotations

import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.runtime import BundleRuntime
from ddnn.tools.broker import start_broker

FLOOR_IMPORTS = "import numpy, onnxruntime, paho.mqtt.client"
# The device segment in one session of one thread, run once: what any agent must hold.
FLOOR_SESSION = FLOOR_IMPORTS + """
import sys
from ddnn.bundle import load_bundle
from ddnn.runtime import BundleRuntime
rt = BundleRuntime(load_bundle(sys.argv[1]), threads=1)
rt.device(0, numpy.zeros((1, *rt.manifest.input_shape), numpy.float32))"""
# Held until told to stop, so that its memory is read at a known point.
HOLD = "\nprint('ready', flush=True)\nsys.stdin.read()"
QEMU_OWN = ("[heap]", "[stack]", "[vdso]", "[vvar]", "[vsyscall]")
HOST_SPACE = 0x7F00_0000_0000  # qemu-user maps its own memory up here, the guest's far below


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def guest_rss_kib(pid: int) -> int:
    """Resident memory of what an emulated (qemu-user) program maps itself, in KiB.

    qemu's own memory is left out: its translated-code cache (anonymous and executable: guest
    code is never executed in place), heap, stack, binary, and what it maps for itself at the
    top of the address space, above the guest's.
    """
    total, own = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"([0-9a-f]+)-[0-9a-f]+ (\S+) \S+ \S+ \S+\s*(.*)$", line)
        if head:
            start, perms, name = int(head[1], 16), head[2], head[3]
            own = (start >= HOST_SPACE or name in QEMU_OWN or "qemu" in name
                   or ("x" in perms and not name))
        elif line.startswith("Rss:") and not own:
            total += int(line.split()[1])
    return total


class MemoryWatch:
    """Peak resident memory of a running process, sampled until it exits (or :meth:`stop`)."""

    def __init__(self, proc: subprocess.Popen, emulated: bool = False, every: float = 0.05):
        self.proc, self.emulated, self.every = proc, emulated, every
        self.peak_kib = self.guest_kib = 0
        self.torch = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        pid = self.proc.pid
        self.peak_kib = max(self.peak_kib, _status_kib(pid, "VmHWM"))
        if self.emulated:
            self.guest_kib = max(self.guest_kib, guest_rss_kib(pid))
        self.torch = self.torch or "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    def _run(self) -> None:
        while self.proc.poll() is None and not self._stop.is_set():
            try:
                self.sample()
            except (FileNotFoundError, ProcessLookupError, ValueError):
                break
            self._stop.wait(self.every)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.result()

    def result(self) -> dict:
        out = {"peak_rss_mib": round(self.peak_kib / 1024, 1)}
        if self.emulated:
            out["peak_guest_mib"] = round(self.guest_kib / 1024, 1)
        return out


def floor(python: Sequence[str], code: str, args: Sequence[str] = (), emulated: bool = False
          ) -> dict:
    """Memory of ``python -c code args`` once it says it is ready."""
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([*python, "-c", code + HOLD, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                proc.wait()
                errors.seek(0)
                raise RuntimeError(f"{code.splitlines()[0]!r} failed: {errors.read()[-2000:]}")
            watch = MemoryWatch(proc, emulated)
            watch.sample()
            return watch.result()
        finally:
            proc.stdin.close()
            proc.wait(60)


def agent(python: Sequence[str], bundle: Path, data: Path, broker: str, frames: int,
          emulated: bool = False) -> dict:
    """Peak memory of ``ddnn device`` replaying ``frames`` frames of view 0 of ``data``."""
    proc = subprocess.Popen(
        [*python, "-m", "ddnn", "device", "--bundle", str(bundle), "--broker", broker,
         "--view", "0", "--data", str(data), "--fps", "200", "--limit", str(frames),
         "--grace", "0.5", "--threads", "1", "--wait-peers", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    watch = MemoryWatch(proc, emulated).start()
    code = proc.wait()
    result = watch.stop()
    if code != 0:
        raise RuntimeError(f"the device agent exited with {code}")
    return {**result, "imported_torch": watch.torch}


def memory(python: Sequence[str], bundle: Path, data: Path, broker: str, frames: int,
           emulated: bool = False) -> dict:
    """The agent's memory beside its two floors, with one interpreter."""
    key = "peak_guest_mib" if emulated else "peak_rss_mib"
    out = {"floor_imports": floor(python, FLOOR_IMPORTS, emulated=emulated),
           "floor_session": floor(python, FLOOR_SESSION, [str(bundle)], emulated),
           "agent": agent(python, bundle, data, broker, frames, emulated)}
    out["agent_over_floor_mib"] = round(out["agent"][key] - out["floor_session"][key], 1)
    return out


def arm64_memory(bundle: Path, data: Path, broker: str, frames: int) -> dict:
    """:func:`memory` in the emulated arm64 userland, with a wheel of this working tree."""
    from ddnn.benchmarks.arm64 import VENV, Userland

    userland = Userland()
    why = userland.host_problem(install=False)
    if why is None and not userland.built:
        why = "no arm64 userland yet: `make test-arm64` builds it"
    if why:
        return {"skipped": why}
    with tempfile.TemporaryDirectory(prefix="ddnn-footprint-") as tmp:
        work = Path(tmp)
        root = Path(__file__).resolve().parents[1]
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(root),
                        "-w", str(work)], check=True)
        userland.install(next(work.glob("ddnn-*.whl")))
        shutil.copytree(bundle, work / "bundle")
        shutil.copy2(data, work / "data.npz")
        python = userland.command([f"{VENV}/bin/python"], binds=[work])
        return memory(python, work / "bundle", work / "data.npz", broker, frames, emulated=True)


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
    del ds, frames

    n = 50 if quick else 300
    with start_broker() as broker:
        host = memory([sys.executable], bundle, data, broker.url, n)
        arm64 = arm64_memory(bundle, data, broker.url, n)
    torch_proc = subprocess.Popen([sys.executable, "-c", "import torch, time; time.sleep(1)"])
    torch_watch = MemoryWatch(torch_proc).start()
    torch_proc.wait()
    torch_rss = torch_watch.stop()["peak_rss_mib"]

    seg = m.devices[0]
    agent_rss = host["agent"]["peak_rss_mib"]
    result = {
        "segment_file_bytes": (bundle / seg.file).stat().st_size,
        "per_frame_ms_one_thread": {"p50": statistics.median(times),
                                    "p99": float(np.percentile(times, 99))},
        "agent_peak_rss_mib": agent_rss,
        "agent_imported_torch": host["agent"]["imported_torch"],
        "memory": {platform.machine(): host, "aarch64_emulated": arm64},
        "baseline_python_with_torch_rss_mib": torch_rss,
        "raw_frame_bytes": int(np.prod(m.input_shape)),
        "ratios": {"torch_process_over_agent_rss": torch_rss / max(agent_rss, 1)},
    }
    write_json(out_dir, "device_footprint", result)
    return result
