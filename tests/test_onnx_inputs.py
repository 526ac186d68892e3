"""ONNX models as hubs ship them (issue 20, items 1-3): external data, a static batch, and no file written beside the
user's model or in the working directory. Small real ONNX files made here, real `qdeploy run`s in ONNX Runtime."""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper
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


def _export(path: Path, dynamic: bool, batch: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(_Net().eval(), torch.randn(batch, 3, 8, 8), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False, dynamic_axes={"x": {0: "n"}, "y": {0: "n"}} if dynamic else None)
    return path


def _with_external_data(path: Path, location: str = "") -> Path:
    """The same model saved as model.onnx + model.onnx.data (every initializer outside the protobuf)."""
    location = location or path.name + ".data"
    proto = onnx.load(str(path))
    path.unlink()
    (path.parent / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
                    size_threshold=0)
    assert (path.parent / location).is_file()
    return path


def _shape_inference_cannot_finish(path: Path) -> Path:
    """A classifier ONNX Runtime's symbolic shape inference cannot finish: a branch whose length comes from NonZero (k)
    is added to the logits (n). At run time k == n; symbolically they conflict, and SymbolicShapeInference.infer_shapes
    then saves sym_shape_infer_temp.onnx into the current directory."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(8, np.float32), "b"),
             numpy_helper.from_array(rng.normal(0, 0.3, (3, 8)).astype(np.float32), "fc"),
             numpy_helper.from_array(np.zeros(3, np.float32), "fcb"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([0], np.int64), "axis0"),
             numpy_helper.from_array(np.zeros((), np.float32), "zero")]
    nodes = [oh.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), oh.make_node("Relu", ["c"], ["r"]),
             oh.make_node("GlobalAveragePool", ["r"], ["p"]), oh.make_node("Flatten", ["p"], ["f"]),
             oh.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], transB=1),
             oh.make_node("ReduceSum", ["logits", "one"], ["s"], keepdims=0), oh.make_node("IsNaN", ["s"], ["nan"]),
             oh.make_node("Not", ["nan"], ["ok"]), oh.make_node("NonZero", ["ok"], ["nz"]),
             oh.make_node("Squeeze", ["nz", "axis0"], ["k"]), oh.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
             oh.make_node("Mul", ["kf", "zero"], ["z"]), oh.make_node("Unsqueeze", ["z", "one"], ["u"]),
             oh.make_node("Add", ["logits", "u"], ["y"])]
    graph = oh.make_graph(nodes, "conflict", [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], inits)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]), str(path))
    return path


def _config(model: Path, images: Path, calib: Path, int8=("onnxruntime",)) -> dict:
    variants = [{"engine": "onnxruntime"}] + [{"engine": "onnxruntime", "precision": "int8", "method": "max",
                                                "placement": p} for p in int8]
    return {"model": {"source": str(model), "task": "classification", "preprocess": PRE},
            "data": {"eval": {"format": "imagefolder", "root": str(images), "batch_size": 4, "workers": 0},
                     "calibration": {"format": "imagefolder", "root": str(calib), "batch_size": 4, "workers": 0}},
            "variants": variants, "bench": {"batch_sizes": [1, 4], "warmup": 1, "iterations": 3}}


def _cli_run(tmp_path: Path, cfg: dict, out: Path) -> int:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["--quiet", "run", str(path), "--out", str(out), "--cache-dir", str(tmp_path / "cache")])


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
    assert _cli_run(tmp_path, _config(model, *images), tmp_path / "out") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [v["status"] for v in results["variants"]] == ["ok", "ok"]
    assert all(set(v["latency_ms"]) == {"1", "4"} for v in results["variants"])
    assert results["variants"][1]["agreement"] > 0.5
    moved = tmp_path / "elsewhere"  # --out alone, away from the cache and the user's files
    shutil.copytree(tmp_path / "out", moved)
    shutil.rmtree(tmp_path / "cache")
    onnx_files = sorted(moved.glob("*.onnx"))
    assert len(onnx_files) >= 2 and not list(moved.glob("*.data"))  # below 2 GB: self-contained copies
    for f in onnx_files:
        _runs_alone(f)
    assert _tree(model.parent) == before  # the user's model and its data file untouched, nothing added beside them


def test_a_missing_external_data_file_is_one_line_naming_it(tmp_path, images, capsys):
    model = _with_external_data(_export(tmp_path / "hub" / "model.onnx", dynamic=True))
    (model.parent / "model.onnx.data").unlink()
    rc = _cli_run(tmp_path, _config(model, *images, int8=()), tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "model.onnx.data" in err[0] and "Traceback" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_large_model_keeps_its_external_data_and_out_gets_the_data_file(tmp_path, images, monkeypatch):
    """Above protobuf's 2 GB the copy keeps external data; --out then holds the data file under the location the ONNX
    reads (a subfolder here), listed with its hash (the limit is lowered here so a small model takes that path)."""
    import qdeploy.export.onnx as export_onnx

    monkeypatch.setattr(export_onnx, "PROTOBUF_LIMIT", 1)
    model = _with_external_data(_export(tmp_path / "hub" / "model.onnx", dynamic=True), "weights/model.bin")
    cfg = _config(model, *images, int8=())
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert (tmp_path / "out" / "weights" / "model.bin").is_file()
    entry = next(a for a in results["artifacts"] if a["path"] == "model.onnx")
    assert [d["path"] for d in entry["external_data"]] == ["weights/model.bin"]
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "out", moved)
    shutil.rmtree(tmp_path / "cache")
    _runs_alone(moved / "model.onnx")


# ---------------------------------------------------------------------------- item 2: static batch
@pytest.mark.slow  # a subprocess or a whole pipeline
def test_a_static_batch_of_one_runs_at_batch_one_and_says_why_once(tmp_path, images, capsys):
    model = _export(tmp_path / "hub" / "static.onnx", dynamic=False)
    cfg = _config(model, *images, int8=("onnxruntime", "tensorrt"))
    cfg["bench"]["batch_sizes"] = [1, 4, 8]
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert [v["status"] for v in results["variants"]] == ["ok"] * 3, [v.get("reason") for v in results["variants"]]
    for v in results["variants"]:
        assert v["metrics"]["samples"] == 18  # every image evaluated, one at a time
        assert set(v["latency_ms"]) == {"1"}
    static = results["model"]["check"]["static_batch"]
    assert static["batch"] == 1 and static["skipped_batch_sizes"] == [4, 8]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "static batch" in line]
    assert len(lines) == 1 and "static.onnx has a static batch of 1 (input 'x' [1x3x8x8])" in lines[0]
    assert "bench.batch_sizes 4, 8 skipped" in lines[0] and "dynamic batch axis" in lines[0]
    assert "Static batch" in (tmp_path / "out" / "report.md").read_text()
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["model"]["check"]["static_batch"]["message"] == static["message"]
    onnx_files = sorted((tmp_path / "out").glob("*.onnx"))
    assert len(onnx_files) == 3  # the model and both INT8 placements keep the static batch of 1 and run
    for f in onnx_files:
        _runs_alone(f)


@pytest.mark.slow  # a subprocess or a whole pipeline
def test_a_static_batch_above_one_runs_in_batches_of_it_or_names_the_count_to_set(tmp_path, images, capsys):
    """A static batch N > 1: the same (batches of N, timing N only) when every image fits a batch; else one line naming
    the count to set (a last partial batch would need padding images or dropping some)."""
    model = _export(tmp_path / "hub" / "batch3.onnx", dynamic=False, batch=3)
    results = api.run(_config(model, *images), tmp_path / "out", cache_dir=tmp_path / "cache")  # 18 images each
    assert [v["status"] for v in results["variants"]] == ["ok", "ok"], [v.get("reason") for v in results["variants"]]
    assert all(v["metrics"]["samples"] == 18 and set(v["latency_ms"]) == {"3"} for v in results["variants"])
    assert results["model"]["check"]["static_batch"]["batch"] == 3
    capsys.readouterr()
    for key, count, fix in (("eval", 10, "set data.eval.count to 9"), ("calibration", 2, "add images")):
        cfg = _config(model, *images)
        cfg["data"][key]["count"] = count
        assert _cli_run(tmp_path, cfg, tmp_path / f"out-{key}") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"data.{key} has {count} images, not a multiple of the model's static batch of 3" in err[0]
        assert fix in err[0], err


# ---------------------------------------------------------------------------- item 3: nothing outside --out and the cache
@pytest.mark.slow
def test_nothing_is_written_beside_the_model_or_in_the_working_directory(tmp_path, images, monkeypatch):
    """A full run of a model whose symbolic shape inference cannot finish (ONNX Runtime's pre-processing would drop
    sym_shape_infer_temp.onnx into the working directory) from a read-only model folder: nothing appears beside the
    model or in the working directory, and the process's working directory is never changed (other threads use it)."""
    hub = tmp_path / "hub"
    model = _shape_inference_cannot_finish(hub / "model.onnx")
    hub.chmod(0o555)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def no_chdir(path):
        raise AssertionError(f"os.chdir({path!r}) during a run")

    monkeypatch.setattr(os, "chdir", no_chdir)
    hub_before = _tree(hub)
    try:
        results = api.run(_config(model, *images, int8=("onnxruntime", "tensorrt")), tmp_path / "out",
                          cache_dir=tmp_path / "cache")
    finally:
        hub.chmod(0o755)
    assert [v["status"] for v in results["variants"]] == ["ok"] * 3, [v.get("reason") for v in results["variants"]]
    assert _tree(hub) == hub_before  # no "-ortpre.onnx" beside the user's model
    assert _tree(cwd) == {}  # no sym_shape_infer_temp.onnx(.data)
    assert list((tmp_path / "cache" / "ortpre").glob("*-ortpre.onnx"))  # the pre-processed copy is in the cache


def test_ort_preprocessing_runs_the_symbolic_pass_where_it_finishes_and_goes_on_without_it_elsewhere(tmp_path, monkeypatch):
    from qdeploy.quantize import calibrate

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    logged = []
    monkeypatch.setattr(calibrate, "log", logged.append)
    plain = calibrate.ort_preprocessed(_export(tmp_path / "hub" / "plain.onnx", dynamic=True), tmp_path / "cache")
    assert not logged  # the symbolic pass ran (ONNX Runtime's internals it calls are still there)
    hard = calibrate.ort_preprocessed(_shape_inference_cannot_finish(tmp_path / "hub" / "hard.onnx"), tmp_path / "cache")
    assert len(logged) == 1 and "symbolic shape inference failed on hard.onnx" in logged[0]
    for out in (plain, hard):
        assert (tmp_path / "cache") in out.parents and out.name.endswith("-ortpre.onnx")
        _runs_alone(out)
    assert _tree(cwd) == {} and sorted(_tree(tmp_path / "hub")) == ["hard.onnx", "plain.onnx"]
    assert sorted(p.name for p in (tmp_path / "cache" / "ortpre").iterdir()) == sorted([plain.name, hard.name])
