"""Operators' labels teach a site: frames the edge's recorder wrote with hard labels
(``put_labelled``, what ``POST /v1/feedback`` records) are read by ``ddnn federate``'s site
and steer the exits above the device stem to the operator's classes, with no cloud."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_labelled_experience_teaches_the_operators_classes(tiny_bundle, tiny_data, tmp_path):
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.edge.recorder import ExperienceRecorder, ExperienceRecording
    from ddnn.models.federated.trainer import LocalTraining, fit, load_site
    from ddnn.models.federated.weights import (
        architecture,
        build_model,
        model_from_bundle,
        model_weights,
        set_weights,
    )

    manifest = load_bundle(tiny_bundle).manifest
    arch = architecture(load_bundle(tiny_bundle))
    start_model = model_from_bundle(tiny_bundle)
    start = model_weights(start_model)
    ds = load_dataset(tiny_data.train, num_classes=manifest.num_classes)
    n, c = 60, manifest.num_classes
    with torch.no_grad():
        x = torch.from_numpy(ds.images(slice(0, n)))
        devices = start_model.devices
        feats = torch.stack([devices[v % len(devices)](x[:, v])[1]
                             for v in range(manifest.views)], 1).numpy()
    # The operator's classes differ from what the bundle learnt: each is the next class.
    wanted = (ds.label[:n] + 1) % c
    recorder = ExperienceRecorder(ExperienceRecording(directory=tmp_path / "exp"))
    recorder.start()
    for i in range(n):
        views = np.flatnonzero(ds.present[i])
        assert recorder.put_labelled(manifest, {int(v): feats[i, v] for v in views},
                                     int(wanted[i]))
    recorder.stop()

    site = load_site(arch, None, tmp_path / "exp")
    assert site.experience is not None and site.experience.labelled.all()

    def agreement(weights) -> float:
        model = build_model(arch)
        set_weights(model, weights)
        model.eval()
        exp = site.experience
        from ddnn.models.network import aggregate

        with torch.no_grad():
            _, edge = model.edge(aggregate(torch.from_numpy(exp.features),
                                           torch.from_numpy(exp.present), model.edge_op))
            predicted = model.cloud(edge).argmax(-1).numpy()
        return float((predicted == exp.label).mean())

    before = agreement(start)
    taught = fit(arch, start, site, LocalTraining(epochs=30, lr=5e-3, batch_size=16))
    after = agreement(taught.weights)
    assert after >= before + 0.4 and after >= 0.8, (before, after)
    device = [k for k in start if k.startswith("devices.")]
    assert all(np.array_equal(taught.weights[k], start[k]) for k in device)
