"""``ddnn gateway``: run a site gateway (the role's scaffold: :mod:`ddnn.plumbing.role_cli`).

Every option also reads ``DDNN_GATEWAY_`` plus its name in upper case with dashes as
underscores. paho-mqtt is imported only when the command runs.
"""

from __future__ import annotations

import json
import logging
import threading

from ddnn.device.gateway.settings import ENV_PREFIX, OPTIONS, GatewaySettings
from ddnn.plumbing.role_cli import Role
from ddnn.plumbing.signals import stop_on_signals

log = logging.getLogger(__name__)

DESCRIPTION = """\
Forward the messages of the devices on a local broker to the edge's broker in batches: one
message per frame up the constrained uplink instead of one per device (the devices run
unchanged, with --broker set to the local broker). Start the edge with --gateways
GATEWAY=DEVICE+DEVICE... so it lets this gateway speak for its devices. --http-port serves
/metrics (Prometheus), /healthz = /readyz (503 with reasons when a broker is unreachable) and
/livez."""


def run(settings: GatewaySettings) -> int:
    from ddnn.device.gateway.service import GatewayService

    log.info("gateway config: %s", settings.describe())
    stop = threading.Event()
    stop_on_signals(stop)
    with GatewayService.from_settings(settings) as service:
        stop.wait()
        log.info("stopping: %s", json.dumps(service.forwarded))
    return 0


ROLE = Role(name="gateway", help="batch a site's device messages up one uplink",
            description=DESCRIPTION, options=OPTIONS, settings=GatewaySettings,
            env_prefix=ENV_PREFIX, run=run)
register = ROLE.register
settings_from = ROLE.settings_from
