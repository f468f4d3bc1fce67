"""A v2 client that knows nothing but the cloud's URL: Triton's ``tritonclient.http``, unchanged,
lists the repository, shapes one request per model and version from the metadata alone, and
gets an answer from every one — whatever models the repository lists (``{name}-cloud``,
``{name}-cloud-packed``, ``{name}-full``, ``{name}-escalated``, a reference's ``{name}-raw``,
and any kind added later), so every input a model's metadata lists must be one its requests
need.

The values are what a generic load generator sends: all zeros, and uniform draws (floats in
[0, 1), integers over their datatype's whole range — any bytes for a packed UINT8 row —, booleans
at random), in binary and in JSON.
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def cloud_kinds_url(kinds_repository):
    """A cloud serving a bundle of every kind (tests/support/data.py ``kinds_repository``)."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from tests.support.cloud import cloud_wait_ready

    settings = CloudSettings(repository=kinds_repository, host="127.0.0.1", port=0,
                             poll_interval=0, max_queue_delay_ms=5.0)
    with run_server(settings) as running:
        cloud_wait_ready(running.url)
        yield running.url


# Triton's own datatypes, as its client maps them; this test must not borrow ddnn's.
_FILLS = ("zeros", "random")


def _values(datatype: str, shape: list[int], fill: str, rng: np.random.Generator) -> np.ndarray:
    from tritonclient.utils import triton_to_np_dtype

    dtype = np.dtype(triton_to_np_dtype(datatype))
    if fill == "zeros":
        return np.zeros(shape, dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return rng.random(shape).astype(dtype)


def _request(client, model: str, version: str, batch: int, fill: str, binary: bool,
             rng: np.random.Generator):
    import tritonclient.http as httpclient

    meta = client.get_model_metadata(model, version)
    inputs = []
    for t in meta["inputs"]:
        shape = [batch if d == -1 else d for d in t["shape"]]
        x = httpclient.InferInput(t["name"], shape, t["datatype"])
        x.set_data_from_numpy(_values(t["datatype"], shape, fill, rng), binary_data=binary)
        inputs.append(x)
    outputs = [httpclient.InferRequestedOutput(t["name"], binary_data=binary)
               for t in meta["outputs"]]
    return meta, inputs, outputs


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_client_that_knows_only_the_url_gets_an_answer_from_every_model(cloud_kinds_url,
                                                                         binary):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(cloud_kinds_url.removeprefix("http://"))
    rng = np.random.default_rng(0)
    try:
        ready = [(m["name"], m["version"]) for m in client.get_model_repository_index()
                 if m["state"] == "READY"]
        answered = []
        for name, version in ready:
            for fill in _FILLS:
                for batch in (1, 3):
                    meta, inputs, outputs = _request(client, name, version, batch, fill,
                                                     binary, rng)
                    result = client.infer(name, inputs, model_version=version, outputs=outputs)
                    for t in meta["outputs"]:
                        got = result.as_numpy(t["name"])
                        assert got is not None and got.shape[0] == batch, (name, t["name"])
                    answered.append((name, version, fill, batch))
        assert len(answered) == len(ready) * len(_FILLS) * 2
        assert {name for name, _ in ready} >= {"tiny-cloud", "tiny-cloud-packed", "tiny-full",
                                               "tiny-raw", "esc-cloud", "esc-escalated"}
    finally:
        client.close()


@pytest.fixture(scope="module")
def escalating_url(kinds_repository, tmp_path_factory):
    """A cloud serving only an escalating bundle whose calibration chose level 1."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from tests.support.cloud import cloud_wait_ready
    from tests.support.data import at_level

    root = tmp_path_factory.mktemp("level1")
    at_level(kinds_repository / "esc", root / "esc", 1)
    settings = CloudSettings(repository=root, host="127.0.0.1", port=0, poll_interval=0)
    with run_server(settings) as running:
        cloud_wait_ready(running.url)
        yield running.url, root / "esc"


def test_the_full_model_answers_as_evaluates_cloud_exit_at_the_escalation_level(
        escalating_url, tiny_data):
    # An unmodified tritonclient on the raw-offload path ({name}-full) gets the hierarchy's
    # best: the cloud exit at the bundle's calibrated escalation level, as `ddnn evaluate`
    # reports it (it answered at level 0 before: below the hierarchy).
    import tritonclient.http as httpclient

    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.runtime import BundleRuntime
    from ddnn.tools.evaluate import evaluate

    url, bundle = escalating_url
    report = evaluate(bundle, tiny_data.test)
    assert report["escalation"]["level"] == 1
    ds = load_dataset(tiny_data.test, num_classes=3)
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        answered = []
        for start in range(0, len(ds.X), 32):
            views = np.ascontiguousarray(ds.X[start:start + 32], np.float32)
            present = np.ascontiguousarray(ds.present[start:start + 32])
            inputs = [httpclient.InferInput("views", list(views.shape), "FP32"),
                      httpclient.InferInput("present", list(present.shape), "BOOL")]
            inputs[0].set_data_from_numpy(views)
            inputs[1].set_data_from_numpy(present)
            answered.append(client.infer("esc-full", inputs).as_numpy("scores"))
    finally:
        client.close()
    scores = np.concatenate(answered)
    seen = ds.present.any(axis=1)
    accuracy = float((np.argmax(scores, axis=1) == ds.label)[seen].mean())
    assert accuracy == pytest.approx(report["accuracy"]["cloud"], abs=1e-9)
    assert report["accuracy"]["cloud"] == report["escalation"]["cloud_accuracy"][1]
    # The scores themselves are the escalated exit's, not the plain cloud's.
    exits = BundleRuntime(load_bundle(bundle)).run_dataset(ds.X, ds.present)
    np.testing.assert_allclose(scores, exits["escalated"], rtol=1e-4, atol=1e-4)
    assert not np.allclose(scores, exits["cloud"], rtol=1e-4, atol=1e-4)
