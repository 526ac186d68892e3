"""Bad inputs, table-driven (issue #20): every case exits 2 with one line that names the file, key or layer and
says what to do, prints no traceback, and writes nothing outside --out and the cache folder: the user's files are
neither changed nor deleted, and --out is left as it was (absent, or unchanged).

Each case is (id, category, setup, expected substring). ``setup`` gets a fresh project (a tiny CNN in
``model.py``, its state_dict ``weights.pt``, 3-class ImageFolders of 8x8 PNGs for evaluation and calibration, a
config that runs) and breaks one thing. The run goes through ``qdeploy.cli.main`` in this process.
"""
from __future__ import annotations

import copy
import hashlib
import io
import os
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from qdeploy.cli import main

MODEL_PY = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def tiny(num_classes=3):
    torch.manual_seed(0)
    return Tiny(num_classes)


def fixed_size(num_classes=3):
    """Accepts 8x8 inputs only (a Linear over the flattened map)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, num_classes))


class _Nan(nn.Module):
    def forward(self, x):
        return x.mean((2, 3)) * float("nan")


def nan_model():
    return _Nan()


def per_pixel():
    return nn.Conv2d(3, 3, 1)


def broken():
    raise RuntimeError("cannot build")


def broken_verbosely():
    raise ValueError("checkpoint layout v2 expected\\n  hint: convert it first\\n  (see the docs)")


NOT_CALLABLE = 42
'''

CLASSES = ("a", "b", "c")


def _write_images(root: Path, per_class: int, seed: int, size=(8, 8)) -> None:
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / c / f"{i}.png")


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """The working project every case copies: model.py, weights.pt, data/eval, data/calib."""
    import importlib.util

    root = tmp_path_factory.mktemp("template") / "project"
    root.mkdir()
    (root / "model.py").write_text(MODEL_PY)
    spec = importlib.util.spec_from_file_location("bad_inputs_template_model", root / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.save(mod.tiny().state_dict(), root / "weights.pt")
    _write_images(root / "data" / "eval", per_class=4, seed=0)
    _write_images(root / "data" / "calib", per_class=4, seed=1)
    return root


def base_config() -> dict:
    """Relative paths: the config sits in the project folder."""
    return {
        "model": {"source": "model.py:tiny", "weights": "weights.pt",
                  "preprocess": {"input_size": [8, 8], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}},
        "data": {"eval": {"root": "data/eval", "batch_size": 4, "workers": 0}},
        "variants": [{"engine": "torch"}],
        "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 2},
    }


@dataclass
class Env:
    root: Path                 # tmp_path: everything the user has, plus cwd, cache and out
    project: Path              # the user's project: config.yaml, model.py, weights.pt, data/
    cfg: dict                  # written to config_path as YAML unless config_text is set
    out: Path
    cache: Path
    command: str = "run"
    config_text: Optional[str] = None
    config_path: Optional[Path] = None
    extra_args: list = field(default_factory=list)

    def int8(self, calibration: bool = True) -> None:
        """Add an INT8 variant (and, unless told not to, the calibration folder)."""
        self.cfg["variants"].append({"engine": "onnxruntime", "precision": "int8"})
        if calibration:
            self.cfg["data"]["calibration"] = {"root": "data/calib", "workers": 0}

    def file(self, rel: str, data: bytes | str) -> Path:
        path = self.project / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 10)).save(buf, "JPEG")
    return buf.getvalue()


def _onnx_bytes(inputs: int = 1) -> bytes:
    import onnx
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, ["N", 3, 8, 8]) for i in range(inputs)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Add", ["x0", "x1"], ["s"]) if inputs == 2 else helper.make_node("Identity", ["x0"], ["s"])
    pool = helper.make_node("ReduceMean", ["s"], ["y"], axes=[2, 3], keepdims=0)
    model = helper.make_model(helper.make_graph([node, pool], "g", ins, [out]), opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


# ---- the cases: each breaks one thing ------------------------------------------------------------------------

def _set(*keys_value):
    """setup that sets cfg[k1][k2]... = value"""
    *keys, value = keys_value

    def setup(e: Env):
        d = e.cfg
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return setup


def _cmd(command: str, setup: Callable[[Env], None]):
    """the same case through another subcommand"""
    def wrapped(e: Env):
        e.command = command
        setup(e)
    return wrapped


def _del(*keys):
    def setup(e: Env):
        d = e.cfg
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return setup


def _text(text: str):
    def setup(e: Env):
        e.config_text = text
    return setup


def _weights_file(name: str, data: Callable[[Env], bytes]):
    def setup(e: Env):
        e.file(name, data(e))
        e.cfg["model"]["weights"] = name
    return setup


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _whole_module(e: Env) -> bytes:
    import importlib.util

    import sys

    spec = importlib.util.spec_from_file_location("bad_inputs_case_model", e.project / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[spec.name] = mod  # pickle finds the class by its module name
    try:
        return _torch_bytes(mod.tiny())  # the whole module pickled (torch.save(model)), not its state_dict
    finally:
        del sys.modules[spec.name]


def _zip_bytes(e: Env) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("readme.txt", "not a checkpoint")
    return buf.getvalue()


def _truncated_checkpoint(e: Env) -> bytes:
    data = (e.project / "weights.pt").read_bytes()
    return data[: len(data) // 2]


def _torchvision_without_weights(e: Env):
    e.cfg["model"]["source"] = "torchvision:mobilenet_v3_small"
    e.cfg["model"]["kwargs"] = {"num_classes": 3}
    del e.cfg["model"]["weights"]


def _unknown_torchvision(e: Env):
    e.cfg["model"]["source"] = "torchvision:mobilenet_v3_smal"
    e.cfg["model"]["weights"] = "random"


def _onnx_source(data: Callable[[Env], bytes]):
    def setup(e: Env):
        e.file("model.onnx", data(e))
        e.cfg["model"]["source"] = "model.onnx"
        del e.cfg["model"]["weights"]
        e.cfg["variants"] = [{"engine": "onnxruntime"}]
    return setup


def _unweighted(source: Optional[str] = None, kwargs: Optional[dict] = None, input_size=None):
    """A file.py factory without a weights file (its own initialisation)."""
    def setup(e: Env):
        del e.cfg["model"]["weights"]
        if source:
            e.cfg["model"]["source"] = source
        if kwargs:
            e.cfg["model"]["kwargs"] = kwargs
        if input_size:
            e.cfg["model"]["preprocess"]["input_size"] = input_size
    return setup


def _model_file_syntax_error(e: Env):
    e.file("bad_model.py", "def tiny(:\n    pass\n")
    e.cfg["model"]["source"] = "bad_model.py:tiny"


def _corrupt_jpeg(folder: str):
    def setup(e: Env):
        good = _jpeg_bytes()
        e.file(f"{folder}/b/broken.jpg", good[: len(good) // 2] + b"\x00" * 8)
    return setup


def _all_corrupt(folder: str, section: str):
    def setup(e: Env):
        for c in CLASSES:
            for p in (e.project / folder / c).iterdir():
                p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 4)
        e.cfg["data"][section]["on_error"] = "skip"
    return setup


def _empty_classes(folder: str):
    def setup(e: Env):
        for c in CLASSES:
            for p in (e.project / folder / c).iterdir():
                p.unlink()
    return setup


def _non_images(e: Env):
    for c in CLASSES:
        for p in (e.project / "data/eval" / c).iterdir():
            p.rename(p.with_suffix(".txt"))


def _flat_eval(e: Env):
    flat = e.project / "data" / "flat"
    flat.mkdir()
    for c in CLASSES:
        for p in (e.project / "data/eval" / c).iterdir():
            shutil.copy2(p, flat / f"{c}{p.name}")
    e.cfg["data"]["eval"]["root"] = "data/flat"


def _classes_file_missing_class(e: Env):
    e.file("classes.txt", "a first\nb second\n")
    e.cfg["data"]["eval"]["classes"] = "classes.txt"


def _classes_file_duplicate(e: Env):
    e.file("classes.txt", "a\nb\na\nc\n")
    e.cfg["data"]["eval"]["classes"] = "classes.txt"


def _root_is_file(section: str):
    def setup(e: Env):
        e.file("data/notafolder.zip", b"PK\x05\x06" + b"\x00" * 18)
        e.cfg["data"].setdefault(section, {"workers": 0})["root"] = "data/notafolder.zip"
    return setup


def _segnet_for_classifier(e: Env):
    e.cfg["data"]["eval"]["format"] = "segnet"


def _calibration_is_eval(e: Env):
    e.int8()
    e.cfg["data"]["calibration"]["root"] = "data/eval"


def _calibration(setup_rest: Optional[Callable[[Env], None]] = None):
    def setup(e: Env):
        e.int8()
        if setup_rest:
            setup_rest(e)
    return setup


def _out_is_file(e: Env):
    e.out = e.file("results.txt", "my notes\n")


def _out_user_folder(e: Env):
    e.out = e.project / "notes"
    e.file("notes/todo.md", "- deploy\n")


def _out_inside_data(e: Env):
    e.out = e.project / "data" / "eval" / "runs"


def _out_is_data(e: Env):
    e.out = e.project / "data" / "calib"
    e.int8()


def _out_parent_is_file(e: Env):
    e.out = e.file("weights.tar", b"\x00" * 512) / "out"


def _out_is_model(e: Env):
    e.out = e.project / "weights.pt"


def _out_is_cache(e: Env):
    e.out = e.cache


def _out_contains_config(e: Env):
    e.out = e.project  # the project folder: the user's config, model and data


def _out_parent_not_writable(e: Env):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    locked = e.project / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    e.out = locked / "out"


CASES = [
    # ---- config
    ("config-unknown-key", "config", _cmd("bench", _set("bench", "iteratoins", 3)), "bench.iteratoins: unknown key (did you mean 'iterations'?)"),
    ("config-wrong-type", "config", _set("data", "eval", "batch_size", "big"), "data.eval.batch_size"),
    ("config-missing-source", "config", _del("model", "source"), "model.source: required key is missing"),
    ("config-unknown-engine", "config", _set("variants", [{"engine": "tensorflow"}]), "variants[0].engine"),
    ("config-negative-batch-size", "config", _set("bench", "batch_sizes", [-1]), "bench.batch_sizes"),
    ("config-yaml-syntax", "config", _text("model: {source: model.py:tiny\ndata: [\n"), "is not valid YAML"),
    ("config-file-missing", "config", lambda e: setattr(e, "config_path", e.project / "gone.yaml"), "gone.yaml does not exist"),
    ("config-empty", "config", _text(""), "config.yaml is empty"),
    ("config-top-level-list", "config", _text("- model\n- data\n"), "top level must be a mapping"),
    ("config-renamed-key", "config", _set("variants", [{"engine": "onnxruntime", "precision": "int8", "calibrator": "max"}]),
     "'calibrator' was renamed to 'method'"),
    ("config-two-errors", "config", _cmd("optimize", _set("bench", {"warmup": -1, "iterations": 0})), "bench.iterations"),
    ("config-unknown-variant-flag", "config", lambda e: e.extra_args.extend(["--variant", "torch-fp16"]), "--variant torch-fp16"),
    # ---- model
    ("model-source-file-missing", "model", _set("model", "source", "gone.py:tiny"), "gone.py does not exist"),
    ("model-unknown-torchvision", "model", _unknown_torchvision, "has no model 'mobilenet_v3_smal' (did you mean mobilenet_v3_small"),
    ("model-onnx-garbage", "model", _onnx_source(lambda e: os.urandom(256)), "export it again"),
    ("model-onnx-two-inputs", "model", _onnx_source(lambda e: _onnx_bytes(inputs=2)), "2 inputs"),
    ("model-output-count", "model", _unweighted(kwargs={"num_classes": 5}), "has 5 outputs"),
    ("model-input-size-rejected", "model", _unweighted("model.py:fixed_size", input_size=[12, 12]), "model.preprocess.input_size"),
    ("model-not-callable", "model", _set("model", "source", "model.py:NOT_CALLABLE"), "not a callable factory"),
    ("model-factory-raises", "model", _set("model", "source", "model.py:broken"), "cannot build"),
    ("model-factory-raises-multiline", "model", _set("model", "source", "model.py:broken_verbosely"),
     "layout v2 expected hint: convert it first (see the docs)"),
    ("model-file-syntax-error", "model", _model_file_syntax_error, "bad_model.py"),
    ("model-kwargs-rejected", "model", _set("model", "kwargs", {"depth": 50}), "rejected kwargs"),
    ("model-nan-output", "model", _unweighted("model.py:nan_model"), "NaN"),
    ("model-output-not-classes", "model", _unweighted("model.py:per_pixel"), "model.task"),
    ("model-source-not-a-source", "model", _set("model", "source", "resnet50"), "model source 'resnet50'"),
    ("model-module-not-importable", "model", _set("model", "source", "no_such_package.models:net"), "no_such_package"),
    # ---- weights
    ("weights-missing-file", "weights", _set("model", "weights", "gone.pt"), "gone.pt does not exist"),
    ("weights-png", "weights", _cmd("export", _weights_file("photo.png", lambda e: _png_bytes())),
     "photo.png is not a PyTorch checkpoint (it is a PNG image)"),
    ("weights-jpeg", "weights", _weights_file("photo.pt", lambda e: _jpeg_bytes()), "photo.pt is not a PyTorch checkpoint (it is a JPEG image)"),
    ("weights-empty", "weights", _cmd("qat", _calibration(_weights_file("empty.pt", lambda e: b""))), "empty.pt is empty"),
    ("weights-other-architecture", "weights", _weights_file("other.pt", lambda e: _torch_bytes(torch.nn.Linear(2, 2).state_dict())),
     "do not match the model architecture"),
    ("weights-torchvision-missing", "weights", _torchvision_without_weights, "weights: random"),
    ("weights-text", "weights", _weights_file("config.pt", lambda e: "model:\n  source: x\n"), "(it is a text file"),
    ("weights-zip", "weights", _weights_file("bundle.zip", _zip_bytes), "(it is a ZIP archive"),
    ("weights-onnx", "weights", _weights_file("model.onnx", lambda e: _onnx_bytes()), "(it is an ONNX model"),
    ("weights-whole-module", "weights", _weights_file("module.pt", _whole_module), "state_dict()"),
    ("weights-key-missing", "weights", _set("model", "weights_key", "ema"), "model.weights_key"),
    ("weights-truncated", "weights", _weights_file("half.pt", _truncated_checkpoint), "half.pt"),
    ("weights-for-onnx-source", "weights",
     lambda e: (_onnx_source(lambda e: _onnx_bytes())(e), e.cfg["model"].update(weights="weights.pt")), "model.weights"),
    # ---- data
    ("data-root-missing", "data", _set("data", "eval", "root", "data/gone"), "data/gone does not exist"),
    ("data-empty-folder", "data", _empty_classes("data/eval"), "no images found under"),
    ("data-corrupt-jpeg", "data", _cmd("eval", _corrupt_jpeg("data/eval")), "data.eval.on_error: skip"),
    ("data-non-images", "data", _non_images, "no images found under"),
    ("data-label-map-missing-class", "data", _classes_file_missing_class, "is not listed in the class-list file"),
    ("data-classes-file-missing", "data", _set("data", "eval", "classes", "synsets.txt"), "synsets.txt does not exist"),
    ("data-classes-file-duplicate", "data", _classes_file_duplicate, "lists 'a' twice"),
    ("data-class-names-count", "data", _set("data", "eval", "class_names", ["x", "y"]), "class_names"),
    ("data-root-is-file", "data", _root_is_file("eval"), "is not a folder"),
    ("data-flat-folder", "data", _flat_eval, "labels: false"),
    ("data-format-task-mismatch", "data", _segnet_for_classifier, "needs task 'segmentation'"),
    ("data-all-corrupt-skipped", "data", _all_corrupt("data/eval", "eval"), "could be decoded"),
    # ---- calibration
    ("calib-folder-missing", "calibration", _calibration(_set("data", "calibration", "root", "data/gone")), "data.calibration"),
    ("calib-overlaps-eval", "calibration", _calibration_is_eval, "shares 12 images with data.eval"),
    ("calib-empty", "calibration", _calibration(_empty_classes("data/calib")), "no images found under"),
    ("calib-corrupt-image", "calibration", _calibration(_corrupt_jpeg("data/calib")), "data.calibration.on_error: skip"),
    ("calib-absent-for-int8", "calibration", _cmd("quantize", lambda e: e.int8(calibration=False)), "add data.calibration"),
    ("calib-cache-missing", "calibration",
     lambda e: e.cfg["variants"].append({"engine": "onnxruntime", "precision": "int8", "calibration_cache": "calib.cache"}),
     "calibration_cache"),
    ("calib-root-is-file", "calibration", _calibration(_root_is_file("calibration")), "is not a folder"),
    ("calib-all-corrupt-skipped", "calibration", _calibration(_all_corrupt("data/calib", "calibration")), "could be decoded"),
    ("calib-count-zero", "calibration", _calibration(_set("data", "calibration", "count", 0)), "data.calibration.count"),
    # ---- output folder
    ("out-is-file", "output", _out_is_file, "is not a directory"),
    ("out-user-folder", "output", _cmd("build", _out_user_folder), "holds files that qdeploy did not write"),
    # optimize writes --out only after its confirm split: the folder is still checked before the search starts
    ("out-user-folder-optimize", "output", _cmd("optimize", _out_user_folder), "holds files that qdeploy did not write"),
    ("out-inside-eval-data", "output", _out_inside_data, "data.eval"),
    ("out-is-calibration-data", "output", _out_is_data, "data.calibration"),
    ("out-parent-is-file", "output", _out_parent_is_file, "weights.tar is a file, not a folder"),
    ("out-is-model-weights", "output", _out_is_model, "weights.pt"),
    ("out-is-cache-dir", "output", _out_is_cache, "--cache-dir"),
    ("out-is-project-folder", "output", _out_contains_config, "project"),
    ("out-parent-not-writable", "output", _out_parent_not_writable, "not writable"),
]


def _snapshot(root: Path, skip: Path) -> dict:
    """path → ('dir',) or (size, mtime_ns, sha256) for everything under root except ``skip``."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if d == skip or skip in d.parents:
            dirnames[:] = []
            continue
        snap[str(d)] = ("dir",)
        for name in filenames:
            p = d / name
            st = p.lstat()
            snap[str(p)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return snap


@pytest.mark.parametrize("case_id,category,setup,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case_id, category, setup, expected, template, tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    shutil.copytree(template, project)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    e = Env(root=tmp_path, project=project, cfg=copy.deepcopy(base_config()), out=tmp_path / "out", cache=tmp_path / "cache")
    setup(e)
    if e.config_path is None:
        e.config_path = project / "config.yaml"
        e.config_path.write_text(e.config_text if e.config_text is not None else yaml.safe_dump(e.cfg, sort_keys=False))
    before = _snapshot(tmp_path, e.cache)
    capsys.readouterr()

    rc = main(["--quiet", e.command, str(e.config_path), "--out", str(e.out), "--cache-dir", str(e.cache), *e.extra_args])

    captured = capsys.readouterr()
    err_lines = captured.err.strip("\n").splitlines()
    assert rc == 2, captured.err
    assert "Traceback" not in captured.err + captured.out
    assert len(err_lines) == 1, captured.err
    assert err_lines[0].startswith("qdeploy: error: "), captured.err
    assert expected in err_lines[0], err_lines[0]
    after = _snapshot(tmp_path, e.cache)
    assert after == before, {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
                             "changed": sorted(k for k in before if k in after and after[k] != before[k])}


def test_the_table_covers_every_category():
    counts = {}
    for _, category, _, _ in CASES:
        counts[category] = counts.get(category, 0) + 1
    assert len(CASES) >= 42
    assert set(counts) == {"config", "model", "weights", "data", "calibration", "output"}
    assert min(counts.values()) >= 6, counts


@pytest.mark.parametrize("fmt", ["zip", "legacy", "safetensors", "wrapped"])
def test_weight_sniffing_lets_real_checkpoints_through(fmt, template, tmp_path):
    """The magic-byte check in front of torch.load refuses images, archives and text, not checkpoints: torch.save's
    ZIP format, its legacy pickle format, safetensors, and a training checkpoint wrapping the state_dict."""
    from qdeploy.config import ModelSpec
    from qdeploy.models import build_torch_model

    state = torch.load(template / "weights.pt", weights_only=True)
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        obj = {"epoch": 3, "model": state} if fmt == "wrapped" else state
        torch.save(obj, path, _use_new_zipfile_serialization=fmt != "legacy")
    spec = ModelSpec(source=f"{template / 'model.py'}:tiny", weights=str(path), preprocess={"input_size": [8, 8]})
    model = build_torch_model(spec)
    assert torch.equal(model.model.fc.weight, state["fc.weight"])
