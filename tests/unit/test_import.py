"""``ddnn data import`` and the memory-mapped dataset directory: layouts, bad folders."""

import numpy as np
import pytest

from ddnn.dataset import MultiViewDataset, RowSelection, load_dataset
from ddnn.errors import DatasetError

Image = pytest.importorskip("PIL.Image")
importer = pytest.importorskip("ddnn.models.importer")


def _image(path, size=(20, 20), value=None, seed=0):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(1, 255, (size[1], size[0], 3), dtype=np.uint8)
    if value is not None:
        pixels[:] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return pixels


def _class_tree(root, classes=("cat", "dog"), samples=3, views=("cam0", "cam1", "cam2")):
    """ROOT/CLASS/SAMPLE/VIEW.png; the last sample of each class misses its last view."""
    pixels = {}
    for k, c in enumerate(classes):
        for s in range(samples):
            for j, v in enumerate(views):
                if s == samples - 1 and j == len(views) - 1:
                    continue
                path = root / c / f"s{s}" / f"{v}.png"
                pixels[c, s, v] = _image(path, seed=100 * k + 10 * s + j)
    return pixels


def test_class_folders_import_to_uint8_memory_mapped(tmp_path):
    pixels = _class_tree(tmp_path / "in")
    out = importer.import_folder(tmp_path / "in", tmp_path / "set")
    ds = load_dataset(out, mmap=True)
    assert ds.lazy and isinstance(ds.X, np.memmap) and ds.X.dtype == np.uint8
    assert ds.classes == ("cat", "dog") and ds.num_views == 3 and ds.image_shape == (3, 20, 20)
    np.testing.assert_array_equal(ds.label, [0, 0, 0, 1, 1, 1])
    assert not ds.present[2, 2] and ds.present.sum() == 16
    np.testing.assert_array_equal(ds.X[4, 1].transpose(1, 2, 0), pixels["dog", 1, "cam1"])
    # The float view is exactly pixel / 255, and the in-memory load gives the .npz layout.
    expected = pixels["dog", 1, "cam1"].transpose(2, 0, 1) / 255
    np.testing.assert_allclose(ds.images([4])[0, 1], expected, atol=1e-6)
    full = load_dataset(out)
    assert not full.lazy and full.X.dtype == np.float32
    np.testing.assert_array_equal(full.X, ds.images(slice(None)))


def test_lazy_subset_reads_only_its_rows(tmp_path):
    _class_tree(tmp_path / "in")
    ds = load_dataset(importer.import_folder(tmp_path / "in", tmp_path / "set"), mmap=True)
    sub = ds.subset(np.array([5, 1, 3])).subset(np.array([True, False, True]))
    assert isinstance(sub.X, RowSelection) and sub.X.shape == (2, 3, 3, 20, 20)
    np.testing.assert_array_equal(sub.images(slice(None)), ds.images([5, 3]))
    np.testing.assert_array_equal(sub.label, ds.label[[5, 3]])
    assert isinstance(sub.in_memory(), MultiViewDataset) and not sub.in_memory().lazy


def test_csv_labels_and_declared_views(tmp_path):
    root = tmp_path / "in"
    for s, views in enumerate([("a", "b"), ("a",), ("b",), ("a", "b")]):
        for v in views:
            _image(root / f"sample{s}" / f"{v}.jpg", size=(24, 24), seed=s)
    table = "sample,label\nsample0,1\nsample1,0\nsample2,1\nsample3,0\n"
    (tmp_path / "labels.csv").write_text(table)
    out = importer.import_folder(root, tmp_path / "set", tmp_path / "labels.csv",
                                 views=["a", "b", "c"], size=16)
    ds = load_dataset(out, mmap=True)
    assert ds.classes == ("0", "1") and ds.num_views == 3 and ds.image_shape == (3, 16, 16)
    np.testing.assert_array_equal(ds.label, [1, 0, 1, 0])
    np.testing.assert_array_equal(ds.present[:, 2], False)


def _bad_unreadable(root):
    (root / "cat" / "s1" / "cam0.png").write_bytes(b"not an image")
    return "s1/cam0.png: unreadable image"


def _bad_size(root):
    _image(root / "dog" / "s0" / "cam1.png", size=(32, 20))
    return r"s0/cam1.png: image is 32x20, expected 20x20"


def _bad_one_class(root):
    import shutil

    shutil.rmtree(root / "dog")
    return "at least two classes"


def _bad_duplicate_view(root):
    _image(root / "cat" / "s0" / "cam0.jpg")
    return "a second image for view 'cam0'"


def _bad_empty_sample(root):
    (root / "dog" / "s9").mkdir()
    return "s9: sample folder holds no view image"


@pytest.mark.parametrize(
    "spoil", [_bad_unreadable, _bad_size, _bad_one_class, _bad_duplicate_view, _bad_empty_sample]
)
def test_bad_folders_name_the_file_and_write_nothing(tmp_path, spoil):
    root = tmp_path / "in"
    _class_tree(root)
    message = spoil(root)
    with pytest.raises(DatasetError, match=message):
        importer.import_folder(root, tmp_path / "set")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no set, no staging left


def test_inconsistent_views_and_missing_labels(tmp_path):
    root = tmp_path / "in"
    _class_tree(root)
    with pytest.raises(DatasetError, match=r"cam2.png: view 'cam2' is not one of the 2 views"):
        importer.import_folder(root, tmp_path / "set", views=["cam0", "cam1"])
    flat = tmp_path / "flat"
    for s in range(3):
        _image(flat / f"x{s}" / "v.png")
    (tmp_path / "l.csv").write_text("sample,label\nx0,a\nx1,b\n")
    with pytest.raises(DatasetError, match=r"x2: sample has no label in .*l.csv"):
        importer.import_folder(flat, tmp_path / "set", tmp_path / "l.csv")
    (tmp_path / "nohead.csv").write_text("x0,a\n")
    with pytest.raises(DatasetError, match="header 'sample,label'"):
        importer.import_folder(flat, tmp_path / "set", tmp_path / "nohead.csv")
    assert not (tmp_path / "set").exists()


def test_existing_output_is_not_overwritten(tmp_path):
    _class_tree(tmp_path / "in")
    (tmp_path / "set").mkdir()
    with pytest.raises(DatasetError, match="already exists"):
        importer.import_folder(tmp_path / "in", tmp_path / "set")


def test_tampered_directory_is_refused(tmp_path):
    _class_tree(tmp_path / "in")
    out = importer.import_folder(tmp_path / "in", tmp_path / "set")
    np.save(out / "X.npy", np.zeros((6, 3, 3, 20, 20), dtype=np.float32))
    with pytest.raises(DatasetError, match="X.npy must be uint8"):
        load_dataset(out)
    (out / "dataset.json").write_text("{}")
    with pytest.raises(DatasetError, match="format is not"):
        load_dataset(out)
    with pytest.raises(DatasetError, match="no dataset.json"):
        load_dataset(tmp_path / "in")


def test_inspect_writes_a_contact_sheet(tmp_path):
    from ddnn.models.contact_sheet import summary, write_sheet

    _class_tree(tmp_path / "in")
    ds = load_dataset(importer.import_folder(tmp_path / "in", tmp_path / "set"), mmap=True)
    lines = summary(ds)
    assert "6 samples, 3 views" in lines[0] and "cat (3), dog (3)" in lines[1]
    sheet = write_sheet(ds, tmp_path / "sheet.png", per_class=2)
    with Image.open(sheet) as img:
        assert img.size[1] == 4 * (64 + 2)  # 2 classes x 2 samples per class
