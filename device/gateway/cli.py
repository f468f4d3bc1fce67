"""``ddnn gateway``: run a site gateway.

Every option also reads an environment variable, ``DDNN_GATEWAY_`` plus the option's name in
upper case with dashes as underscores; a flag given on the command line wins. paho-mqtt is
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
from collections.abc import Mapping

from ddnn.device.gateway.settings import ENV_PREFIX, OPTIONS, GatewaySettings
from ddnn.plumbing import options
from ddnn.plumbing.signals import stop_on_signals

log = logging.getLogger(__name__)

DESCRIPTION = f"""\
Forward the messages of the devices on a local broker to the edge's broker in batches: one
message per frame up the constrained uplink instead of one per device (the devices run
unchanged, with --broker set to the local broker). Start the edge with --gateways
GATEWAY=DEVICE+DEVICE... so it lets this gateway speak for its devices. --http-port serves
/metrics (Prometheus), /healthz = /readyz (503 with reasons when a broker is unreachable) and
/livez. Every option also reads the environment variable {ENV_PREFIX}<OPTION>; a flag wins."""


def register(sub, data_sub, formatter) -> None:
    """Add ``ddnn gateway`` to the subcommands."""
    p = sub.add_parser("gateway", help="batch a site's device messages up one uplink",
                       description=DESCRIPTION, formatter_class=formatter)
    options.add_options(p, OPTIONS, GatewaySettings, ENV_PREFIX)
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> GatewaySettings:
    """Resolve flags over ``DDNN_GATEWAY_*`` variables over defaults into settings."""
    return options.settings_from(args, OPTIONS, GatewaySettings, ENV_PREFIX, environ)


def run(args: argparse.Namespace) -> int:
    from ddnn.device.gateway.service import GatewayService

    settings = settings_from(args)
    log.info("gateway config: %s", settings.describe())
    stop = threading.Event()
    stop_on_signals(stop)
    with GatewayService.from_settings(settings) as service:
        stop.wait()
        log.info("stopping: %s", json.dumps(service.forwarded))
    return 0
