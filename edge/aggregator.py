"""The edge aggregator: fuses the devices' views of each frame and walks it up the exits.

1. local exit: the devices' scores aggregated over the views present (``BundleRuntime.local``);
2. else pull the present views' features, run the edge segment (``BundleRuntime.edge``);
3. else send the edge features to the cloud (:class:`edge.cloud_client.CloudClient`); when the
   cloud cannot answer, the edge answers with its own exit, flagged ``degraded``.

Every step is the one ``ddnn evaluate`` runs (``BundleRuntime.all_exits``), fed with the tensors
as they crossed the wire, so the live hierarchy's answers equal the offline evaluation's. Bad
messages are counted by reason, logged once per reason, and dropped.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddnn import envelope as env
from ddnn.edge.assembler import DONE, SCORES, Drop, Frame, FrameAssembler
from ddnn.edge.callback import ResultsCallback
from ddnn.edge.cloud_client import CloudClient, CloudError, UnknownVersion
from ddnn.edge.metrics import EdgeMetrics
from ddnn.envelope import DecodeError, MessageType
from ddnn.exits import entropy_of_logits
from ddnn.plumbing.mqtt import QOS_REQUESTS, QOS_RESULTS, status_info
from ddnn.result import Result, result_for
from ddnn.runtime import BundleRuntime, transmit
from ddnn.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class EdgeConfig:
    """What one edge aggregator does; the CLI fills it from options and ``DDNN_EDGE_*``."""

    devices: list[str]  # device ids in view order: devices[i] runs the bundle's view i
    deployment: str = "default"
    edge_id: str = "edge0"
    deadline: float = 0.2  # seconds a frame waits for its views' scores after the first one
    feature_deadline: float = 0.5  # seconds a frame waits for pulled features
    suspect_after: int = 3  # missed deadlines in a row before a silent device is not waited for
    local_threshold: float | None = None  # overrides of the bundle's exit thresholds
    edge_threshold: float | None = None
    cloud_batch: int = 32  # frames per cloud call at most
    results_ring: int = 1000  # recent results kept for GET /v1/results
    results_path: Path | None = None  # also append every result to this JSON-lines file
    results_url: str | None = None  # also POST every result to this URL (edge.callback)
    results_token: str | None = None  # bearer token for results_url
    expect_frames: int | None = None  # set ``done`` after this many results (tests, demos)


class EdgeAggregator:
    """Consumes device messages, publishes requests and results through ``publish``."""

    def __init__(self, runtime: BundleRuntime, config: EdgeConfig, topics: Topics,
                 metrics: EdgeMetrics | None = None, cloud: CloudClient | None = None,
                 publish: Callable[[str, bytes, int], object] | None = None,
                 connected: Callable[[], bool] = lambda: True):
        m = runtime.manifest
        self.runtime, self.config, self.topics, self.manifest = runtime, config, topics, m
        if len(config.devices) != m.views:
            raise ValueError(f"{len(config.devices)} device ids for {m.views} views")
        self.metrics = metrics or EdgeMetrics()
        self.cloud = cloud
        self._publish = publish
        self._connected = connected
        self.policy = m.policy.with_overrides(local=config.local_threshold,
                                              edge=config.edge_threshold)
        self.views = {d: i for i, d in enumerate(config.devices)}
        self.single_view = m.views == 1
        self.assembler = FrameAssembler(m.views, config.deadline, config.feature_deadline,
                                        config.suspect_after, single_view=self.single_view)
        self._scores_shape = (1, m.num_classes)
        self._feature_shape = tuple(m.devices[0].output("features").sample_shape)
        self._ready: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        self._to_cloud: queue.SimpleQueue = queue.SimpleQueue()
        self.results: collections.deque[dict] = collections.deque(maxlen=config.results_ring)
        self.answered = 0
        self.done = threading.Event()
        self._results_lock = threading.Lock()
        self._results_file = open(config.results_path, "a", encoding="utf-8") \
            if config.results_path else None  # noqa: SIM115 - lives as long as the aggregator
        self.callback = (ResultsCallback(config.results_url, self.metrics.callback,
                                         token=config.results_token)
                         if config.results_url else None)
        self._logged: set[str] = set()  # kinds of trouble already logged once
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.draining = False  # stopping: frames under way finish, new ones are declined
        self._previous: tuple[str, str] | None = None  # the version before the last update
        # A version announced for an update: devices may switch to it before this edge does.
        self.announced: tuple[str, str] | None = None
        self.metrics.bundle.set(1, model=m.name, version=m.version)
        self.declined = 0  # messages declined while draining

    # --- incoming (MQTT thread or HTTP handler) ---------------------------------------------

    def on_message(self, topic: str, payload: bytes) -> bool | None:
        """One MQTT message; False declines it (while draining: a frame for the next edge)."""
        parsed = self.topics.parse_device(topic)
        if parsed is None:
            self._drop("topic", f"message on unexpected topic {topic!r}")
            return None
        device, kind = parsed
        if kind == "status":
            self.on_status(device, payload)
        elif self.draining and not self._handled_here(payload):
            self.declined += 1
            return False
        else:
            self.ingest(payload, device)
        return None

    def _handled_here(self, payload: bytes) -> bool:
        try:
            frame = env.decode(payload).frame
        except DecodeError:
            return True  # dropped and counted here like any malformed message
        return self.assembler.knows(frame)

    def drain(self, timeout: float) -> int:
        """Stop opening frames and finish those under way; returns how many were left.

        Messages of new frames are declined (with a persistent session the broker keeps them
        for the next edge), so a restart neither loses nor splits a frame.
        """
        self.draining = True
        deadline = time.monotonic() + timeout
        while len(self.assembler) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the assembler: frames finish on the worker threads
        left = len(self.assembler)
        if left:
            log.warning("stopping with %d frames unanswered after %.1f s of draining", left,
                        timeout)
        log.info("drained: %d frames left unanswered, %d messages of new frames left to the "
                 "broker for the next edge", left, self.declined)
        return left

    def swap(self, runtime: BundleRuntime) -> None:
        """Run new frames on ``runtime`` (an over-the-air update); frames under way keep theirs.

        Messages of the previous version are still taken: devices update one after another.
        """
        runtime.load_all()
        old, m = self.manifest, runtime.manifest
        self.policy = m.policy.with_overrides(local=self.config.local_threshold,
                                              edge=self.config.edge_threshold)
        self._previous = (old.name, old.version)
        self.runtime, self.manifest = runtime, m
        self.metrics.bundle.set(0, model=old.name, version=old.version)
        self.metrics.bundle.set(1, model=m.name, version=m.version)

    def on_status(self, device: str, payload: bytes) -> None:
        view = self.views.get(device)
        info = status_info(payload)
        state = info.get("state")
        if view is None or state not in ("online", "offline"):
            return  # other deployments' or tools' devices, or an empty retained message
        self.assembler.set_online(view, state == "online")
        if state == "online" and "mode" in info:  # a pushing device is never asked for features
            self.assembler.pushing[view] = info["mode"] == "push"
        self.metrics.devices_online.set(1 if state == "online" else 0, device=device)
        log.info("device %s (view %d) is %s", device, view, state)
        if state == "online":
            self._request_again()

    def ingest(self, payload: bytes, device: str | None = None) -> str | None:
        """Take one device message; returns the drop reason, or ``None`` when accepted."""
        try:
            self._ingest(payload, device)
        except Drop as d:
            self._drop(d.reason, str(d))
            return d.reason
        return None

    def _ingest(self, payload: bytes, device: str | None) -> None:
        if len(payload) > env.MAX_MESSAGE:
            raise Drop("oversized", f"message of {len(payload)} bytes")
        try:
            e = env.decode(payload)
        except DecodeError as err:
            raise Drop("malformed", str(err)) from None
        m = self.manifest
        if device is not None and e.device != device:
            raise Drop("malformed", f"device {e.device!r} publishing on {device!r}'s topic")
        if e.deployment != self.topics.deployment:
            raise Drop("deployment", f"message for deployment {e.deployment!r}")
        if (e.model, e.version) not in ((m.name, m.version), self._previous, self.announced):
            raise Drop("model", f"message for model {e.model}:{e.version}, serving "
                                f"{m.name}:{m.version}")
        view = self.views.get(e.device)
        if view is None:
            raise Drop("unknown_device", f"device {e.device!r} is not one of {self.config.devices}")
        kind = e.kind.name.lower()
        self.metrics.messages.inc(kind=kind)
        self.metrics.bytes.inc(len(e.payload), kind=kind, part="payload")
        self.metrics.bytes.inc(len(payload) - len(e.payload), kind=kind, part="header")
        now = time.monotonic()
        if e.kind == MessageType.SCORES and not self.single_view:
            x = self._tensor(e, m.codec["scores"], self._scores_shape)
            f = self.assembler.add_scores(view, e.frame, x[0], e.timestamp, now, len(e.payload))
        elif e.kind == MessageType.ABSENT:
            f = self.assembler.add_scores(view, e.frame, None, e.timestamp, now)
        elif e.kind == MessageType.FEATURES:
            x = self._tensor(e, m.codec["device_features"], (1, *self._feature_shape))
            f = self.assembler.add_features(view, e.frame, x, e.timestamp, now, len(e.payload))
        else:
            raise Drop("malformed", f"a device cannot send {kind} messages")
        if f is None:
            return
        # The local exit is cheap: take it right here rather than pay a thread hop; only
        # frames going on to the edge segment (ONNX Runtime) are handed to the worker.
        if f.stage == SCORES:
            if f.missing:
                self.metrics.missing.inc(len(f.missing), stage=f.stage)
            if not self._local_stage(f):
                return
        self._ready.put(f)

    def _tensor(self, e: env.Envelope, codec: str, shape: tuple[int, ...]) -> np.ndarray:
        if e.codec != codec or e.shape != shape:
            raise Drop("shape", f"{e.kind.name.lower()} of {e.device} is {e.codec} {e.shape}, "
                                f"expected {codec} {shape}")
        try:
            return e.tensor()
        except DecodeError as err:
            raise Drop("malformed", str(err)) from None

    def _drop(self, reason: str, detail: str) -> None:
        self.metrics.dropped.inc(reason=reason)
        if reason == "late":
            self.metrics.late.inc()
        # One line per kind, the counters say the rest; push mode's extra features are normal.
        if reason not in self._logged and reason != "unneeded":
            self._logged.add(reason)
            log.warning("dropped a message (%s): %s; further ones are only counted", reason, detail)

    # --- the worker: exits --------------------------------------------------------------------

    def _process(self, f: Frame) -> None:
        if f.missing:
            self.metrics.missing.inc(len(f.missing), stage=f.stage)
        if f.stage == SCORES and not self._local_stage(f):
            return
        self._edge_stage(f)

    def _local_stage(self, f: Frame) -> bool:
        """The local exit; True when the frame goes on to the edge segment now."""
        if f.runtime is None:  # a frame runs on one bundle version, even across an update
            f.runtime = self.runtime
        rt = f.runtime
        m = rt.manifest
        t0 = time.perf_counter()
        present = f.present
        scores = np.zeros((1, m.views, m.num_classes), np.float32)
        mask = np.zeros((1, m.views), bool)
        for v in present:
            scores[0, v] = f.scores[v]
            mask[0, v] = True
        local = rt.local(scores, mask)
        eta = float(entropy_of_logits(local)[0])
        self.metrics.segment.observe(time.perf_counter() - t0, step="local")
        if self.policy.exits("local", eta):
            self._answer(f, local[0], eta, "local")
            return False
        pushing = self.assembler.pushing
        pull = [v for v in present if v not in f.features and not pushing[v]]
        if pull and self._publish is not None:  # (over HTTP the devices push their features)
            self._request(f.id, pull)
        return self.assembler.await_features(f, present, time.monotonic()) is not None

    def _request(self, frame: int, views: list[int]) -> None:
        mask = np.full(self.manifest.views, -1.0, np.float32)
        mask[views] = 1.0
        req = env.pack(MessageType.REQUEST, model=self.manifest.name,
                       version=self.manifest.version, deployment=self.topics.deployment,
                       device=self.config.edge_id, frame=frame, tensor=mask, codec="binary")
        self._publish(self.topics.requests(self.config.edge_id), env.encode(req), QOS_REQUESTS)
        self.metrics.requests.inc()

    def _request_again(self) -> None:
        # After an outage a device may have missed pulls: ask again for what is still awaited.
        if self._publish is None:
            return
        for f in self.assembler.pending():
            missing = [v for v in f.requested if v not in f.features]
            if missing:
                self._request(f.id, missing)

    def _edge_stage(self, f: Frame) -> None:
        if f.runtime is None:
            f.runtime = self.runtime
        rt = f.runtime
        m = rt.manifest
        t0 = time.perf_counter()
        feats = np.zeros((1, m.views, *self._feature_shape), np.float32)
        mask = np.zeros((1, m.views), bool)
        for v in f.requested:
            if v in f.features:  # a view whose features never came is fused without
                feats[0, v] = f.features[v][0]
                mask[0, v] = True
        edge_scores, edge_feats = rt.edge(feats, mask)
        eta = float(entropy_of_logits(edge_scores)[0])
        self.metrics.segment.observe(time.perf_counter() - t0, step="edge")
        if self.policy.exits("edge", eta):
            self._answer(f, edge_scores[0], eta, "edge")
            return
        self._to_cloud.put((f, transmit(edge_feats, rt.edge_codec), edge_scores[0], eta))

    def on_reconnect(self) -> None:
        """The broker is back: waiting frames get a fresh deadline, missed pulls are redone."""
        self.assembler.extend_deadlines(time.monotonic())
        self._request_again()

    def _work_loop(self) -> None:
        while not self._stop.is_set():
            wait = self.assembler.next_deadline() - time.monotonic()
            try:
                f = self._ready.get(timeout=min(max(wait, 0.001), 0.05))
            except queue.Empty:
                f = None
            if f is not None:
                self._process_safely(f)
            # No expiry while the broker is away: the views are not late, the link is down.
            if self._connected():
                for g in self.assembler.expire(time.monotonic()):
                    self._process_safely(g)
            self.metrics.pending.set(len(self.assembler))

    def _process_safely(self, f: Frame) -> None:
        """Process one frame; a failure (a bug, a broken segment) ends that frame, counted."""
        try:
            self._process(f)
        except Exception:  # one bad frame must not stop the edge
            log.exception("processing frame %d failed", f.id)
            if f.stage != DONE:  # (a failure after its result went out loses nothing)
                self.assembler.finish(f)
                self.metrics.dropped.inc(reason="processing_failed")

    # --- the cloud ----------------------------------------------------------------------------

    def _cloud_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._to_cloud.get(timeout=0.05)]
            except queue.Empty:
                continue
            while len(batch) < self.config.cloud_batch:
                try:
                    batch.append(self._to_cloud.get_nowait())
                except queue.Empty:
                    break
            # One call per bundle version: during an update, frames finish on their own.
            by_version: dict[str, list] = {}
            for item in batch:
                by_version.setdefault(item[0].runtime.manifest.version, []).append(item)
            for version, items in by_version.items():
                try:
                    self._cloud_batch(items, version)
                except Exception:  # a bug must not lose the frames: the edge's answer stands
                    log.exception("cloud stage failed; answering from the edge exit")
                    for f, _, edge_scores, eta in items:
                        if f.stage != DONE:
                            self._answer(f, edge_scores, eta, "edge", degraded=True)

    def _cloud_batch(self, batch: list, version: str) -> None:
        if self.cloud is not None and self.cloud.available():
            t0 = time.perf_counter()
            try:
                scores, _ = self.cloud.infer(np.concatenate([b[1] for b in batch]), version)
            except UnknownVersion as e:
                self.metrics.cloud.inc(outcome="unknown_version")
                self._log_unknown_version(version, e)
            except CloudError:
                self.metrics.cloud.inc(outcome="error")
                self.metrics.cloud_up.set(0)
            else:
                self.metrics.cloud.inc(outcome="ok")
                self.metrics.cloud_up.set(1)
                self.metrics.segment.observe(time.perf_counter() - t0, step="cloud_call")
                etas = entropy_of_logits(scores)
                for (f, *_), s, eta in zip(batch, scores, etas, strict=True):
                    self._answer(f, s, float(eta), "cloud")
                return
        # No cloud: the best answer this edge has is its own exit, marked degraded.
        for f, _, edge_scores, eta in batch:
            self._answer(f, edge_scores, eta, "edge", degraded=True)

    def _log_unknown_version(self, version: str, error: Exception) -> None:
        if f"unknown_version {version}" not in self._logged:  # once per version, not per batch
            self._logged.add(f"unknown_version {version}")
            log.error("%s; its frames are answered from the edge exit, degraded", error)

    # --- results --------------------------------------------------------------------------

    def _answer(self, f: Frame, scores: np.ndarray, eta: float, tier: str,
                degraded: bool = False) -> None:
        self.assembler.finish(f)
        classes = (f.runtime or self.runtime).manifest.classes
        latency = max(time.time() - f.captured, 0.0)
        fused, missing = self._fused_and_missing(f, tier)
        result = result_for(frame=f.id, scores=scores, classes=classes, exit=tier, entropy=eta,
                            views=fused, missing=missing, degraded=degraded,
                            latency_ms=latency * 1000)
        self.metrics.frames.inc(exit=tier, degraded=str(degraded).lower())
        self.metrics.latency.observe(latency, exit=tier)
        self.publish_result(result)

    def _fused_and_missing(self, f: Frame, tier: str) -> tuple[list[str], dict[str, str]]:
        """The device ids fused into ``f``'s answer, and why each other view is not."""
        ids = self.config.devices
        if tier == "local" or self.single_view:
            fused = f.present
        else:  # past the local exit the segments fuse the features that arrived
            fused = [v for v in f.requested if v in f.features]
        missing = {}
        for v in range(len(ids)):
            if v in fused:
                continue
            if v in f.absent:
                missing[ids[v]] = "absent"
            elif v in f.scores:
                missing[ids[v]] = "no_features"
            else:
                missing[ids[v]] = "late" if self.assembler.is_expected(v) else "offline"
        return [ids[v] for v in fused], missing

    def publish_result(self, result: Result) -> None:
        """Publish one result (the edge's own, or a one-view device's posted over HTTP)."""
        body = result.to_json().decode()
        if self._publish is not None:
            self._publish(self.topics.results, body.encode(), QOS_RESULTS)
        with self._results_lock:
            self.results.append(result.to_dict())
            self.answered += 1
            if self._results_file:
                self._results_file.write(body + "\n")
                self._results_file.flush()
            if self.callback is not None:
                self.callback.post(body.encode())
            if self.config.expect_frames and self.answered >= self.config.expect_frames:
                self.done.set()

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> EdgeAggregator:
        if self.callback is not None:
            self.callback.start()
        self.runtime.runner("edge")  # load now, so the first frame does not pay for it
        if self.manifest.local is not None:
            self.runtime.runner("local")
        for target, name in ((self._work_loop, "edge-worker"), (self._cloud_loop, "edge-cloud")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.cloud is not None:
            self.cloud.close()
        if self.callback is not None:
            self.callback.stop()
        if self._results_file:
            self._results_file.close()
