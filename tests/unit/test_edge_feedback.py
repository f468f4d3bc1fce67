"""Operators' feedback (edge/feedback.py) alone: the body, the token, the frames remembered,
features pulled for a label and recorded with it (experience format version 2; version 1
chunks still load)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from ddnn import experience
from ddnn.bundle import load_bundle
from ddnn.edge.credentials import HttpCredentials
from ddnn.edge.events import EdgeEvents
from ddnn.edge.feedback import (
    AnsweredMemory,
    FeedbackDesk,
    FeedbackError,
    FeedbackRoute,
    OperatorAccess,
    class_index,
    parse_feedback,
)
from ddnn.edge.recorder import ExperienceRecorder, ExperienceRecording
from ddnn.errors import ConfigError, DatasetError

TOKEN = "operator-token-0123456789"
DEVICE_TOKEN = "device-token-0123456789"


class Outcomes(EdgeEvents):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_feedback(self, outcome: str) -> None:
        self.seen.append(outcome)


class Devices:
    """Stands in for the devices behind FeaturePulls: answers a pull through ``desk.offer``
    for the frames it still keeps."""

    def __init__(self, shape, keep: set[int]):
        self.shape, self.keep, self.pulled = shape, keep, []
        self.desk: FeedbackDesk | None = None

    def request(self, frame, views):
        self.pulled.append((frame, tuple(views)))
        if frame in self.keep:
            for v in views:
                assert self.desk is not None
                threading.Thread(target=self.desk.offer,
                                 args=(v, frame, np.full(self.shape, v, np.float32))).start()


@pytest.fixture
def manifest(tiny_bundle):
    return load_bundle(tiny_bundle).manifest


def features_of(m, views):
    shape = m.devices[0].output("features").sample_shape
    return {v: np.full(shape, 10 + v, np.float32) for v in views}


@pytest.mark.parametrize("body, why", [
    (b"\xff", "not JSON"), (b"[1, 2]", "must be"), (b'{"frame": 1}', "must be"),
    (b'{"frame": 1, "label": 0, "x": 2}', "must be"), (b'{"frame": -1, "label": 0}', "frame"),
    (b'{"frame": true, "label": 0}', "frame"), (b'{"frame": 1.5, "label": 0}', "frame"),
    (b'{"frame": 18446744073709551616, "label": 0}', "frame"),
    (b'{"frame": 1, "label": null}', "label"), (b'{"frame": 1, "label": false}', "label"),
    (b'{"frame": 1, "label": [0]}', "label"),
])
def test_a_malformed_body_is_a_400_that_says_why(body, why):
    with pytest.raises(FeedbackError, match=why) as e:
        parse_feedback(body)
    assert e.value.status == 400


def test_a_label_is_a_class_name_or_index():
    classes = ("cat", "dog", "bird")
    assert parse_feedback(b'{"frame": 7, "label": "dog"}') == (7, "dog")
    assert class_index("bird", classes) == 2 and class_index(0, classes) == 0
    for bad in ("horse", 3, -1):
        with pytest.raises(FeedbackError, match="is not a class") as e:
            class_index(bad, classes)
        assert e.value.status == 400


def test_the_memory_tells_a_frame_never_answered_from_one_forgotten(manifest):
    memory = AnsweredMemory(history=4, kept=2)
    for frame in range(10, 16):
        memory.remember(frame, manifest, (0, 1), features_of(manifest, (0,)))
    with pytest.raises(FeedbackError) as old:
        memory.get(11)  # answered, then forgotten
    with pytest.raises(FeedbackError) as new:
        memory.get(99)
    assert (old.value.status, new.value.status) == (410, 404)
    assert memory.get(12).features == {} and memory.get(13).features == {}  # past `kept`
    assert set(memory.get(15).features) == {0}  # (view 1 was fused without features here)


def test_a_label_takes_the_features_it_has_and_pulls_the_others(manifest, tmp_path):
    shape = manifest.devices[0].output("features").sample_shape
    memory = AnsweredMemory()
    recorder = ExperienceRecorder(ExperienceRecording(directory=tmp_path / "exp"))
    recorder.start()
    devices = Devices(shape, keep={5})
    desk = FeedbackDesk(memory, recorder, devices, devices=["cam0", "cam1", "cam2"],  # type: ignore[arg-type]
                        events=EdgeEvents(), wait=5.0)
    devices.desk = desk
    memory.remember(5, manifest, (0, 2), features_of(manifest, (0,)))
    memory.remember(6, manifest, (0, 1), {})  # its devices keep it no more
    memory.remember(7, manifest, (), {})  # answered without any view
    got = desk.label(5, manifest.classes[1])
    assert got == {"recorded": True, "frame": 5, "class": 1, "label": manifest.classes[1],
                   "views": ["cam0", "cam2"], "pulled": ["cam2"]}
    assert devices.pulled == [(5, (2,))]
    with pytest.raises(FeedbackError) as again:
        desk.label(5, 0)
    desk.wait = 0.2
    with pytest.raises(FeedbackError) as gone:
        desk.label(6, 0)
    with pytest.raises(FeedbackError) as empty:
        desk.label(7, 0)
    assert (again.value.status, gone.value.status, empty.value.status) == (409, 410, 422)
    assert not desk.offer(2, 5, np.zeros(shape, np.float32))  # nothing awaits it now
    recorder.stop()
    exp = experience.read_experience(tmp_path / "exp", classes=tuple(manifest.classes))
    assert exp.num_samples == 1 and exp.label.tolist() == [1]  # (not frame 6: none came)
    assert exp.soft_label[0].tolist() == [float(c == 1) for c in range(manifest.num_classes)]
    assert exp.present[0].tolist() == [True, False, True]
    assert np.all(exp.features[0, 0] == 10) and np.all(exp.features[0, 2] == 2)


def test_version_1_chunks_still_load_beside_version_2(manifest, tmp_path):
    v, c = manifest.views, manifest.num_classes
    shape = manifest.devices[0].output("features").sample_shape
    soft = np.full((3, c), 1 / c, np.float32)
    experience.write_chunk(tmp_path, np.zeros((3, v, *shape)), np.ones((3, v), bool), soft,
                           model=("m", "1"), classes=list(manifest.classes), device_codec="x",
                           label=np.array([-1, 2, -1]))
    old = tmp_path / "experience-1-0-0.npz"
    meta = {"format": "ddnn-experience", "format_version": 1, "classes": list(manifest.classes)}
    np.savez(old, features=np.zeros((2, v, *shape), np.float16),
             present=np.ones((2, v), bool), soft_label=soft[:2], meta=np.array(json.dumps(meta)))
    exp = experience.read_experience(tmp_path)
    assert exp.num_samples == 5
    assert sorted(exp.label.tolist()) == [-1, -1, -1, -1, 2]
    assert exp.labelled.sum() == 1 and exp.subset(np.flatnonzero(exp.labelled)).label[0] == 2


@pytest.mark.parametrize("label, why", [(np.array([0, 0, 99]), "not a class index"),
                                        (np.array([0, 0]), "should be integers")])
def test_a_chunk_with_bad_labels_is_skipped(manifest, tmp_path, label, why, caplog):
    v, c = manifest.views, manifest.num_classes
    shape = manifest.devices[0].output("features").sample_shape
    experience.write_chunk(tmp_path, np.zeros((3, v, *shape)), np.ones((3, v), bool),
                           np.full((3, c), 1 / c), model=("m", "1"),
                           classes=list(manifest.classes), device_codec="x", label=label)
    with pytest.raises(DatasetError, match="no usable"):
        experience.read_experience(tmp_path)
    assert why in caplog.text


class Desk:
    def __init__(self) -> None:
        self.asked: list[tuple[int, object]] = []

    def label(self, frame, label):
        self.asked.append((frame, label))
        if frame == 404:
            raise FeedbackError(404, "unknown", "frame 404 has not been answered")
        return {"recorded": True, "frame": frame}


def post(route, body: bytes, token: str | None = TOKEN, client="10.0.0.1", devices=None,
         length: int | None = -2):
    auth = f"Bearer {token}".encode() if token else b""
    return route.post(auth, client, len(body) if length == -2 else length,
                      lambda n: body[:n], devices or HttpCredentials())


def test_the_route_takes_only_the_operators_token():
    events, desk = Outcomes(), Desk()
    route = FeedbackRoute(desk, TOKEN, events)  # type: ignore[arg-type]
    devices = HttpCredentials(devices={"cam0": DEVICE_TOKEN})
    body = b'{"frame": 3, "label": "cat"}'
    assert post(route, body).status == 201 and desk.asked == [(3, "cat")]
    assert post(route, body, token=None).status == 401
    assert post(route, body, token="x" * 24).status == 401
    forbidden = post(route, body, token=DEVICE_TOKEN, devices=devices)
    assert forbidden.status == 403 and "device" in forbidden.body["error"]
    unknown = post(route, b'{"frame": 404, "label": 1}')
    assert unknown.status == 404 and "not been answered" in unknown.body["error"]
    assert post(route, b"x" * 2000).status == 413 and post(route, body, length=None).status == 411
    assert post(route, b'{"frame": "3"}').status == 400
    assert len(desk.asked) == 2  # nothing refused reached the desk
    assert events.seen == ["recorded", "unauthorized", "unauthorized", "forbidden", "unknown",
                           "invalid", "invalid", "invalid"]
    assert route.shares([None, DEVICE_TOKEN, TOKEN]) and not route.shares([DEVICE_TOKEN])
    assert TOKEN not in repr(route)


def test_the_route_limits_each_clients_rate():
    route = FeedbackRoute(Desk(), TOKEN, EdgeEvents(), rate=2.0)  # type: ignore[arg-type]
    statuses = [post(route, b'{"frame": 1, "label": 0}', client="a").status for _ in range(8)]
    assert statuses.count(429) >= 4 and statuses[0] == 201
    assert post(route, b'{"frame": 1, "label": 0}', client="b").status == 201


def test_the_operator_token_is_checked_and_read_from_its_file(tmp_path):
    with pytest.raises(ConfigError, match="16 characters"):
        OperatorAccess(operator_token="short")
    with pytest.raises(ConfigError, match="not both"):
        OperatorAccess(operator_token=TOKEN, operator_token_file=tmp_path / "t")
    with pytest.raises(ConfigError, match="cannot read"):
        OperatorAccess(operator_token_file=tmp_path / "missing").token()
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    assert OperatorAccess(operator_token_file=f).token() == TOKEN
    assert not OperatorAccess().enabled and OperatorAccess().token() is None


def test_feedback_needs_the_experience_and_the_http_server(tmp_path):
    from ddnn.edge.settings import EdgeSettings

    base = {"bundle": tmp_path, "broker": "mqtt://localhost:1883", "operator_token": TOKEN}
    with pytest.raises(ConfigError, match="needs --experience"):
        EdgeSettings(**base, http_port=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="--http-port"):
        EdgeSettings(**base, experience=tmp_path / "exp")  # type: ignore[arg-type]
    # Operators' labels alone need no cloud.
    s = EdgeSettings(**base, http_port=0, experience=tmp_path / "exp")  # type: ignore[arg-type]
    assert s.operator.token() == TOKEN and TOKEN not in json.dumps(s.describe())
