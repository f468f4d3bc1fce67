"""The device's side of over-the-air updates (:class:`~ddnn.plumbing.ota.BundleUpdater`).

An applied version replaces the agent's runtime; every outcome is counted in the metrics, and a
refusal or a rollback stays in the device's retained status (``ota_error``,
``rolled_back_from``) beside the version that keeps running, until an update succeeds.
"""

from __future__ import annotations

from ddnn.bundle import Bundle
from ddnn.device.agent import DeviceAgent
from ddnn.device.health import DeviceMetrics
from ddnn.device.settings import DeviceSettings
from ddnn.device.transport import MqttTransport
from ddnn.plumbing.ota import BundleUpdater
from ddnn.plumbing.ota_settings import UpdateHooks
from ddnn.plumbing.probation import VersionProbe
from ddnn.runtime import BundleRuntime


class DeviceUpdates:
    """Follows the deployment's bundle topic for the device (announced over ``mqtt``):
    :attr:`updater` fetches and verifies, this applies and reports."""

    def __init__(self, settings: DeviceSettings, bundle: Bundle, agent: DeviceAgent,
                 metrics: DeviceMetrics, mqtt: MqttTransport, probe: VersionProbe):
        self.threads, self.agent, self.metrics, self.mqtt = settings.threads, agent, metrics, mqtt
        hooks = UpdateHooks(apply=self.apply, on_result=self.result,
                            on_retry=lambda ann, why: self.result(None),
                            on_rollback=self.rolled_back)
        self.updater = BundleUpdater(bundle, hooks, policy=settings.updates,
                                     source=settings.update_source,
                                     public_key=settings.bundle_key, tag=settings.device_id,
                                     probe=probe)

    def apply(self, bundle: Bundle) -> None:
        """Run ``bundle`` from the next frame on."""
        old = self.agent.manifest
        self.agent.swap(BundleRuntime(bundle, threads=self.threads))
        self.metrics.bundle.set(0, model=old.name, version=old.version)
        self.metrics.bundle.set(1, model=bundle.manifest.name, version=bundle.manifest.version)
        self.mqtt.update_status(model=bundle.ref)

    def rolled_back(self, ref: str, why: str) -> None:
        """A version failed its probation (or a crash during it): counted, and in the retained
        status until an update succeeds."""
        self.metrics.bundle_updates.inc(result="rolled_back")
        self.mqtt.update_status(rolled_back_from=ref, ota_error=why[:300])

    def result(self, ok: bool | None) -> None:
        """Count an update's outcome (None: a fetch to retry); a refusal is also in the
        retained status (``ota_error``), beside the version that keeps running."""
        self.metrics.bundle_updates.inc(result={True: "applied", False: "refused",
                                                None: "retry"}[ok])
        if ok is not None:
            error = self.updater.last_error if not ok else None
            cleared = {"rolled_back_from": None} if ok else {}  # a newer version applied
            self.mqtt.update_status(ota_error=error[:300] if error else None, **cleared)
