"""The numbers the edge gives its answers (``seq``), in the order it makes them.

Frame ids come out of order (a frame sent to the cloud is answered after later frames that exited
locally), so a consumer that pages by frame id misses answers; one that pages by ``seq`` misses
none (``GET /v1/results?since=SEQ``, ``GET /v1/results/stream``). ``seq`` keeps increasing across
restarts of the edge:

* with a state directory (``--state-dir``), numbers are reserved in blocks of :data:`BLOCK`: the
  end of the reserved block is written to ``answers.seq`` (atomically, fsynced) before any number
  of the block is given; a restart, even after a crash, starts past the last reservation, so no
  number is ever given twice (a crash skips the rest of its block: gaps are allowed, repeats
  never);
* without one, numbers start at the wall clock in microseconds, so a restart still starts past
  the numbers given before unless the clock stepped back (or the edge answered more than a
  million frames a second).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

BLOCK = 1 << 16  # numbers reserved per write of the state file
STATE_FILE = "answers.seq"
MAX_SEQ = (1 << 53) - 1  # JSON numbers are exact up to here (JavaScript's Number)


class AnswerSequence:
    """Gives increasing answer numbers; :meth:`open` before the first."""

    def __init__(self, state_dir: Path | None = None):
        self.path = None if state_dir is None else Path(state_dir) / STATE_FILE
        self._next = 0
        self.first = 0  # the first number of this run (those before are an earlier run's)
        self._reserved = 0  # numbers below this may be given without writing the state file
        self._lock = threading.Lock()

    def open(self) -> AnswerSequence:
        """Start past every number given before (read the state file, or the clock)."""
        with self._lock:
            if self.path is None:
                self._next = self._reserved = time.time_ns() // 1000
            else:
                self._next = self._read()
                self._reserve(self._next)
            self.first = self._next
        log.info("answers are numbered from seq %d%s", self._next,
                 "" if self.path is None else f" (reserved in {self.path})")
        return self

    def next(self) -> int:
        """The next answer's number."""
        with self._lock:
            n = self._next
            if self.path is not None and n >= self._reserved:
                try:
                    self._reserve(n)
                except ConfigError as e:  # (a full disk): answers go on, numbered in memory
                    log.error("%s; answers go on, but a restart may number some of them again",
                              e)
                    self._reserved = n + BLOCK
            self._next = n + 1
            return n

    def _read(self) -> int:
        path = self.path
        assert path is not None
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the answer sequence in {path} (--state-dir): {e}"
                              ) from None
        if not text.isdigit() or int(text) > MAX_SEQ:
            raise ConfigError(f"{path} holds {text[:40]!r}, not an answer number: remove it "
                              "only if no consumer pages this edge's results by seq")
        return int(text)

    def _reserve(self, start: int) -> None:
        """Write ``start + BLOCK`` as the new high-water mark, durably, before giving numbers."""
        end = start + BLOCK
        path = self.path
        assert path is not None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="ascii") as f:
                f.write(f"{end}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic: a crash leaves the old mark or the new one
        except OSError as e:
            raise ConfigError(f"cannot keep the answer sequence in {path.parent} "
                              f"(--state-dir): {e}") from None
        self._reserved = end
