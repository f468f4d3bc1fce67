"""``ddnn device``: run a device agent (the role's scaffold: :mod:`ddnn.plumbing.role_cli`).

Every option also reads ``DDNN_DEVICE_`` plus its name in upper case with dashes as
underscores (``--edge-url`` ← ``DDNN_DEVICE_EDGE_URL``). ONNX Runtime and paho-mqtt are
imported only when the command runs.
"""

from __future__ import annotations

from ddnn.device.settings import ENV_PREFIX, OPTIONS, DeviceSettings
from ddnn.plumbing.role_cli import Role
from ddnn.plumbing.signals import stop_on_signals

DESCRIPTION = """\
Run one device agent: read frames from a source, run the bundle's device segment for --view
with ONNX Runtime, and talk to the edge aggregator over MQTT (or HTTP POSTs to --edge-url when
no broker is given). With several views the device publishes its scores for every frame and
sends its features when the edge pulls them (--mode pull) or with every frame (--mode push:
no round trip, more bytes). With a one-view bundle the device decides its own exit.

A replay (--data) exits by itself once every frame is delivered and the edge has stopped
pulling for --grace seconds. SIGINT/SIGTERM stop it cleanly (status offline, broker flushed)."""


def run(settings: DeviceSettings) -> int:
    from ddnn.device.service import DeviceService

    with DeviceService.from_settings(settings) as service:
        stop_on_signals(service.stop_event)
        service.run()
    if service.refused is not None:  # credentials or certificate refused: exit 78
        raise service.refused
    return 0


ROLE = Role(name="device", help="run a device agent (device segment, MQTT uplink)",
            description=DESCRIPTION, options=OPTIONS, settings=DeviceSettings,
            env_prefix=ENV_PREFIX, run=run, example="BROKER=mqtt://broker:1883")
register = ROLE.register
settings_from = ROLE.settings_from
