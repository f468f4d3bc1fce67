"""Over-the-air updates against hostile servers and announcements (ddnn.plumbing.ota).

Anyone who may publish on the broker can announce a version, and the server that answers may
be hostile: real HTTP servers on loopback ports play the cloud and a foreign host, and serve,
redirect, trickle or flood. The updater must fetch only from the cloud's origin, give the
token to no one else, verify the signature before it downloads a segment, refuse downgrades,
stop at the declared sizes and at one deadline, and leave nothing on disk when it refuses.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ddnn.bundle import load_bundle
from ddnn.errors import BundleError
from ddnn.plumbing import download
from ddnn.plumbing.ota import Announcement, BundleUpdater
from ddnn.signing import generate_keypair, sign_bundle
from tests.support.ota import bundle_updater
from tests.support.polling import wait_for

PREFIX = "/v1/bundles/tiny"
TOKEN = "s3cret-token"


# --- real HTTP servers on loopback, told what to do ---------------------------------------------


def send(h: BaseHTTPRequestHandler, status: int, body: bytes = b"",
         headers: dict[str, str] | None = None) -> None:
    h.send_response(status)
    for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


class Server:
    """A threaded HTTP server on a free loopback port; ``respond(handler)`` answers each GET and
    every request is recorded (path, headers)."""

    def __init__(self, respond: Callable[[BaseHTTPRequestHandler], None]):
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append((self.path, dict(self.headers)))
                # The client hanging up on a hostile answer is what the tests want.
                with contextlib.suppress(OSError):
                    respond(self)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made: list[Server] = []

    def make(respond) -> Server:
        made.append(Server(respond))
        return made[-1]

    yield make
    for s in made:
        s.close()


def files_of(bundle: Path, prefix: str) -> dict[str, bytes]:
    """Routes serving a bundle directory's files under ``prefix``."""
    return {f"{prefix}/{f.name}": f.read_bytes() for f in bundle.iterdir() if f.is_file()}


def static(routes: dict[str, bytes | Callable]) -> Callable[[BaseHTTPRequestHandler], None]:
    def respond(h: BaseHTTPRequestHandler) -> None:
        answer = routes.get(h.path)
        if answer is None:
            send(h, 404, b'{"error": "not found"}')
        elif callable(answer):
            answer(h)
        else:
            send(h, 200, answer)
    return respond


# --- bundles and updaters -----------------------------------------------------------------------


def version_copy(src: Path, dst: Path, version: str, key: Path | None,
                 edit: Callable[[dict], None] | None = None) -> Path:
    shutil.copytree(src, dst)
    mf = dst / "manifest.json"
    d = json.loads(mf.read_text())
    d["model"]["version"] = version
    if edit is not None:
        edit(d)
    mf.write_text(json.dumps(d, indent=2))
    if key is not None:
        sign_bundle(dst, key)
    return dst


class World:
    def __init__(self, tiny_bundle: Path, tmp: Path):
        self.tmp = tmp
        self.key, self.pub = generate_keypair(tmp / "keys")
        self.other_key, _ = generate_keypair(tmp / "other-keys")
        self.tiny = tiny_bundle
        run = version_copy(tiny_bundle, tmp / "running" / "tiny", "1", self.key)
        self.running = load_bundle(run, public_key=self.pub)
        self.staging = tmp / "running" / ".ddnn-ota"
        self.applied: list = []
        self.updaters: list[BundleUpdater] = []

    def bundle(self, version: str, key: Path | None = "default", name: str | None = None,
               edit=None) -> Path:
        key = self.key if key == "default" else key
        return version_copy(self.tiny, self.tmp / "published" / (name or f"v{version}"), version,
                            key, edit)

    def updater(self, **kwargs) -> BundleUpdater:
        kwargs.setdefault("public_key", self.pub)
        u = bundle_updater(self.running, self.applied.append, **kwargs)
        self.updaters.append(u)
        return u

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.staging.iterdir()) if self.staging.exists() else []


@pytest.fixture
def world(tiny_bundle, tmp_path):
    w = World(tiny_bundle, tmp_path)
    yield w
    for u in w.updaters:
        u.stop()


def onnx_paths(server: Server) -> list[str]:
    return [p for p in server.paths() if p.endswith(".onnx")]


# --- origin and token ---------------------------------------------------------------------------


def test_a_foreign_url_gets_no_request_and_no_token(world, servers):
    v2 = world.bundle("2")
    cloud = servers(static(files_of(v2, f"{PREFIX}/2")))
    foreign = servers(static(files_of(v2, f"{PREFIX}/2")))
    updater = world.updater(cloud=cloud.url, token=TOKEN)

    # The retained announcement names another host (here: another port of the same one).
    ann = Announcement("tiny", "2", f"{foreign.url}{PREFIX}/2")
    assert not updater.update(ann)
    updater.on_message(ann.to_bytes())  # the MQTT path refuses before it queues anything
    assert foreign.requests == [] and cloud.requests == []
    assert updater.refused == 2 and updater.applied == 0 and world.applied == []
    assert "not on the cloud's origin" in updater.last_error

    # Other spellings of a foreign origin: scheme, and credentials smuggled into the URL.
    for url in (f"https://127.0.0.1:{cloud.url.rsplit(':', 1)[1]}{PREFIX}/2",
                f"http://{TOKEN}@127.0.0.1:{cloud.url.rsplit(':', 1)[1]}{PREFIX}/2"):
        assert not updater.update(Announcement("tiny", "2", url))
    assert cloud.requests == [] and foreign.requests == []

    # The same version from the cloud itself: fetched, and the token went only there.
    assert updater.update(Announcement("tiny", "2", f"{cloud.url}{PREFIX}/2"))
    assert [b.manifest.version for b in world.applied] == ["2"]
    assert cloud.requests and all(h.get("Authorization") == f"Bearer {TOKEN}"
                                  for _, h in cloud.requests)


def test_a_tier_without_a_cloud_sends_no_token_to_the_announced_url(world, servers):
    v2 = world.bundle("2")
    host = servers(static(files_of(v2, f"{PREFIX}/2")))
    updater = world.updater(token=TOKEN)  # a device: no cloud, so no origin to trust a token to
    assert updater.update(Announcement("tiny", "2", f"{host.url}{PREFIX}/2"))
    assert host.requests and not any("Authorization" in h for _, h in host.requests)


def test_redirects_stay_on_the_origin(world, servers):
    v2 = world.bundle("2")
    foreign = servers(static(files_of(v2, f"{PREFIX}/2")))
    routes = {p: (lambda h, p=p: send(h, 302, headers={"Location": foreign.url + p}))
              for p in files_of(v2, f"{PREFIX}/2")}
    cloud = servers(static(routes))
    updater = world.updater(cloud=cloud.url, token=TOKEN)
    assert not updater.update(Announcement("tiny", "2"))
    assert foreign.requests == [], "a cross-origin redirect must not be followed"
    assert "is not the origin" in updater.last_error
    assert world.leftovers() == []

    # A redirect within the cloud's origin is fine (a mirror path on the same server).
    mirror = files_of(v2, "/mirror")
    same = servers(static({**mirror, **{
        p: (lambda h, p=p: send(h, 307, headers={"Location": "/mirror/" + p.rsplit("/", 1)[1]}))
        for p in files_of(v2, f"{PREFIX}/2")}}))
    assert world.updater(cloud=same.url, token=TOKEN).update(Announcement("tiny", "2"))
    assert all(h.get("Authorization") == f"Bearer {TOKEN}" for _, h in same.requests)


# --- signatures first ---------------------------------------------------------------------------


def test_unsigned_bundles_need_an_explicit_opt_out(world, servers):
    unsigned = world.bundle("2", key=None)
    cloud = servers(static(files_of(unsigned, f"{PREFIX}/2")))

    no_key = world.updater(cloud=cloud.url, public_key=None)
    assert not no_key.update(Announcement("tiny", "2"))
    assert "must be signed" in no_key.last_error
    assert cloud.requests == [], "refused before anything is fetched"

    keyed = world.updater(cloud=cloud.url)
    assert not keyed.update(Announcement("tiny", "2"))
    assert "unsigned" in keyed.last_error
    assert onnx_paths(cloud) == [], "the manifest is verified before any segment is fetched"

    opted_out = world.updater(cloud=cloud.url, public_key=None, allow_unsigned=True)
    assert opted_out.update(Announcement("tiny", "2"))
    assert [b.manifest.version for b in world.applied] == ["2"]


def test_a_forged_manifest_is_refused_before_its_files(world, servers):
    forged = world.bundle("2", key=world.other_key)  # signed, by someone else's key
    cloud = servers(static(files_of(forged, f"{PREFIX}/2")))
    updater = world.updater(cloud=cloud.url)
    assert not updater.update(Announcement("tiny", "2"))
    assert "bad signature" in updater.last_error
    assert onnx_paths(cloud) == [] and world.leftovers() == []


def test_downgrades_are_refused_unless_allowed(world, servers):
    routes = {}
    for v in ("0", "1.0", "beta", "3"):
        routes.update(files_of(world.bundle(v), f"{PREFIX}/{v}"))
    # The announced version 7 turns out to hold version 0: refused on the verified manifest.
    routes.update(files_of(world.tmp / "published" / "v0", f"{PREFIX}/7"))
    cloud = servers(static(routes))
    updater = world.updater(cloud=cloud.url)
    for version in ("0", "1.0", "beta"):
        assert not updater.update(Announcement("tiny", version)), version
        assert "not newer than the running 1" in updater.last_error
    assert cloud.requests == [], "refused from the announcement alone"
    assert not updater.update(Announcement("tiny", "7"))
    assert "holds tiny:0, not tiny:7" in updater.last_error
    assert onnx_paths(cloud) == []

    allowing = world.updater(cloud=cloud.url, allow_downgrade=True)
    assert allowing.update(Announcement("tiny", "0"))
    assert updater.update(Announcement("tiny", "3"))  # forward is always fine
    assert [b.manifest.version for b in world.applied] == ["0", "3"]


# --- bounded downloads --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["status line", "manifest body", "segment body"])
def test_a_trickling_server_cannot_hold_the_updater(world, servers, where):
    v2 = world.bundle("2")
    routes = files_of(v2, f"{PREFIX}/2")
    stop = threading.Event()

    def trickle(h: BaseHTTPRequestHandler) -> None:
        if where == "status line":
            data = b"HTTP/1.0 200 OK\r\n" + b"X" * 1000
        else:
            data = b"HTTP/1.0 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"0" * 100000
        # One byte a second: each read gets something well within any per-read timeout, so
        # only a deadline for the whole download ends it.
        for byte in data:
            h.wfile.write(bytes([byte]))
            if stop.wait(1):
                return

    target = f"{PREFIX}/2/manifest.json" if where != "segment body" else next(
        p for p in routes if p.endswith(".onnx"))
    routes[target] = trickle
    cloud = servers(static(routes))
    updater = world.updater(cloud=cloud.url, timeout=3.0)
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(
        updater.update(Announcement("tiny", "2"))), daemon=True)
    worker.start()
    worker.join(30)
    stop.set()
    assert not worker.is_alive(), "the updater is still held by the trickling server"
    assert result == [False]
    assert "did not finish within 3 s" in updater.last_error
    assert world.leftovers() == [], "a refused download leaves nothing on disk"


def test_a_file_larger_than_declared_is_cut_off(world, servers):
    v2 = world.bundle("2")
    routes = files_of(v2, f"{PREFIX}/2")
    target = next(p for p in routes if p.endswith(".onnx"))
    sent: list[int] = []

    def flood(h: BaseHTTPRequestHandler) -> None:  # no Content-Length: until we hang up
        h.send_response(200)
        h.end_headers()
        chunk, total = bytes(1 << 20), 0
        try:
            for _ in range(256):
                h.wfile.write(chunk)
                total += len(chunk)
        finally:
            sent.append(total)

    routes[target] = flood
    cloud = servers(static(routes))
    updater = world.updater(cloud=cloud.url)
    assert not updater.update(Announcement("tiny", "2"))
    assert "more than the" in updater.last_error
    assert world.leftovers() == []
    wait_for(lambda: sent, what="the flooding handler to give up")
    assert sent[0] < 64 << 20, f"the updater read {sent[0]} bytes of a file declared far smaller"

    # A Content-Length beyond the declared size is refused before the body is read.
    routes[target] = lambda h: send(h, 200, bytes(4 << 20))
    assert not updater.update(Announcement("tiny", "2"))
    assert "the server announces" in updater.last_error and world.leftovers() == []


def test_a_manifest_without_sizes_caps_at_max_file_and_checks_while_streaming(
        world, servers, monkeypatch):
    def drop_sizes(d: dict) -> None:
        segs = d["segments"]
        for seg in [*segs["device"], segs["edge"], segs["cloud"], segs.get("local") or {}]:
            seg.pop("size", None)

    v2 = world.bundle("2", edit=drop_sizes)
    routes = files_of(v2, f"{PREFIX}/2")
    target = max((p for p in routes if p.endswith(".onnx")), key=lambda p: len(routes[p]))
    good = routes[target]
    monkeypatch.setattr(download, "MAX_FILE", len(good) + 10)
    cloud = servers(static(routes))
    updater = world.updater(cloud=cloud.url)

    routes[target] = good + bytes(100)  # past MAX_FILE
    assert not updater.update(Announcement("tiny", "2"))
    assert f"at most {len(good) + 10} are accepted" in updater.last_error
    routes[target] = bytes(len(good))  # the right size, the wrong bytes
    assert not updater.update(Announcement("tiny", "2"))
    assert "checksum mismatch" in updater.last_error
    assert world.leftovers() == []
    routes[target] = good
    assert updater.update(Announcement("tiny", "2"))


def test_a_refused_apply_leaves_nothing_on_disk(world, servers):
    v2 = world.bundle("2")
    cloud = servers(static(files_of(v2, f"{PREFIX}/2")))

    def refuse(bundle) -> None:
        raise BundleError("the tier refuses it")

    updater = bundle_updater(world.running, refuse, cloud=cloud.url, public_key=world.pub)
    world.updaters.append(updater)
    assert not updater.update(Announcement("tiny", "2"))
    assert "the tier refuses it" in updater.last_error
    assert world.leftovers() == []


# --- the real cloud -----------------------------------------------------------------------------


def test_a_signed_update_from_the_real_cloud(world, cloud_server):
    repo = world.tmp / "repo"
    repo.mkdir()
    shutil.copytree(world.bundle("2"), repo / "tiny-2")
    url = cloud_server(repository=repo, poll_interval=0, token=TOKEN, bundle_key=world.pub)
    updater = world.updater(cloud=url, token=TOKEN)
    assert updater.update(Announcement("tiny", "2"))
    assert updater.running.manifest.version == "2" and updater.running.signature_bytes
    assert world.leftovers() == ["tiny-2"]
