"""``ddnn train``'s options: the grouped DDNNConfig, presets, config files, and every flag of
before the presets still asking for the configuration it asked for."""

from __future__ import annotations

import pytest

from ddnn.cli import build_parser, main
from ddnn.errors import ConfigError
from ddnn.models.cli import _config
from ddnn.models.config import FLAT, DDNNConfig, DeviceConfig, EscalationConfig
from ddnn.models.config_file import read_config_file, to_toml
from ddnn.models.presets import DEFAULT_PRESET, PRESETS, preset

PAPER = {"scheme": "MP-AP", "device_filters": 4, "device_stem": [], "device_binary": True,
         "device_codec": "binary", "device_exit_float": False, "device_exit_pool": 0,
         "device_scores": "logits", "edge_filters": 16, "edge_per_view": False,
         "edge_codec": "binary", "distill_device": True, "escalate": "none", "device_convs": 1,
         "channels_last": False}
PI = {"device_stem": [16, 48], "device_convs": 2, "device_filters": 64, "escalate": "none",
      "channels_last": True}
DEEP = {**PI, "device_stem": [32, 64]}
# Every configuration flag `ddnn train` had before presets and config files, with a value and
# the fields the configuration then had besides the defaults (`--paper`, `--deep-device`: the
# networks DDNNConfig.paper() and DDNNConfig.deep_device() gave). The defaults are now the
# default preset's (pi), so each flag changes those fields of it.
CONFIG_FLAGS = {
    "--epochs": (["3"], {"epochs": 3}), "--batch-size": (["8"], {"batch_size": 8}),
    "--lr": (["0.01"], {"lr": 0.01}), "--tolerance": (["0.02"], {"tolerance": 0.02}),
    "--agreement": (["0.9"], {"agreement": 0.9}), "--max-bytes": (["40"], {"max_bytes": 40.0}),
    "--no-stacking": ([], {"stack_exits": False}),
    "--val-fraction": (["0.25"], {"val_fraction": 0.25}), "--seed": (["7"], {"seed": 7}),
    "--threads": (["1"], {"threads": 1}), "--paper": ([], PAPER), "--deep-device": ([], DEEP),
    "--scheme": (["MP-CC"], {"scheme": "MP-CC"}),
    "--device-filters": (["8"], {"device_filters": 8}),
    "--device-stem": (["4,8"], {"device_stem": [4, 8]}),
    "--device-convs": (["2"], {"device_convs": 2}),
    "--device-codec": (["bits4"], {"device_codec": "bits4"}),
    "--float-device": ([], {"device_codec": "float16"}),
    "--binary-weights": ([], {"device_binary": True}),
    "--device-exit-pool": (["0"], {"device_exit_pool": 0}),
    "--device-scores": (["logits"], {"device_scores": "logits"}),
    "--per-view-devices": ([], {"share_device_weights": False}),
    "--edge-filters": (["8"], {"edge_filters": 8}),
    "--edge-codec": (["float16"], {"edge_codec": "float16"}),
    "--early-fusion": ([], {"edge_per_view": False}),
    "--cloud-filters": (["16,16,16"], {"cloud_filters": [16, 16, 16]}),
    "--escalate": (["stem"], {"escalate": "stem"}),
    "--escalate-pool": (["4"], {"escalate_pool": 4}),
    "--escalate-bits": (["8"], {"escalate_bits": 8}),
    "--escalate-views": (["2"], {"escalate_views": 2}),
    "--escalate-widths": (["8,16"], {"escalate_widths": [8, 16]}),
    "--distill": (["0.5"], {"distill": 0.5}),
    "--teacher-weight": (["2"], {"teacher_weight": 2.0}),
    "--distill-device": ([], {"distill_device": True}),
    "--lowres-epochs": (["1"], {"lowres_epochs": 1}),
    "--no-augment": ([], {"augment": False}),
    "--schedule": (["onecycle"], {"schedule": "onecycle"}),
    "--patience": (["3"], {"patience": 3}),
    "--stop-fraction": (["0.1"], {"stop_fraction": 0.1}),
    "--device": (["cpu"], {"device": "cpu"}), "--no-amp": ([], {"amp": False}),
    "--cpu-amp": ([], {"cpu_amp": True}), "--comm-hook": (["fp16"], {"comm_hook": "fp16"}),
}
# ... and the others, with a value and the argument they set.
RUN_FLAGS = {
    "--data": (["d.npz"], "data", "d.npz"), "--out": (["b"], "out", "b"),
    "--val": (["v.npz"], "val", "v.npz"), "--name": (["cam"], "name", "cam"),
    "--model-version": (["2"], "model_version", "2"), "--json": ([], "json", True),
    "--no-progress": ([], "no_progress", True), "--baseline": ([], "baseline", True),
    "--test": (["t.npz"], "test", "t.npz"), "--teacher": (["ref"], "teacher", "ref"),
    "--checkpoint": (["c.pt"], "checkpoint", "c.pt"), "--resume": ([], "resume", True),
}
# The manifest's training.config keys (other tiers and `ddnn federate` read them).
MANIFEST_KEYS = {*PAPER, "cloud_filters", "escalate_pool", "escalate_bits", "escalate_widths",
                 "escalate_views", "share_device_weights", "edge_view_pool", "epochs",
                 "batch_size", "lr", "weight_decay", "exit_weights", "seed", "threads", "distill",
                 "teacher_weight", "distill_temperature", "lowres_epochs", "augment", "shift",
                 "brightness", "view_dropout", "schedule", "patience", "stop_fraction", "device",
                 "amp", "cpu_amp", "comm_hook", "channels_last", "val_fraction", "tolerance",
                 "agreement", "max_bytes", "threshold_grid", "stack_exits", "extra"}


def _args(*flags: str):
    return build_parser().parse_args(["train", "--data", "d.npz", "--out", "b", *flags])


def _train_flags() -> set[str]:
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    return {s for a in train._actions for s in a.option_strings}


def test_every_flag_of_before_is_still_there():
    assert len(CONFIG_FLAGS) + len(RUN_FLAGS) == 55  # all of them, as the parser had them
    assert set(CONFIG_FLAGS) | set(RUN_FLAGS) <= _train_flags()


@pytest.mark.parametrize("flag", sorted(CONFIG_FLAGS))
def test_each_configuration_flag_asks_for_what_it_asked_for_before(flag):
    values, changed = CONFIG_FLAGS[flag]
    default = preset(DEFAULT_PRESET).to_dict()
    assert _config(_args(flag, *values)).to_dict() == {**default, **changed}


@pytest.mark.parametrize("flag", sorted(RUN_FLAGS))
def test_each_other_flag_sets_its_argument_and_leaves_the_configuration(flag):
    values, dest, value = RUN_FLAGS[flag]
    args = _args(flag, *values)
    assert getattr(args, dest) == value
    if flag not in ("--teacher", "--baseline"):  # those two refuse each other, tested elsewhere
        assert _config(args) == preset(DEFAULT_PRESET)


def test_the_manifest_keeps_its_flat_config_keys():
    assert set(DDNNConfig().to_dict()) == MANIFEST_KEYS == set(FLAT) | {"extra"}
    saved = {**preset("pi").to_dict(), "from_a_newer_ddnn": 1}
    assert DDNNConfig.from_saved(saved) == preset("pi")  # unknown names are ignored


def test_each_group_validates_itself_and_the_config_what_spans_two():
    with pytest.raises(ConfigError, match="device convs must be 1, 2 or 3"):
        DeviceConfig(convs=4)
    with pytest.raises(ConfigError, match="escalate bits"):
        EscalationConfig(bits=3)
    with pytest.raises(ConfigError, match="'stem' needs a device stem"):
        DDNNConfig.from_flat(escalate="stem", device_stem=())
    with pytest.raises(ConfigError, match="unknown configuration field 'epoch'.*epochs"):
        DDNNConfig.from_flat(epoch=3)
    with pytest.raises(ConfigError, match="epochs takes int, got '3'"):
        DDNNConfig.from_flat(epochs="3")
    with pytest.raises(ConfigError, match="augment takes bool"):
        DDNNConfig.from_flat(augment=1)
    cfg = DDNNConfig.from_flat(lr=1, max_bytes=30)  # a TOML integer for a float field
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    with pytest.raises(AttributeError):
        cfg.training.lr = 2.0  # type: ignore[misc]  # frozen: change one with replace()
    assert cfg.replace(max_bytes=None).calibration.max_bytes is None


def test_the_presets_are_tiny_the_paper_pi_the_default_and_the_deep_device():
    assert set(PRESETS) == {"tiny", "paper", "pi", "deep"}
    assert DEFAULT_PRESET == "pi" and _config(_args()) == preset("pi")  # no preset: pi
    assert preset("tiny") == DDNNConfig()  # DDNNConfig's own fields: bundles of before
    assert preset("paper").to_dict() == {**DDNNConfig().to_dict(), **PAPER}
    assert preset("pi").to_dict() == {**DDNNConfig().to_dict(), **PI}
    assert preset("deep").to_dict() == {**DDNNConfig().to_dict(), **DEEP}
    assert _config(_args("--preset", "paper")) == _config(_args("--paper")) == preset("paper")
    with pytest.raises(ConfigError, match="unknown preset 'big'"):
        preset("big")
    with pytest.raises(ConfigError, match="two different networks"):
        _config(_args("--preset", "pi", "--paper"))
    with pytest.raises(ConfigError, match="two different networks"):
        _config(_args("--preset", "pi", "--deep-device"))
    assert _config(_args("--preset", "deep", "--deep-device")) == preset("deep")  # the same one
    assert _config(_args("--deep-device")) == preset("deep")


@pytest.mark.parametrize("cfg", [
    DDNNConfig(), preset("paper"), preset("pi"), preset("deep"),
    DDNNConfig.from_flat(max_bytes=24.5, lr=3e-5, exit_weights=(0.5, 1, 1, 2),
                         extra={"note": "a \"quoted\" run", "site": 3}),
], ids=["tiny", "paper", "pi", "deep", "custom"])
def test_a_config_file_reads_back_to_the_configuration_it_was_written_from(tmp_path, cfg):
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg, "a comment\nof two lines"))
    assert DDNNConfig.from_flat(**read_config_file(path)) == cfg
    assert _config(_args("--config", str(path))) == cfg


def test_flags_override_the_file_and_the_file_the_preset(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('epochs = 5\n[device]\nfilters = 8\n[training]\nlr = 0.01\n')
    cfg = _config(_args("--preset", "paper", "--config", str(path), "--epochs", "7"))
    assert cfg.device.filters == 8  # file over preset
    assert cfg.training.epochs == 7  # flag over file
    assert cfg.training.lr == 0.01 and cfg.edge.scheme == "MP-AP"  # file, preset
    assert cfg == preset("paper").replace(device_filters=8, epochs=7, lr=0.01)


@pytest.mark.parametrize("text, message", [
    ("epoch = 5\n", r"unknown key 'epoch'; .*\[device\].* epochs"),
    ("[device]\nfilter = 8\n", r"unknown key 'filter' in \[device\]; its keys are filters"),
    ("[gpu]\nn = 1\n", "unknown key 'gpu'"),
    ("[training]\nepochs = \"five\"\n", "epochs takes int"),
    ("epochs = \n", "not valid TOML"),
    ("[device]\nconvs = 4\n", "device convs must be 1, 2 or 3"),
])
def test_a_bad_config_file_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        _config(_args("--config", str(path)))


def test_a_missing_config_file_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--data", "d", "--out", "b", "--config", str(tmp_path / "no")]) != 0
    assert "cannot read the config file" in capsys.readouterr().err


def test_print_config_prints_the_effective_configuration_and_needs_no_data(tmp_path, capsys):
    assert main(["train", "--preset", "pi", "--epochs", "9", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# ddnn train configuration (preset pi")
    path = tmp_path / "printed.toml"
    path.write_text(printed)
    assert _config(_args("--config", str(path))) == preset("pi").replace(epochs=9)
    assert main(["train", "--epochs", "9"]) != 0
    assert "needs --data and --out" in capsys.readouterr().err


def test_help_shows_the_presets_and_common_options_first_then_groups_by_concern(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    heads = ["Presets", "options:", "device segment:", "edge:", "cloud:", "escalation:",
             "training:", "calibration:", "hardware:"]
    assert [text.index(h) for h in heads] == sorted(text.index(h) for h in heads)
    common = text[text.index("options:"):text.index("device segment:")]
    for flag in ("--data", "--out", "--preset", "--config", "--epochs", "--seed", "--baseline"):
        assert flag in common
    assert all(f"  {name} " in text for name in PRESETS)


def test_the_config_file_of_the_training_docs_asks_for_what_they_say(tmp_path):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    path = tmp_path / "small.toml"
    path.write_text(doc.split("```toml\n", 1)[1].split("```", 1)[0])
    cfg = _config(_args("--preset", "paper", "--config", str(path), "--epochs", "30"))
    assert cfg == preset("paper").replace(device_filters=8, escalate="none", epochs=30,
                                          lr=0.003, device="cuda", tolerance=0.01)
