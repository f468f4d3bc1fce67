"""What the demo and test brokers bound, both of them (Mosquitto's configuration in
:mod:`ddnn.tools.broker`, amqtt's in :mod:`ddnn.tools.amqtt_plugins`), and deploy/mosquitto/*.conf
likewise."""

from __future__ import annotations

from ddnn.envelope import MAX_MESSAGE

# The largest MQTT packet a ddnn client ever sends: one envelope of MAX_MESSAGE bytes (the
# receivers' bound, ddnn.envelope) in a PUBLISH with the longest topic MQTT allows (2 + 65535
# bytes), the fixed header (at most 5), the packet id (2) and room for MQTT 5 properties. The
# broker disconnects a client sending a larger packet before it routes anything (Mosquitto's
# max_packet_size), so no subscriber ever receives one; the exact envelope bound stays with the
# receivers, which count a larger payload as "oversized". deploy/mosquitto/*.conf use the same.
MAX_PACKET = MAX_MESSAGE + (64 << 10) + 1024
# What a broker queues per client while it is away (a persistent session: the edge, a gateway,
# a bridge), whichever bound comes first; past them new messages for it are dropped. 32 MiB is
# hours of a site's scores, or 32 envelopes of the largest size: without it one client publishing
# 1 MiB messages grew Mosquitto from 10 to 311 MiB in 6 s. deploy/mosquitto/*.conf use the same.
MAX_QUEUED_MESSAGES = 100_000
MAX_QUEUED_BYTES = 32 << 20
