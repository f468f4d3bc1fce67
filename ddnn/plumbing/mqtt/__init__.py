"""MQTT for the device, the gateway and the edge: a small package over paho-mqtt.

* :mod:`~ddnn.plumbing.mqtt.client`: :class:`MqttClient` — last will and retained status,
  subscriptions restored (and their SUBACKs awaited) on every reconnect, backoff, refusals
  for good;
* :mod:`~ddnn.plumbing.mqtt.presence`: :class:`Presence`, a client's retained online/offline
  status and last will (``client.presence.update(...)`` changes its fields);
* :mod:`~ddnn.plumbing.mqtt.inbox`: :class:`Inbox`, what the broker delivers on to the handler
  (stale retained messages dropped, a persistent session's acknowledgements);
* :mod:`~ddnn.plumbing.mqtt.attempts`: failed connection attempts, logged (throttled) and kept
  for health, and the bounded wait for the CONNACK;
* :mod:`~ddnn.plumbing.mqtt.broker`: the broker URL, TLS files and credentials;
* :mod:`~ddnn.plumbing.mqtt.aliases`: MQTT 5 topic aliases;
* :mod:`~ddnn.plumbing.mqtt.errors`: :class:`MqttError` and :class:`BrokerRefusedError`;
* :mod:`~ddnn.plumbing.mqtt._paho`: the few private parts of paho it must touch, in one place.

MQTT 5 when the broker speaks it (else 3.1.1, found out at the first connection): then each
topic a client publishes on is sent once per connection and a two-byte topic alias after that.
Persistent sessions (the edge) stay on 3.1.1, whose sessions never expire by themselves. Which
QoS each kind of topic takes, and whether it is retained, is the contract's
(:data:`ddnn.topics.DELIVERY`). paho is imported when a client is made, so importing this
package costs nothing on a machine that does not run MQTT; everything logs to the one logger
``ddnn.plumbing.mqtt``.
"""

from ddnn.plumbing.mqtt.aliases import TopicAliases
from ddnn.plumbing.mqtt.broker import (
    CONNECT_TIMEOUT_OPTION,
    SECURITY_OPTIONS,
    BrokerUrl,
    MqttSecurity,
    tls_context,
)
from ddnn.plumbing.mqtt.client import SESSION_EXPIRY, MqttClient, MqttOptions
from ddnn.plumbing.mqtt.errors import BrokerRefusedError, MqttError
from ddnn.plumbing.mqtt.presence import Presence

__all__ = [
    "CONNECT_TIMEOUT_OPTION",
    "SECURITY_OPTIONS",
    "SESSION_EXPIRY",
    "BrokerRefusedError",
    "BrokerUrl",
    "MqttClient",
    "MqttError",
    "MqttOptions",
    "MqttSecurity",
    "Presence",
    "TopicAliases",
    "tls_context",
]
