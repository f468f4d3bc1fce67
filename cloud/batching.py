"""Dynamic batching: concurrent requests for one model run as one ONNX Runtime call.

A request waits in a bounded per-model queue. The model's batch loop takes the oldest request,
then gathers more until the batch holds ``max_batch_size`` samples or the oldest request has
waited ``max_queue_delay`` — whichever comes first, and without waiting at all when no other
request is on its way — and runs the batch in a worker thread, so the event loop keeps accepting
requests. While a batch runs the next one fills up, which is where
the throughput comes from under load. With batching off each request runs alone (still off the
event loop): the plain one-request-one-run endpoint the benchmarks compare against.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from ddnn.oip import OipError

log = logging.getLogger(__name__)

Predict = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class OverloadedError(OipError):
    """The model's queue is full; the client should retry later."""

    status = 503


@dataclass
class _Pending:
    inputs: dict[str, np.ndarray]
    size: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    """Runs ``predict`` for one model, batching concurrent requests when ``enabled``."""

    def __init__(self, name: str, predict: Predict, executor: Executor, *, enabled: bool = True,
                 max_batch_size: int = 64, max_queue_delay: float = 0.002, max_queue: int = 1024,
                 on_batch: Callable[[int, float], None] | None = None,
                 on_depth: Callable[[int], None] | None = None):
        self.name = name
        self._predict = predict
        self._executor = executor
        self.enabled = enabled
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay
        self.max_queue = max_queue
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_depth = on_depth or (lambda depth: None)
        self._queue: collections.deque[_Pending] = collections.deque()
        self._depth = 0  # samples queued or running, for the queue-depth gauge and the bound
        self._arriving = 0  # requests being read or checked that will join the queue soon
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        return self._depth

    @contextlib.contextmanager
    def expecting(self) -> Iterator[None]:
        """Announce a request on its way (being decoded); batches wait only for such requests."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            if self._wakeup is not None:
                self._wakeup.set()  # it joined the queue or failed: the gatherer re-checks

    async def submit(self, inputs: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
        """Run one request's ``size`` samples; returns its slice of the outputs."""
        if self._depth + size > self.max_queue and self._depth > 0:
            raise OverloadedError(f"model {self.name} has {self._depth} samples queued; "
                                  "retry later")
        self._set_depth(self._depth + size)
        try:
            if not self.enabled:
                return await self._run_alone(inputs, size)
            loop = asyncio.get_running_loop()
            item = _Pending(inputs, size, loop.create_future())
            self._queue.append(item)
            self._ensure_loop()
            self._wakeup.set()  # type: ignore[union-attr]
            return await item.future
        finally:
            self._set_depth(self._depth - size)

    async def _run_alone(self, inputs: dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._executor, self._predict, inputs)
        self._on_batch(size, time.perf_counter() - start)
        return out

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._on_depth(depth)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._batch_loop(),
                                                                name=f"batcher {self.name}")

    async def close(self, drain_timeout: float = 10.0) -> None:
        """Stop the batch loop once the requests already queued are answered (or time out)."""
        deadline = time.monotonic() + drain_timeout
        while self._depth and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # draining: polls the queue, bounded by drain_timeout
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail(list(self._queue), OverloadedError(f"model {self.name} was unloaded"))
        self._queue.clear()

    # --- the loop ---------------------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        while True:
            batch = await self._gather()
            if batch:
                await self._run(batch)

    def _pop_live(self) -> _Pending | None:
        """The oldest queued request whose client is still waiting."""
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():  # a cancelled request (client gone) is skipped
                return item
        return None

    async def _wait(self, timeout: float | None) -> bool:
        """Wait for a new request; False when ``timeout`` passed first."""
        assert self._wakeup is not None
        self._wakeup.clear()
        if timeout is None:
            await self._wakeup.wait()
            return True
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):  # distinct classes before Python 3.11
            return False
        return True

    async def _gather(self) -> list[_Pending]:
        first = self._pop_live()
        while first is None:
            await self._wait(None)
            first = self._pop_live()
        batch, size = [first], first.size
        # The delay counts from when the oldest request arrived, not from when the loop got free.
        deadline = first.enqueued + self.max_queue_delay
        while size < self.max_batch_size:
            if not self._queue:
                # Waiting pays only when a request is on its way: with none, the batch goes now
                # (at low load that saves the whole delay; under load the queue refills while
                # a batch runs, so batches grow anyway).
                remaining = deadline - time.monotonic()
                if not self._arriving or remaining <= 0 or not await self._wait(remaining):
                    break
                continue
            if size + self._queue[0].size > self.max_batch_size:
                break  # it starts the next batch rather than overfilling this one
            item = self._pop_live()
            if item is not None:
                batch.append(item)
                size += item.size
        return batch

    async def _run(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        try:
            if len(batch) == 1:
                inputs = batch[0].inputs
            else:
                inputs = {k: np.concatenate([p.inputs[k] for p in batch]) for k in batch[0].inputs}
            out = await loop.run_in_executor(self._executor, self._predict, inputs)
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch, e)
            else:  # one request's failure must not fail the others: run each alone
                for p in batch:
                    await self._run([p])
            return
        except asyncio.CancelledError:
            self._fail(batch, OverloadedError(f"model {self.name} was unloaded"))
            raise
        self._on_batch(sum(p.size for p in batch), time.perf_counter() - start)
        offset = 0
        for p in batch:
            if not p.future.done():
                p.future.set_result({k: v[offset:offset + p.size] for k, v in out.items()})
            offset += p.size

    @staticmethod
    def _fail(batch: list[_Pending], error: BaseException) -> None:
        for p in batch:
            if not p.future.done():
                p.future.set_exception(error)
