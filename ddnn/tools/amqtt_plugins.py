"""A plugin for the embedded amqtt broker (``ddnn.tools.broker``): open access that keeps
persistent sessions.

amqtt's stock anonymous-access plugin marks every client anonymous, and amqtt keeps no queue
for an anonymous client's persistent session (``clean_session`` off): QoS 1 messages published
while the edge is away were dropped, where Mosquitto queues them for its next connection. This
plugin lets every client in without marking it anonymous, so amqtt queues for persistent
sessions as the MQTT specification says (3.1.2.4). Demo and test brokers only: it
authenticates nobody. Imported by amqtt itself (the broker's ``plugins`` configuration).
"""

from __future__ import annotations

from dataclasses import dataclass

from amqtt.plugins.base import BaseAuthPlugin


class OpenSessions(BaseAuthPlugin):
    """Accept every client, and leave it non-anonymous so its persistent session is kept."""

    @dataclass
    class Config:
        """No options."""

    async def authenticate(self, *, session) -> bool:
        return True
