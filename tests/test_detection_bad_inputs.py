"""Bad detection inputs, table-driven (issue 37, as tests/test_bad_inputs.py for images): every case exits 2 with one
line naming the file, key or class and what to do, no traceback, and nothing written outside --out and the cache.

The project every case copies: a tiny PyTorch detector with a YOLOv8-style head (``model.py``), its weights, a config
that runs (checked by the last tests) and the same four 16x16 PNGs with boxes of classes a and b in three layouts: a
flat Pascal VOC folder (``data/voc``), VOC as Kaggle and Roboflow publish it (``data/sbs``: annotations/ + images/) and
Ultralytics' YOLO layout (``data/yolo``: images/val, labels/val, data.yaml).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from qdeploy.cli import main

MODEL_PY = '''
import torch
from torch import nn


class TinyYolo(nn.Module):
    """(N, 4 + 2, 16) like Ultralytics' export: 16 anchors of a 4x4 grid, cx cy w h in input pixels, 2 class scores."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.head = nn.Conv2d(8, 6, 1)

    def forward(self, x):
        h = self.head(self.body(x)).flatten(2)
        return torch.cat([torch.sigmoid(h[:, :4]) * 16, torch.sigmoid(h[:, 4:])], 1)


def tiny():
    torch.manual_seed(0)
    return TinyYolo()
'''


def _xml(name: str, size=(16, 16), boxes=(("a", 2, 2, 8, 8),)) -> str:
    objs = "".join(f"<object><name>{c}</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax>"
                   f"<ymax>{y1}</ymax></bndbox></object>" for c, x0, y0, x1, y1 in boxes)
    return (f"<annotation><filename>{name}</filename><size><width>{size[0]}</width><height>{size[1]}</height>"
            f"<depth>3</depth></size>{objs}</annotation>")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    import importlib.util

    root = tmp_path_factory.mktemp("dtemplate") / "project"
    (root / "data" / "voc").mkdir(parents=True)
    (root / "model.py").write_text(MODEL_PY)
    spec = importlib.util.spec_from_file_location("detection_bad_inputs_model", root / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.save(mod.tiny().state_dict(), root / "weights.pt")
    rng = np.random.default_rng(0)
    for d in ("sbs/annotations", "sbs/images", "yolo/images/val", "yolo/labels/val"):
        (root / "data" / d).mkdir(parents=True)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / "data" / "voc" / f"{i}.png")
        (root / "data" / "voc" / f"{i}.xml").write_text(_xml(f"{i}.png", boxes=(("a", 2, 2, 8, 8), ("b", 6, 6, 15, 14))))
        shutil.copy(root / "data" / "voc" / f"{i}.png", root / "data" / "sbs" / "images" / f"{i}.png")
        (root / "data" / "sbs" / "annotations" / f"{i}.xml").write_text(
            _xml(f"{i}.png", boxes=(("a", 2, 2, 8, 8), ("b", 6, 6, 15, 14))).replace("<filename>", "<folder>images</folder><filename>"))
        shutil.copy(root / "data" / "voc" / f"{i}.png", root / "data" / "yolo" / "images" / "val" / f"{i}.png")
        (root / "data" / "yolo" / "labels" / "val" / f"{i}.txt").write_text(YOLO_LABEL)
    (root / "data" / "yolo" / "data.yaml").write_text("path: .\nval: images/val\nnames: {0: a, 1: b}\n")
    return root


# the boxes of _xml's default two, normalized: a 2,2-8,8 and b 6,6-15,14 in a 16x16 image
YOLO_LABEL = "0 0.3125 0.3125 0.375 0.375\n1 0.65625 0.625 0.5625 0.5\n"


def base_config() -> dict:
    return {
        "model": {"source": "model.py:tiny", "weights": "weights.pt", "task": "detection", "decode": "yolov8",
                  "preprocess": {"input_size": [16, 16]}},
        "data": {"eval": {"format": "voc", "root": "data/voc", "classes": ["a", "b"], "batch_size": 2, "workers": 0}},
        "variants": [{"engine": "torch"}],
        "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 2},
    }


def _set(path: str, value):
    def setup(project: Path, cfg: dict):
        *keys, last = path.split(".")
        d = cfg
        for k in keys:
            d = d[k]
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    return setup


def _write(rel: str, text):
    def setup(project: Path, cfg: dict):
        p = project / rel
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def _remove(rel: str):
    def setup(project: Path, cfg: dict):
        (project / rel).unlink()
    return setup


def _remove_folder(rel: str):
    def setup(project: Path, cfg: dict):
        shutil.rmtree(project / rel)
    return setup


def _eval(**spec):
    """data.eval replaced by ``spec`` (keeping batch_size and workers)."""
    def setup(project: Path, cfg: dict):
        cfg["data"]["eval"] = {"batch_size": 2, "workers": 0, **spec}
    return setup


def _favour_second_class(project: Path, cfg: dict):
    """The detector's second class wins every anchor, so a class list of one name meets an output it does not have."""
    state = torch.load(project / "weights.pt")
    state["head.bias"][5] = 20.0  # channels: cx cy w h, class a, class b
    torch.save(state, project / "weights.pt")


YOLO_EVAL = {"format": "yolo", "root": "data/yolo/images/val", "names": "data/yolo/data.yaml"}


def _both(*steps):
    def setup(project: Path, cfg: dict):
        for s in steps:
            s(project, cfg)
    return setup


CASES: list[tuple[str, Callable, str]] = [
    ("box-outside-image", _write("data/voc/1.xml", _xml("1.png", boxes=(("a", 2, 2, 30, 8),))), "1.xml"),
    ("zero-size-box", _write("data/voc/2.xml", _xml("2.png", boxes=(("a", 5, 5, 5, 9),))), "2.xml"),
    ("unknown-class", _write("data/voc/0.xml", _xml("0.png", boxes=(("zebra", 2, 2, 8, 8),))), "zebra"),
    ("empty-annotation", _write("data/voc/3.xml", ""), "3.xml"),
    ("not-xml", _write("data/voc/3.xml", "this is not xml <"), "3.xml"),
    ("image-without-annotation", _remove("data/voc/2.xml"), "2.png"),
    ("annotation-without-image", _remove("data/voc/1.png"), "1.png"),
    ("corrupt-image", _write("data/voc/0.png", b"\x89PNG\r\n\x1a\n not really"), "0.png"),
    ("size-differs-from-image", _write("data/voc/1.xml", _xml("1.png", size=(32, 16))), "1.xml"),
    ("non-numeric-coordinate", _write("data/voc/1.xml", _xml("1.png").replace("<xmin>2</xmin>", "<xmin>two</xmin>")),
     "1.xml"),
    ("no-classes", _set("data.eval.classes", None), "classes"),
    ("no-decoder", _set("model.decode", None), "model.decode"),
    ("unknown-decoder", _set("model.decode", "yolov99"), "yolov99"),
    ("decoder-file-missing", _set("model.decode", "nowhere.py:decode"), "nowhere.py"),
    ("decoder-of-another-head", _set("model.decode", "fastestdet"), "fastestdet"),
    ("coco-without-annotations", _set("data.eval.format", "coco"), "annotations"),
    ("coco-json-missing", _both(_set("data.eval.format", "coco"), _set("data.eval.annotations", "data/none.json")),
     "none.json"),
    ("yolo-without-names", _set("data.eval.format", "yolo"), "names"),
    ("crop-cuts-boxes", _set("model.preprocess.crop", 16), "crop"),
    # VOC as published (annotations/ + images/) and YOLO's data.yaml
    ("voc-images-folder-missing", _both(_eval(format="voc", root="data/sbs", classes=["a", "b"]),
                                        _remove_folder("data/sbs/images")), "4 annotations have no image"),
    ("voc-xml-points-to-missing-image", _both(_eval(format="voc", root="data/sbs", classes=["a", "b"]),
                                              _write("data/sbs/annotations/9.xml", _xml("gone.png"))), "'gone.png'"),
    ("voc-no-xml-anywhere", _eval(format="voc", root="data/yolo", classes=["a", "b"]), "set format: yolo"),
    ("yolo-data-yaml-without-names", _both(_eval(**YOLO_EVAL), _write("data/yolo/data.yaml", "path: .\nnc: 2\n")),
     "has no 'names'"),
    ("yolo-data-yaml-names-with-gaps", _both(_eval(**YOLO_EVAL), _write("data/yolo/data.yaml", "names: {0: a, 2: b}\n")),
     "no entry for class index 1"),
    ("yolo-data-yaml-not-yaml", _both(_eval(**YOLO_EVAL), _write("data/yolo/data.yaml", "names: [a, b\n")),
     "not valid YAML"),
    ("yolo-data-yaml-missing", _eval(**{**YOLO_EVAL, "names": "data/yolo/none.yaml"}), "none.yaml"),
    ("yolo-root-data-yaml-without-the-split", _eval(format="yolo", root="data/yolo/data.yaml"), "set split: val"),
    ("yolo-names-fewer-than-model-outputs",
     _both(_eval(**YOLO_EVAL), _write("data/yolo/data.yaml", "names: [a]\n"), _favour_second_class,
           *[_write(f"data/yolo/labels/val/{i}.txt", "0 0.3125 0.3125 0.375 0.375\n") for i in range(4)]),
     "outside the 1 classes"),
]


def _snapshot(root: Path, skip: Path) -> dict:
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if d == skip or skip in d.parents:
            dirnames[:] = []
            continue
        for name in filenames:
            p = d / name
            snap[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def _run(template: Path, tmp_path: Path, setup, monkeypatch, capsys):
    project = tmp_path / "project"
    shutil.copytree(template, project)
    cfg = copy.deepcopy(base_config())
    setup(project, cfg)
    (project / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(["--quiet", "run", str(project / "config.yaml"), "--out", str(tmp_path / "out"),
               "--cache-dir", str(tmp_path / "cache")])
    return rc, capsys.readouterr()


@pytest.mark.slow
@pytest.mark.parametrize("case_id,setup,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_detection_input(case_id, setup, expected, template, tmp_path, monkeypatch, capsys):
    before = None
    project = tmp_path / "project"

    def snap_then(p, c):
        setup(p, c)
        nonlocal before
        before = _snapshot(tmp_path, tmp_path / "cache")

    rc, captured = _run(template, tmp_path, snap_then, monkeypatch, capsys)
    lines = captured.err.strip("\n").splitlines()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert len(lines) == 1 and lines[0].startswith("qdeploy: error: "), captured.err
    assert expected in lines[0], lines[0]
    after = {k: v for k, v in _snapshot(tmp_path, tmp_path / "cache").items() if not k.endswith("config.yaml")}
    assert after == {k: v for k, v in before.items() if not k.endswith("config.yaml")}
    assert not (tmp_path / "out").exists()
    assert project.is_dir()


@pytest.mark.slow
def test_the_template_runs_and_skipped_boxes_are_listed(template, tmp_path, monkeypatch, capsys):
    """The unbroken project runs (so every case above fails for its own reason); bad_boxes: skip runs past a
    zero-size box and the results name it."""
    setup = _both(_write("data/voc/2.xml", _xml("2.png", boxes=(("a", 5, 5, 5, 9), ("b", 1, 1, 9, 9)))),
                  _set("data.eval.bad_boxes", "skip"))
    rc, captured = _run(template, tmp_path, setup, monkeypatch, capsys)
    assert rc in (0, 1), captured.err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    row = results["variants"][0]
    assert row["status"] == "ok" and row["metrics"]["map"] is not None and row["metrics"]["gt_boxes"] == 7
    skipped = results["data"]["eval"]["skipped_boxes"]
    assert len(skipped) == 1 and "2.xml" in skipped[0]


@pytest.mark.slow
@pytest.mark.parametrize("spec", [
    {"format": "voc", "root": "data/sbs", "classes": ["a", "b"]},
    YOLO_EVAL,
    {"format": "yolo", "root": "data/yolo/data.yaml", "split": "val"},
], ids=["voc-annotations-beside-images", "yolo-names-data-yaml", "yolo-root-data-yaml"])
def test_published_layouts_run(spec, template, tmp_path, monkeypatch, capsys):
    """The layouts users download run as written: VOC's annotations/ + images/, YOLO with names: data.yaml and no
    classes (the data.yaml's names are the model's), YOLO with root: data.yaml."""
    rc, captured = _run(template, tmp_path, _eval(**spec), monkeypatch, capsys)
    assert rc in (0, 1), captured.err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    row = results["variants"][0]
    assert row["status"] == "ok" and row["metrics"]["map"] is not None and row["metrics"]["gt_boxes"] == 8
