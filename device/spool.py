"""The device's on-disk spool: the outbox's messages kept until the broker acknowledged them.

A crash, a SIGKILL or a power cut must not lose what a device measured while its uplink was
away, nor what it had handed to the MQTT client but the broker had not yet acknowledged
(PUBACK). So the outbox writes every message here first and marks it *done* only when the
broker has acknowledged it (or when the bounded outbox dropped it, counted); after a restart
every message not done is sent again. Delivery is therefore **at least once**: a message
acknowledged just before a crash, but not yet marked done, is sent twice; receivers drop the
duplicate (the edge counts it as ``duplicate`` or ``late``).

Layout of the directory: append-only segments ``{first seq:016d}.log`` of records

    u32 body length | u32 crc32(body) | body = u64 seq | i64 frame | u8 len(kind) | kind | payload

and beside each a ``{first seq:016d}.done`` file of the u64 sequence numbers that are done. A
segment is removed once a newer one exists and all its messages are done.

Durability: a record is written with one ``write`` call, so a killed process loses nothing that
was put; the segment is fsynced every ``sync_every`` messages or ``sync_interval`` seconds,
whichever comes first, so a power cut loses at most that window (``sync_every=1`` syncs every
message). Done markers are never fsynced: losing one only sends a message again. Recovery reads
each segment up to its first torn or corrupt record.
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ddnn.device.message import OutMessage
from ddnn.device.spool_run import SpoolLock, SpoolRun, adopt
from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")  # body length, crc32 of the body
_BODY = struct.Struct("<qqB")  # seq, frame, length of the kind
_SEQ = struct.Struct("<Q")
MAX_RECORD = 64 << 20  # a larger length field is corruption, not a message


@dataclass
class _Segment:
    first: int
    log: Path
    done: Path
    outstanding: set[int] = field(default_factory=set)
    done_fd: int | None = None
    size: int = 0  # bytes of its log

    def close(self) -> None:
        if self.done_fd is not None:
            os.close(self.done_fd)
            self.done_fd = None


def _encode(seq: int, msg: OutMessage) -> bytes:
    kind = msg.kind.encode()
    body = _BODY.pack(seq, msg.frame, len(kind)) + kind + msg.payload
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _records(data: bytes) -> tuple[list[tuple[int, OutMessage]], int]:
    """The records of a segment's bytes, and how many bytes they took (the rest is torn)."""
    out, pos = [], 0
    while pos + _HEAD.size <= len(data):
        length, crc = _HEAD.unpack_from(data, pos)
        body = data[pos + _HEAD.size: pos + _HEAD.size + length]
        if length > MAX_RECORD or len(body) < length or zlib.crc32(body) != crc \
                or length < _BODY.size:
            break
        seq, frame, n = _BODY.unpack_from(body)
        try:
            kind = body[_BODY.size: _BODY.size + n].decode()
        except UnicodeDecodeError:
            break
        out.append((seq, OutMessage(kind, bytes(body[_BODY.size + n:]), frame)))
        pos += _HEAD.size + length
    return out, pos


class Spool:
    """The on-disk half of :class:`~ddnn.device.buffer.Outbox` (not thread-safe: the outbox
    calls it under its lock).

    After construction :attr:`recovered` holds the messages a previous process left undone,
    oldest first, and :attr:`next_seq` the first sequence number that is free. With ``run``
    (:mod:`~ddnn.device.spool_run`) the spool is locked for this process and keeps only what
    that run sends again.
    """

    def __init__(self, directory: str | Path, *, sync_every: int = 64,
                 sync_interval: float = 0.2, segment_bytes: int = 4 << 20,
                 run: SpoolRun | None = None):
        if sync_every < 1 or sync_interval < 0:
            raise ConfigError("the spool syncs every N >= 1 messages or T >= 0 seconds")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = SpoolLock(self.dir) if run is not None else None
        self.sync_every, self.sync_interval = sync_every, sync_interval
        self.segment_bytes = segment_bytes
        self.syncs = 0  # fsyncs made (for tests and the exit summary)
        self.bytes = 0  # bytes of the segments on disk
        self._segments: dict[int, _Segment] = {}
        self._starts: list[int] = []  # first seq of every segment, ascending
        self._active: _Segment | None = None
        self._fd: int | None = None  # the active segment, open for appending
        self._size = 0
        self._unsynced = 0
        self._unsynced_since = 0.0
        self._dir_dirty = False  # a segment was created since the directory was synced
        self.recovered: list[tuple[int, OutMessage]] = []
        self.next_seq = 0
        self._recover()
        if run is not None:
            self.recovered, stale = adopt(self.dir, self.recovered, run)
            for seq, _ in stale:
                self.done(seq)
        if self.recovered:
            log.info("spool: %d unacknowledged messages recovered from %s; sending them again "
                     "(at least once: the edge drops duplicates)", len(self.recovered), self.dir)

    # --- recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        for stray in self.dir.glob("*.tmp"):  # the one-file-per-message spool's half-writes
            stray.unlink(missing_ok=True)
        for f in sorted(self.dir.glob("*.log"), key=lambda p: p.stem):
            try:
                first = int(f.stem)
            except ValueError:
                continue
            self._recover_segment(first, f)
        for done in self.dir.glob("*.done"):  # a segment removed before its markers
            if not done.with_suffix(".log").exists():
                done.unlink(missing_ok=True)
        legacy = self._legacy()
        for _, msg in legacy:  # re-written in this format before the old files go
            self.recovered.append((self.next_seq, msg))
            self.append(self.next_seq, msg)
        if legacy:
            self.sync()
            for f in self.dir.glob("*.msg"):
                f.unlink(missing_ok=True)

    def _recover_segment(self, first: int, path: Path) -> None:
        data = path.read_bytes()
        records, used = _records(data)
        if used < len(data):
            log.warning("spool: %s: %d bytes after record %d unreadable (a write cut short by "
                        "a crash or power cut); dropped", path.name, len(data) - used,
                        len(records))
        done_path = path.with_suffix(".done")
        done: set[int] = set()
        if done_path.exists():
            raw = done_path.read_bytes()
            done = {_SEQ.unpack_from(raw, i)[0] for i in range(0, len(raw) - 7, _SEQ.size)}
        seg = _Segment(first, path, done_path, size=len(data))
        for seq, msg in records:
            self.next_seq = max(self.next_seq, seq + 1)
            if seq not in done:
                seg.outstanding.add(seq)
                self.recovered.append((seq, msg))
        if seg.outstanding:
            self._segments[first] = seg
            self._starts.append(first)
            self.bytes += seg.size
        else:
            self._remove(seg)

    def _legacy(self) -> list[tuple[int, OutMessage]]:
        """Messages of the spool format before this one: one ``{seq}.msg`` file each."""
        out = []
        for f in sorted(self.dir.glob("*.msg")):
            try:
                data = f.read_bytes()
                n = data[0]
                kind = data[1:1 + n].decode()
                frame = int.from_bytes(data[1 + n:9 + n], "little", signed=True)
                out.append((int(f.stem), OutMessage(kind, data[9 + n:], frame)))
            except (ValueError, IndexError, UnicodeDecodeError, OSError):
                log.warning("spool: dropping unreadable %s", f.name)
        return sorted(out, key=lambda x: x[0])

    # --- writing ----------------------------------------------------------------------------

    def _rotate(self, seq: int) -> None:
        old = self._active
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
        path = self.dir / f"{seq:016d}.log"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = 0
        self._active = seg = _Segment(seq, path, path.with_suffix(".done"))
        self._segments[seq] = seg
        self._starts.append(seq)
        self._dir_dirty = True
        if old is not None and not old.outstanding:
            self._forget(old)

    def append(self, seq: int, msg: OutMessage) -> None:
        """Write one message (``seq`` above every earlier one); fsync when a batch is due."""
        if self._fd is None or self._size >= self.segment_bytes:
            self._rotate(seq)
        record = _encode(seq, msg)
        os.write(self._fd, record)  # type: ignore[arg-type]
        self._size += len(record)
        self._active.size += len(record)  # type: ignore[union-attr]
        self.bytes += len(record)
        self._active.outstanding.add(seq)  # type: ignore[union-attr]
        self.next_seq = max(self.next_seq, seq + 1)
        if self._unsynced == 0:
            self._unsynced_since = time.monotonic()
        self._unsynced += 1
        if self._unsynced >= self.sync_every:
            self.sync()

    def sync_if_due(self) -> None:
        """fsync when the oldest unsynced message has waited ``sync_interval``."""
        if self._unsynced and time.monotonic() - self._unsynced_since >= self.sync_interval:
            self.sync()

    def sync(self) -> None:
        """Make every message written so far survive a power cut."""
        if self._fd is not None and self._unsynced:
            os.fsync(self._fd)
            self.syncs += 1
        if self._dir_dirty:  # the new segment's name must survive too
            fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._dir_dirty = False
        self._unsynced = 0

    def done(self, seq: int) -> None:
        """The message ``seq`` needs no sending any more (acknowledged, or dropped)."""
        i = bisect.bisect_right(self._starts, seq) - 1
        if i < 0:
            return
        seg = self._segments[self._starts[i]]
        if seq not in seg.outstanding:
            return
        seg.outstanding.discard(seq)
        if not seg.outstanding and seg is not self._active:
            self._forget(seg)
            return
        if seg.done_fd is None:
            seg.done_fd = os.open(seg.done, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(seg.done_fd, _SEQ.pack(seq))

    def _forget(self, seg: _Segment) -> None:
        del self._segments[seg.first]
        self._starts.remove(seg.first)
        self.bytes -= seg.size
        self._remove(seg)

    @staticmethod
    def _remove(seg: _Segment) -> None:
        seg.close()
        seg.log.unlink(missing_ok=True)  # the log first: markers without a log are ignored
        seg.done.unlink(missing_ok=True)

    def close(self) -> None:
        """fsync what is written and close every file."""
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        for seg in self._segments.values():
            seg.close()
        if self._lock is not None:
            self._lock.release()
