"""Bytes per forwarded frame on the edge → cloud link: FP32 against packed features, in one run.

The real cloud service (``ddnn cloud`` in a subprocess on a free loopback port) sits behind a
small loopback relay that counts every byte each way: HTTP as it crosses the link, request line
and headers included (TCP/IP framing excluded). The edge's cloud client (``CloudClient``)
forwards batches of 1 and 8 frames of the bundle's edge features (as they leave the bundle's
edge codec) in three ways, one after another on the same server:

* ``fp32_before``: the client as it was before packing: FP32 features, urllib3's default
  headers, ``scores`` and ``entropy`` asked for;
* ``fp32``: today's client against a cloud that does not serve packed features: FP32 to
  ``{name}-cloud``, lean headers, ``scores`` only (the edge computes the entropy);
* ``packed``: today's client against today's cloud: the features packed in the bundle's codec
  to ``{name}-cloud-packed``, negotiated once per version (that one metadata request is
  reported apart, not spread over the frames), on the cloud's lean route (``/lean/{model}/{v}``:
  the packed rows in, the scores' FP32 bytes out, no JSON and no header but the lengths and
  the host; docs/cloud.md).

A bundle that escalates (and a test file to take frames from) adds the escalated requests: the
edge features and every present view's detail of 64 test frames in turn (their bytes vary with
the frame), in four ways: FP32 to ``{name}-escalated``, plain (``escalated_plain``, the client
before it deflated them) and deflated (``escalated_fp32``, the client before it packed them:
``Content-Encoding: deflate``); packed and deflated to ``{name}-escalated-packed``
(``escalated_packed``, the client before the lean frame: the features in the edge codec, the
details one row per slot in the detail codec with which slots hold one, as v2 inputs); and
today's client (``escalated``): each frame in one row of bytes on the lean route to
``{name}-escalated-lean`` (the detail rows through the average filter, deflated with deflate's
filtered strategy; raw FP32 scores back). Their scores are checked to be bit-identical (packing
and filtering are lossless, so the answers are those ``ddnn evaluate`` computes), and a lone
escalated frame's exchange is split into its parts for the last two ways.

Bytes per frame are a request's bytes divided by its frames; the scores of the packed and FP32
paths are checked to be bit-identical. For a lone packed frame the exchange is also split into
its parts (request line and headers, JSON header, tensor bytes; each way), so what remains is
visible. Nothing is asserted.

    ddnn bench --only edge_cloud_bytes [--quick]
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
import socket
import threading
from pathlib import Path

import numpy as np

from ddnn import oip
from ddnn.benchmarks.cloud_throughput import HOST, start_server, wait_ready
from ddnn.benchmarks.common import stop_process, write_json
from ddnn.tools.broker import free_port

BATCHES = (1, 8)
ESCALATED_FRAMES = 64  # test frames the escalated requests take in turn (bytes vary by frame)
AIM = 16.0  # issues 13, 21: edge → cloud bytes per forwarded frame ≥ 16× fewer than FP32


class CountingRelay:
    """A loopback TCP relay to ``port`` that counts the bytes it passes each way."""

    def __init__(self, port: int):
        self.upstream = port
        self.sent = self.received = 0  # client → server, server → client
        self.captured: list[tuple[bool, bytes]] | None = None  # (upward, data), when capturing
        self._lock = threading.Lock()
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self.sent, self.received

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection((HOST, self.upstream))
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upward: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:  # counted before it is passed on: a reader has been counted
                    if upward:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                    if self.captured is not None:
                        self.captured.append((upward, data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._listener.close()


class _ClientBefore:
    """The edge's cloud client as it was before packing (its request, byte for byte)."""

    def __init__(self, url: str, model: str):
        from ddnn.plumbing.http import KeepAliveConnection

        self._conn = KeepAliveConnection(url, "cloud", 10.0)
        self._path = f"/v2/models/{model}/versions/{{}}/infer"

    def infer(self, x: np.ndarray, version: str) -> np.ndarray:
        body, headers = oip.encode_request({oip.EDGE_FEATURES: x},
                                           outputs=["scores", "entropy"])
        status, data, resp_headers = self._conn.request("POST", self._path.format(version),
                                                        body, headers)
        assert status == 200, data[:200]
        return oip.decode_response(data, resp_headers)["scores"]

    def close(self) -> None:
        self._conn.close()


def _measure(relay: CountingRelay, infer, batch: np.ndarray, requests: int) -> dict:
    """Bytes of the first request (with any negotiation) and per request and frame after it."""
    def call() -> tuple[int, int, np.ndarray]:
        before = relay.counts()
        scores = infer(batch)
        after = relay.counts()
        return after[0] - before[0], after[1] - before[1], scores

    first_up, first_down, scores = call()
    ups, downs = zip(*((u, d) for u, d, _ in (call() for _ in range(requests))), strict=True)
    up, down = float(np.mean(ups)), float(np.mean(downs))
    frames = len(batch)
    return {"request_bytes": up, "response_bytes": down,
            "request_bytes_per_frame": up / frames, "response_bytes_per_frame": down / frames,
            "bytes_per_frame": (up + down) / frames,
            "first_call_extra_bytes": first_up + first_down - up - down,
            "constant": len(set(ups)) == 1 and len(set(downs)) == 1,
            "scores": scores}


def _parts(message: bytes) -> dict[str, int]:
    """An HTTP message's bytes by part: start line and headers, JSON header, tensor bytes."""
    head, _, body = message.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    if headers.get(b"content-encoding"):  # deflated: the parts are inside the deflated bytes
        return {"start_line_and_headers": len(head) + 4, "deflated_body": len(body)}
    json_body = b"json" in headers.get(b"content-type", b"")  # else raw bytes (the lean route)
    json_length = int(headers.get(oip.HEADER_LENGTH.lower().encode(),
                                  len(body) if json_body else 0))
    return {"start_line_and_headers": len(head) + 4, "json_header": json_length,
            "tensor_bytes": len(body) - json_length}


def _breakdown(relay: CountingRelay, infer, x: np.ndarray) -> dict:
    """One call's exchange split into its parts, each way."""
    # A call first: a connection the server closed while the client was idle is reopened (and
    # its request sent again) outside the count.
    infer(x)
    relay.captured = []
    infer(x)
    captured, relay.captured = relay.captured, None
    up = b"".join(d for upward, d in captured if upward)
    down = b"".join(d for upward, d in captured if not upward)
    return {"request": _parts(up), "response": _parts(down),
            "request_text": up.partition(b"\r\n\r\n")[0].decode(errors="replace"),
            "response_text": down.partition(b"\r\n\r\n")[0].decode(errors="replace")}


def _ways(url: str, model: str, codec: str):
    from ddnn.edge.cloud_client import CloudClient

    before = _ClientBefore(url, model)
    fp32 = CloudClient(url, model, timeout=10.0)  # no codec: never packs
    packed = CloudClient(url, model, timeout=10.0, codec=codec)
    ways = {"fp32_before": before.infer,
            "fp32": lambda x, v: fp32.infer(x, v, entropy=False)[0],
            "packed": lambda x, v: packed.infer(x, v, entropy=False)[0]}
    return ways, (before, fp32, packed), packed


def _in_turn(client, features: np.ndarray, detail: np.ndarray, version: str):
    """An infer function whose every call sends the next frames (as many as it is given
    indices), round the frames given, to the escalated model."""
    calls = itertools.count()

    def infer(idx: np.ndarray) -> np.ndarray:
        rows = (idx + next(calls) * len(idx)) % len(features)
        return client.infer_escalated(features[rows], detail[rows], version)

    return infer


def _escalated_ways(url: str, bundle, test: Path, requests: int, relay: CountingRelay
                    ) -> tuple[dict, dict]:
    """The escalated requests of the first test frames, plain and deflated, per batch."""
    from ddnn.dataset import load_dataset
    from ddnn.edge.cloud_client import CloudClient
    from ddnn.runtime import BundleRuntime

    m = bundle.manifest
    ds = load_dataset(test, num_classes=m.num_classes)
    seen = np.flatnonzero(ds.present.any(axis=1))[:ESCALATED_FRAMES]
    features, detail = BundleRuntime(bundle).escalation_request(ds.X[seen], ds.present[seen])
    codec = m.codec["edge_features"]  # a client without it never packs: the FP32 ways
    clients = {way: CloudClient(url, f"{m.name}-cloud", timeout=10.0,
                                escalated=f"{m.name}-escalated",
                                codec=codec if way in ("escalated", "escalated_packed") else None)
               for way in ("escalated_plain", "escalated_fp32", "escalated_packed", "escalated")}
    clients["escalated_plain"].escalated_route.deflate = False
    clients["escalated_packed"].escalated_route.lean = False
    results: dict[str, dict] = {way: {} for way in clients}
    for b in BATCHES:
        for way, client in clients.items():  # every way sends the same frames in the same order
            infer = _in_turn(client, features, detail, m.version)
            results[way][str(b)] = _measure(relay, infer, np.arange(b), requests)
    scores = {(way, b): r.pop("scores").view(np.uint32)
              for way, by_batch in results.items() for b, r in by_batch.items()}
    identical = all(np.array_equal(scores["escalated", str(b)], scores[way, str(b)])
                    for b in BATCHES for way in clients)
    breakdown = {way: _breakdown(relay, _in_turn(clients[way], features, detail, m.version),
                                 np.arange(1)) for way in ("escalated_packed", "escalated")}
    about = {"escalated_frames": len(seen),
             "escalated_went_deflated": clients["escalated"].escalated_route.deflate,
             "escalated_went": clients["escalated"].escalated_way(m.version),
             "escalated_packed_went": clients["escalated_packed"].escalated_way(m.version),
             "escalated_scores_bit_identical": identical,
             "detail_shape": list(detail.shape[1:]),
             "escalated_slots_present_mean": float(np.mean(ds.present[seen].sum(axis=1))),
             "escalated_lone_frame_breakdown": breakdown}
    for c in clients.values():
        c.close()
    return results, about


def _run_all(bundle: Path, requests: int, test: Path | None = None) -> tuple[dict, dict]:
    from ddnn.bundle import load_bundle

    loaded = load_bundle(bundle)
    m = loaded.manifest
    model, codec = f"{m.name}-cloud", m.codec["edge_features"]
    sample = tuple(m.cloud.inputs[0].sample_shape)
    rng = np.random.default_rng(0)
    port = free_port()
    proc = start_server(bundle, port, True, 1)
    relay = None
    try:
        wait_ready(port, proc)
        relay = CountingRelay(port)
        ways, clients, packed_client = _ways(f"http://{HOST}:{relay.port}", model, codec)
        results: dict[str, dict] = {w: {} for w in ways}
        for b in BATCHES:
            x = np.sign(rng.standard_normal((b, *sample))).astype(np.float32)
            for way, infer in ways.items():
                results[way][str(b)] = _measure(relay, lambda z, f=infer: f(z, m.version), x,
                                                requests)
        lone = np.sign(rng.standard_normal((1, *sample))).astype(np.float32)
        breakdown = {w: _breakdown(relay, lambda z, f=infer: f(z, m.version), lone)
                     for w, infer in ways.items()}
        scores = {(w, b): r.pop("scores").view(np.uint32)
                  for w, by_batch in results.items() for b, r in by_batch.items()}
        identical = all(np.array_equal(scores["packed", b], s) for (_, b), s in scores.items())
        info = {"model": model, "version": m.version, "codec": codec,
                "features_shape": list(sample), "went_packed": packed_client.packed(m.version),
                "scores_bit_identical": identical, "lone_frame_breakdown": breakdown}
        for c in clients:
            c.close()
        if m.escalated is not None and test is not None:
            escalated, about = _escalated_ways(f"http://{HOST}:{relay.port}", loaded, test,
                                               requests, relay)
            results.update(escalated)
            info.update(about)
        return results, info
    finally:
        if relay is not None:
            relay.close()
        stop_process(proc)


def run(out_dir: Path, bundle: Path, test: Path | None = None, quick: bool = False) -> dict:
    """Measure; writes ``edge_cloud_bytes.json``. ``test``: frames for the escalated requests
    (a bundle that escalates)."""
    requests = 20 if quick else 200
    # (`ddnn bench` runs every benchmark in one process: this one's share is the difference)
    who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    before = [resource.getrusage(w) for w in who]
    results, info = _run_all(Path(bundle), requests, test)
    own, server = (a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
                   for a, b in zip((resource.getrusage(w) for w in who), before, strict=True))
    cpu = {"benchmark_process": round(own, 1), "cloud_server": round(server, 1)}

    def ratio(a: str, b: str, key: str, batch: int) -> float:
        return results[a][str(batch)][key] / results[b][str(batch)][key]

    ratios = {f"batch_{b}": {
        "before_over_packed": ratio("fp32_before", "packed", "bytes_per_frame", b),
        "before_over_packed_requests_only": ratio("fp32_before", "packed",
                                                  "request_bytes_per_frame", b),
        "fp32_over_packed": ratio("fp32", "packed", "bytes_per_frame", b),
        **({"escalated_plain_over_deflated": ratio("escalated_plain", "escalated_fp32",
                                                   "bytes_per_frame", b),
            "escalated_fp32_over_lean": ratio("escalated_fp32", "escalated",
                                                "bytes_per_frame", b),
            "escalated_packed_over_lean": ratio("escalated_packed", "escalated",
                                                "bytes_per_frame", b),
            "escalated_over_fp32": ratio("escalated", "fp32", "bytes_per_frame", b),
            "escalated_over_fp32_before": ratio("escalated", "fp32_before",
                                                "bytes_per_frame", b)}
           if "escalated" in results else {}),
    } for b in BATCHES}
    summary = {f"batch_{b}": {w: round(results[w][str(b)]["bytes_per_frame"], 1)
                              for w in results} for b in BATCHES}
    # The most any framing could give: the FP32 exchange over the packed features alone (int8
    # features, a quarter of FP32, cannot reach 16× however lean the HTTP around them).
    row = info["lone_frame_breakdown"]["packed"]["request"]["tensor_bytes"]
    aims = {f"16x_fewer_bytes_per_frame_batch_{b}": {
        "target": AIM, "measured": ratios[f"batch_{b}"]["before_over_packed"],
        "met": ratios[f"batch_{b}"]["before_over_packed"] >= AIM,
        "bound_without_framing": results["fp32_before"][str(b)]["bytes_per_frame"] / row}
        for b in BATCHES}
    result = {
        "benchmark": "edge_cloud_bytes", "bundle": str(bundle), "quick": quick,
        "requests_per_point": requests, **info,
        "counted": "HTTP bytes each way through a loopback relay (request line, headers, body; "
                   "TCP/IP framing excluded); bytes per frame = a request's bytes / its frames",
        "note": "the server no longer sends 'server: uvicorn' (19 bytes per response); "
                "fp32_before is measured against this server, so it does not count them. The "
                "packed way uses the lean route where the cloud offers it (no date, no "
                "content-type, no JSON header in its answers)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "cpu_seconds": cpu, "summary": summary, "results": results, "ratios": ratios, "aims": aims,
    }
    write_json(Path(out_dir), "edge_cloud_bytes", result)
    return result


def main(argv: list[str] | None = None) -> None:
    """``python -m ddnn.benchmarks.edge_cloud_bytes --bundle B``: the same run on any bundle
    (``ddnn bench`` uses its default one), e.g. the paper preset's (``ddnn train --paper``)."""
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True, type=Path)
    p.add_argument("--out", default="runs/bench/edge_cloud_bytes", type=Path)
    p.add_argument("--test", type=Path, default=None,
                   help="a dataset file to take escalated frames from (a bundle that escalates)")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    result = run(args.out, args.bundle, args.test, quick=args.quick)
    print(json.dumps({"summary": result["summary"], "ratios": result["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
