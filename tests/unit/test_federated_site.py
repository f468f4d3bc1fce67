"""What a site computes: calibration tables that add up to the central choice, the experience
format (written as the edge will write it, read back, bad chunks skipped), and the trainer that
fits from given weights on labelled data and on experience."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ddnn.errors import DatasetError
from ddnn.experience import chunks, prune, read_experience, stream_sample, write_chunk
from ddnn.hierarchy import UplinkCost
from ddnn.models.calibrate import calibrate
from ddnn.models.federated.calibration import (
    LEVEL1_NAMES,
    add_counts,
    calibrate_counts,
    counts_problem,
    exit_counts,
    narrow_counts,
)


def _exits(rng, n: int, skills=(1.0, 1.5, 2.5), c: int = 3, v: int = 3):
    labels = rng.integers(0, c, n)
    exits = {}
    for k, skill in zip(("local", "edge", "cloud"), skills, strict=True):
        logits = rng.normal(0, 1, (n, c))
        logits[np.arange(n), labels] += skill * rng.random(n) * 2
        exits[k] = logits.astype(np.float32)
    present = rng.random((n, v)) < 0.7  # some frames no view saw
    return exits, labels, present


def _pooled(sites):
    pooled = {k: np.concatenate([e[k] for e, _, _ in sites]) for k in sites[0][0]}
    return (pooled, np.concatenate([y for _, y, _ in sites]),
            np.concatenate([p for _, _, p in sites]))


COST = UplinkCost(scores=6, features=32, single_view=False)


@pytest.mark.parametrize("tolerance", [0.0, 0.03])
@pytest.mark.parametrize(("skills", "best"), [((1.0, 1.5, 2.5), 2), ((1.0, 2.5, 1.5), 1)])
def test_summed_site_tables_choose_what_central_calibration_chooses(tolerance, skills, best):
    rng = np.random.default_rng(4)
    sites = [_exits(rng, n, skills) for n in (70, 130, 41)]
    pooled, labels, present = _pooled(sites)
    central = calibrate(pooled, labels, present, COST, tolerance, grid=51)
    counts = add_counts(exit_counts(e, y, p, 51) for e, y, p in sites)
    assert int(np.argmax(counts["tier_correct"])) == best  # the cloud, or the edge
    federated = calibrate_counts(counts, COST, tolerance)
    assert federated.point == central.point and federated.agreement == central.agreement
    assert federated.best_tier_accuracy == central.best_tier_accuracy
    assert federated.samples == central.samples and federated.curve == central.curve
    assert 0 < central.point.exit_fraction["local"] < 1  # a point inside the grid
    # The agreement decides here: accuracy alone would pick a cheaper point.
    alone = calibrate(pooled, labels, present, COST, tolerance, grid=51, agreement=0.0)
    assert alone.point.bytes_per_frame < central.point.bytes_per_frame


def test_a_byte_budget_chooses_what_central_calibration_chooses_and_is_kept_by_default():
    # A bundle trained with `ddnn train --max-bytes B` is recalibrated by a federation within
    # the same budget (its manifest says so), never silently by a tolerance.
    from ddnn.models.federated.calibration import calibration_budget

    rng = np.random.default_rng(7)
    sites = [_exits(rng, n) for n in (70, 130, 41)]
    pooled, labels, present = _pooled(sites)
    counts = add_counts(exit_counts(e, y, p, 51) for e, y, p in sites)
    cheapest = calibrate(pooled, labels, present, COST, 1.0, grid=51).point.bytes_per_frame
    budget = cheapest + 6.0  # room for a few frames' features
    central = calibrate(pooled, labels, present, COST, max_bytes=budget, grid=51)
    assert central.point.bytes_per_frame <= budget
    recorded = central.to_dict()  # what a bundle's manifest holds
    tolerance, agreement, max_bytes = calibration_budget(-1.0, -1.0, 0.0, recorded)
    assert max_bytes == budget
    federated = calibrate_counts(counts, COST, tolerance, agreement, max_bytes)
    assert federated.point == central.point and federated.max_bytes == budget
    assert federated.to_dict()["objective"].startswith("highest accuracy within max_bytes")
    # A tolerance given to ddnn federate wins; a bundle calibrated by a tolerance keeps it.
    assert calibration_budget(0.02, -1.0, 0.0, recorded)[2] is None
    by_tolerance = calibrate(pooled, labels, present, COST, 0.03, grid=51).to_dict()
    assert calibration_budget(-1.0, -1.0, 0.0, by_tolerance) == (0.03, by_tolerance["agreement"],
                                                                   None)
    assert calibration_budget(-1.0, -1.0, 40.0, by_tolerance)[2] == 40.0


def _escalating(rng, n: int, skills=(1.0, 1.5, 2.0, 3.0), c: int = 3, v: int = 3):
    """Exits of a bundle that escalates, its escalated exit the best, and each frame's detail
    bytes as its present views' devices would send them (about 200 B a view)."""
    exits, labels, present = _exits(rng, n, skills[:3], c, v)
    logits = rng.normal(0, 1, (n, c))
    logits[np.arange(n), labels] += skills[3] * rng.random(n) * 2
    exits["escalated"] = logits.astype(np.float32)
    exits["detail_bytes"] = (present * rng.integers(150, 250, (n, v))).sum(1)
    return exits, labels, present


ESCALATING = UplinkCost(scores=6, features=32, single_view=False, detail=384)


@pytest.mark.parametrize("tolerance", [0.0, 0.03])
def test_summed_site_tables_of_an_escalating_bundle_choose_the_level_central_calibration_does(
        tolerance):
    rng = np.random.default_rng(5)
    sites = [_escalating(rng, n) for n in (90, 150, 61)]
    pooled, labels, present = _pooled(sites)
    central = calibrate(pooled, labels, present, ESCALATING, tolerance, grid=51)
    counts = add_counts(exit_counts(e, y, p, 51) for e, y, p in sites)
    assert all(counts_problem(exit_counts(e, y, p, 51), 51, 3, 384) is None for e, y, p in sites)
    federated = calibrate_counts(counts, ESCALATING, tolerance)
    assert central.point.level == 1 and 0 < central.point.exit_fraction["cloud"] < 1
    assert federated.point == central.point and federated.agreement == central.agreement
    assert federated.best_tier_accuracy == central.best_tier_accuracy
    assert federated.curve == central.curve and set(central.curve["level"]) == {0, 1}
    # A site too old to count level 1: every site calibrates at level 0, as without escalation.
    old = {k: v for k, v in exit_counts(*sites[1], 51).items() if k not in LEVEL1_NAMES}
    mixed = calibrate_counts(add_counts([exit_counts(*sites[0], 51), old,
                                         exit_counts(*sites[2], 51)]), ESCALATING, tolerance)
    level0 = {k: v for k, v in pooled.items() if k not in ("escalated", "detail_bytes")}
    assert mixed.point == calibrate(level0, labels, present, ESCALATING, tolerance, grid=51).point
    assert set(mixed.curve["level"]) == {0}


def test_narrowed_tables_travel_in_a_byte_a_count_and_choose_what_the_full_ones_do():
    """A site sends its tables in the narrowest unsigned type that holds them; the server adds
    them in int64 (sums over sites of uint8 tables would wrap) and decides the same."""
    rng = np.random.default_rng(5)
    sites = [_escalating(rng, n) for n in (200, 250, 61)]
    full = [exit_counts(e, y, p, 51) for e, y, p in sites]
    narrow = [narrow_counts(c) for c in full]
    for wide, small in zip(full, narrow, strict=True):
        assert all(np.array_equal(wide[k], small[k]) for k in wide)
        assert all(counts_problem(small, 51, 3, 384) is None for small in narrow)
    assert {narrow[0][k].dtype for k in ("correct", "agree_cloud", "edge_exits")} == {
        np.dtype(np.uint8)}
    assert narrow[0]["details_1"].dtype == np.uint32  # bytes: a few hundred a frame
    total = add_counts(narrow)
    assert int(total["samples"][0]) == 511 and total["correct"].dtype == np.int64
    assert all(np.array_equal(total[k], add_counts(full)[k]) for k in total)
    assert (calibrate_counts(total, ESCALATING, 0.0).point
            == calibrate_counts(add_counts(full), ESCALATING, 0.0).point)
    size = {n: sum(a.nbytes for a in t.values()) for n, t in (("full", full[0]),
                                                             ("narrow", narrow[0]))}
    assert size["narrow"] < size["full"] / 4
    with pytest.raises(ValueError, match="none negative"):
        narrow_counts({"samples": np.array([-1])})


@pytest.mark.parametrize(("change", "why"), [
    (lambda c: {**c, "details_1": c["details_1"] + 10**6}, "more detail bytes"),
    # Within the views past the local exit, but more than the frames past both exits send.
    (lambda c: {**c, "details_1": np.repeat(c["past_local_views"][:, None] * 384, 21, 1)},
     "more detail bytes"),
    # Small integer types (honest values): checked, not overflowed (a crash, before).
    (lambda c: {**{k: v.astype(np.uint8) for k, v in c.items()}, "details_1": c["details_1"]
                + 10**6}, "more detail bytes"),
    (lambda c: {**c, "correct_1": c["correct_1"] + 10**4}, "more frames"),
    (lambda c: {**c, "escalated_correct": c["escalated_correct"] * 100}, "more frames"),
    (lambda c: {**c, "details_1": c["details_1"] - 10**6}, "out of range"),
    (lambda c: {**c, "details_1": c["details_1"].astype(np.float64)}, "whole numbers"),
    (lambda c: {k: v for k, v in c.items() if k != "agree_edge_1"}, "some level-1 tables"),
], ids=["details-beyond", "details-beyond-past-both", "small-ints", "right-beyond",
        "escalated-beyond", "negative", "fractions", "some-level-1"])
def test_level_1_tables_that_cannot_be_true_are_refused(change, why):
    rng = np.random.default_rng(6)
    counts = exit_counts(*_escalating(rng, 80), 21)
    assert counts_problem(counts, 21, 3, 384) is None
    assert counts_problem({k: v.astype(np.uint8) for k, v in counts.items()
                           if k != "details_1"} | {"details_1": counts["details_1"]}, 21, 3,
                          384) is None  # honest, in small integer types
    assert why in counts_problem(change(counts), 21, 3, 384)
    # Level-1 tables from a site of a bundle that cannot escalate.
    assert "does not escalate" in counts_problem(counts, 21, 3, 0)


def test_a_site_counts_its_details_as_its_devices_send_them(kinds_repository, tiny_data,
                                                             tmp_path):
    """A site of an escalating bundle costs each frame's details as the bundle's devices code
    them (what ``ddnn evaluate`` and central calibration count), and sends level 1's tables."""
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.models.federated.publish import write_federated_bundle
    from ddnn.models.federated.trainer import detail_bytes, evaluate
    from ddnn.models.federated.weights import architecture, model_from_bundle, model_weights
    from ddnn.runtime import BundleRuntime

    bundle = kinds_repository / "esc"
    runtime = BundleRuntime(load_bundle(bundle))
    ds = load_dataset(tiny_data.test)
    expected = runtime.run_dataset(ds.X, ds.present)["detail_bytes"]
    model = model_from_bundle(bundle)
    sent = detail_bytes(model, ds, runtime.run_dataset(ds.X, ds.present, stacked=False)["device"])
    assert (expected > 0).all() and np.array_equal(sent, expected)
    arch, weights = architecture(runtime.bundle), model_weights(model)
    held = evaluate(arch, weights, ds, grid=11)
    assert all(held.counts[k].shape == (11, 11) for k in LEVEL1_NAMES if k != "escalated_correct")
    cost = UplinkCost.of(runtime.manifest)
    assert counts_problem(held.counts, 11, 3, cost.detail) is None

    # The version the federation writes answers at the level its calibration chose.
    cal = calibrate_counts(held.counts, cost)
    for level in (0, 1):
        chosen = dataclasses.replace(cal, point=dataclasses.replace(cal.point, level=level))
        out = write_federated_bundle(runtime.bundle, arch, weights, tmp_path / f"v{level}", "2",
                                     chosen, {"strategy": "fedavg"})
        assert out.manifest.escalation_level == level
        assert out.manifest.calibration["escalation_level"] == level


def test_a_site_without_agreement_tables_leaves_accuracy_alone(caplog):
    rng = np.random.default_rng(4)
    sites = [_exits(rng, n) for n in (70, 130, 41)]
    tables = [exit_counts(e, y, p, 51) for e, y, p in sites]
    old = {k: v for k, v in tables[1].items() if not k.startswith("agree_")}  # an older site
    counts = add_counts([tables[0], old, tables[2]])
    assert not any(k.startswith("agree_") for k in counts)
    federated = calibrate_counts(counts, COST, 0.0)
    central = calibrate(*_pooled(sites), COST, 0.0, grid=51, agreement=0.0)
    assert federated.point == central.point and federated.agreement == 0.0
    assert federated.to_dict()["agreement"] == 0.0
    assert "calibrating on accuracy alone" in caplog.text


def _chunk(tmp_path, n=8, classes=("a", "b", "c"), shape=(4, 2, 2), views=2, seed=0, **kw):
    rng = np.random.default_rng(seed)
    p = rng.random((n, len(classes)))
    return write_chunk(
        tmp_path, np.sign(rng.normal(size=(n, views, *shape))), rng.random((n, views)) < 0.8,
        p / p.sum(1, keepdims=True), model=("m", "1"), classes=list(classes),
        device_codec="binary", **kw)


def test_experience_round_trip_and_bad_chunks_skipped(tmp_path, caplog):
    _chunk(tmp_path, n=8, seed=1)
    _chunk(tmp_path, n=5, seed=2)
    _chunk(tmp_path, n=3, classes=("x", "y", "z"))  # another model's classes
    (tmp_path / "experience-9-0-0.npz").write_bytes(b"not a zip")
    np.savez(tmp_path / "experience-9-0-1.npz", features=np.ones(1),
             meta=np.array(json.dumps({"format": "ddnn-experience", "format_version": 1})))
    (tmp_path / ".experience-1-1-1.npz.tmp").write_bytes(b"half written")  # ignored
    exp = read_experience(tmp_path, classes=("a", "b", "c"), feature_shape=(4, 2, 2), views=2)
    assert exp.num_samples == 13 and exp.features.dtype == np.float32
    assert exp.present.shape == (13, 2) and exp.soft_label.shape == (13, 3)
    np.testing.assert_allclose(exp.soft_label.sum(1), 1.0, atol=1e-5)
    assert exp.device_scores is None
    assert caplog.text.count("skipping experience chunk") == 3
    with pytest.raises(DatasetError, match="no usable experience"):
        read_experience(tmp_path, classes=("q", "r"))


def test_experience_refuses_what_does_not_fit(tmp_path):
    _chunk(tmp_path, shape=(4, 2, 2))
    with pytest.raises(DatasetError, match="no usable"):
        read_experience(tmp_path, feature_shape=(8, 2, 2))
    with pytest.raises(DatasetError, match="no such experience directory"):
        read_experience(tmp_path / "missing")


def test_prune_removes_the_oldest_chunks_first(tmp_path):
    paths = [_chunk(tmp_path, n=50, seed=i) for i in range(4)]
    for i, p in enumerate(paths):  # distinct ages, oldest first
        import os
        os.utime(p, (1000 + i, 1000 + i))
    size = paths[0].stat().st_size
    assert prune(tmp_path, max_bytes=2 * size + size // 2) == 2
    assert chunks(tmp_path) == paths[2:]


def _bundle_site(bundle, data):
    """The bundle's architecture and weights, and a site holding ``data``'s training file."""
    from ddnn.bundle import load_bundle
    from ddnn.models.federated.trainer import load_site
    from ddnn.models.federated.weights import architecture, model_from_bundle, model_weights

    arch = architecture(load_bundle(bundle))
    return (arch, model_weights(model_from_bundle(bundle)),
            load_site(arch, data.train, holdout=0.25, seed=0))


def test_fit_from_given_weights_learns_labelled_data_and_experience(tiny_bundle, tiny_data,
                                                                      tmp_path):
    import torch

    from ddnn.models.calibrate import stacking_tables
    from ddnn.models.federated.trainer import LocalTraining, evaluate, fit, load_site
    from ddnn.models.federated.weights import (
        build_model,
        set_weights,
    )
    from ddnn.models.train import predict

    arch, start, site = _bundle_site(tiny_bundle, tiny_data)
    assert site.train.num_samples + site.holdout.num_samples == 360
    done = fit(arch, start, site, LocalTraining(epochs=1, lr=3e-3))
    assert done.examples == site.train.num_samples and done.steps == 5
    assert set(done.weights) == set(start)
    assert any(not np.array_equal(done.weights[k], start[k]) for k in start)
    held = evaluate(arch, done.weights, site.holdout, grid=11)
    counts = held.counts
    assert held.correct["samples"] == site.holdout.num_samples
    assert counts["correct"].shape == (11, 11) and held.stacking_tables is None  # not asked
    assert all(counts[f"agree_{t}"].shape == (11, 11) for t in ("local", "edge", "cloud"))
    assert arch["stacking"] is not None  # asked for, the tables that refit the stacking
    tables = evaluate(arch, done.weights, site.holdout, grid=11,
                      with_stacking_tables=True).stacking_tables
    model = build_model(arch)
    set_weights(model, done.weights)
    expected = stacking_tables(predict(model, site.holdout), site.holdout.label)
    assert set(tables) == set(expected) and tables["cloud"].shape == (21, 21, 4)
    assert all(np.array_equal(tables[k], expected[k]) for k in tables)  # the tiers' own answers

    # Experience: the cloud's soft labels teach the layers above the device stem.
    model = build_model(arch)
    with torch.no_grad():
        x = torch.from_numpy(site.train.images(slice(0, 40)))
        feats = torch.stack([model.devices[0](x[:, v])[1] for v in range(3)], 1).numpy()
    soft = np.eye(3, dtype=np.float32)[site.train.label[:40]] * 0.9 + 0.1 / 3
    write_chunk(tmp_path / "exp", feats, site.train.present[:40], soft, model=("tiny", "1"),
                classes=list(arch["classes"]), device_codec="binary")
    learner = load_site(arch, None, tmp_path / "exp")
    taught = fit(arch, start, learner, LocalTraining(epochs=2, lr=3e-3, batch_size=16))
    assert taught.examples == 40 and taught.steps == 6
    device = [k for k in start if k.startswith("devices.")]
    assert all(np.array_equal(taught.weights[k], start[k]) for k in device)
    assert any(not np.array_equal(taught.weights[k], start[k]) for k in start if
               k.startswith(("edge.", "cloud.")))


def test_stop_when_ends_local_training_at_the_first_check_that_says_so(tiny_bundle, tiny_data):
    from ddnn.models.federated.trainer import LocalTraining, fit

    arch, start, site = _bundle_site(tiny_bundle, tiny_data)
    seen = []
    done = fit(arch, start, site, LocalTraining(epochs=3), stop_when=lambda w: seen.append(1)
               or len(seen) == 2, check_steps=2)
    assert done.stopped and done.steps == 4 and len(seen) == 2


def test_the_proximal_term_holds_a_site_near_the_model_it_started_from(tiny_bundle, tiny_data):
    from ddnn.models.federated.strategy import distance2
    from ddnn.models.federated.trainer import LocalTraining, fit

    arch, start, site = _bundle_site(tiny_bundle, tiny_data)
    # The same batches and augmentation: only the proximal term differs between the runs.
    moved = {mu: distance2(fit(arch, start, site, LocalTraining(epochs=2, lr=0.01,
                                                                proximal=mu)).weights, start)
             for mu in (0.0, 100.0)}
    assert 0 < moved[100.0] < 0.5 * moved[0.0]


def test_a_scaffold_correction_steers_the_steps_and_the_site_reports_its_mean_gradient(
        tiny_bundle, tiny_data):
    from ddnn.models.federated.trainer import LocalTraining, fit
    from ddnn.models.federated.weights import (
        build_model,
    )

    arch, start, site = _bundle_site(tiny_bundle, tiny_data)
    local = LocalTraining(epochs=1, lr=0.01)
    plain = fit(arch, start, site, local)
    params = [k for k, _ in build_model(arch).named_parameters()]
    names = [k for k in params if k.startswith("cloud.")]
    zero = fit(arch, start, site, local, correction={k: np.zeros_like(start[k]) for k in names})
    none = fit(arch, start, site, local, correction={})
    # A zero (or empty) correction changes no step; the site's mean raw gradient of every
    # parameter comes back, by name.
    assert plain.gradient is None and list(zero.gradient) == list(none.gradient) == params
    assert all(np.array_equal(plain.weights[k], zero.weights[k]) and
               np.array_equal(plain.weights[k], none.weights[k]) for k in start)
    assert all(zero.gradient[k].shape == start[k].shape and np.isfinite(zero.gradient[k]).all()
               and np.abs(zero.gradient[k]).sum() > 0 for k in names)
    # A correction is added to every step's gradient: one far larger than the site's own
    # gradients moves every one of those weights against it.
    pushed = fit(arch, start, site, local, correction={k: np.full_like(start[k], 1e3)
                                                       for k in names})
    assert all((pushed.weights[k] < start[k]).all() for k in names)
    # FedProx's pull toward the start is no part of the site's gradient: a pull this strong
    # (its gradient, mu x the distance moved, far above the loss's) leaves the variate's size
    # about that of the plain run.
    pulled = fit(arch, start, site, LocalTraining(epochs=1, lr=0.01, proximal=1e5),
                 correction={})
    size = {r: np.sqrt(sum(float(np.square(g[k]).sum()) for k in params))
            for r, g in (("plain", none.gradient), ("pulled", pulled.gradient))}
    assert size["pulled"] < 3 * size["plain"]


def test_logit_adjustment_keeps_a_skewed_site_from_erasing_the_class_it_lacks(tiny_bundle,
                                                                               tiny_data):
    """A site without class 2 trains its exits to give class 2 no probability on anything;
    with the balanced softmax (``balance`` tau) its loss already expects no 2s, so the shared
    model keeps more of its belief in class 2."""
    import torch

    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.models.federated.trainer import (
        LocalTraining,
        SiteData,
        class_prior_shift,
        fit,
    )
    from ddnn.models.federated.weights import (
        architecture,
        build_model,
        model_from_bundle,
        model_weights,
        set_weights,
    )
    from ddnn.models.train import predict

    arch = architecture(load_bundle(tiny_bundle))
    start = model_weights(model_from_bundle(tiny_bundle))
    ds = load_dataset(tiny_data.train, num_classes=len(arch["classes"]))
    lacking = ds.subset(np.flatnonzero(ds.label != 2))
    counts = np.bincount(lacking.label, minlength=3) + 1.0
    shift = class_prior_shift(lacking, 1.0).numpy()
    assert shift == pytest.approx(np.log(counts / counts.sum()))
    assert shift[2] < min(shift[:2]) - 4  # the class it lacks: large and finite
    test = load_dataset(tiny_data.test, num_classes=len(arch["classes"]))

    def belief_in_2(tau: float) -> float:
        w = fit(arch, start, SiteData(lacking, None, None),
                LocalTraining(epochs=3, balance=tau)).weights
        model = build_model(arch)
        set_weights(model, w)
        out = predict(model, test)
        return sum(float(torch.softmax(torch.from_numpy(out[k]), -1)[:, 2].mean())
                   for k in ("local", "edge", "cloud"))

    assert belief_in_2(1.0) > 1.3 * belief_in_2(0.0)


def test_an_escalating_bundle_is_rebuilt_from_its_onnx_files(kinds_repository):
    """Its devices' weights are named under the detail wrapper, and its escalated cloud's view
    trunk had each batch norm folded into its convolution: both come back, and torch gives
    every exit of the bundle, the escalated one included (model_from_bundle checks parity)."""
    from ddnn.models.federated.weights import model_from_bundle

    model = model_from_bundle(kinds_repository / "esc")
    assert model.escalated is not None


@pytest.mark.parametrize("kw", [{"escalate": "view"}, {}, {"device_binary": True}],
                         ids=["escalating", "preset", "binary-weights"])
def test_a_deep_device_bundle_is_rebuilt_from_its_onnx_files(tiny_data, tmp_path, kw):
    """A deep device's double-conv blocks had the batch norm after each first convolution folded
    into it at export (the second one's follows a pool: kept by name; a binarized conv is not
    folded at all); all come back, beside the escalated trunk's where the bundle escalates, and
    torch gives every exit of the bundle (parity is checked)."""
    torch = pytest.importorskip("torch")
    from ddnn.models.build import build_bundle
    from ddnn.models.federated.weights import model_from_bundle
    from ddnn.models.presets import preset

    cfg = preset("pi").replace(epochs=1, batch_size=32, seed=0, **kw)
    build_bundle(tiny_data.train, tmp_path / "deep", cfg, name="deep", version="1",
                 progress=False, log=lambda *_: None)
    model = model_from_bundle(tmp_path / "deep")
    first = model.devices[0].stem[0].conv[1]  # the batch norm after the first conv
    assert isinstance(first, torch.nn.BatchNorm2d)
    # folded (statistics given back as zero mean) unless the conv is binarized
    assert torch.all(first.running_mean == 0) != bool(kw.get("device_binary"))
    assert not torch.all(model.devices[0].stem[0].bn.running_mean == 0)  # kept by name


def test_the_recorded_chances_make_a_sample_of_the_whole_stream(tmp_path):
    """A frame the exits sent up is recorded for sure, an audited early exit with the audit's
    chance: the sample keeps each frame with min(chance) / its chance, so every frame of the
    stream had the same chance to be in it; an operator's choice (chance 0) is left out."""
    chance = np.array([1.0] * 3000 + [0.25] * 3000 + [0.0] * 100, np.float32)
    draw = np.random.default_rng(3).random(len(chance))
    kept = stream_sample(chance, draw)
    assert not (kept >= 6000).any()  # the operator's frames
    sent_up, audited = (kept < 3000).sum(), ((kept >= 3000) & (kept < 6000)).sum()
    assert audited == 3000  # the least likely draw is kept whole
    assert abs(sent_up - 750) < 4 * np.sqrt(3000 * 0.25 * 0.75)  # a quarter, as the audits
    assert np.array_equal(kept[kept < 3000], np.flatnonzero(draw[:3000] < 0.25))  # own draws
    assert stream_sample(np.zeros(5), draw[:5]).size == 0
    _chunk(tmp_path, n=4, chance=np.array([1, 0.5, 0.5, 0], np.float32))
    _chunk(tmp_path, n=2, seed=1, chance=np.array([1, 1], np.float32))
    exp = read_experience(tmp_path)
    assert sorted(exp.chance.tolist()) == [0, 0.5, 0.5, 1, 1, 1]
    assert exp.subset(np.array([1])).chance.tolist() == [0.5]
    exp = read_experience(tmp_path)
    again = read_experience(tmp_path)  # a frame's draws are its chunk's, read after read
    assert exp.draw.shape == (6, 2) and np.array_equal(exp.draw, again.draw)
    _chunk(tmp_path, n=2, seed=2)  # an older edge's chunk: no chances, so none is known
    grown = read_experience(tmp_path)
    assert grown.chance is None
    assert np.array_equal(grown.draw[np.isin(grown.draw[:, 0], exp.draw[:, 0])].shape,
                          exp.draw.shape)  # a new chunk leaves the others' draws alone


@pytest.mark.parametrize("chance", [[0.5, 2.0], [np.nan, 1.0], [-0.1, 1.0], [1.0]])
def test_chances_that_are_not_probabilities_are_refused(tmp_path, caplog, chance):
    _chunk(tmp_path, n=2, chance=np.array(chance, np.float32))
    with pytest.raises(DatasetError, match="no usable"):
        read_experience(tmp_path)
    assert "chance" in caplog.text


def test_held_out_experience_calibrates_a_site_that_has_no_labelled_data(tiny_bundle,
                                                                        tiny_data, tmp_path):
    """A site with experience only holds out a sample of its stream and evaluates the exits
    experience can run, the teacher's answers (or an operator's) as the labels: calibration
    tables of level 0 that a server accepts, and stacking tables of the edge and cloud."""
    import torch

    from ddnn.models.calibrate import stacking_tables_problem
    from ddnn.models.federated.trainer import (
        LocalTraining,
        evaluate_experience,
        experience_exits,
        fit,
        load_site,
    )
    from ddnn.models.federated.weights import build_model, set_weights

    arch, start, site = _bundle_site(tiny_bundle, tiny_data)
    model = build_model(arch)
    set_weights(model, start)
    n = 200
    with torch.no_grad():
        x = torch.from_numpy(site.train.images(slice(0, n)))
        outs = [model.devices[0](x[:, v]) for v in range(3)]
    scores = torch.stack([o[0] for o in outs], 1).numpy()
    feats = torch.stack([o[1] for o in outs], 1).numpy()
    truth = site.train.label[:n]
    soft = np.eye(3, dtype=np.float32)[truth] * 0.8 + 0.2 / 3
    # As the recorder writes them: the cloud's answers with the devices' scores and chances
    # (1 for a frame sent up, 0.5 for an audit), and the operators' labels in chunks of their
    # own (no scores, chance 0; an operator's word beats the cloud's).
    chance = np.where(np.arange(n) % 2 == 0, 1.0, 0.5).astype(np.float32)
    write_chunk(tmp_path / "exp", feats, site.train.present[:n], soft, model=("tiny", "1"),
                classes=list(arch["classes"]), device_codec="binary", device_scores=scores,
                chance=chance)
    operator = (truth[:5] + 1) % 3
    write_chunk(tmp_path / "exp", feats[:5], site.train.present[:5],
                np.eye(3, dtype=np.float32)[operator], model=("tiny", "1"),
                classes=list(arch["classes"]), device_codec="binary", label=operator,
                chance=np.zeros(5, np.float32))
    # Each frame's draws follow from its chunk's name (the recorder's names hold the time):
    # fixed names, so the split this test checks is the same in every run.
    for i, path in enumerate(chunks(tmp_path / "exp")):
        path.rename(path.with_name(f"experience-1000-0-{i}.npz"))
    learner = load_site(arch, None, tmp_path / "exp", holdout=0.3, seed=1)
    held = learner.experience_holdout
    assert learner.holdout is None and held is not None
    assert learner.experience.num_samples + held.num_samples == n + 5
    assert 10 <= held.num_samples < 0.3 * n
    assert not held.labelled.any() and held.scored.all()  # an operator's choice is no draw
    # Held out from a uniform sample of the stream: the frames sent up (chance 1) are kept at
    # half the rate of the audited ones (chance 0.5), the least likely draw.
    assert (held.chance == 1).sum() < (held.chance == 0.5).sum()
    every = read_experience(tmp_path / "exp")
    drawn = every.scored & (every.chance > 0)
    expected = np.flatnonzero(drawn & (every.draw[:, 0] < 0.5 / np.where(drawn, every.chance, 1))
                              & (every.draw[:, 1] < 0.3))
    assert np.array_equal(held.draw, every.draw[expected])  # exactly those frames
    assert np.array_equal(held.teacher_label, held.soft_label.argmax(1))
    taught_by = learner.experience
    by_operator = taught_by.labelled
    assert by_operator.sum() == 5 and not taught_by.scored[by_operator].any()
    assert sorted(taught_by.teacher_label[by_operator].tolist()) == sorted(operator.tolist())
    again = load_site(arch, None, tmp_path / "exp", holdout=0.3, seed=1).experience_holdout
    assert np.array_equal(again.features, held.features)  # the same frames, round after round
    result = evaluate_experience(arch, start, held, grid=11, with_stacking_tables=True)
    assert counts_problem(result.counts, 11, 3) is None  # what a server checks
    assert not any(k in result.counts for k in LEVEL1_NAMES)
    own = experience_exits(model, held)
    right = (own["local"].argmax(1) == held.teacher_label).sum()
    assert result.correct["local"] == right and result.correct["samples"] == held.num_samples
    assert stacking_tables_problem(result.stacking_tables, held.num_samples,
                                   {"edge", "cloud"}) is None
    taught = fit(arch, start, learner, LocalTraining(epochs=1, lr=3e-3, batch_size=16))
    assert taught.examples == learner.experience.num_samples  # the held-out frames are not

    # No chances recorded (an older edge), or too few frames of the stream: nothing held out.
    write_chunk(tmp_path / "old", feats, site.train.present[:n], soft, model=("tiny", "1"),
                classes=list(arch["classes"]), device_codec="binary", device_scores=scores)
    old = load_site(arch, None, tmp_path / "old")
    assert old.experience_holdout is None and old.experience.num_samples == n
    few = load_site(arch, None, tmp_path / "exp", holdout=0.02)
    assert few.experience_holdout is None and few.experience.num_samples == n + 5
