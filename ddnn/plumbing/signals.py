"""SIGINT and SIGTERM as a stop request, the same for every long-running command."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (logged once each). Only from the main thread, where
    Python delivers signals: a command run from a test's thread keeps the default handlers."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _stop(signum, frame) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
