"""A federation's settings travel as Flower's run config and back; the Flower App we write is
one Flower accepts; the site's paths reach its SuperNode intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from ddnn.errors import ConfigError
from ddnn.models.federated import deployment
from ddnn.models.federated.settings import FederationSettings


def test_settings_round_trip_through_the_run_config():
    s = FederationSettings(bundle="/b", out="/o", work="/w", strategy="dma", rounds=7,
                           epochs=0.5, threshold=0.02, agreement=0.9, version="3.1",
                           proximal=0.01, balance=0.5)
    assert FederationSettings.from_run_config(s.run_config()) == s
    assert s.run_config()["check-steps"] == s.check_steps
    m = FederationSettings(bundle="/b", out="/o", work="/w", momentum=0.5)
    assert FederationSettings.from_run_config(m.run_config()).momentum == 0.5


@pytest.mark.parametrize("bad", [{"strategy": "fedprox"}, {"rounds": -1}, {"epochs": -1.0},
                                 {"epochs": float("nan")}, {"holdout": 1.0},
                                 {"threshold": 0.0}, {"min_sites": 0}, {"grid": 1},
                                 {"agreement": 1.5}, {"proximal": -0.1},
                                 {"proximal": float("nan")}, {"momentum": 1.0},
                                 {"momentum": -0.1}, {"momentum": float("nan")},
                                 {"strategy": "dma", "momentum": 0.5}, {"balance": -1.0},
                                 {"balance": float("nan")}, {"balance": 5.0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ConfigError):
        FederationSettings(bundle="b", out="o", work="w", **bad)


def test_each_strategy_has_its_own_rounds_and_epochs_unless_given():
    """FedAvg 10 x 6 with SCAFFOLD, DMA 10 x 2 without (each the better measured for it); a
    given value wins, and a run config's 0 or -1 (the Flower App's defaults) means the
    strategy's own there too."""
    paths = {"bundle": "b", "out": "o", "work": "w"}
    fedavg = FederationSettings(**paths)
    assert (fedavg.rounds, fedavg.epochs, fedavg.scaffold) == (10, 6.0, 1)
    dma = FederationSettings(**paths, strategy="dma")
    assert (dma.rounds, dma.epochs, dma.scaffold) == (10, 2.0, 0)
    assert FederationSettings(**paths, strategy="dma", rounds=3).epochs == 2.0
    assert FederationSettings(**paths, epochs=0.5).rounds == 10
    plain = FederationSettings(**paths, scaffold=0)  # uncorrected: many short rounds
    assert (plain.rounds, plain.epochs, plain.scaffold) == (20, 1.0, 0)
    assert FederationSettings(**paths, scaffold=0, epochs=3).rounds == 20
    app = deployment.app_pyproject()
    assert all(f"\n{line}\n" in app for line in ("rounds = 0", "epochs = 0.0", "scaffold = -1"))
    from_flower = FederationSettings.from_run_config(
        {**paths, "strategy": "dma", "rounds": 0, "epochs": 0.0, "scaffold": -1})
    assert (from_flower.rounds, from_flower.epochs, from_flower.scaffold) == (10, 2.0, 0)


def test_the_flower_app_validates_and_takes_our_run_config(tmp_path):
    from flwr.cli.config_utils import load_and_validate
    from flwr.common.config import parse_config_args

    app = deployment.write_app(tmp_path / "app")
    config, warnings = load_and_validate(app / "pyproject.toml")  # imports both components
    assert not warnings
    defaults = config["tool"]["flwr"]["app"]["config"]
    assert set(defaults) == set(FederationSettings(bundle="", out="", work="").run_config())
    node = deployment.node_config(tmp_path / "site one.npz", None)
    assert parse_config_args([node]) == {"data": str((tmp_path / "site one.npz").resolve())}
    with pytest.raises(ConfigError, match="quote"):
        deployment.node_config("it's.npz", None)


def test_the_committed_flower_app_is_the_one_ddnn_federate_runs():
    """deploy/flower-app, what a Flower user runs with `flwr run`, never drifts from the app
    `ddnn federate` writes (the run config's keys and defaults)."""
    committed = Path(__file__).resolve().parents[2] / "deploy" / "flower-app" / "pyproject.toml"
    assert committed.read_text(encoding="utf-8") == deployment.app_pyproject()


def test_the_run_config_file_flwr_run_takes_holds_the_settings(tmp_path):
    import tomllib  # Python 3.11, as Flower 1.42

    s = FederationSettings(bundle='/b "quoted"\\x', out="/o", work="/w", lr=1e-5, rounds=3)
    path = deployment.write_run_config(tmp_path / "run.toml", s.run_config())
    assert FederationSettings.from_run_config(tomllib.loads(path.read_text())) == s


def test_flowers_command_line_starts():
    """`flwr`, the command line of this environment's Flower (it did not start beside amqtt's
    typer 0.15: "Type not yet supported: typing.Literal")."""
    script = Path(sys.executable).parent / "flwr"
    entry = ("import sys; from importlib.metadata import entry_points; "
             "(e,) = entry_points(group='console_scripts', name='flwr'); sys.exit(e.load()())")
    argv = [str(script)] if script.exists() else [sys.executable, "-c", entry]
    done = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "run" in done.stdout and "supernode" in done.stdout


def test_flowers_refusal_reaches_the_operator(tmp_path):
    """What `flwr` says when it fails (here: a SuperNode key that is not one) is the error."""
    from ddnn.errors import DdnnError
    from ddnn.models.federated.driver import free_port

    deployment.write_connection(tmp_path, f"127.0.0.1:{free_port()}", None)
    (tmp_path / "site.pub").write_text("not a key\n")
    with pytest.raises(DdnnError, match=r"(?s)`flwr supernode` failed.*Unsupported key type"):
        deployment.register_supernode(tmp_path, tmp_path / "site.pub")


def test_a_site_directory_of_recorded_experience_is_learnt_from_as_experience(tmp_path):
    import numpy as np

    from ddnn.experience import write_chunk
    from ddnn.models.federated.cli import site_of

    recorded, dataset = tmp_path / "experience", tmp_path / "images"
    dataset.mkdir()
    write_chunk(recorded, np.zeros((2, 3, 4, 2, 2)), np.ones((2, 3), bool),
                np.full((2, 3), 1 / 3), model=("m", "1"), classes=["a", "b", "c"],
                device_codec="binary")
    assert site_of(str(recorded)).experience == str(recorded)
    assert site_of(str(dataset)).data == str(dataset)  # (no chunk: a dataset directory)
    assert site_of(str(tmp_path / "site.npz")).data == str(tmp_path / "site.npz")


@pytest.mark.parametrize("flag, strategy, scaffold", [
    ([], "fedavg", 1), (["--no-scaffold"], "fedavg", 0), (["--scaffold"], "fedavg", 1),
    ([], "dma", 0)])
def test_the_command_line_turns_scaffold_on_and_off(flag, strategy, scaffold):
    """Each with its own schedule: FedAvg 10 x 6 corrected, 20 x 1 plain; DMA 10 x 2."""
    from ddnn.cli import build_parser
    from ddnn.models.federated import cli

    args = build_parser().parse_args(["federate", "--bundle", "b", "--out", "o",
                                      "--strategy", strategy, *flag])
    s = cli._settings(args, "w")
    assert s.scaffold == scaffold
    assert (s.rounds, s.epochs) == {"fedavg": [(20, 1.0), (10, 6.0)], "dma": [(10, 2.0)]}[
        strategy][scaffold]


def test_scaffold_under_dma_is_refused_at_the_command_line():
    from ddnn.cli import build_parser
    from ddnn.models.federated import cli

    args = build_parser().parse_args(["federate", "--bundle", "b", "--out", "o",
                                      "--strategy", "dma", "--scaffold"])
    with pytest.raises(ConfigError, match="FedAvg's"):
        cli._settings(args, "w")


@pytest.mark.parametrize("flags, variates, why", [
    ([], "sent", None), (["--scaffold-variates", "derived"], "derived", None),
    (["--scaffold-variates", "derived", "--no-scaffold"], None, "FedAvg alone runs"),
    (["--scaffold-variates", "derived", "--strategy", "dma"], None, "FedAvg alone runs"),
    (["--scaffold-variates", "derived", "--server-momentum", "0.5"], None, "server momentum")])
def test_the_command_line_chooses_how_scaffolds_variates_travel(flags, variates, why):
    from ddnn.cli import build_parser
    from ddnn.models.federated import cli

    args = build_parser().parse_args(["federate", "--bundle", "b", "--out", "o", *flags])
    if why is None:
        s = cli._settings(args, "w")
        assert (s.variates, s.scaffold, s.rounds, s.epochs) == (variates, 1, 10, 6.0)
        assert FederationSettings.from_run_config(s.run_config()).variates == variates
    else:
        with pytest.raises(ConfigError, match=why):
            cli._settings(args, "w")


def test_the_report_says_where_the_cloud_labelled_the_held_out_frames(capsys):
    """Held-out experience is labelled by the cloud's answers: the summary a person reads says
    its accuracy is agreement with the cloud, and says nothing of the kind for labelled data."""
    import argparse

    from ddnn.models.federated.cli import _report

    result = {"bundle": "out", "version": "2", "rounds": 2, "communicated_bytes": 2e6,
              "evaluation": {"samples": 60, "teacher_labelled": 60, "accuracy": {"edge": 0.8}}}
    assert _report(argparse.Namespace(json=False), result) == 0
    assert ("held-out accuracy on 60 samples (60 labelled by the cloud's answers: agreement "
            "with it): edge 0.800") in capsys.readouterr().err
    del result["evaluation"]["teacher_labelled"]
    _report(argparse.Namespace(json=False), result)
    assert "held-out accuracy on 60 samples: edge 0.800" in capsys.readouterr().err
