"""The edge's answers numbered and served without gaps (ddnn.edge.sequence, results_feed, the
recent results ring): seq increases across restarts, pages by seq miss nothing that frame
cursors miss, a consumer behind the ring is told so, a stream resumes where it left off."""

from __future__ import annotations

import json

import pytest

from ddnn.edge.events import EdgeEvents
from ddnn.edge.fanout import ResultFanout
from ddnn.edge.results_feed import follow, results_query, stream_start
from ddnn.edge.sequence import BLOCK, STATE_FILE, AnswerSequence
from ddnn.edge.sinks import RecentResults
from ddnn.errors import ConfigError
from ddnn.result import Result


def result(frame: int, seq: int | None = None) -> Result:
    return Result(frame=frame, cls=0, label="car", exit="local", entropy=0.1, views=("cam0",),
                  seq=seq)


def test_seq_keeps_increasing_across_restarts_and_crashes(tmp_path):
    first = AnswerSequence(tmp_path).open()
    given = [first.next() for _ in range(10)]
    assert given == list(range(10))
    # A crash: nothing is written at exit. The next run starts past the reserved block.
    second = AnswerSequence(tmp_path).open()
    assert second.first >= 10 and second.next() == BLOCK
    assert [second.next() for _ in range(BLOCK + 5)][-1] == 2 * BLOCK + 5  # a second block
    third = AnswerSequence(tmp_path).open()
    assert third.next() > 2 * BLOCK + 5
    # Without a state directory, the clock: a later run still starts past an earlier one.
    a, b = AnswerSequence().open(), AnswerSequence().open()
    assert b.next() >= a.next()


def test_a_bad_state_file_is_refused_clearly(tmp_path):
    (tmp_path / STATE_FILE).write_text("not a number\n")
    with pytest.raises(ConfigError, match="not an answer number"):
        AnswerSequence(tmp_path).open()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--state-dir"):
        AnswerSequence(blocker / "state").open()  # a directory under a file cannot be made


def test_paging_by_seq_misses_the_answers_that_frame_cursors_miss():
    # Frames 0..9 answered out of order: 2 and 5 went to the cloud and came back last.
    ring = RecentResults(100)
    order = [0, 1, 3, 4, 6, 7, 8, 9, 2, 5]
    for seq, frame in enumerate(order):
        ring.publish(result(frame, seq))
    # The old way: a consumer that read frames 0..4 as the first answers came, pages on after
    # frame 4 and never sees frame 2.
    assert 2 not in [r["frame"] for r in ring.after(4)]
    got, since = [], -1
    while True:
        page = ring.since(since, limit=3)
        if not page.results:
            break
        got += [r["frame"] for r in page.results]
        since = page.results[-1]["seq"]
        assert not page.gap
    assert got == order


def test_a_consumer_further_behind_than_the_ring_is_told_so():
    ring = RecentResults(5)
    for seq in range(20):
        ring.publish(result(seq, seq))
    page = ring.since(3)
    assert page.gap and page.oldest == 15 and page.latest == 19
    assert [r["seq"] for r in page.results] == [15, 16, 17, 18, 19]
    assert not ring.since(14).gap and not ring.since(19).results
    # Answer numbers have holes (a restart's jump, the clock start): no gap unless one was lost.
    fresh = RecentResults(5)
    for seq in (10**15, 10**15 + 1):
        fresh.publish(result(0, seq))
    assert not fresh.since(-1).gap and len(fresh.since(-1).results) == 2


def test_the_ring_outlives_a_graceful_restart_in_the_state_dir(tmp_path):
    before = ResultFanout([], EdgeEvents(), state_dir=tmp_path)
    before.start()
    for frame in range(5):
        before.publish(result(frame))
    before.close()
    after = ResultFanout([], EdgeEvents(), state_dir=tmp_path)
    after.start()
    after.publish(result(5))
    seqs = [r["seq"] for r in after.recent.since(-1).results]
    assert seqs[:5] == list(range(5)) and seqs[5] >= BLOCK  # the old answers, then the new
    assert [r["frame"] for r in after.recent.since(4).results] == [5]
    assert not after.recent.since(4).gap  # the jump to the new block lost nothing


def test_the_query_takes_one_cursor_and_bounded_numbers():
    assert results_query("since=5&limit=10").since == 5
    q = results_query("after=7")
    assert q.since is None and q.after == 7 and q.limit == 100
    for bad in ("since=1&after=2", "since=-2", "since=" + "9" * 30, "since=x", "limit=0",
                f"since={2**53}"):
        with pytest.raises(ValueError):
            results_query(bad)


def test_a_stream_resumes_from_last_event_id_and_says_when_it_fell_behind():
    ring = RecentResults(4)
    for seq in range(3):
        ring.publish(result(seq, seq))
    assert stream_start("", None, ring) == 2  # no cursor: from the next answer on
    assert stream_start("since=0", None, ring) == 0
    assert stream_start("since=0", "1", ring) == 1  # a reconnecting EventSource wins
    with pytest.raises(ValueError):
        stream_start("", "abc", ring)

    written: list[bytes] = []
    stop_after = iter(range(3))

    def running() -> bool:
        return next(stop_after, None) is not None

    follow(ring, 0, written.append, running, keep_alive=0.01)
    events = [e for e in b"".join(written).split(b"\n\n") if e and not e.startswith(b":")]
    assert [json.loads(e.split(b"data: ")[1])["seq"] for e in events] == [1, 2]
    assert events[0].startswith(b"id: 1\n")
    for seq in range(3, 10):  # the reader falls behind the ring (it keeps 4)
        ring.publish(result(seq, seq))
    written.clear()
    stop_after = iter(range(2))
    follow(ring, 2, written.append, running, keep_alive=0.01)
    text = b"".join(written)
    assert text.startswith(b"event: gap\ndata: ") and b'"oldest_seq":6' in text
    assert b"id: 9\n" in text
