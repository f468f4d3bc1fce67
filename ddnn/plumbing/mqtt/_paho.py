"""What the MQTT plumbing reads or changes inside paho-mqtt, where paho has no public API.

Every private attribute of paho this package touches is here and nowhere else, so an upgrade
has one place to check; ``pyproject.toml`` pins paho-mqtt to the versions tested (2.0 up to 2.2,
``tests/integration/test_paho_versions.py`` runs the MQTT tests on the lowest).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


def network_thread_alive(client) -> bool:
    """Whether the thread of ``loop_start()`` runs (private: ``Client._thread``)."""
    thread = getattr(client, "_thread", None)
    return isinstance(thread, threading.Thread) and thread.is_alive()


def stored_count(client) -> int:
    """Messages paho still holds: sent and unacknowledged, or queued
    (private: ``Client._out_messages``)."""
    return len(client._out_messages)


@contextmanager
def stored_messages(client) -> Iterator[Iterator]:
    """paho's stored outgoing messages (``MQTTMessage``), under paho's own lock (private:
    ``Client._out_message_mutex`` and ``Client._out_messages``)."""
    with client._out_message_mutex:
        yield iter(list(client._out_messages.values()))


def set_protocol(client, protocol: int, clean_session: bool) -> None:
    """Change the MQTT version of the next CONNECT: paho has no public way to change the
    protocol of a client; these two fields are what its CONNECT packet is built from."""
    client._protocol = protocol
    client._clean_session = clean_session


def freeze_pack(props) -> None:
    """Pack ``props`` (paho ``Properties``) once and answer every later ``pack()`` with those
    bytes: paho packs a message's properties at every send. Its ``__setattr__`` refuses new
    attributes, so the method is set past it."""
    packed = props.pack()
    object.__setattr__(props, "pack", lambda: packed)
