"""The demo's work dir: what it generated and trained is reused only for the options that made
it, so a demo of before (or other flags) never replays one scene through another's bundle."""

import json

from ddnn.cli import build_parser
from ddnn.tools import demo
from ddnn.tools.demo import _recipe

BOTH = {"test", "bundle"}


def _args(work, *flags):
    return build_parser().parse_args(["demo", "--work", str(work), *flags])


def _forget_stale(args, work, parts=BOTH):
    return demo._forget_stale(work, demo._recorded(work), _recipe(args), parts)


def _work_dir(tmp_path, recipe):
    for name in ("test.npz", "train.npz", "bundle/manifest.json"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("made")
    if recipe is not None:
        (tmp_path / "recipe.json").write_text(json.dumps(recipe))


def _left(tmp_path):
    return sorted(p.name for p in (tmp_path / "test.npz", tmp_path / "train.npz") if p.exists())


def test_the_same_options_reuse_everything(tmp_path):
    args = _args(tmp_path)
    _work_dir(tmp_path, _recipe(args))
    assert not _forget_stale(args, tmp_path)
    assert _left(tmp_path) == ["test.npz", "train.npz"]


def test_a_work_dir_of_before_the_recipe_is_made_again(tmp_path):
    _work_dir(tmp_path, None)
    assert _forget_stale(_args(tmp_path), tmp_path)
    assert _left(tmp_path) == []


def test_more_frames_regenerate_the_test_split_only(tmp_path):
    _work_dir(tmp_path, _recipe(_args(tmp_path)))
    assert not _forget_stale(_args(tmp_path, "--frames", "500"), tmp_path)
    assert _left(tmp_path) == ["train.npz"]


def test_another_scene_or_training_retrains(tmp_path):
    _work_dir(tmp_path, _recipe(_args(tmp_path)))
    assert _forget_stale(_args(tmp_path, "--classes", "3"), tmp_path)
    assert _left(tmp_path) == []
    _work_dir(tmp_path, _recipe(_args(tmp_path)))
    assert _forget_stale(_args(tmp_path, "--epochs", "60"), tmp_path)
    assert _left(tmp_path) == ["test.npz"]


def test_a_stopped_training_leaves_no_stale_training_split(tmp_path):
    _work_dir(tmp_path, _recipe(_args(tmp_path)))
    (tmp_path / "bundle" / "manifest.json").unlink()  # the training never finished
    assert _forget_stale(_args(tmp_path, "--classes", "3"), tmp_path)
    assert _left(tmp_path) == []


def test_a_given_bundle_leaves_the_work_dirs_own_and_its_record(tmp_path, monkeypatch):
    """--bundle: the work dir's bundle is neither retrained nor recorded as made for the
    options of this run (a later run without --bundle still sees it is stale)."""
    old = _recipe(_args(tmp_path, "--classes", "3"))
    _work_dir(tmp_path, old)
    args = _args(tmp_path, "--bundle", "elsewhere")
    monkeypatch.setattr(demo, "_make", lambda *a, **k: ("elsewhere", tmp_path / "test.npz"))
    demo._prepare(args, tmp_path, demo.Stages())
    assert _left(tmp_path) == ["train.npz"]  # the test split was made for other options
    recorded = demo._recorded(tmp_path)
    assert recorded == {"test": _recipe(args)["test"], "bundle": old["bundle"]}
    assert recorded["bundle"] != _recipe(_args(tmp_path))["bundle"]
