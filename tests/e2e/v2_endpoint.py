"""A minimal, real Open Inference Protocol v2 endpoint for ``{name}-cloud``, for tests.

Serves ``GET /v2/health/ready`` and ``POST /v2/models/{name}-cloud/infer`` with
``BundleRuntime.cloud`` over the standard library's HTTP server, using :mod:`ddnn.oip` on the
server side. It stands in for ``ddnn cloud`` where starting uvicorn is not wanted (in-process
integration tests); the e2e tests use the real cloud service when it is installed.
Run alone: ``python -m tests.e2e.v2_endpoint --bundle B --port P``.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from ddnn import oip
from ddnn.bundle import load_bundle
from ddnn.exits import entropy_of_logits
from ddnn.runtime import BundleRuntime


class V2Endpoint:
    """``{name}-cloud`` of a bundle on ``127.0.0.1:port`` in a background thread."""

    def __init__(self, bundle_dir, port: int = 0, host: str = "127.0.0.1"):
        bundle = load_bundle(bundle_dir)
        runtime = BundleRuntime(bundle, threads=1)
        runtime.runner("cloud")
        self.model = f"{bundle.manifest.name}-cloud"
        self.calls = 0
        self.server = ThreadingHTTPServer((host, port), self._handler(runtime))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self, runtime: BundleRuntime):
        endpoint = self
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms stalls

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                ok = self.path in ("/v2/health/ready", "/v2/health/live")
                self._send(200 if ok else 404, b"{}", {"Content-Type": "application/json"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != f"/v2/models/{endpoint.model}/infer":
                    self._send(404, oip.error_body("no such model"), {})
                    return
                try:
                    req = oip.decode_request(body, dict(self.headers))
                    with lock:
                        scores = runtime.cloud(req.inputs["edge_features"])
                except (oip.OipError, KeyError) as e:
                    self._send(400, oip.error_body(str(e)), {"Content-Type": "application/json"})
                    return
                endpoint.calls += 1
                outputs = {"scores": scores.astype(np.float32),
                           "entropy": entropy_of_logits(scores).astype(np.float32)}
                out, headers = oip.encode_response(endpoint.model, "1", outputs,
                                                   request_id=req.id,
                                                   binary_outputs=req.binary_outputs)
                self._send(200, out, headers)

        return Handler

    def start(self) -> V2Endpoint:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> V2Endpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bundle", required=True)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    endpoint = V2Endpoint(args.bundle, args.port)
    endpoint.server.serve_forever()


if __name__ == "__main__":
    main()
