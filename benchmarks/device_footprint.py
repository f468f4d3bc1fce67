"""Device footprint: segment size, per-frame latency on one thread, agent memory, no torch.

Baselines in the same run: the raw 8-bit image a device would otherwise send; the floor of the
agent's memory, a process that only imports numpy, ONNX Runtime and paho (``floor_imports``) and
one that also runs the device segment once in its one-thread session (``floor_session``); a bare
Python process that imports torch (what the agent would cost with torch); and, with
``DDNN_FOOTPRINT_BASELINE=REV``, the agent of that git revision (before a change, after it).
The agent replays view 0 of the test file from a wheel installed with the device extra alone
in a fresh venv: on this machine and, when ``make test-arm64`` has built the emulated arm64
userland (benchmarks/arm64.py; root only), on aarch64 too. Under qemu a process's resident
memory also holds the emulator (its translated-code cache and heap): ``peak_guest_mib`` is what
the program itself maps, what a board would hold, read from the process's smaps.

The agent's own per-frame cost (everything but the model: reading the view, the codec, the
envelope, publishing) is its process's CPU time per frame, replaying at full speed into the
broker, less the model's; on aarch64 it is reported, not compared with a board (emulation says
little of one's speed). Whether the emulated agent keeps a 10 fps camera is counted as frames
delivered against frames skipped (``--fps 10``, the default ``--max-lag-ms``).

Each preset (``ddnn.models.presets.PRESETS``, whatever it holds) is trained small (its size and
speed do not depend on accuracy) and checked against the device budget
(:mod:`ddnn.benchmarks.device_budget`), one pass/fail per budget line.
"""

from __future__ import annotations

import hashlib
import json
import os
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

from ddnn.benchmarks.common import ddnn, write_json
from ddnn.benchmarks.device_budget import BUDGET
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
# The agent's cost per frame, in the process of the interpreter under test: the service
# replays view 0 at full speed into the broker (every message published and acknowledged),
# ``repeats`` times; CPU time counts every thread (paho's, the sender's). The model alone, on
# the frames that run it, is timed the same way in the same process.
AGENT_COST = """
import json, sys, threading, time
from pathlib import Path
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
bundle, data, broker, frames, repeats = sys.argv[1:6]
settings = DeviceSettings(bundle=Path(bundle), view=0, broker=broker, deployment="footprint",
                          data=Path(data), limit=int(frames), fps=0, grace=0, wait_peers=0,
                          threads=1, no_spool=True)
runs = []
with DeviceService.from_settings(settings) as service:
    replay = list(service.source)
    present = [image for _, image in replay if image.any()]
    runtime = service.agent.runtime
    for _ in range(int(repeats)):
        cpu = time.process_time()
        for image in present:
            runtime.device_outputs(0, image[None])
        model = (time.process_time() - cpu) / len(present)
        cpu, wall = time.process_time(), time.perf_counter()
        service.agent.replay(replay, threading.Event())
        service.drain(60)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        runs.append({"agent_cpu_ms": cpu / len(replay) * 1e3, "wall_ms": wall / len(replay) * 1e3,
                     "model_cpu_ms": model * 1e3, "present_share": len(present) / len(replay)})
print(json.dumps(runs), flush=True)
"""
# The agent's last line: how many frames it saw, how many it skipped to stay current.
DONE = re.compile(r"done: (\d+) frames \((\d+) absent, (\d+) skipped")
# Held until told to stop, so that its memory is read at a known point.
HOLD = "\nprint('ready', flush=True)\nsys.stdin.read()"
QEMU_OWN = ("[heap]", "[stack]", "[vdso]", "[vvar]", "[vsyscall]")
REPO = Path(__file__).resolve().parents[1]
# Where the measured processes start: in the repository, `python -m ddnn` would import the
# source folder ddnn/ instead of the wheel under test.
AWAY = tempfile.gettempdir()
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
                                stdout=subprocess.PIPE, stderr=errors, text=True, cwd=AWAY)
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
        [*python, "-m", "ddnn", "device", "--bundle", str(bundle.resolve()), "--broker", broker,
         "--view", "0", "--data", str(data.resolve()), "--fps", "200", "--limit", str(frames),
         "--grace", "0.5", "--threads", "1", "--wait-peers", "0", "--max-lag-ms", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=AWAY,
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
           "floor_session": floor(python, FLOOR_SESSION, [str(bundle.resolve())], emulated),
           "agent": agent(python, bundle, data, broker, frames, emulated)}
    out["agent_over_floor_mib"] = round(out["agent"][key] - out["floor_session"][key], 1)
    return out


def wheels(work: Path) -> dict[str, Path]:
    """A wheel of this working tree and, with ``DDNN_FOOTPRINT_BASELINE=REV``, one of that git
    revision: the agent before and after a change, measured in the same run."""
    builds = {"this_tree": REPO}
    rev = os.environ.get("DDNN_FOOTPRINT_BASELINE")
    if rev:
        src = work / "baseline-src"
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        builds[f"baseline_{rev}"] = src
    out = {}
    for name, src in builds.items():
        dest = work / "wheels" / name
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w",
                        str(dest)], check=True)
        out[name] = next(dest.glob("ddnn-*.whl"))
    return out


def agent_cost(python: Sequence[str], bundle: Path, data: Path, broker: str, frames: int,
               repeats: int) -> dict:
    """The agent's CPU per frame (``AGENT_COST``), the model's, and the rest: the agent's own
    cost. Medians of ``repeats`` replays of ``frames`` frames, in ms."""
    done = subprocess.run([*python, "-c", AGENT_COST, str(bundle.resolve()),
                           str(data.resolve()), broker, str(frames), str(repeats)],
                          capture_output=True, text=True, cwd=AWAY)
    if done.returncode != 0:
        raise RuntimeError(f"the agent's cost could not be measured: {done.stderr[-2000:]}")
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return {**cost_medians(runs), "frames": frames, "repeats": repeats}


def cost_medians(runs: list[dict]) -> dict:
    """The medians over ``AGENT_COST``'s runs, with the agent's own cost: its CPU less the
    model's on the frames that had a view."""
    for r in runs:
        r["own_cpu_ms"] = r["agent_cpu_ms"] - r["model_cpu_ms"] * r["present_share"]
    out = {k: round(statistics.median(r[k] for r in runs), 4)
           for k in ("agent_cpu_ms", "own_cpu_ms", "model_cpu_ms", "wall_ms")}
    # A difference of two CPU times: where the model's dominates (pi under emulation), their
    # noise exceeds the agent's own cost, and a negative difference is no measurement (None).
    if out["own_cpu_ms"] < 0:
        out["own_cpu_ms"] = None
    return out


def keeps_up(python: Sequence[str], bundle: Path, data: Path, broker: str, frames: int,
             fps: float = 10.0) -> dict:
    """``ddnn device`` replaying ``frames`` frames at ``fps`` with the default ``--max-lag-ms``:
    how many it delivered and how many it skipped to stay current."""
    done = subprocess.run(
        [*python, "-m", "ddnn", "device", "--bundle", str(bundle.resolve()), "--broker", broker,
         "--view", "0", "--data", str(data.resolve()), "--fps", str(fps), "--limit", str(frames),
         "--grace", "0.5", "--threads", "1", "--wait-peers", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=AWAY)
    found = DONE.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"the device agent exited with {done.returncode}: "
                           f"{done.stderr[-2000:]}")
    seen, absent, skipped = map(int, found.groups())
    return {"fps": fps, "frames": seen, "absent": absent, "skipped": skipped,
            "delivered": seen - skipped, "delivered_share": round((seen - skipped) / seen, 4)}


def figures(python: Sequence[str], bundle: Path, data: Path, broker: str, frames: int,
            emulated: bool = False, with_memory: bool = True) -> dict:
    """Memory (unless not ``with_memory``), per-frame cost and the 10 fps check of one
    interpreter's agent. Under emulation a replay is shorter: each frame costs ~80 times more."""
    out = memory(python, bundle, data, broker, frames, emulated) if with_memory else {}
    return {**out, "per_frame": agent_cost(python, bundle, data, broker, frames // 3 if emulated
                                           else frames, 3 if emulated else 5),
            "ten_fps": keeps_up(python, bundle, data, broker, 100 if emulated else 50)}


def host_venvs(wheels: dict[str, Path]) -> dict[str, list[str]]:
    """Each wheel in a fresh venv with the device extra alone (as on a board: no torch, no
    other tier's packages); its interpreter."""
    out = {}
    for name, wheel in wheels.items():
        venv = wheel.parent / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q",
                        f"{wheel}[device]"], check=True)
        out[name] = [str(venv / "bin/python")]
    return out


def arm64_figures(wheels: dict[str, Path], bundle: Path, data: Path, broker: str, frames: int,
                  presets: dict[str, Path]) -> tuple[dict, dict[str, float]]:
    """:func:`figures` in the emulated arm64 userland, each wheel installed there in turn, and
    the peak memory (what the program maps) of this tree's agent with each preset's bundle."""
    from ddnn.benchmarks.arm64 import VENV, Userland

    userland = Userland()
    why = userland.host_problem(install=False)
    if why is None and not userland.built:
        why = "no arm64 userland yet: `make test-arm64` builds it"
    if why:
        return {"skipped": why}, {}
    with tempfile.TemporaryDirectory(prefix="ddnn-footprint-") as tmp:
        work = Path(tmp)  # under /tmp: bound into the userland's own /tmp, nothing left there
        shutil.copytree(bundle, work / "bundle")
        shutil.copy2(data, work / "data.npz")
        for name, path in presets.items():
            shutil.copytree(path, work / "presets" / name)
        python = userland.command([f"{VENV}/bin/python"], binds=[work])
        out, per_preset = {}, {}
        # This tree last: the preset bundles run on what it installed. (An older commit's
        # memory under emulation is left out: minutes of emulated start-ups.)
        for name, wheel in sorted(wheels.items(), key=lambda kv: kv[0] == "this_tree"):
            userland.install(wheel)
            out[name] = figures(python, work / "bundle", work / "data.npz", broker, frames,
                                emulated=True, with_memory=name == "this_tree")
        for name in presets:
            per_preset[name] = agent(python, work / "presets" / name, work / "data.npz", broker,
                                     frames, emulated=True)["peak_guest_mib"]
        return out, per_preset


def preset_bundles(work: Path, quick: bool = False) -> dict[str, Path]:
    """A bundle of every preset, trained small on a small generated set (cached by the preset's
    fields: a changed preset is trained again)."""
    from ddnn.models.presets import PRESETS

    work.mkdir(parents=True, exist_ok=True)
    train = work / "train.npz"
    if not train.exists():
        ddnn("data", "synth", "--out", str(train), "--samples", "200", "--seed", "3",
             quiet=True)
    out = {}
    for name, preset in PRESETS.items():
        key = hashlib.sha256(repr(sorted(preset.fields.items())).encode()).hexdigest()[:8]
        bundle = work / f"{name}-{key}"
        if not (bundle / "manifest.json").exists():
            ddnn("train", "--preset", name, "--data", str(train), "--out", str(bundle),
                 "--name", "mvmc", "--epochs", "1" if quick else "2", "--no-progress",
                 quiet=True)
        out[name] = bundle
    return out


def segment_times(bundle: Path, frames: np.ndarray) -> list[float]:
    """Milliseconds per frame of view 0's device segment in a one-thread session."""
    rt = BundleRuntime(load_bundle(bundle), threads=1)
    rt.device(0, frames[:1])  # session creation and first-run allocation are not per frame
    times = []
    for x in frames:
        start = time.perf_counter()
        rt.device(0, x[None])
        times.append((time.perf_counter() - start) * 1e3)
    return times


def against_budget(figures: dict) -> dict:
    """Each budget line's figure, limit and pass/fail (None: not measured here)."""
    return {b.key: {"value": figures.get(b.key), "limit": b.limit, "unit": b.unit,
                    "pass": b.passes(figures.get(b.key))} for b in BUDGET}


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    b = load_bundle(bundle)
    m = b.manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    frames = ds.X[: (50 if quick else 300), 0]
    times = segment_times(bundle, frames)
    presets = preset_bundles(bundle.parent / "presets", quick)
    preset_times = {name: statistics.median(segment_times(path, frames))
                    for name, path in presets.items()}
    del ds, frames

    n = 50 if quick else 300
    with tempfile.TemporaryDirectory(prefix="ddnn-footprint-") as tmp, start_broker() as broker:
        built = wheels(Path(tmp))
        venvs = host_venvs(built)
        host = {name: figures(python, bundle, data, broker.url, n)
                for name, python in venvs.items()}
        tree = venvs["this_tree"]
        preset_host = {name: {"rss": agent(tree, path, data, broker.url, n)["peak_rss_mib"],
                              "cost": agent_cost(tree, path, data, broker.url, n, 3)}
                       for name, path in presets.items()}
        arm64, preset_arm64 = arm64_figures(built, bundle, data, broker.url, n, presets)
    torch_proc = subprocess.Popen([sys.executable, "-c", "import torch, time; time.sleep(1)"])
    torch_watch = MemoryWatch(torch_proc).start()
    torch_proc.wait()
    torch_rss = torch_watch.stop()["peak_rss_mib"]

    seg = m.devices[0]
    agent_rss = host["this_tree"]["agent"]["peak_rss_mib"]
    per_preset = {}
    for name, path in presets.items():
        manifest = load_bundle(path).manifest
        measured = {
            "segment_ms": round(preset_times[name], 4),
            "agent_ms": preset_host[name]["cost"]["agent_cpu_ms"],
            "rss_x86_mib": preset_host[name]["rss"],
            "rss_aarch64_mib": preset_arm64.get(name),
            "segment_file_bytes": max((path / d.file).stat().st_size
                                      for d in manifest.devices),
        }
        per_preset[name] = {"budget": against_budget(measured),
                            "own_cpu_ms": preset_host[name]["cost"]["own_cpu_ms"]}
    result = {
        "segment_file_bytes": (bundle / seg.file).stat().st_size,
        "per_frame_ms_one_thread": {"p50": statistics.median(times),
                                    "p99": float(np.percentile(times, 99))},
        "agent_peak_rss_mib": agent_rss,
        "agent_imported_torch": host["this_tree"]["agent"]["imported_torch"],
        "memory": {platform.machine(): host, "aarch64_emulated": arm64},
        "presets": per_preset,
        "baseline_python_with_torch_rss_mib": torch_rss,
        "raw_frame_bytes": int(np.prod(m.input_shape)),
        "ratios": {"torch_process_over_agent_rss": torch_rss / max(agent_rss, 1)},
    }
    for where, measured in (("x86", host), ("aarch64", arm64)):
        base = next((v for k, v in measured.items() if k.startswith("baseline_")), None)
        if base is not None:
            now, before = (x["per_frame"]["own_cpu_ms"] for x in (measured["this_tree"], base))
            if now and before:  # (None: not resolved, see agent_cost)
                result["ratios"][f"own_cost_this_tree_over_baseline_{where}"] = round(
                    now / before, 3)
    write_json(out_dir, "device_footprint", result)
    return result
