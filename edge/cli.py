"""``ddnn edge``: run an edge aggregator.

Every option also reads an environment variable, ``DDNN_EDGE_`` plus the option's name in upper
case with dashes as underscores (``--deadline-ms`` ← ``DDNN_EDGE_DEADLINE_MS``); a flag given on
the command line wins. ONNX Runtime and paho-mqtt are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Mapping

from ddnn.edge.settings import ENV_PREFIX, OPTIONS, EdgeSettings
from ddnn.plumbing import options
from ddnn.plumbing.signals import stop_on_signals

DESCRIPTION = f"""\
Run the edge aggregator of a deployment: subscribe to its devices over MQTT, assemble each
frame from the views that arrive in time (at least --deadline-ms, longer for a device that
usually lags, at most --max-wait-ms: a missing or dead device never blocks a frame), take the
local exit on the aggregated scores, else pull the present views' features and run the edge
segment, else call the cloud (Open Inference Protocol v2, binary tensors).
One JSON result per frame is published on {{prefix}}/{{deployment}}/results. Without a reachable
cloud the edge answers with its own exit, flagged "degraded", and recovers when the cloud
returns. --http-port serves /metrics (Prometheus), /healthz = /readyz (503 with reasons when
it cannot serve), /livez, /v1/results and the devices' HTTP fallback (/v1/ingest).
SIGINT/SIGTERM stop it cleanly.
Every option also reads the environment variable {ENV_PREFIX}<OPTION> (e.g.
{ENV_PREFIX}DEADLINE_MS); a flag wins over the variable."""


def register(sub, data_sub, formatter) -> None:
    """Add ``ddnn edge`` to the subcommands."""
    p = sub.add_parser("edge", help="run an edge aggregator (local + edge exits, cloud client)",
                       description=DESCRIPTION, formatter_class=formatter)
    options.add_options(p, OPTIONS, EdgeSettings, ENV_PREFIX)
    p.set_defaults(func=run)


def settings_from(args: argparse.Namespace, environ: Mapping[str, str] | None = None
                  ) -> EdgeSettings:
    """Resolve flags over ``DDNN_EDGE_*`` variables over defaults into settings."""
    return options.settings_from(args, OPTIONS, EdgeSettings, ENV_PREFIX, environ)


def run(args: argparse.Namespace) -> int:
    from ddnn.edge.service import EdgeService

    settings = settings_from(args)
    stop = threading.Event()
    stop_on_signals(stop)
    with EdgeService.from_settings(settings) as service:
        service.run_until(stop)
    if service.refused is not None:  # credentials or certificates refused: exit non-zero
        raise service.refused
    return 0
