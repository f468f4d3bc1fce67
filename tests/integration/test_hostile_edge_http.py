"""The edge's HTTP server (``POST /v1/ingest``, ``POST /v1/results``) against hostile clients,
on a real server on a loopback port:

* per-device tokens (``--http-tokens``): a device's token posts only that device's envelopes
  and results, as its MQTT credentials publish only on its own topics;
* a multi-view bundle's devices never post results (the edge answers their frames);
* the connections are bounded: idle ones cannot pile up threads or lock the server out.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from ddnn import envelope as env
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.envelope import MessageType
from ddnn.errors import ConfigError
from tests.support.data import one_epoch_bundle
from tests.support.polling import wait_for

TOKENS = {"cam0": "cam0-token-0123456789", "cam1": "cam1-token-0123456789",
          "cam2": "cam2-token-0123456789"}


def bearer(device: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[device]}"}


def tokens_file(tmp_path: Path, devices=("cam0", "cam1", "cam2")) -> Path:
    path = tmp_path / "http-tokens"
    path.write_text("# device token\n" + "".join(f"{d} {TOKENS[d]}\n" for d in devices))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def edge(bundle: Path, **settings):
    service = EdgeService.from_settings(EdgeSettings(bundle=bundle, http_port=0, **settings))
    with service:
        yield service


def scores_of(device: str, frame: int, deployment="default") -> bytes:
    return env.encode(env.pack(MessageType.SCORES, model="tiny", version="1",
                               deployment=deployment, device=device, frame=frame,
                               tensor=np.zeros((1, 3), np.float32), codec="float16"))


def result_of(device: str, frame: int = 7) -> dict:
    return {"frame": frame, "class": 0, "label": "car", "exit": "local", "entropy": 0.1,
            "views": [device], "missing": {}, "partial": False, "degraded": False,
            "latency_ms": 2.5}


@pytest.fixture(scope="module")
def six_view_bundle(tmp_path_factory) -> Path:
    """A six-view bundle (what is tested is the edge, not accuracy)."""
    return one_epoch_bundle(tmp_path_factory.mktemp("six-views"), views=6)


# --- per-device tokens -----------------------------------------------------------------------

def test_a_devices_token_cannot_post_as_another_device(tiny_bundle, tmp_path, caplog):
    with caplog.at_level(logging.INFO), edge(tiny_bundle,
                                             http_tokens=tokens_file(tmp_path)) as service:
        agg, url = service.aggregator, service.http.url
        # cam0's leaked token, posting one frame's scores as every device of the bundle:
        refused = [httpx.post(f"{url}/v1/ingest", content=scores_of(d, 5), headers=bearer("cam0"))
                   for d in ("cam1", "cam2")]
        assert [r.status_code for r in refused] == [403, 403]
        assert refused[0].json() == {"error": "the token of cam0 cannot post a message of cam1"}
        assert agg.metrics.messages.value(kind="scores") == 0  # nothing reached the frame
        assert service.http.metrics.refused.value(reason="forbidden") == 2
        # ... and its own scores are taken.
        ok = httpx.post(f"{url}/v1/ingest", content=scores_of("cam0", 5), headers=bearer("cam0"))
        assert ok.status_code == 202 and ok.json()["accepted"] is True
        assert agg.metrics.messages.value(kind="scores") == 1
        # A token that is nobody's is a 401, as before; no token at all too.
        assert httpx.post(f"{url}/v1/ingest", content=scores_of("cam0", 6),
                          headers={"Authorization": "Bearer cam9-token-0123456789"}
                          ).status_code == 401
        assert httpx.post(f"{url}/v1/ingest", content=scores_of("cam0", 6)).status_code == 401
        assert service.http.metrics.refused.value(reason="unauthorized") == 2
        # Results: another device's token cannot post one (nor, with three views, its own).
        r = httpx.post(f"{url}/v1/results", content=json.dumps(result_of("cam0")),
                       headers=bearer("cam1"))
        assert r.status_code == 403
        # Frame 5 was answered from cam0's view alone; the made-up frame 7 never was.
        results = wait_for(lambda: httpx.get(f"{url}/v1/results").json(), what="frame 5")
        assert [(r["frame"], r["views"]) for r in results] == [(5, ["cam0"])]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'ddnn_edge_http_refused_total{reason="forbidden"} 3.0' in metrics
    text = caplog.text
    assert "the token of cam0 cannot post a message of cam1" in text
    assert not any(token in text for token in TOKENS.values())  # never logged


def test_a_malformed_body_with_a_devices_token_is_a_400_not_a_403(tiny_bundle, tmp_path):
    with edge(tiny_bundle, http_tokens=tokens_file(tmp_path)) as service:
        r = httpx.post(f"{service.http.url}/v1/ingest", content=b"garbage",
                       headers=bearer("cam1"))
        assert r.status_code == 400 and r.json()["reason"] == "malformed"


def test_a_multi_view_bundles_devices_cannot_post_results(six_view_bundle, tmp_path):
    # A made-up result for a six-view frame, posted with the shared token, or with no token:
    # a six-view frame is answered by the edge from its views, never by one device.
    for settings in ({"http_token": "s3cret"}, {}):
        with edge(six_view_bundle, **settings) as service:
            url = service.http.url
            headers = {"Authorization": "Bearer s3cret"} if settings else {}
            r = httpx.post(f"{url}/v1/results", content=json.dumps(result_of("cam0")),
                           headers=headers)
            assert r.status_code == 403, r.text
            assert "6 views" in r.json()["error"]
            assert httpx.get(f"{url}/v1/results").json() == []
            assert service.aggregator.answered == 0  # nothing republished
            assert service.http.metrics.refused.value(reason="forbidden") == 1


def test_a_one_view_device_posts_its_own_result_with_its_own_token(one_view_bundle, tmp_path):
    with edge(one_view_bundle, http_tokens=tokens_file(tmp_path, ["cam0"])) as service:
        url = service.http.url
        good = result_of("cam0")
        assert httpx.post(f"{url}/v1/results", content=json.dumps(good)).status_code == 401
        r = httpx.post(f"{url}/v1/results", content=json.dumps(good), headers=bearer("cam0"))
        assert r.status_code == 202
        (kept,) = httpx.get(f"{url}/v1/results").json()
        assert kept.pop("seq") >= 0 and kept == good  # as posted, numbered by the edge


def test_a_bad_tokens_file_stops_the_edge_at_start_without_showing_a_token(tiny_bundle,
                                                                           tmp_path):
    path = tmp_path / "tokens"  # (tests/unit/test_edge_credentials.py: every way it can be bad)
    path.write_text("cam0 cam0-token-0123456789\ncam7 cam7-token-0123456789\n")
    with pytest.raises(ConfigError, match="'cam7' is not one of this edge's devices") as e:
        EdgeService.from_settings(EdgeSettings(bundle=tiny_bundle, http_port=0, http_tokens=path))
    assert "token-0123456789" not in str(e.value)
    with pytest.raises(ConfigError, match="not both"):
        EdgeSettings(bundle=tiny_bundle, http_port=0, http_tokens=path, http_token="s3cret")


# --- bounded connections -------------------------------------------------------------------------

def test_idle_connections_cannot_pile_up_threads_or_lock_the_server_out(tiny_bundle):
    with edge(tiny_bundle, http_max_connections=16) as service:
        server = service.http.server
        before = threading.active_count()
        idle = []
        try:
            for _ in range(200):  # connect and say nothing (or stop half-way through a head)
                s = socket.create_connection(("127.0.0.1", service.http.port), timeout=10)
                if len(idle) % 2:
                    s.sendall(b"POST /v1/ingest HTTP/1.1\r\nContent-Le")
                idle.append(s)
            wait_for(lambda: service.http.metrics.evicted.value() >= 200 - 16,
                     what="the server to take every connection")
            assert server.open_connections <= 16
            # (the threads of the connections closed to make room end at once)
            wait_for(lambda: threading.active_count() - before <= 16, what="at most 16 threads")
            # The server keeps answering: a new client gets through (an idle one makes room).
            r = httpx.get(f"{service.http.url}/healthz", timeout=5)
            assert r.status_code == 200
            r = httpx.post(f"{service.http.url}/v1/ingest", content=scores_of("cam0", 1),
                           timeout=5)
            assert r.status_code == 202
            wait_for(lambda: threading.active_count() - before <= 16, what="at most 16 threads")
        finally:
            for s in idle:
                s.close()


def test_a_server_whose_connections_are_all_busy_answers_503(tiny_bundle):
    with edge(tiny_bundle, http_max_connections=2) as service:
        ingest, release, inside = service.aggregator.ingest, threading.Event(), []
        real_accept = ingest.accept

        def slow_accept(payload, device=None):
            inside.append(1)
            release.wait(10)
            return real_accept(payload, device)

        ingest.accept = slow_accept
        url = f"{service.http.url}/v1/ingest"
        answers: list[int] = []
        posts = [threading.Thread(target=lambda f=f: answers.append(
            httpx.post(url, content=scores_of("cam0", f), timeout=10).status_code))
            for f in (1, 2)]
        try:
            for t in posts:
                t.start()
            wait_for(lambda: len(inside) == 2, what="two requests inside the ingest")
            r = httpx.get(f"{service.http.url}/healthz", timeout=5)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert service.http.metrics.refused.value(reason="busy") == 1
        finally:
            release.set()
            for t in posts:
                t.join(10)
        assert answers == [202, 202]
        assert httpx.get(f"{service.http.url}/healthz", timeout=5).status_code == 200
