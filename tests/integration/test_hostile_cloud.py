"""The cloud service against hostile clients: a real uvicorn server on a loopback port, and
clients that send huge or slow request heads, slow bodies, JSON bombs, absurd shapes, and
bundle directories changed under the server's feet.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest

from ddnn import oip
from ddnn.signing import generate_keypair, sign_bundle

TOKEN = "hostile-test-token"


def port_of(url: str) -> int:
    return urlsplit(url).port


def exchange(url: str, data: bytes, timeout: float = 20.0) -> bytes:
    """Send ``data`` on a fresh connection (from a thread: the server may stop reading) and
    return whatever the server answers before it closes the connection."""
    sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=timeout)

    def write() -> None:
        with contextlib.suppress(OSError):  # the server closed on us mid-send: the point
            sock.sendall(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    finally:
        sock.close()
        writer.join(timeout)
    return received


def closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> tuple[bool, bytes]:
    """Keep ``sock`` open for up to ``seconds``, sending ``drip`` every 0.2 s; (whether the
    server closed it, what it sent)."""
    received = b""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return True, received
            received += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True, received
        if drip:
            try:
                sock.sendall(drip)
            except OSError:
                return True, received
    return False, received


def live(url: str, timeout: float = 5.0) -> bool:
    return httpx.get(f"{url}/v2/health/live", timeout=timeout).json() == {"live": True}


# --- request heads ------------------------------------------------------------------------------


def test_a_huge_header_is_refused_early_while_health_answers(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, token=TOKEN, poll_interval=0)
    huge = (b"GET /v2/models/tiny-cloud HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (1 << 20)
            + b"\r\n\r\n")
    answers = []
    worker = threading.Thread(target=lambda: answers.append(exchange(url, huge)), daemon=True)
    worker.start()
    assert live(url)  # meanwhile
    worker.join(30)
    assert answers, "the server never closed the connection"
    # 431 — or a reset that swallowed it: the server stopped reading at its bound (64 KiB) and
    # closed with the rest unread. Never an answer from a route (401 without the token).
    assert answers[0] == b"" or answers[0].startswith(b"HTTP/1.1 431 "), answers[0][:200]
    assert live(url)

    # The request line counts too, and a head just under the bound is served as usual.
    line = b"GET /v2/health/live?" + b"q" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    answer = exchange(url, line)
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    ok = httpx.get(f"{url}/v2/health/live", headers={"X-Pad": "a" * 60_000})
    assert ok.status_code == 200


def test_a_head_over_the_bound_gets_431_when_it_stops_sending(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, max_header_bytes=4096)
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000)
        closed, answer = closed_within(sock, 10)
    assert closed and answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"exceed 4096 bytes" in answer


def test_slow_heads_and_silent_connections_are_cut_off(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, header_timeout=1.0)
    # Slowloris: a header line every 0.2 s, never the end of the head.
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        closed, answer = closed_within(sock, 15, drip=b"X-Slow: 1\r\n")
    assert closed, "the server kept a connection whose headers never end"
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    # A client that connects and says nothing.
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        closed, _ = closed_within(sock, 15)
    assert closed, "the server kept a silent connection"
    assert live(url)


def test_a_slow_body_is_cut_off(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, body_timeout=1.0)
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/tiny-cloud/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        closed, _ = closed_within(sock, 15, drip=b" ")
    assert closed, "the server waited forever for a body trickling a byte at a time"
    assert live(url)


def test_idle_keep_alive_connections_are_closed(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0, keep_alive_timeout=0.5)
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        closed, answer = closed_within(sock, 10)
    assert answer.startswith(b"HTTP/1.1 200 ") and closed


# --- JSON bodies --------------------------------------------------------------------------------


def test_a_json_array_bomb_is_refused_before_parsing(cloud_server, tiny_bundle):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0)
    head = b'{"inputs": [{"name": "edge_features", "datatype": "FP32", "shape": [1, 16, 4, 4], ' \
        b'"data": ['
    n = ((30 << 20) - len(head)) // 3
    body = head + b"[]," * n + b"[]]}]}"  # 30 MiB: ten million empty lists
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}/v2/models/tiny-cloud/infer", content=body,
        headers={"Content-Type": "application/json"}, timeout=60)), daemon=True)
    worker.start()
    while worker.is_alive():  # the event loop keeps answering while the bomb is handled
        assert live(url, timeout=3.0)
        time.sleep(0.05)
    assert answers[0].status_code == 413  # past the JSON part's bounds: never parsed
    assert "send large tensors binary" in answers[0].json()["error"], answers[0].text
    # Under those bounds, more arrays than the model's tensors can need: a 400, unparsed too.
    r = httpx.post(f"{url}/v2/models/tiny-cloud/infer", content=head + b"[]," * 100_000
                   + b"[]]}]}", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "arrays" in r.json()["error"], r.text

    # The same tensor, nested as its shape says or flat, is served.
    x = np.ones((2, 16, 4, 4), np.float32)
    for data in (x.tolist(), x.ravel().tolist()):
        r = httpx.post(f"{url}/v2/models/tiny-cloud/infer", json={"inputs": [
            {"name": "edge_features", "datatype": "FP32", "shape": [2, 16, 4, 4],
             "data": data}]})
        assert r.status_code == 200, r.text
    assert live(url)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_absurd_dimensions_are_a_400(cloud_server, tiny_bundle, binary):
    url = cloud_server(bundle=tiny_bundle, poll_interval=0)
    for shape in ([10**30, 0], [0, 10**30, 16, 4]):
        tensor = {"name": "edge_features", "datatype": "FP32", "shape": shape}
        if binary:
            tensor["parameters"] = {"binary_data_size": 0}
            head = json.dumps({"inputs": [tensor]}).encode()
            r = httpx.post(f"{url}/v2/models/tiny-cloud/infer", content=head,
                           headers={oip.HEADER_LENGTH: str(len(head))})
        else:
            tensor["data"] = []
            r = httpx.post(f"{url}/v2/models/tiny-cloud/infer", json={"inputs": [tensor]})
        assert r.status_code == 400, r.text
        assert "exceeds the limit" in r.json()["error"]
    assert 'kind="internal"' not in httpx.get(f"{url}/metrics").text


# --- bundle downloads ---------------------------------------------------------------------------


@pytest.fixture
def served(cloud_server, tiny_bundle, tmp_path):
    """A repository serving one signed bundle; returns (url, bundle directory, files route)."""
    key, pub = generate_keypair(tmp_path / "keys")
    repo = tmp_path / "repo"
    repo.mkdir()
    bundle = repo / "tiny-1"
    shutil.copytree(tiny_bundle, bundle)
    (bundle / "cloud.onnx").unlink()  # a symlink to a valid copy: loads, never handed out
    shutil.copy(tiny_bundle / "cloud.onnx", tmp_path / "elsewhere.onnx")
    (bundle / "cloud.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    sign_bundle(bundle, key)
    url = cloud_server(repository=repo, poll_interval=0, token=TOKEN, bundle_key=pub)
    return url, bundle, f"{url}/v1/bundles/tiny/1"


def get(url: str) -> httpx.Response:
    return httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"})


def test_only_verified_bytes_and_regular_files_are_handed_out(served, tmp_path):
    url, bundle, files = served
    manifest, sig = (bundle / "manifest.json").read_bytes(), (bundle / "manifest.sig").read_bytes()
    assert get(f"{files}/manifest.json").content == manifest
    assert get(f"{files}/manifest.sig").content == sig
    assert get(f"{files}/edge.onnx").content == (bundle / "edge.onnx").read_bytes()
    assert httpx.get(f"{files}/edge.onnx").status_code == 401  # the token applies

    # Served from the loaded bundle, but never handed out: a symlink.
    assert get(f"{files}/cloud.onnx").status_code == 404
    assert get(f"{url}/v2/models/tiny-cloud").status_code == 200

    # The manifest edited on disk after the repository verified it: the verified bytes stay.
    edited = json.loads(manifest)
    edited["exits"]["local"]["threshold"] = 0.99
    (bundle / "manifest.json").write_text(json.dumps(edited))
    (bundle / "manifest.sig").write_text("forged\n")
    assert get(f"{files}/manifest.json").content == manifest
    assert get(f"{files}/manifest.sig").content == sig

    # A segment swapped for a symlink to a secret, or changed in place: not handed out.
    secret = tmp_path / "secret.txt"
    secret.write_text("the operator's secret")
    (bundle / "edge.onnx").unlink()
    (bundle / "edge.onnx").symlink_to(secret)
    assert get(f"{files}/edge.onnx").status_code == 404
    device = bundle / "device-0.onnx"
    device.write_bytes(device.read_bytes()[:-4] + b"evil")
    r = get(f"{files}/device-0.onnx")
    assert r.status_code == 404 and "changed since it was verified" in r.json()["error"]

    # Names the verified manifest does not list: never, whatever is in the directory.
    (bundle / "extra.onnx").write_bytes(b"x")
    for name in ("extra.onnx", "..", "report", "%2e%2e%2fsecret.txt"):
        assert get(f"{files}/{name}").status_code == 404, name
    assert get(f"{url}/v1/bundles/tiny/2/manifest.json").status_code == 404


def test_an_unsigned_bundle_has_no_signature_to_hand_out(cloud_server, tiny_bundle, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(tiny_bundle, repo / "tiny-1")
    url = cloud_server(repository=repo, poll_interval=0)
    files = f"{url}/v1/bundles/tiny/1"
    assert httpx.get(f"{files}/manifest.sig").status_code == 404
    assert httpx.get(f"{files}/manifest.json").content == \
        (repo / "tiny-1" / "manifest.json").read_bytes()
    os.remove(repo / "tiny-1" / "manifest.json")  # gone from disk: still the verified bytes
    assert httpx.get(f"{files}/manifest.json").status_code == 200



def test_a_segment_edited_in_place_is_never_handed_out(served):
    """Same size, same modification time, same inode: only its bytes changed (an editor that
    restores the mtime, or a write within the file system's timestamp granularity)."""
    _, bundle, files = served
    device = bundle / "device-0.onnx"
    verified = device.read_bytes()
    assert get(f"{files}/device-0.onnx").content == verified
    st = device.stat()
    with open(device, "r+b") as f:  # in place: the inode stays
        f.seek(len(verified) // 2)
        f.write(bytes(b ^ 0xFF for b in verified[len(verified) // 2:][:16]))
    os.utime(device, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert device.stat().st_size == st.st_size and device.stat().st_ino == st.st_ino
    r = get(f"{files}/device-0.onnx")
    assert r.status_code == 404, "the edited bytes were handed out"
    assert "changed since it was verified" in r.json()["error"]
    device.write_bytes(verified)  # put back as verified: handed out again
    os.utime(device, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert get(f"{files}/device-0.onnx").content == verified
