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
