"""``ddnn device``: run a device agent.

Every option also reads an environment variable, ``DDNN_DEVICE_`` plus the option's name in
upper case with dashes as underscores (``--edge-url`` ← ``DDNN_DEVICE_EDGE_URL``); a flag given
on the command line wins. ONNX Runtime and paho-mqtt are imported only when the command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ddnn.device.settings import ENV_PREFIX, OPTIONS, DeviceSettings
from ddnn.plumbing import options
from ddnn.plumbing.signals import stop_on_signals

DESCRIPTION = f"""\
Run one device agent: read frames from a source, run the bundle's device segment for --view
with ONNX Runtime, and talk to the edge aggregator over MQTT (or HTTP POSTs to --edge-url when
no broker is given). With several views the device publishes its scores for every frame and
sends its features when the edge pulls them (--mode pull) or with every frame (--mode push:
no round trip, more bytes). With a one-view bundle the device decides its own exit.

A replay (--data) exits by itself once every frame is delivered and the edge has stopped
pulling for --grace seconds. SIGINT/SIGTERM stop it cleanly (status offline, broker flushed).
Every option also reads the environment variable {ENV_PREFIX}<OPTION>, e.g.
{ENV_PREFIX}BROKER=mqtt://broker:1883; a flag wins over the variable."""


def register(sub, data_sub, formatter) -> None:
    """Add ``ddnn device`` to the subcommands."""
    p = sub.add_parser("device", help="run a device agent (device segment, MQTT uplink)",
                       description=DESCRIPTION, formatter_class=formatter)
    options.add_options(p, OPTIONS, DeviceSettings, ENV_PREFIX)
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> DeviceSettings:
    """Resolve flags over ``DDNN_DEVICE_*`` variables over defaults into settings."""
    return options.settings_from(args, OPTIONS, DeviceSettings, ENV_PREFIX, environ)


def run(args: argparse.Namespace) -> int:
    from ddnn.device.service import DeviceService

    with DeviceService.from_settings(settings_from(args)) as service:
        stop_on_signals(service.stop_event)
        service.run()
    if service.refused is not None:  # credentials or certificate refused: exit 78
        raise service.refused
    return 0
