"""``ddnn gateway``: devices behind one uplink, their messages of a frame sent as one.

Devices on a site (one board with several cameras, or boards on one LAN) publish to a local
broker as usual. The gateway forwards their messages to the edge's broker over the constrained
uplink in batches (:mod:`ddnn.batch`): the scores of a frame go as one message once every
online device sent its own (or after ``--coalesce-ms``), pulled features likewise. Their
statuses go up as one retained gateway status. Down, it repeats the edge's pulls, its status
and bundle announcements on the local broker, so the devices run unchanged.

The tier shape: :mod:`~ddnn.device.gateway.settings` (``GatewaySettings`` and its options
table), :mod:`~ddnn.device.gateway.service` (``GatewayService.from_settings``, a context
manager over its lifecycle), :mod:`~ddnn.device.gateway.health` (``--http-port``: /metrics,
/healthz, /livez) and :mod:`~ddnn.device.gateway.cli` (``ddnn gateway``); what it holds back
to send together is :mod:`~ddnn.device.gateway.coalescer`'s.
"""
