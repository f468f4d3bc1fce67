"""How applications read the edge's answers over HTTP without losing any.

* ``GET /v1/results?since=SEQ&limit=K``: a page of the answers numbered after ``SEQ``, in the
  order the edge made them (``seq``, :mod:`ddnn.edge.sequence`), with the oldest and newest
  ``seq`` kept and ``gap: true`` when answers after ``SEQ`` were dropped from the ring before the
  consumer read them (never a silent gap). A consumer pages on with the last ``seq`` it got.
* ``GET /v1/results?after=FRAME``: the old cursor, by frame id, answered as a list in frame order.
  Frames are answered out of order (a frame sent to the cloud comes back after later frames that
  exited locally), so paging on with the last frame misses those: use ``since``.
* ``GET /v1/results/stream``: the answers as Server-Sent Events (``id:`` = seq, ``data:`` = the
  result's JSON), resumable with ``Last-Event-ID`` (or ``?since=SEQ``; without either, from the
  next answer). A browser's ``EventSource`` or ``curl -N`` follows a live edge. At most
  :data:`MAX_STREAMS` at once; a stream is a connection the server waits on (its reader), so it
  never takes the slots that keep ``/livez`` answering, and a reader that stops reading is cut off
  after the server's wait timeout.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from ddnn.edge.sinks import RecentResults
from ddnn.result import MAX_SEQ

RESULTS_PAGE = 100  # results per GET /v1/results at most (the ring keeps 1000)
MAX_FRAME = 2**63 - 1  # the largest frame id a cursor may name
MAX_STREAMS = 8  # GET /v1/results/stream at once (each holds a thread)
KEEP_ALIVE = 5.0  # seconds between comments on an idle stream (under the server's wait timeout)

_ENCODER = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class ResultsQuery:
    """A parsed ``GET /v1/results`` query: one cursor (``since`` a seq, or ``after`` a frame)."""

    since: int | None  # page by answer number (None: by frame, ``after``)
    after: int  # the frame cursor (-1: from the first kept)
    limit: int


def _integer(value: str, name: str, low: int, high: int, what: str) -> int:
    # (length first: int() of a 4000-digit string is work an attacker chooses)
    if len(value) > 20 or not value.lstrip("-").isdigit() or not low <= int(value) <= high:
        raise ValueError(f"{name} must be {what} in {low}..{high}")
    return int(value)


def results_query(query: str) -> ResultsQuery:
    """Parse ``GET /v1/results``'s query; a ValueError says what is wrong."""
    q = urllib.parse.parse_qs(query)
    if "since" in q and "after" in q:
        raise ValueError("give since (an answer's seq) or after (a frame id), not both")
    limit = q.get("limit", [str(RESULTS_PAGE)])[-1]
    if len(limit) > 4 or not limit.isdigit() or not 1 <= int(limit) <= RESULTS_PAGE:
        raise ValueError(f"limit must be in 1..{RESULTS_PAGE}")
    since = None
    if "since" in q:
        since = _integer(q["since"][-1], "since", -1, MAX_SEQ, "an answer's seq")
    after = _integer(q.get("after", ["-1"])[-1], "after", -1, MAX_FRAME, "a frame id")
    return ResultsQuery(since, after, int(limit))


def stream_start(query: str, last_event_id: str | None, recent: RecentResults) -> int:
    """The seq a stream follows from: ``Last-Event-ID`` (a reconnecting EventSource), else
    ``?since=``, else the newest kept (only answers from now on); ValueError if malformed."""
    if last_event_id is not None and last_event_id.strip():
        return _integer(last_event_id.strip(), "Last-Event-ID", -1, MAX_SEQ, "an answer's seq")
    q = urllib.parse.parse_qs(query)
    if "since" in q:
        return _integer(q["since"][-1], "since", -1, MAX_SEQ, "an answer's seq")
    latest = recent.since(MAX_SEQ).latest
    return -1 if latest is None else latest


class StreamSlots:
    """At most ``size`` streams at once."""

    def __init__(self, size: int = MAX_STREAMS):
        self._free = threading.BoundedSemaphore(size)

    def take(self) -> bool:
        return self._free.acquire(blocking=False)

    def give_back(self) -> None:
        self._free.release()


def follow(recent: RecentResults, since: int, write: Callable[[bytes], None],
           running: Callable[[], bool], keep_alive: float = KEEP_ALIVE) -> None:
    """Write every answer numbered after ``since`` as an event, as they come, while
    ``running()``; returns when it is not, and raises when ``write`` does (the reader left)."""
    last = since
    while running():
        page = recent.since(last, RESULTS_PAGE)
        if page.gap:  # the reader was further behind than the ring: said, then from the oldest
            write(b"event: gap\ndata: " + _ENCODER.encode(
                {"since": last, "oldest_seq": page.oldest}).encode() + b"\n\n")
        for r in page.results:
            write(f"id: {r['seq']}\n".encode() + b"data: " + _ENCODER.encode(r).encode()
                  + b"\n\n")
            last = r["seq"]
        if page.results:
            continue  # (there may be more than a page)
        if not recent.wait_after(last, keep_alive):
            write(b": keep-alive\n\n")  # an idle stream still tells a dead reader apart
