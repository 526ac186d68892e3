"""Data stage: real files written to tmp_path with PIL (no mocks), plus ../shared real-data checks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qdeploy.config import DatasetSpec, Preprocess
from qdeploy.data import (
    ImageFolderDataset,
    SegNetDataset,
    build_dataset,
    load_image,
    make_batches,
    normalize,
    subset,
)
from qdeploy.config import parse_config
from qdeploy.errors import DataError, UnreadableImage

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
RNG = np.random.default_rng(0)


def write_image(path: Path, w: int, h: int, mode: str = "RGB", value=None) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = (h, w, 3) if mode == "RGB" else (h, w)
    arr = np.full(shape, value, np.uint8) if value is not None else RNG.integers(0, 256, shape, dtype=np.uint8)
    Image.fromarray(arr).save(path)
    return arr


def write_label(path: Path, w: int, h: int, values=(0, 1, 2, 11)) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = RNG.choice(np.asarray(values, np.uint8), size=(h, w))
    Image.fromarray(arr).save(path)
    return arr


def small(size=8, **kw) -> Preprocess:
    return Preprocess(input_size=(size, size), **kw)


# ------------------------------------------------------------------------------------------
# ImageFolder


def test_class_file_with_subset_of_folders_gives_file_indices(tmp_path):
    (tmp_path / "classes.txt").write_text("n001 tench, Tinca tinca\n\nn002 goldfish\nn003\nn004 shark, big\n")
    for wnid in ("n002", "n004"):
        write_image(tmp_path / "data" / wnid / "a.JPEG", 8, 8)  # upper-case extension counts
        write_image(tmp_path / "data" / wnid / "b.png", 8, 8)
    (tmp_path / "data" / "n004" / "notes.txt").write_text("not an image")
    ds = ImageFolderDataset(tmp_path / "data", small(), tmp_path / "classes.txt")
    assert ds.num_classes == 4
    assert ds.class_names == ["tench", "goldfish", "n003", "shark"]
    assert [label for _, label in ds.samples] == [1, 1, 3, 3]
    image, label = ds[0]
    assert image.shape == (3, 8, 8) and image.dtype == np.uint8 and label == 1


def test_classes_as_a_list_gives_list_indices_like_a_file(tmp_path):
    """data.eval.classes: [...] is the file's content written in the config: the list's order gives the indices, a subset
    of folders keeps the model's indices, a name may hold spaces (a list entry is a whole folder name)."""
    for name in ("dog", "traffic light"):
        write_image(tmp_path / "data" / name / "a.png", 8, 8)
    cfg = parse_config({"model": {"source": "torchvision:resnet18", "weights": "random", "preprocess": {"input_size": [8, 8]}},
                        "data": {"eval": {"root": str(tmp_path / "data"), "classes": ["cat", "dog", "traffic light"]}},
                        "variants": [{"engine": "torch"}]})
    batches = make_batches(cfg.data.eval, small(), "classification", progress=False)
    assert batches.num_classes == 3 and batches.class_names == ["cat", "dog", "traffic light"]
    assert sorted(label for _, label in batches.dataset.samples) == [1, 2]
    with pytest.raises(DataError, match=r"data\.eval: class folder .*dog is not listed in the classes list"):
        make_batches(DatasetSpec(root=str(tmp_path / "data"), classes=["cat", "traffic light"]).keyed("data.eval"), small(),
                     "classification", progress=False)


@pytest.mark.parametrize("classes,message", [([], "empty list"), (["a", "b", "a"], "'a' is listed twice"),
                                             (["a", " "], "entry 1 is empty")])
def test_classes_list_is_checked_in_the_config(classes, message):
    from qdeploy.errors import ConfigError

    with pytest.raises(ConfigError, match=f"data\\.eval\\.classes.*{message}"):
        parse_config({"model": {"source": "torchvision:resnet18", "weights": "random", "preprocess": {"input_size": [8, 8]}},
                      "data": {"eval": {"root": "x", "classes": classes}}, "variants": [{"engine": "torch"}]})


def test_sorted_folders_without_class_file(tmp_path):
    for name in ("b", "a", "c"):
        write_image(tmp_path / name / "x.png", 8, 8)
    (tmp_path / ".ipynb_checkpoints").mkdir()  # hidden folders are not classes
    ds = ImageFolderDataset(tmp_path, small())
    assert ds.class_names == ["a", "b", "c"]
    assert [label for _, label in ds.samples] == [0, 1, 2]


def test_folder_not_in_class_file_is_named(tmp_path):
    (tmp_path / "classes.txt").write_text("n001 tench\n")
    write_image(tmp_path / "data" / "n001" / "a.png", 8, 8)
    write_image(tmp_path / "data" / "stray" / "a.png", 8, 8)
    with pytest.raises(DataError, match=r"stray.*not listed.*classes\.txt"):
        ImageFolderDataset(tmp_path / "data", small(), tmp_path / "classes.txt")


def test_empty_and_missing_roots(tmp_path):
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match=r"no images found under .*empty \(expected .*<class>/<image>\)"):
        ImageFolderDataset(tmp_path / "empty", small())
    with pytest.raises(DataError, match=r"nope does not exist"):
        ImageFolderDataset(tmp_path / "nope", small())


def test_corrupt_and_truncated_images_are_named(tmp_path):
    bad = tmp_path / "x.png"
    bad.write_bytes(b"this is not a png at all" * 10)
    with pytest.raises(DataError, match=r"x\.png is corrupt"):
        load_image(bad, small())
    good = tmp_path / "t.jpg"
    write_image(good, 64, 64)
    good.write_bytes(good.read_bytes()[:600])  # header intact, pixels cut: only load() notices
    with pytest.raises(DataError, match=r"t\.jpg cannot be decoded"):
        load_image(good, Preprocess(input_size=(64, 64)))


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_image_through_make_batches(tmp_path, workers):
    # >= 64 samples, or make_batches decodes in-process regardless of `workers`
    for i in range(70):
        write_image(tmp_path / "c" / f"{i:03d}.png", 4, 4)
    (tmp_path / "c" / "050.png").write_bytes(b"garbage")
    batches = make_batches(DatasetSpec(root=str(tmp_path), workers=workers, batch_size=16), small(4), "classification",
                           progress=False)
    assert batches.workers == workers
    with pytest.raises(DataError) as info:
        list(batches)
    # the original one-line message and class, not DataLoader's wrapped worker traceback, and the way around it
    assert type(info.value) is UnreadableImage
    assert str(info.value) == (f"image {tmp_path / 'c' / '050.png'} is corrupt or not an image (PIL cannot identify it); "
                               "to leave unreadable images out (they are listed in results.json), set on_error: skip in its "
                               "data section")


def test_task_must_match_format(tmp_path):
    write_image(tmp_path / "a" / "x.png", 8, 8)
    with pytest.raises(DataError, match="needs task 'classification'"):
        build_dataset(DatasetSpec(root=str(tmp_path)), small(), "segmentation")


# ------------------------------------------------------------------------------------------
# SegNet


def make_segnet(root: Path, n=3, w=30, h=20, split="test"):
    labels = []
    for i in range(n):
        write_image(root / split / f"f{i}.jpg", w, h)
        labels.append(write_label(root / f"{split}annot" / f"f{i}.png", w, h))
    return labels


def test_segnet_happy_path_and_ignore_index(tmp_path):
    labels = make_segnet(tmp_path)
    spec = DatasetSpec(format="segnet", root=str(tmp_path), split="test", ignore_index=11, batch_size=2)
    batches = make_batches(spec, Preprocess(input_size=(20, 30)), "segmentation", progress=False)
    assert batches.num_samples == 3 and batches.ignore_index == 11 and batches.class_names is None
    images, labs = zip(*batches)
    assert images[0].shape == (2, 3, 20, 30) and labs[0].shape == (2, 20, 30) and labs[0].dtype == np.int64
    np.testing.assert_array_equal(np.concatenate(labs), np.stack(labels))  # 11 (void) passes through unchanged
    # resized with NEAREST: only original label values, never blends of them
    ds = SegNetDataset(tmp_path, "test", Preprocess(input_size=(13, 17)), ignore_index=11)
    assert set(np.unique(ds[0][1])) <= {0, 1, 2, 11}
    # a crop larger than the image pads the label with ignore_index, not with class 0
    ds = SegNetDataset(tmp_path, "test", Preprocess(crop=[24, 30]), ignore_index=11)
    label = ds[0][1]
    assert label.shape == (24, 30) and (label[:2] == 11).all() and (label[-2:] == 11).all()


def test_segnet_label_of_wrong_size_names_both(tmp_path):
    make_segnet(tmp_path, n=1)
    write_label(tmp_path / "testannot" / "f0.png", 31, 20)
    ds = SegNetDataset(tmp_path, "test", Preprocess(input_size=(20, 30)))
    with pytest.raises(DataError, match=r"label .*f0\.png is 31x20 but image .*f0\.jpg is 30x20"):
        ds[0]


def test_segnet_missing_pieces(tmp_path):
    make_segnet(tmp_path, n=2)
    (tmp_path / "testannot" / "f1.png").unlink()
    with pytest.raises(DataError, match=r"label .*testannot/f1\.png for image .*f1\.jpg does not exist"):
        SegNetDataset(tmp_path, "test", small())
    with pytest.raises(DataError, match=r"split 'val'.*val does not exist"):
        SegNetDataset(tmp_path, "val", small())


# ------------------------------------------------------------------------------------------
# Subsets


def test_seeded_subset(tmp_path):
    for i in range(20):
        write_image(tmp_path / "a" / f"{i:02d}.png", 2, 2)
    ds = ImageFolderDataset(tmp_path, small(2))
    a, b, c = (subset(ds, 5, seed) for seed in (1, 1, 2))
    assert a.samples == b.samples and a.samples != c.samples
    assert a.samples == sorted(a.samples) and len(a) == 5 and a.class_names == ["a"]
    with pytest.warns(UserWarning, match="count=50 but the dataset has only 20"):
        assert subset(ds, 50, 0) is ds


# ------------------------------------------------------------------------------------------
# Geometry and normalisation


def test_resize_crop_matches_torchvision(tmp_path):
    tvf = pytest.importorskip("torchvision.transforms.functional")
    path = tmp_path / "x.png"
    write_image(path, 40, 60)
    assert load_image(path, Preprocess(resize=32, crop=32)).shape == (3, 32, 32)
    for w, h, pre in [(47, 61, Preprocess(resize=33, crop=31)), (61, 47, Preprocess(resize=[30, 20], crop=[18, 21])),
                      (10, 13, Preprocess(crop=[16, 15]))]:  # the last pads: crop larger than the image
        write_image(path, w, h)
        ref = Image.open(path).convert("RGB")
        if pre.resize is not None:
            ref = tvf.resize(ref, pre.resize if isinstance(pre.resize, int) else list(pre.resize))
        ref = tvf.center_crop(ref, [pre.crop, pre.crop] if isinstance(pre.crop, int) else list(pre.crop))
        np.testing.assert_array_equal(load_image(path, pre), np.asarray(ref).transpose(2, 0, 1))


def test_exact_resize_and_size_mismatch(tmp_path):
    path = tmp_path / "x.png"
    write_image(path, 40, 60)
    assert load_image(path, Preprocess(input_size=(16, 24))).shape == (3, 16, 24)  # neither resize nor crop
    with pytest.raises(DataError, match=r"x\.png is 48x32 \(HxW\) after resize/crop but input_size is 32x32"):
        load_image(path, Preprocess(input_size=(32, 32), resize=32))


def test_normalize_matches_hand_computation():
    pre = Preprocess(input_size=(2, 2), mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    batch = RNG.integers(0, 256, (2, 3, 2, 2), dtype=np.uint8)
    out = normalize(batch, pre)
    assert out.dtype == np.float32 and out.shape == batch.shape
    n, c, y, x = 1, 2, 0, 1
    assert out[n, c, y, x] == pytest.approx((batch[n, c, y, x] / 255 - 0.406) / 0.225, abs=1e-6)
    expected = (batch / 255.0 - np.array(pre.mean)[:, None, None]) / np.array(pre.std)[:, None, None]
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_mode_l_gives_one_channel(tmp_path):
    write_image(tmp_path / "a" / "x.png", 8, 8)  # RGB on disk, converted to L
    pre = Preprocess(input_size=(8, 8), mode="L", mean=[0.5], std=[0.5])
    image, _ = ImageFolderDataset(tmp_path, pre)[0]
    assert image.shape == (1, 8, 8)
    assert normalize(image[None], pre).shape == (1, 1, 8, 8)


# ------------------------------------------------------------------------------------------
# Batches


@pytest.mark.parametrize("cache_limit_mb", [2048, 0])
def test_second_pass_is_identical(tmp_path, cache_limit_mb):
    for i in range(10):
        write_image(tmp_path / ("a" if i % 2 else "b") / f"{i}.png", 9, 7)
    spec = DatasetSpec(root=str(tmp_path), batch_size=4)
    batches = make_batches(spec, small(), "classification", desc="test", cache_limit_mb=cache_limit_mb)
    first_n = batches.first(6)  # before any pass: decoded directly
    one, two = list(batches), list(batches)
    assert len(batches) == len(one) == 3 and batches.cached == (cache_limit_mb > 0)
    for (i1, l1), (i2, l2) in zip(one, two):
        assert i1.dtype == np.uint8 and l1.dtype == np.int64
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_array_equal(l1, l2)
    images = np.concatenate([b[0] for b in one])
    np.testing.assert_array_equal(first_n[0], images[:6])
    np.testing.assert_array_equal(batches.first(6)[0], images[:6])  # from the cache this time
    assert batches.num_classes == 2 and batches.input_size == (8, 8) and batches.task == "classification"


# ------------------------------------------------------------------------------------------
# Real data in ../shared (absent on a user's machine)


def shared(rel: str) -> Path:
    path = SHARED / "data" / rel
    if not path.exists():
        pytest.skip(f"../shared/data/{rel} not present: real-data test")
    return path


def test_real_imagenet_subset_indices_come_from_synsets():
    root = shared("imagenet-val1300")
    spec = DatasetSpec(root=str(root), classes=str(root / "synsets.txt"), batch_size=8)
    pre = Preprocess(resize=256, crop=224, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    batches = make_batches(spec, pre, "classification", progress=False)
    assert batches.num_samples == 1300 and batches.num_classes == 1000
    assert batches.class_names[0] == "tench"
    tench = [label for path, label in batches.dataset.samples if Path(path).parent.name == "n01440764"]
    assert tench and set(tench) == {0}
    images, labels = batches.first(2)
    assert images.shape == (2, 3, 224, 224) and labels.tolist() == [0, 0]


def test_real_camvid_test_split():
    root = shared("camvid")
    spec = DatasetSpec(format="segnet", root=str(root), split="test", ignore_index=11)
    batches = make_batches(spec, Preprocess(input_size=(360, 480)), "segmentation", progress=False)
    assert batches.num_samples == 233
    images, labels = batches.first(2)
    assert images.shape == (2, 3, 360, 480) and labels.shape == (2, 360, 480)
    assert labels.max() <= 11


def test_complement_subset_is_the_disjoint_rest(tmp_path):
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.data import build_dataset

    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "imgs", per_class=5)
    pre = Preprocess(input_size=[8, 8])
    part = build_dataset(DatasetSpec(root=str(root), count=6, seed=3), pre, "classification")
    rest = build_dataset(DatasetSpec(root=str(root), count=6, seed=3, complement=True), pre, "classification")
    a, b = {p for p, _ in part.samples}, {p for p, _ in rest.samples}
    assert len(a) == 6 and len(b) == 9 and not a & b


# ------------------------------------------------------------------------------------------
# issue #20: messages name the config key and its on_error option; calibration takes any layout

def _config(tmp_path, **data) -> dict:
    return {"model": {"source": "m.py:f", "preprocess": {"input_size": [8, 8]}},
            "data": {k: {"root": str(v), "workers": 0} for k, v in data.items()}}


@pytest.mark.parametrize("section", ["eval", "calibration"])
def test_corrupt_jpeg_names_its_sections_on_error_option(tmp_path, section):
    write_image(tmp_path / "imgs" / "a" / "0.png", 8, 8)
    jpg = tmp_path / "imgs" / "a" / "1.jpg"
    write_image(jpg, 16, 16)
    jpg.write_bytes(jpg.read_bytes()[:300])  # header intact, pixels cut
    cfg = parse_config(_config(tmp_path, **{"eval": tmp_path / "other", section: tmp_path / "imgs"}))
    spec = getattr(cfg.data, section)
    batches = make_batches(spec, small(), "classification", progress=False)
    with pytest.raises(UnreadableImage) as info:
        list(batches)
    msg = str(info.value)
    assert str(jpg) in msg and f"set data.{section}.on_error: skip" in msg and "\n" not in msg
    with pytest.raises(UnreadableImage, match=f"data.{section}.on_error: skip"):
        make_batches(spec, small(), "classification", progress=False).first(2)
    # and with the option set, the image is left out and listed
    spec.on_error = "skip"
    batches = make_batches(spec, small(), "classification", progress=False)
    assert sum(len(x) for x, _ in batches) == 1 and [s["path"] for s in batches.skipped] == [str(jpg)]


def test_layout_errors_start_with_the_config_key(tmp_path):
    cfg = parse_config(_config(tmp_path, eval=tmp_path / "imgs", calibration=tmp_path / "gone"))
    with pytest.raises(DataError, match=r"^data.calibration: dataset folder .*gone does not exist$"):
        build_dataset(cfg.data.calibration, small(), "classification")


def test_folder_of_non_images_says_what_is_there(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"no images found under .* \(1 files, none of them an image: \.txt; images are \.bmp"):
        ImageFolderDataset(tmp_path, small())


def test_calibration_accepts_a_flat_folder_without_labels_false(tmp_path):
    """issue #20 item 12: calibration never uses labels, so a flat folder of images needs no `labels: false`."""
    for i in range(5):
        write_image(tmp_path / "flat" / f"{i}.png", 8, 8)
    write_image(tmp_path / "eval" / "a" / "0.png", 8, 8)
    cfg = parse_config(_config(tmp_path, eval=tmp_path / "eval", calibration=tmp_path / "flat"))
    calib = make_batches(cfg.data.calibration, small(), "classification", progress=False)
    images, labels = next(iter(calib))
    assert images.shape == (5, 3, 8, 8) and labels.tolist() == [-1] * 5  # no labels: UNLABELLED
    # data.eval still needs its class folders (it measures accuracy), and says how to go without
    cfg = parse_config(_config(tmp_path, eval=tmp_path / "flat"))
    with pytest.raises(DataError, match="data.eval: no images found .* set labels: false"):
        make_batches(cfg.data.eval, small(), "classification", progress=False)
    # the same after a dump and re-parse, which spells labels: true out (qdeploy optimize's sub-runs)
    d = parse_config(_config(tmp_path, eval=tmp_path / "eval", calibration=tmp_path / "flat")).model_dump(mode="json")
    assert d["data"]["calibration"]["labels"] is True
    assert make_batches(parse_config(d).data.calibration, small(), "classification", progress=False).num_samples == 5
    # an empty calibration folder is still an error, naming the key
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="data.calibration: no images found"):
        make_batches(parse_config(_config(tmp_path, eval=tmp_path / "eval", calibration=tmp_path / "none")).data.calibration,
                     small(), "classification", progress=False)


def test_calibration_with_class_folders_reads_the_same_images_in_the_same_order(tmp_path):
    """A class-folder calibration set is read as before: the seeded count/complement split of one folder into
    eval and calibration depends on both sides listing the images in the same order."""
    for c in ("a", "b"):
        for i in range(4):
            write_image(tmp_path / "all" / c / f"{i}.png", 8, 8)
    d = _config(tmp_path, eval=tmp_path / "all", calibration=tmp_path / "all")
    d["data"]["eval"].update(count=3, complement=True)
    d["data"]["calibration"].update(count=3)
    cfg = parse_config(d)
    ev = build_dataset(cfg.data.eval, small(), "classification")
    cal = build_dataset(cfg.data.calibration, small(), "classification")
    ev_paths, cal_paths = {p for p, _ in ev.samples}, {p for p, _ in cal.samples}
    assert len(ev_paths) == 5 and len(cal_paths) == 3 and not ev_paths & cal_paths


def test_segnet_calibration_split_without_annotations(tmp_path):
    for i in range(3):
        write_image(tmp_path / "camvid" / "train" / f"f{i}.png", 8, 8)
    d = _config(tmp_path, eval=tmp_path / "x", calibration=tmp_path / "camvid")
    d["data"]["calibration"].update(format="segnet", split="train")
    ds = build_dataset(parse_config(d).data.calibration, small(), "segmentation")
    image, label = ds[0]
    assert len(ds) == 3 and image.shape == (3, 8, 8) and (label == 255).all()
