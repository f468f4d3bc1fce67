"""An edge and devices in this process (threads), on a real broker, and the check that the live
hierarchy answers every frame as ``ddnn evaluate`` does offline."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.device.gateway.service import GatewayService
from ddnn.device.gateway.settings import GatewaySettings
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.plumbing.retry import RetryPolicy
from ddnn.runtime import BundleRuntime
from ddnn.tools.evaluate import evaluate
from tests.support.data import mixed
from tests.support.polling import wait_for

REPLAY_WAIT = 60.0  # seconds: whole replays through a broker take longer than other waits
# Devices behind a gateway replay at a camera's pace. The gateway groups a frame's views from
# every device, but sends one device's alone once its window (200 ms here) ends; replayed as
# fast as they can, one device can get ahead, its views reach the edge with no peer active,
# and the run-ahead rule holds them as a camera over --max-fps (240) and, on a loaded machine,
# drops them as run ahead (a test flaked so). At 60 fps from the agreed start a device alone
# stays under that pace. (With --max-lag-ms 0: a paced device that stalls never skips a frame.)
GATEWAY_FPS = 60.0


class Edge:
    """An edge aggregator in this process."""

    def __init__(self, bundle: Path, broker: str | None, cloud: str | None, *, deployment="it",
                 http_port: int | None = None, observers=(), **settings):
        self.runtime = BundleRuntime(load_bundle(bundle), threads=1)
        s = EdgeSettings(bundle=bundle, broker=broker, cloud=cloud, deployment=deployment,
                         http_port=http_port, keepalive=5, reconnect_max=1,
                         **{"deadline_ms": 2000.0, "feature_deadline_ms": 2000.0, **settings})
        self.service = EdgeService.from_settings(
            s, runtime=self.runtime, cloud_retry=RetryPolicy(initial=0.05, maximum=0.2),
            observers=observers).start()
        self.agg = self.service.aggregator
        if broker:
            assert self.service.mqtt.wait_subscribed(10)  # SUBACKs: no message lost

    def stop(self) -> None:
        self.service.stop()


def run_devices(bundle: Path, data: Path, broker: str | None, *, mode="pull", deployment="it",
                edge_url: str | None = None, start=0, limit=None, views=None,
                prepare: Callable[[DeviceService], None] | None = None, fps: float = 0,
                max_lag_ms: float | None = None) -> list[DeviceService]:
    """Replay every view of ``data`` from threads (``fps`` 0: as fast as they can); returns
    when every device is done (``prepare``: called with each device before it runs;
    ``max_lag_ms`` None: the device's default)."""
    lag = {} if max_lag_ms is None else {"max_lag_ms": max_lag_ms}
    views = range(load_bundle(bundle).manifest.views) if views is None else views
    # The devices keep the default grace (2 s): a loaded CI host can leave the edge more than
    # half a second behind them, and a shorter one let them leave before its last pulls.
    with contextlib.ExitStack() as stack:
        services = [stack.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=bundle, view=v, broker=broker, edge_url=edge_url, deployment=deployment,
            mode=mode, data=data, start=start, limit=limit, fps=fps, drain_timeout=30,
            keepalive=5, reconnect_max=1, peers=tuple(f"cam{i}" for i in views),
            wait_peers=20 if broker else 0, **lag))) for v in views]
        for service in services if prepare is not None else ():
            prepare(service)
        threads = [threading.Thread(target=s.run) for s in services]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    return services


def replay(bundle: Path, data: Path, broker: str, cloud: str, *, deployment: str,
           thresholds: dict[str, float], site: str | None = None, frames: int = 120
           ) -> tuple[Edge, GatewayService | None]:
    """Every view of ``data`` replayed to an edge on ``broker`` with these thresholds, straight
    or (``site``: the site broker the devices use) behind one gateway, until the edge answered
    ``frames``; returns the stopped edge and the gateway."""
    gateways = ()
    if site is not None:
        views = load_bundle(bundle).manifest.views
        gateways = (("gw0", tuple(f"cam{v}" for v in range(views))),)
    edge = Edge(bundle, broker, cloud, deployment=deployment, gateways=gateways,
                **mixed(thresholds))
    gateway = None
    try:
        with contextlib.ExitStack() as stack:
            if site is not None:
                gateway = stack.enter_context(GatewayService(GatewaySettings(
                    local=site, broker=broker, deployment=deployment, coalesce_ms=200)))
            run_devices(bundle, data, site or broker, deployment=deployment,
                        fps=GATEWAY_FPS if site is not None else 0, max_lag_ms=0)
            wait_for(lambda: edge.agg.answered >= frames, REPLAY_WAIT, f"{frames} results")
    finally:
        edge.stop()
    return edge, gateway


def check_against_evaluate(results: list[dict], bundle: Path, data: Path,
                           thresholds: dict[str, float]) -> dict:
    """Every frame once; accuracy and exit fractions equal to ``ddnn evaluate``."""
    ds = load_dataset(data)
    frames = sorted(r["frame"] for r in results)
    assert frames == list(range(len(ds.label))), "every frame exactly once"
    expected = evaluate(bundle, data, thresholds["local"], thresholds["edge"])
    assert all(f > 0 for f in expected["exit_fraction"].values()), "every tier is exercised"
    by_frame = {r["frame"]: r for r in results}
    pred = np.array([by_frame[i]["class"] for i in range(len(frames))])
    tiers = [by_frame[i]["exit"] for i in range(len(frames))]
    degraded = [{k: r[k] for k in ("frame", "exit", "missing")} for r in results if r["degraded"]]
    assert not degraded, f"degraded answers (a pull or the cloud timed out): {degraded[:5]}"
    assert float((pred == ds.label).mean()) == pytest.approx(expected["accuracy"]["overall"],
                                                             abs=1e-12)
    for tier in ("local", "edge", "cloud"):
        assert tiers.count(tier) / len(tiers) == pytest.approx(expected["exit_fraction"][tier],
                                                               abs=1e-12)
    for r in results:
        assert r["label"] == load_bundle(bundle).manifest.classes[r["class"]]
        present = [f"cam{v}" for v in np.flatnonzero(ds.present[r["frame"]])]
        assert r["views"] == present
    return expected


