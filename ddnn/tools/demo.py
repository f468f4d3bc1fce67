"""``ddnn demo``: the whole hierarchy on one machine, with no external services.

It trains a bundle on generated data when none is given, starts a broker (Mosquitto when
installed, else the embedded amqtt), the cloud service, the edge aggregator and one device
process per view, replays the test split, shows live progress, and ends with a summary of the
live hierarchy beside the offline evaluation. Every role runs as its own ``ddnn`` process, as it
would in a deployment; the demo only starts them, listens to the results topic and stops them.

It proves itself: every frame answered, each frame's live answer (tier and class) the one
``ddnn evaluate`` computes offline with the bundle's own thresholds, and every tier answering
some frames; ``--json`` prints the summary with these checks for a machine. The exit status is 1
when the hierarchy is wrong (a frame unanswered, a live answer not the offline one); a tier that
answers no frame is shown, not a failure: the bundle's own calibration decides it.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddnn.errors import ConfigError
from ddnn.tools.demo_report import offline_answers as _offline_answers
from ddnn.tools.demo_report import summary as _summary
from ddnn.tools.demo_report import table as _table
from ddnn.tools.demo_report import write_report as _write_report

DEPLOYMENT = "demo"
# The generated scene: each camera sees part of the object (`ddnn data synth --zoom 2`), so
# fusing views matters and the frames a local exit cannot settle go up to the edge and the
# cloud, which answers them from the cameras' detail. Five classes give the upper tiers work:
# with three, the edge answered 2 frames in 300 (README.md, "Quick start").
SCENE = ("--zoom", "2")
# The preset the demo trains: tiny's device leaves the upper tiers the frames it cannot settle,
# where the Pi-class presets' (pi, `ddnn train`'s default, and deep) settle most frames of the
# generated scenes themselves (their cloud would show nothing) and train longer
# (docs/training.md, "A Pi-class default").
DEMO_PRESET = "tiny"
# Half the preset's 60 epochs: training and replay within 300 s on 2 cores (on the default
# seeds: 55% local, 1% edge, 44% cloud, 0.970 accurate, 26x fewer uplink bytes than raw).
DEMO_EPOCHS = 30
# The checks whose failure fails the demo: what the hierarchy answers must be right. Which tiers
# answer is the calibration's choice (a deep device may take every frame itself).
CORRECTNESS = ("every_frame_answered", "live_equals_offline")


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole hierarchy locally: broker, cloud, edge, one device per view",
        description=__doc__,
        formatter_class=formatter,
    )
    p.add_argument(
        "--work", default="runs/demo", help="working directory (data, bundle, logs, report)"
    )
    p.add_argument("--bundle", default=None, help="use this bundle instead of training one")
    p.add_argument("--data", default=None, help="replay this test .npz instead of a generated one")
    p.add_argument("--train-samples", type=int, default=1500, help="generated training samples")
    p.add_argument("--frames", type=int, default=300, help="frames to replay (from the test file)")
    p.add_argument("--classes", type=int, default=5, help="object classes of the generated scene")
    p.add_argument("--views", type=int, default=6,
                   help="cameras of the generated scene (one device process each)")
    p.add_argument("--size", type=int, default=32, help="image side of the generated scene")
    p.add_argument(
        "--epochs", type=int, default=DEMO_EPOCHS, help="training epochs"
    )
    p.add_argument("--preset", default=DEMO_PRESET,
                   help="ddnn train's preset for the bundle it trains: tiny, pi, deep or paper "
                   "(tiny: its upper tiers answer the frames its device cannot settle; pi, "
                   "ddnn train's default, and deep settle most frames on the device and train "
                   "longer)")
    p.add_argument("--fps", type=float, default=25.0, help="replay rate of every device")
    p.add_argument("--mode", choices=["pull", "push"], default="pull", help="device feature mode")
    p.add_argument(
        "--broker", default=None, help="use this MQTT broker URL instead of starting one"
    )
    p.add_argument(
        "--broker-kind",
        choices=["auto", "mosquitto", "amqtt"],
        default="auto",
        help="which broker to start when --broker is not given (auto: Mosquitto when "
        "installed, else the embedded amqtt of `make setup`'s .venv-broker)",
    )
    p.add_argument("--cloud", default=None, help="use this cloud URL instead of starting one")
    p.add_argument(
        "--retrain", action="store_true", help="train again even if the work dir has a bundle"
    )
    p.add_argument("--seed", type=int, default=0, help="training seed (ddnn train --seed)")
    p.add_argument("--json", action="store_true",
                   help="print the summary and its checks as JSON on stdout (the table goes to "
                   "stderr)")
    p.set_defaults(func=run)


@dataclass
class Processes:
    """The child processes of the demo, stopped in reverse order of start."""

    logs: Path
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddnn", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children.append((name, proc))
        return proc

    def stop_all(self, timeout: float = 10.0) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.children):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Stages:
    """CPU seconds (this process and its finished children: the machine may be shared, so not
    wall time) and wall seconds of each stage of the demo, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        cpu, wall = _cpu_seconds(), time.monotonic()
        try:
            yield
        finally:
            took = self.seconds.setdefault(name, {"cpu_s": 0.0, "wall_s": 0.0})
            took["cpu_s"] = round(took["cpu_s"] + _cpu_seconds() - cpu, 2)
            took["wall_s"] = round(took["wall_s"] + time.monotonic() - wall, 2)


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its children that have ended."""
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                     resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ddnn(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddnn", *args])
    if proc.returncode != 0:
        raise ConfigError(f"`ddnn {' '.join(args[:2])}` failed with exit code {proc.returncode}")


def _recipe(args) -> dict:
    """What the work dir's generated test split and its bundle are made from."""
    scene = list(_scene(args))
    return {"test": {"scene": scene, "frames": args.frames},
            "bundle": {"scene": scene, "train_samples": args.train_samples,
                       "preset": args.preset, "epochs": args.epochs, "seed": args.seed}}


def _recorded(work: Path) -> dict:
    """The recipe the work dir's files were made from (empty: none recorded)."""
    try:
        recorded = json.loads((work / "recipe.json").read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _forget_stale(work: Path, before: dict, now: dict, parts: set[str]) -> bool:
    """Remove what the work dir holds of ``parts`` ("test", "bundle") from other options than
    ``now`` (a demo of before, other flags), so that it is made again; whether the bundle must
    be trained again."""
    if "test" in parts and before.get("test") != now["test"] and (work / "test.npz").exists():
        _say(f"{work}/test.npz was made with other options: generating it again")
        (work / "test.npz").unlink()
    if "bundle" not in parts or before.get("bundle") == now["bundle"]:
        return False
    (work / "train.npz").unlink(missing_ok=True)  # (a training of it may have stopped short)
    if (work / "bundle" / "manifest.json").exists():
        _say(f"{work}/bundle was trained with other options: training it again")
    return True


def _prepare(args, work: Path, stages: Stages) -> tuple[Path, Path]:
    """The bundle and test file to use, generating and training what is missing."""
    if not args.bundle:  # an unknown preset fails now, not after the data is generated
        from ddnn.models.presets import preset  # (boards install no ddnn.models: lazily)

        preset(args.preset)
    before, now = _recorded(work), _recipe(args)
    # Only what this run makes is checked and recorded: --data and --bundle leave the work
    # dir's own test split and bundle as they were.
    parts = {part for part, given in (("test", args.data), ("bundle", args.bundle)) if not given}
    retrain = _forget_stale(work, before, now, parts) or args.retrain
    made = _make(args, work, stages, retrain)
    made_now = {part: now[part] for part in parts}
    (work / "recipe.json").write_text(json.dumps({**before, **made_now}))  # once all is made
    return made


def _make(args, work: Path, stages: Stages, retrain: bool) -> tuple[Path, Path]:
    data = Path(args.data) if args.data else work / "test.npz"
    if not args.data and not data.exists():
        _say("generating the test split")
        with stages.stage("data"):
            _ddnn("data", "synth", "--out", str(data), "--samples", str(max(args.frames, 1)),
                  "--seed", "2", *_scene(args))
    if args.bundle:
        return Path(args.bundle), data
    bundle = work / "bundle"
    if (bundle / "manifest.json").exists() and not retrain:
        _say(f"reusing the bundle in {bundle} (--retrain to train again)")
        return bundle, data
    train = work / "train.npz"
    if not train.exists():
        _say("generating the training split")
        with stages.stage("data"):
            _ddnn("data", "synth", "--out", str(train), "--samples", str(args.train_samples),
                  "--seed", "1", *_scene(args))
    _say("training the DDNN (all exits jointly), exporting to ONNX, calibrating thresholds")
    with stages.stage("train"):  # (ddnn train exports to ONNX and calibrates too)
        _ddnn("train", "--data", str(train), "--out", str(bundle), "--name", "demo", "--seed",
              str(args.seed), "--preset", args.preset, "--epochs", str(args.epochs))
    return bundle, data


def _scene(args) -> tuple[str, ...]:
    """``ddnn data synth``'s options for the demo's scene."""
    return (*SCENE, "--classes", str(args.classes), "--views", str(args.views), "--size",
            str(args.size))


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"the process serving {url} exited with code {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.1)  # readiness poll
    raise ConfigError(f"{url} not ready after {timeout:.0f} s")


def _edge_payload_bytes(http: str) -> float | None:
    """Device payload bytes the edge counted, from its Prometheus metrics."""
    try:
        with urllib.request.urlopen(f"{http}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    pattern = r'^ddnn_edge_received_bytes_total\{[^}]*part="payload"[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


class ResultsListener:
    """Subscribes to the deployment's results and shows progress; keeps the first per frame."""

    def __init__(self, broker_url: str, frames: int):
        import paho.mqtt.client as mqtt
        from tqdm import tqdm

        from ddnn.plumbing.mqtt import BrokerUrl

        self.frames, self.results = frames, {}
        self.got_all = threading.Event()
        self._bar = tqdm(total=frames, desc="frames", unit="frame", file=sys.stderr,
                         mininterval=0.5)
        self._counts = {"local": 0, "edge": 0, "cloud": 0}
        url = BrokerUrl.parse(broker_url)
        self._client = c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                                       client_id="ddnn-demo-listener")
        c.on_message = self._on_message
        c.on_connect = lambda c, *_a: c.subscribe(f"ddnn/{DEPLOYMENT}/results", qos=1)
        if url.username:
            c.username_pw_set(url.username, url.password)
        if url.tls:
            c.tls_set()
        c.connect(url.host, url.port)
        c.loop_start()

    def _on_message(self, _client, _userdata, msg) -> None:
        from ddnn.result import Result, ResultError

        try:
            r = Result.from_json(msg.payload)
        except ResultError:
            return  # not ours to judge: the demo only counts what it can read
        if r.frame in self.results:
            return
        self.results[r.frame] = r.to_dict()
        self._counts[r.exit] += 1
        self._bar.update(1)
        self._bar.set_postfix(self._counts)
        if len(self.results) >= self.frames:
            self.got_all.set()

    def close(self) -> None:
        self._bar.close()
        self._client.loop_stop()
        self._client.disconnect()


def _start_cloud(procs: Processes, bundle_dir: Path, m) -> str:
    from ddnn.tools.broker import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = procs.start("cloud", "cloud", "--bundle", str(bundle_dir), "--host", "127.0.0.1",
                       "--port", str(port))
    _wait_http(f"{url}/v2/health/ready", proc)
    _say(f"cloud service ready on {url} (models {m.name}-cloud, {m.name}-full)")
    return url


def _start_edge(procs: Processes, bundle_dir: Path, broker_url: str, cloud_url: str,
                work: Path) -> str:
    from ddnn.tools.broker import free_port

    port = free_port()
    http = f"http://127.0.0.1:{port}"
    edge = procs.start("edge", "edge", "--bundle", str(bundle_dir), "--broker", broker_url,
                       "--cloud", cloud_url, "--deployment", DEPLOYMENT, "--http-port", str(port),
                       "--results-out", str(work / "results.jsonl"))
    # No --expect-frames: the edge keeps serving until the demo has read its metrics.
    _wait_http(f"{http}/healthz", edge)
    return http


def _start_devices(procs: Processes, args, bundle_dir: Path, broker_url: str, data_path: Path,
                   views: int, frames: int) -> None:
    _say(f"edge aggregator up; starting {views} device agents at {args.fps:g} fps")
    for view in range(views):
        procs.start(f"device-{view}", "device", "--bundle", str(bundle_dir), "--broker",
                    broker_url, "--view", str(view), "--data", str(data_path), "--fps",
                    str(args.fps), "--limit", str(frames), "--deployment", DEPLOYMENT, "--mode",
                    args.mode, "--wait-peers", "30",
                    # every frame, however late: the summary holds live answers against the
                    # offline evaluation of the same frames
                    "--max-lag-ms", "0")


def _run_hierarchy(args, work: Path, bundle_dir: Path, data_path: Path, m, n: int
                   ) -> tuple[dict[int, dict], float | None]:
    """Start broker, cloud, edge and devices; collect the results of ``n`` frames."""
    from ddnn.tools.broker import start_broker

    procs = Processes(work / "logs")
    broker = None
    try:
        broker_url = args.broker
        if not broker_url:
            broker = start_broker(prefer=args.broker_kind)
            broker_url = broker.url
            _say(f"started {broker.kind} on {broker_url}")
        cloud_url = args.cloud or _start_cloud(procs, bundle_dir, m)
        listener = ResultsListener(broker_url, n)
        edge_http = _start_edge(procs, bundle_dir, broker_url, cloud_url, work)
        _start_devices(procs, args, bundle_dir, broker_url, data_path, m.views, n)
        budget = n / max(args.fps, 1e-3) + 90
        if not listener.got_all.wait(budget):
            _say(f"warning: {len(listener.results)} of {n} frames answered after {budget:.0f} s;"
                 f" see the logs in {procs.logs}")
        listener.close()
        return listener.results, _edge_payload_bytes(edge_http)
    except KeyboardInterrupt:
        _say("interrupted: stopping every process")
        raise
    finally:
        procs.stop_all()
        if broker is not None:
            broker.stop()


def run(args) -> int:
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.hierarchy import hierarchy_predictions, summarize
    from ddnn.runtime import BundleRuntime

    work = Path(args.work)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stages = Stages()
    bundle_dir, data_path = _prepare(args, work, stages)
    bundle = load_bundle(bundle_dir)
    m = bundle.manifest
    ds = load_dataset(data_path, num_classes=m.num_classes)
    n = min(args.frames, ds.num_samples)
    sub = ds.subset(np.arange(n))
    _say(f"offline evaluation of {bundle.ref} on {n} frames (ONNX Runtime)")
    with stages.stage("offline"):
        exits = BundleRuntime(bundle).run_dataset(sub.X, sub.present)
        offline = summarize(exits, sub.label, sub.y, m, m.policy)
        classes, tiers = hierarchy_predictions(exits, m.policy, m.escalation_level)
        expected = _offline_answers(classes, tiers, sub.y)
    with stages.stage("replay"):  # broker, cloud, edge and devices, until they are stopped
        results, payload = _run_hierarchy(args, work, bundle_dir, data_path, m, n)
    summary = _summary(results, sub, offline, payload, m, expected)
    summary["stages"] = stages.seconds
    _say("")
    table = _table(summary)
    if args.json:
        _say(table)
        print(json.dumps(summary, indent=2))
    else:
        print(table)
    report = _write_report(work / "report", summary, results)
    _say(f"\nreport: {report}   logs: {logs}")
    failed = [name for name, ok in summary["checks"].items() if not ok]
    if failed:
        _say(f"not met: {', '.join(failed)}")
    return 1 if set(failed) & set(CORRECTNESS) else 0
