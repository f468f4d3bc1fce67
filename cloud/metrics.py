"""The cloud service's Prometheus series, rendered at ``/metrics``."""

from __future__ import annotations

from ddnn.plumbing.metrics import Registry

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Error kinds by HTTP status, so dashboards can tell a client's mistakes from the server's.
ERROR_KINDS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "bad_method", 413: "too_large", 503: "overloaded", 500: "internal"}


class CloudMetrics:
    """Requests, latencies, batch sizes, queue depth, errors and repository loads."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("ddnn_cloud_requests_total", "Inference requests answered",
                                  ("model", "version", "encoding", "code"))
        self.latency = r.histogram("ddnn_cloud_request_seconds",
                                   "Inference request latency, body read to response built",
                                   ("model", "version"))
        self.batch_size = r.histogram("ddnn_cloud_batch_size",
                                      "Samples per ONNX Runtime call", ("model", "version"),
                                      buckets=BATCH_BUCKETS)
        self.run_seconds = r.histogram("ddnn_cloud_inference_seconds",
                                       "Duration of one ONNX Runtime call (a batch)",
                                       ("model", "version"))
        self.queue_depth = r.gauge("ddnn_cloud_queue_depth",
                                   "Samples waiting or running per model", ("model", "version"))
        self.errors = r.counter("ddnn_cloud_errors_total", "Requests refused or failed, by kind",
                                ("kind",))
        self.model_ready = r.gauge("ddnn_cloud_model_ready",
                                   "1 while a model version is served", ("model", "version"))
        self.loads = r.counter("ddnn_cloud_bundle_loads_total",
                               "Bundle load attempts by the repository", ("result",))
        self.failed_bundles = r.gauge("ddnn_cloud_bundles_failed",
                                      "Bundle directories that currently fail to load")

    def error(self, status: int) -> None:
        self.errors.inc(kind=ERROR_KINDS.get(status, f"http_{status}"))

    def render(self) -> str:
        return self.registry.render()
