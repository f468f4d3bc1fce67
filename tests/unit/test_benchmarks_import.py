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
