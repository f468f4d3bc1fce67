"""Loading the multi-view dataset file: the contract's layout, MVMC's, and bad files."""

import numpy as np
import pytest

from ddnn.dataset import load_dataset, load_view, write_directory_meta
from ddnn.errors import DatasetError


def _write(path, **arrays):
    np.savez(path, **arrays)
    return path


def _sample(n=4, v=3, h=16, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.random((n, v, 3, h, h), dtype=np.float32)
    label = rng.integers(0, classes, n)
    y = np.repeat(label[:, None], v, 1)
    return X, y, label


def test_contract_layout_with_absent_views(tmp_path):
    X, y, label = _sample()
    X[1, 2] = 0.0
    y[1, 2] = -1
    ds = load_dataset(_write(tmp_path / "d.npz", X=X, y=y, label=label))
    assert ds.X.dtype == np.float32 and ds.X.shape == (4, 3, 3, 16, 16)
    assert not ds.present[1, 2] and ds.present.sum() == 11
    np.testing.assert_array_equal(ds.label, label)
    assert ds.classes == ("class0", "class1", "class2")


def test_mvmc_layout_marks_absent_views_with_label_3(tmp_path):
    # MVMC: classes 0..2, an absent view is an all-zero image labelled 3, no `label` array.
    X, y, _ = _sample(classes=3)
    y[:] = [[0, 1, 3], [2, 3, 3], [1, 1, 1], [0, 3, 2]]
    for n, v in zip(*np.nonzero(y == 3), strict=True):
        X[n, v] = 0.0
    ds = load_dataset(_write(tmp_path / "mvmc.npz", X=X, y=y), num_classes=3)
    np.testing.assert_array_equal(ds.y, [[0, 1, -1], [2, -1, -1], [1, 1, 1], [0, -1, 2]])
    np.testing.assert_array_equal(ds.label, [1, 2, 1, 2])  # largest label of the present views


def test_all_zero_view_is_absent_whatever_its_label(tmp_path):
    X, y, label = _sample()
    X[0, 1] = 0.0
    ds = load_dataset(_write(tmp_path / "d.npz", X=X, y=y, label=label))
    assert ds.y[0, 1] == -1


def test_class_names_are_read(tmp_path):
    X, y, label = _sample(classes=2)
    path = _write(tmp_path / "d.npz", X=X, y=y, label=label, classes=np.array(["cat", "dog"]))
    assert load_dataset(path).classes == ("cat", "dog")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.pop("X"), "missing array 'X'"),
        (lambda a: a.update(X=a["X"][:, :, :2]), r"shape \(N, V, 3, H, W\)"),
        (lambda a: a.update(X=a["X"] * 2), r"\[0, 1\]"),
        (lambda a: a.update(X=(a["X"] * 255).astype(np.uint8)), "floating point"),
        (lambda a: a.update(X=a["X"][..., :8, :8]), "at least 16x16"),
        (lambda a: a.update(y=a["y"][:, :2]), "y must be integer"),
        (lambda a: a.update(label=a["label"] + 5), "label out of range"),
        (lambda a: a.update(y=a["y"] - 3), "negative label"),
        (lambda a: a.update(label=a["label"][:2]), "label must be integer"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, change, message):
    X, y, label = _sample()
    arrays = {"X": X, "y": y, "label": label}
    change(arrays)
    with pytest.raises(DatasetError, match=message):
        load_dataset(_write(tmp_path / "bad.npz", **arrays), num_classes=3)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset(tmp_path / "nope.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DatasetError, match="not a readable .npz"):
        load_dataset(tmp_path / "junk.npz")


def test_a_sample_no_view_sees_is_kept_with_label_minus_one(tmp_path):
    # A scene where no camera sees anything is normal: replayed, answered "none", not trained on.
    X, y, label = _sample()
    X[2] = 0.0
    ds = load_dataset(_write(tmp_path / "d.npz", X=X, y=y, label=label), num_classes=3)
    assert ds.label[2] == -1 and not ds.present[2].any() and (ds.label[[0, 1]] >= 0).all()
    ds = load_dataset(_write(tmp_path / "e.npz", X=X, y=y), num_classes=3)  # label from y
    assert ds.label[2] == -1


def test_training_skips_the_samples_no_view_sees(tmp_path):
    pytest.importorskip("torch")  # (training: not on a board)
    from ddnn.models.build import seen

    X, y, label = _sample()
    X[2] = 0.0
    ds = seen(load_dataset(_write(tmp_path / "d.npz", X=X, y=y, label=label), num_classes=3))
    assert ds.num_samples == len(label) - 1 and (ds.label >= 0).all()


def test_pickled_arrays_are_refused(tmp_path):
    X, y, label = _sample()
    path = _write(
        tmp_path / "d.npz", X=X, y=y, label=label, classes=np.array(["a", 1], dtype=object)
    )
    with pytest.raises(DatasetError):
        load_dataset(path)


def _view_of(ds, view):
    return np.where(ds.present[:, view, None, None, None], ds.X[:, view], 0.0), ds.present[:, view]


@pytest.mark.parametrize("order", ["C", "F"])
def test_one_view_is_the_view_of_the_whole_file(tmp_path, order):
    X, y, label = _sample(n=7)
    y[1, 2] = -1  # absent by label, yet not blank: a replay sends it as absent (all zero)
    X[3, 0] = 0.0  # blank: absent whatever its label
    path = _write(tmp_path / "d.npz", X=np.asarray(X, order=order), y=y, label=label)
    whole = load_dataset(path)
    for view in range(3):
        images, present = load_view(path, view)
        expected, seen = _view_of(whole, view)
        assert images.dtype == np.float32 and images.flags.c_contiguous
        np.testing.assert_array_equal(images, expected)
        np.testing.assert_array_equal(present, seen)
    assert not load_view(path, 2)[1][1] and not load_view(path, 0)[1][3]
    images, present = load_view(path, 1, start=2, limit=3)  # a replay's --start and --limit
    expected, seen = _view_of(whole, 1)
    np.testing.assert_array_equal(images, expected[2:5])
    np.testing.assert_array_equal(present, seen[2:5])
    assert len(load_view(path, 1, start=5)[0]) == 2 and len(load_view(path, 1, start=9)[0]) == 0


def test_one_view_of_a_directory_is_read_from_its_mapped_images(tmp_path):
    X, y, label = _sample(n=5)
    pixels = (X * 255).astype(np.uint8)
    pixels[2, 1] = 0
    for name, a in (("X", pixels), ("y", y), ("label", label)):
        np.save(tmp_path / f"{name}.npy", a)
    write_directory_meta(tmp_path, ("a", "b", "c"), ("v0", "v1", "v2"))
    images, present = load_view(tmp_path, 1)
    expected, seen = _view_of(load_dataset(tmp_path), 1)
    np.testing.assert_array_equal(images, expected)
    np.testing.assert_array_equal(present, seen)
    assert not present[2]
    images, present = load_view(tmp_path, 1, start=1, limit=2)
    np.testing.assert_array_equal(images, expected[1:3])
    np.testing.assert_array_equal(present, seen[1:3])


def test_one_view_of_a_bad_file_names_the_problem(tmp_path):
    X, y, label = _sample()
    path = _write(tmp_path / "d.npz", X=X, y=y, label=label)
    with pytest.raises(DatasetError, match=r"has views 0..2, not 3"):
        load_view(path, 3)
    with pytest.raises(DatasetError, match=r"\[0, 1\]"):
        load_view(_write(tmp_path / "bad.npz", X=X * 2, y=y, label=label), 0)
    with pytest.raises(DatasetError, match="label out of range"):
        load_view(_write(tmp_path / "bad.npz", X=X, y=y, label=label + 5), 0, num_classes=3)
    with open(tmp_path / "one.npz", "wb") as f:
        np.save(f, X)  # one array, under a .npz name
    with pytest.raises(DatasetError, match="not a .npz file"):
        load_view(tmp_path / "one.npz", 0)
