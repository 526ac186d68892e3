"""ONNX models as hubs ship them (issue 20, items 1-3): external data, a static batch of 1, and no file written
beside the user's model or in the working directory. Small real ONNX files made here, real ONNX Runtime runs."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from qdeploy import api
from qdeploy.cli import main

PRE = {"input_size": [8, 8], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _export(path: Path, dynamic: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(_Net().eval(), torch.randn(1, 3, 8, 8), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False, dynamic_axes={"x": {0: "n"}, "y": {0: "n"}} if dynamic else None)
    return path


def _with_external_data(path: Path) -> Path:
    """The same model saved as model.onnx + model.onnx.data (every initializer outside the protobuf)."""
    proto = onnx.load(str(path))
    path.unlink()
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=0)
    assert (path.parent / (path.name + ".data")).is_file()
    return path


def _config(model: Path, images: Path, calib: Path, int8: bool = True) -> dict:
    variants = [{"engine": "onnxruntime"}] + ([{"engine": "onnxruntime", "precision": "int8", "method": "max"}]
                                              if int8 else [])
    return {"model": {"source": str(model), "task": "classification", "preprocess": PRE},
            "data": {"eval": {"format": "imagefolder", "root": str(images), "batch_size": 4, "workers": 0},
                     "calibration": {"format": "imagefolder", "root": str(calib), "batch_size": 4, "workers": 0}},
            "variants": variants, "bench": {"batch_sizes": [1, 4], "warmup": 1, "iterations": 3}}


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def images(tmp_path):
    from conftest import write_image_folder

    return write_image_folder(tmp_path / "eval"), write_image_folder(tmp_path / "calib", seed=1)


def _runs_alone(onnx_file: Path) -> None:
    """The file loads and runs in ONNX Runtime with nothing but what sits beside it."""
    proto = onnx.load(str(onnx_file))
    onnx.checker.check_model(proto)
    sess = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    x = np.zeros([d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape], np.float32)
    assert np.isfinite(sess.run(None, {sess.get_inputs()[0].name: x})[0]).all()


# ---------------------------------------------------------------------------- item 1: external data
@pytest.mark.slow
def test_a_model_with_external_data_runs_and_every_onnx_in_out_loads_alone(tmp_path, images):
    model = _with_external_data(_export(tmp_path / "hub" / "model.onnx", dynamic=True))
    before = _tree(model.parent)
    results = api.run(_config(model, *images), tmp_path / "out", cache_dir=tmp_path / "cache")
    assert [v["status"] for v in results["variants"]] == ["ok", "ok"]
    assert results["variants"][1]["agreement"] > 0.5
    moved = tmp_path / "elsewhere"  # --out alone, away from the cache and the user's files
    shutil.copytree(tmp_path / "out", moved)
    shutil.rmtree(tmp_path / "cache")
    onnx_files = sorted(moved.glob("*.onnx"))
    assert len(onnx_files) >= 2
    for f in onnx_files:
        _runs_alone(f)
    assert _tree(model.parent) == before  # the user's model and its data file untouched, nothing added beside them


def test_a_missing_external_data_file_is_one_line_naming_it(tmp_path, images, capsys):
    import yaml

    model = _with_external_data(_export(tmp_path / "hub" / "model.onnx", dynamic=True))
    (model.parent / "model.onnx.data").unlink()
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(_config(model, *images, int8=False)))
    rc = main(["--quiet", "run", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "out"), "--cache-dir",
               str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.onnx.data" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_large_model_keeps_its_external_data_and_out_gets_the_data_file(tmp_path, images, monkeypatch):
    """Above protobuf's 2 GB the copy keeps external data; --out then holds the data file under the name the ONNX
    reads (the limit is lowered here so a small model takes that path)."""
    import qdeploy.export.onnx as export_onnx

    monkeypatch.setattr(export_onnx, "PROTOBUF_LIMIT", 1)
    model = _with_external_data(_export(tmp_path / "hub" / "model.onnx", dynamic=True))
    cfg = _config(model, *images, int8=False)
    cfg["bench"] = {"enabled": False}
    api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert (tmp_path / "out" / "model.onnx.data").is_file()
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "out", moved)
    _runs_alone(moved / "model.onnx")


# ---------------------------------------------------------------------------- item 2: static batch 1
@pytest.mark.slow
def test_a_static_batch_of_one_runs_at_batch_one_and_says_why_once(tmp_path, images, capsys):
    model = _export(tmp_path / "hub" / "static.onnx", dynamic=False)
    results = api.run(_config(model, *images), tmp_path / "out", cache_dir=tmp_path / "cache")
    fp32, int8 = results["variants"]
    assert fp32["status"] == "ok" and int8["status"] == "ok", (fp32.get("reason"), int8.get("reason"))
    assert fp32["metrics"]["samples"] == 18  # every image evaluated, one at a time
    assert set(fp32["latency_ms"]) == {"1"} and set(int8["latency_ms"]) == {"1"}
    static = results["model"]["check"]["static_batch"]
    assert static["batch"] == 1 and static["skipped_batch_sizes"] == [4]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "static batch of 1" in line]
    assert len(lines) == 1 and "bench.batch_sizes 4 skipped" in lines[0]
    assert "Static batch" in (tmp_path / "out" / "report.md").read_text()
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["model"]["check"]["static_batch"]["message"] == static["message"]


# ---------------------------------------------------------------------------- item 3: nothing outside --out and the cache
@pytest.mark.slow
def test_nothing_is_written_beside_the_model_or_in_the_working_directory(tmp_path, images, monkeypatch):
    model = _export(tmp_path / "hub" / "model.onnx", dynamic=True)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    hub_before = _tree(model.parent)
    api.run(_config(model, *images), tmp_path / "out", cache_dir=tmp_path / "cache")
    assert _tree(model.parent) == hub_before  # no "-ortpre.onnx" beside the user's model
    assert _tree(cwd) == {}


def test_symbolic_shape_inference_failing_writes_nothing_in_the_working_directory(tmp_path, monkeypatch):
    """ONNX Runtime's symbolic shape inference saves sym_shape_infer_temp.onnx (+ data) into the current directory when
    it cannot infer every shape, then raises: the pre-processing runs in a scratch directory and goes on without it."""
    from onnxruntime.tools import symbolic_shape_infer

    from qdeploy.quantize.calibrate import ort_preprocessed

    model = _export(tmp_path / "hub" / "model.onnx", dynamic=True)
    real = symbolic_shape_infer.SymbolicShapeInference.infer_shapes

    def incomplete(in_mp, *args, **kwargs):  # what ORT does on a graph it cannot finish (Swin's window reshapes)
        onnx.save_model(real(in_mp, *args, **kwargs), "sym_shape_infer_temp.onnx", save_as_external_data=True)
        raise Exception("Incomplete symbolic shape inference")

    monkeypatch.setattr(symbolic_shape_infer.SymbolicShapeInference, "infer_shapes", staticmethod(incomplete))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    out = ort_preprocessed(model, tmp_path / "cache")
    assert out.is_file() and (tmp_path / "cache") in out.parents and _tree(cwd) == {}
    assert os.getcwd() == str(cwd)
    _runs_alone(out)
