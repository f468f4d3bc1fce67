"""The cloud inference service behind the HTTP routes: repository, batchers, metrics, inference.

:class:`CloudService` owns everything with a lifetime — the worker threads that call ONNX Runtime,
one :class:`~ddnn.cloud.batching.Batcher` per served model version, the repository poller —
and turns a request body into a response body. The HTTP layer (:mod:`ddnn.cloud.app`) only
routes and frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddnn.cloud.batching import Batcher
from ddnn.cloud.metrics import CloudMetrics
from ddnn.cloud.models import ServedModel
from ddnn.cloud.repository import Failure, ModelRepository
from ddnn.cloud.settings import CloudSettings
from ddnn.errors import ConfigError
from ddnn.oip import (
    HEADER_LENGTH,
    InferRequest,
    OipError,
    decode_request,
    encode_raw_response,
    encode_response,
)

log = logging.getLogger(__name__)

# Bodies larger than this are parsed (and packed features unpacked) in a worker thread so the
# event loop keeps serving.
_PARSE_OFF_LOOP = 1 << 20
_RAW_REQUEST = {HEADER_LENGTH: "0"}  # how the lean route's body is read


class CloudService:
    """Serves the models of a repository with dynamic batching; one per running app."""

    def __init__(self, settings: CloudSettings):
        self.settings = settings
        self.metrics = CloudMetrics()
        self.repository = ModelRepository(
            settings.root, single=settings.bundle is not None, ort_threads=settings.ort_threads,
            on_load=self._attach, on_unload=self._detach, on_failure=self._failed,
            public_key=settings.bundle_key)
        self._batchers: dict[ServedModel, Batcher] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task] = set()
        self._poller: asyncio.Task | None = None

    # --- lifetime -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the repository and start polling it; a lone ``--bundle`` that fails is fatal."""
        s = self.settings
        self._executor = ThreadPoolExecutor(s.inference_threads, thread_name_prefix="ddnn-ort")
        await self.repository.poll()
        if s.bundle is not None and not self.repository.ready:
            reason = "; ".join(f.reason for f in self.repository.failures()) or "nothing loaded"
            raise ConfigError(f"cannot serve bundle {s.bundle}: {reason}")
        if s.poll_interval > 0:
            self._poller = asyncio.create_task(self._poll_forever(), name="repository poller")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for batcher in self._batchers.values():
            await batcher.close(drain_timeout=5.0)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval)  # the scan period, not a wait
            try:
                await self.repository.poll()
            except Exception:  # a scan bug must not end hot reload for good
                log.exception("repository poll failed")

    # --- repository hooks -------------------------------------------------------------------------

    def _attach(self, model: ServedModel) -> None:
        s, m = self.settings, self.metrics
        labels = {"model": model.name, "version": model.version}

        def on_batch(size: int, seconds: float) -> None:
            m.batch_size.observe(size, **labels)
            m.run_seconds.observe(seconds, **labels)

        self._batchers[model] = Batcher(
            model.ref, model.predict, self._executor,  # type: ignore[arg-type]
            enabled=s.batching, max_batch_size=s.max_batch_size,
            max_queue_delay=s.max_queue_delay_ms / 1000.0, max_queue=s.max_queue,
            on_batch=on_batch, on_depth=lambda depth: m.queue_depth.set(depth, **labels))
        m.model_ready.set(1, **labels)
        m.loads.inc(result="ok")
        m.failed_bundles.set(len(self.repository.failures()))

    def _detach(self, model: ServedModel) -> None:
        self.metrics.model_ready.set(0, model=model.name, version=model.version)
        batcher = self._batchers.pop(model, None)
        if batcher is not None:  # let its queued requests finish, then stop its loop
            task = asyncio.get_running_loop().create_task(batcher.close())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _failed(self, failure: Failure) -> None:
        self.metrics.loads.inc(result="failed")
        self.metrics.failed_bundles.set(len(self.repository.failures()))

    # --- inference --------------------------------------------------------------------------------

    async def infer(self, name: str, version: str | None, body: bytes | bytearray,
                    headers: Mapping[str, str], *, lean: bool = False
                    ) -> tuple[bytes, dict[str, str]]:
        """Answer one inference request body; raises :class:`OipError` for the client's mistakes.
        ``lean`` (the lean route): the body is a raw binary request whatever the headers say, and
        the answer the raw bytes of the model's first output, with no headers."""
        start = time.perf_counter()
        if lean:
            encoding, headers = "lean", _RAW_REQUEST
        else:
            encoding = "binary" if headers.get(HEADER_LENGTH) is not None else "json"
        model: ServedModel | None = None
        code = 500
        try:
            model = self.repository.get(name, version)
            batcher = self._batchers[model]
            with batcher.expecting():
                if len(body) > _PARSE_OFF_LOOP:
                    request, inputs, size = await asyncio.to_thread(_parse, model, body, headers)
                else:
                    request, inputs, size = _parse(model, body, headers)
            outputs = await batcher.submit(inputs, size)
            if lean:
                answer = encode_raw_response(outputs[model.outputs[0].name]), {}
            else:
                answer = encode_response(model.name, model.version, model.encode(request, outputs),
                                         request_id=request.id,
                                         binary_outputs=request.binary_outputs)
            code = 200
            return answer
        except OipError as e:
            code = e.status
            raise
        finally:
            labels = {"model": model.name if model else name,
                      "version": model.version if model else (version or "")}
            if model is not None:  # errors by kind are counted where they are answered
                self.metrics.requests.inc(encoding=encoding, code=str(code), **labels)
                self.metrics.latency.observe(time.perf_counter() - start, **labels)


def _parse(model: ServedModel, body: bytes | bytearray, headers: Mapping[str, str]
           ) -> tuple[InferRequest, dict[str, np.ndarray], int]:
    """The request, its inputs as the model runs them (checked, unpacked) and its batch size."""
    # A JSON body holding more arrays than this model's tensors can need is refused by a count
    # of its bytes, before json.loads builds them.
    request = decode_request(body, headers, max_json_arrays=model.json_arrays,
                             raw_input=model.raw_input)
    inputs, size = model.decode(request)
    return request, inputs, size
