"""Every benchmark module imports: a benchmark broken by a change elsewhere fails here, in the
suite, not months later in `ddnn bench` (alignment once imported a helper that was gone)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import ddnn.benchmarks


@pytest.mark.parametrize("name", sorted(m.name for m in pkgutil.iter_modules(
    ddnn.benchmarks.__path__)))
def test_benchmark_module_imports(name):
    importlib.import_module(f"ddnn.benchmarks.{name}")


def test_every_training_variant_of_the_benchmarks_is_a_valid_ddnn_train_call():
    """The flags a benchmark trains a variant with parse, and give a valid configuration that
    differs from the defaults: a renamed flag fails here, not hours into `ddnn bench`."""
    from ddnn.benchmarks import ablation, tiers
    from ddnn.cli import build_parser
    from ddnn.models.cli import _config
    from ddnn.models.config import DDNNConfig

    variants = {**{f"tiers.{k}": v for k, v in tiers.VARIANTS.items()},
                **{f"ablation.{k}": v for k, v in ablation.VARIANTS.items()}}
    for name, flags in variants.items():
        flags = [f.format(reference="ref-bundle") for f in flags]
        args = build_parser().parse_args(["train", "--data", "d.npz", "--out", "b", *flags])
        cfg = _config(args)
        assert isinstance(cfg, DDNNConfig), name
        if name != "tiers.escalate_view":  # the defaults themselves, named for the table
            assert (cfg != DDNNConfig.from_flat(threads=cfg.training.threads) or args.teacher
                    or args.baseline), name
    pi = _config(build_parser().parse_args(["train", "--data", "d", "--out", "b",
                                            *tiers.VARIANTS["pi_device"]]))
    assert (pi.device.stem, pi.device.convs, pi.device.filters, pi.escalation.detail) == (
        (16, 32), 2, 32, "view")


def test_the_tiers_gate_needs_the_mean_each_seed_and_fifty_times_fewer_bytes():
    """Issue 41's gate: the mean at least the reference's, no seed 0.5 points under its own
    reference, at least 50x fewer bytes than raw offload on every seed."""
    from ddnn.benchmarks.tiers import _gate

    refs = {0: {"overall": 0.921}, 1: {"overall": 0.897}}

    def rows(s0, s1, fewer=64.0):
        return {0: {"overall": s0, "x_fewer_than_raw": fewer},
                1: {"overall": s1, "x_fewer_than_raw": 145.0}}

    gate = _gate(rows(0.934, 0.932), refs)
    assert gate["met"] and gate["worst_seed_minus_reference"] == pytest.approx(0.013)
    assert not _gate(rows(0.915, 0.932), refs)["met"]  # seed 0 0.6 points under, mean above
    assert not _gate(rows(0.934, 0.932, fewer=40.0), refs)["met"]  # too many bytes
    assert not _gate(rows(0.918, 0.894), refs)["met"]  # each seed 0.3 under: the mean is
