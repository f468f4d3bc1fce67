"""The loopback TCP relays the tests cut, restore and slow down (:mod:`ddnn.tools.relay`, which
the latency benchmark shares)."""

from ddnn.tools.relay import DelayingRelay, TcpRelay

__all__ = ["DelayingRelay", "TcpRelay"]
