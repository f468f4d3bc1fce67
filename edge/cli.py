"""``ddnn edge``: run an edge aggregator (the role's scaffold: :mod:`ddnn.plumbing.role_cli`).

Every option also reads ``DDNN_EDGE_`` plus its name in upper case with dashes as underscores
(``--deadline-ms`` ← ``DDNN_EDGE_DEADLINE_MS``). ONNX Runtime and paho-mqtt are imported only
when the command runs.
"""

from __future__ import annotations

import threading

from ddnn.edge.settings import ENV_PREFIX, OPTIONS, EdgeSettings
from ddnn.plumbing.role_cli import Role
from ddnn.plumbing.signals import stop_on_signals

DESCRIPTION = """\
Run the edge aggregator of a deployment: subscribe to its devices over MQTT, assemble each
frame from the views that arrive in time (at least --deadline-ms, longer for a device that
usually lags, at most --max-wait-ms: a missing or dead device never blocks a frame), take the
local exit on the aggregated scores, else pull the present views' features and run the edge
segment, else call the cloud (Open Inference Protocol v2, binary tensors).
One JSON result per frame is published on {prefix}/{deployment}/results. Without a reachable
cloud the edge answers with its own exit, flagged "degraded", and recovers when the cloud
returns. --http-port serves /metrics (Prometheus), /healthz = /readyz (503 with reasons when
it cannot serve), /livez, /v1/results and the devices' HTTP fallback (/v1/ingest).
SIGINT/SIGTERM stop it cleanly."""


def run(settings: EdgeSettings) -> int:
    from ddnn.edge.service import EdgeService

    stop = threading.Event()
    stop_on_signals(stop)
    with EdgeService.from_settings(settings) as service:
        service.run_until(stop)
    if service.refused is not None:  # credentials or certificates refused: exit non-zero
        raise service.refused
    return 0


ROLE = Role(name="edge", help="run an edge aggregator (local + edge exits, cloud client)",
            description=DESCRIPTION, options=OPTIONS, settings=EdgeSettings,
            env_prefix=ENV_PREFIX, run=run, example="DEADLINE_MS")
register = ROLE.register
settings_from = ROLE.settings_from
