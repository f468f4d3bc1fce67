"""The device's on-disk spool: a message stays until the broker acknowledged it, survives a
restart whatever state it was in, and a write cut short loses only itself."""

import dataclasses
from pathlib import Path

import pytest

from ddnn.device.buffer import Outbox
from ddnn.device.message import OutMessage
from ddnn.device.spool import Spool
from ddnn.device.spool_run import SpoolRun, default_spool_dir
from ddnn.errors import ConfigError


class Receipt:
    """A transport's receipt whose acknowledgement the test decides."""

    def __init__(self):
        self.acked = False

    def is_published(self) -> bool:
        return self.acked


def msg(i: int) -> OutMessage:
    return OutMessage("scores", bytes([i % 256]) * (i % 7 + 1), i)


def frames(box: Outbox) -> list[int]:
    out = []
    while (m := box.peek(0)) is not None:
        out.append(m.frame)
        box.pop()
    return out


def test_a_message_handed_over_stays_on_disk_until_acknowledged(tmp_path):
    box = Outbox(100, tmp_path)
    for i in range(5):
        box.put(msg(i))
    receipts = [Receipt() for _ in range(3)]
    for r in receipts:
        box.taken(r)
    assert (box.waiting(), box.in_flight(), len(box)) == (2, 3, 5)
    receipts[0].acked = True
    receipts[2].acked = True  # out of order: waits for the one before it
    assert box.settle() == 1 and box.in_flight() == 2
    box.close()
    # A crash now: the unacknowledged two and the two never sent come back, in order.
    again = Outbox(100, tmp_path)
    assert frames(again) == [1, 2, 3, 4]
    again.close()
    assert frames(Outbox(100, tmp_path)) == []


def test_without_close_nothing_written_is_lost(tmp_path):
    box = Outbox(100, tmp_path, sync_every=1000, sync_interval=3600)
    for i in range(10):
        box.put(msg(i))
    box.pop()
    # No close, no fsync: a killed process leaves what it wrote in the page cache.
    assert frames(Outbox(100, tmp_path)) == list(range(1, 10))


def test_fsync_in_batches_by_count_and_by_age(tmp_path):
    spool = Spool(tmp_path / "a", sync_every=3, sync_interval=3600)
    for i in range(7):
        spool.append(i, msg(i))
    assert spool.syncs == 2  # after the 3rd and the 6th
    spool.sync_if_due()
    assert spool.syncs == 2  # the 7th is not old enough
    spool.close()
    assert spool.syncs == 3
    timed = Spool(tmp_path / "b", sync_every=1000, sync_interval=0)
    timed.append(0, msg(0))
    timed.sync_if_due()
    assert timed.syncs == 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_last_record_loses_only_itself(tmp_path, damage, caplog):
    spool = Spool(tmp_path)
    for i in range(4):
        spool.append(i, msg(i))
    spool.close()
    (seg,) = tmp_path.glob("*.log")
    data = bytearray(seg.read_bytes())
    if damage == "truncate":
        data = data[:-2]
    else:
        data[-1] ^= 0xFF
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert [s for s, _ in again.recovered] == [0, 1, 2]
    assert again.next_seq == 3
    assert "unreadable" in caplog.text


def test_segments_rotate_and_go_once_every_message_is_done(tmp_path):
    spool = Spool(tmp_path, segment_bytes=100)
    for i in range(20):
        spool.append(i, msg(i))
    assert len(list(tmp_path.glob("*.log"))) > 2
    for i in range(19):
        spool.done(i)
    # Only the active segment remains (it holds the one message not done).
    assert len(list(tmp_path.glob("*.log"))) == 1
    spool.close()
    again = Spool(tmp_path, segment_bytes=100)
    assert [s for s, _ in again.recovered] == [19]
    again.done(19)
    again.append(20, msg(20))  # a new segment: the recovered one is removed
    again.done(20)
    again.close()
    assert [s for s, _ in Spool(tmp_path).recovered] == []


def test_a_full_outbox_drops_the_oldest_for_good(tmp_path):
    box = Outbox(3, tmp_path)
    for i in range(5):
        box.put(msg(i))
    assert box.dropped == 2
    box.close()
    assert frames(Outbox(3, tmp_path)) == [2, 3, 4]


def test_the_one_file_per_message_spool_is_taken_over(tmp_path: Path):
    for seq, (kind, frame, payload) in enumerate([("scores", 7, b"abc"),
                                                   ("features", 8, b"\x00\x01")]):
        k = kind.encode()
        (tmp_path / f"{seq:016d}.msg").write_bytes(
            bytes([len(k)]) + k + frame.to_bytes(8, "little", signed=True) + payload)
    (tmp_path / "0000000000000002.tmp").write_bytes(b"half")
    box = Outbox(10, tmp_path)
    assert not list(tmp_path.glob("*.msg")) and not list(tmp_path.glob("*.tmp"))
    assert box.peek(0) == OutMessage("scores", b"abc", 7)
    box.pop()
    box.close()
    assert [m.frame for _, m in Spool(tmp_path).recovered] == [8]


# --- whose spool: a run sends again only what it left itself ------------------------------------

RUN = SpoolRun("site", "cam0", "tiny:1", "camera:0")


def test_the_default_spool_is_per_deployment_and_device(tmp_path):
    env = {"HOME": str(tmp_path / "home")}
    assert default_spool_dir("site", "cam0", env) == \
        tmp_path / "home/.local/state/ddnn/spool/site/cam0"
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg")
    assert default_spool_dir("site", "cam1", env) == tmp_path / "xdg/ddnn/spool/site/cam1"
    env["STATE_DIRECTORY"] = f"{tmp_path / 'systemd'}:/other"  # systemd's StateDirectory=
    assert default_spool_dir("b", "cam0", env) == tmp_path / "systemd/spool/b/cam0"


@pytest.mark.parametrize("other", [
    SpoolRun("site", "cam0", "tiny:2", "camera:0"),  # another bundle version
    SpoolRun("site", "cam0", "tiny:1", "camera:1"),  # another source
    SpoolRun("site", "cam1", "tiny:1", "camera:0"),  # another device given the same --spool
    SpoolRun("lab", "cam0", "tiny:1", "camera:0"),  # another deployment
])
def test_a_spool_another_run_left_is_never_sent(tmp_path, other, caplog):
    box = Outbox(100, tmp_path, run=RUN)
    for i in range(5):
        box.put(msg(i))
    box.close()
    again = Outbox(100, tmp_path, run=other)
    assert frames(again) == []
    assert "dropping 5 messages another run left" in caplog.text
    again.close()
    assert not list(tmp_path.glob("*.log")), "dropped for good"


def test_a_restarted_run_sends_what_it_left_and_a_replay_not_what_it_sends_again(tmp_path):
    box = Outbox(100, tmp_path, run=RUN)
    for i in range(5):
        box.put(msg(i))
    box.close()
    again = Outbox(100, tmp_path, run=RUN)  # a camera: frame ids never repeat
    assert frames(again) == [0, 1, 2, 3, 4]
    for i in range(10):
        again.put(msg(i))
    again.close()
    replay = dataclasses.replace(RUN, replayed=range(3, 20))  # frames 3..19 are sent afresh
    assert frames(Outbox(100, tmp_path, run=replay)) == [0, 1, 2]


def test_one_process_at_a_time(tmp_path):
    box = Outbox(100, tmp_path, run=RUN)
    with pytest.raises(ConfigError, match="in use by another process"):
        Outbox(100, tmp_path, run=RUN)
    box.close()
    Outbox(100, tmp_path, run=RUN).close()


def test_the_outbox_and_its_spool_are_bounded_in_bytes(tmp_path):
    bound = 200 << 10
    box = Outbox(1_000_000, tmp_path, max_bytes=bound, run=RUN)
    payload = b"x" * 1000
    for i in range(2000):  # ten times the bound
        box.put(OutMessage("features", payload, i))
        if i % 10 == 0:
            box.taken(Receipt())  # a few in flight, never acknowledged: they stay too
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.log"))
    assert box.dropped > 1500
    assert len(box) * len(payload) <= bound
    assert on_disk <= 2 * bound  # the bound, plus segments pinned by a message in flight
    box.close()
