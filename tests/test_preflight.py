"""Bad input found before the first variant runs: one line naming the key/file, exit 2, nothing written."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml
from PIL import Image

from conftest import write_image_folder
from qdeploy import api
from qdeploy.cli import main
from qdeploy.errors import DataError, ModelError, QDeployError


def _run_cli(tmp_path, cfg, out=None):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = out or tmp_path / "out"
    return main(["run", str(path), "--out", str(out), "--cache-dir", str(tmp_path / "cache")]), out


def test_wrong_input_size_names_the_key_without_torch_spam(tiny_model_file, tiny_weights, image_folder, tmp_path, capsys):
    # a flatten + linear head only accepts the size it was built for
    model = tmp_path / "fixed.py"
    model.write_text("import torch\nfrom torch import nn\ndef net():\n    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))\n")
    cfg = {"model": {"source": f"{model}:net", "preprocess": {"input_size": [12, 12]}},
           "data": {"eval": {"root": str(image_folder), "workers": 0}}, "variants": [{"engine": "torch"}, {"engine": "onnxruntime"}]}
    code, out = _run_cli(tmp_path, cfg)
    err = capsys.readouterr().err
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("qdeploy: error:")]
    assert len(lines) == 1 and "model.preprocess.input_size [12, 12]" in lines[0] and "(2, 3, 12, 12)" in lines[0]
    assert "\x1b[" not in lines[0] and "Traceback" not in err
    assert not out.exists()  # nothing written: not even an empty output folder


def test_model_outputs_vs_number_of_classes(tiny_model_file, tiny_weights, image_folder, tmp_path):
    cfg = {"model": {"source": f"{tiny_model_file}:tiny", "kwargs": {"num_classes": 5},
                     "preprocess": {"input_size": [8, 8]}},
           "data": {"eval": {"root": str(image_folder), "workers": 0}}, "variants": [{"engine": "torch"}]}
    with pytest.raises(ModelError, match="the model has 5 outputs but data.eval .* has 3 classes"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_segmentation_label_values_vs_output_classes(tiny_model_file, tmp_path):
    root = tmp_path / "seg"
    (root / "test").mkdir(parents=True)
    (root / "testannot").mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)).save(root / "test" / f"{i}.png")
        label = np.full((6, 10), 1, np.uint8)
        label[0, 0] = 7  # class 7 does not exist in a 3-class model
        Image.fromarray(label).save(root / "testannot" / f"{i}.png")
    cfg = {"model": {"source": f"{tiny_model_file}:tiny_seg", "task": "segmentation", "output": "out",
                     "preprocess": {"input_size": [6, 10]}},
           "data": {"eval": {"format": "segnet", "root": str(root), "workers": 0}}, "variants": [{"engine": "torch"}]}
    with pytest.raises(ModelError, match="hold class value 7, but the model has only 3 output classes"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    cfg["data"]["eval"]["ignore_index"] = 7  # 7 = void: now it is fine
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][0]["status"] == "ok"


def test_fixed_shape_onnx_that_disagrees_with_input_size(tiny_config, tmp_path):
    tiny_config["export"] = {"dynamic_batch": False}
    exported = api.export(tiny_config, tmp_path / "exp", cache_dir=tmp_path / "cache")
    cfg = {**tiny_config, "model": {**tiny_config["model"], "source": exported["copied_to"], "weights": None},
           "variants": [{"engine": "onnxruntime"}], "export": {}}
    cfg["model"]["preprocess"] = {**cfg["model"]["preprocess"], "input_size": [10, 10]}
    with pytest.raises(ModelError, match="fixed input of 8x8 .* model.preprocess.input_size is 10x10"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    cfg["model"]["preprocess"]["input_size"] = [8, 8]  # right size; the export has a fixed batch of 2, evaluated in
    cfg["data"]["eval"]["count"] = 5                   # batches of 2 (tests/test_onnx_inputs.py): 5 images do not fit
    with pytest.raises(DataError, match="data.eval has 5 images, not a multiple of the model's static batch of 2 .*"
                                        "set data.eval.count to 4"):
        api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")


def _corrupt(folder):
    bad = folder / "a" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return bad


@pytest.mark.slow
def test_corrupt_image_error_or_skip_and_listed(tiny_config, image_folder, tmp_path):
    bad = _corrupt(image_folder)
    tiny_config["variants"] = [{"engine": "onnxruntime"}]
    tiny_config["bench"] = {"enabled": False}
    with pytest.raises(DataError, match="broken.png"):
        api.run(tiny_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    tiny_config["data"]["eval"]["on_error"] = "skip"
    results = api.run(tiny_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    skipped = results["data"]["eval"]["skipped_files"]
    assert [s["path"] for s in skipped] == [str(bad)] and "broken.png" in skipped[0]["reason"]
    assert results["variants"][0]["metrics"]["samples"] == 18  # 19 files, one left out
    assert "broken.png" in (tmp_path / "out" / "report.md").read_text()


def test_unreadable_calibration_image_stops_the_run_before_any_variant(tiny_config, tmp_path):
    calib = write_image_folder(tmp_path / "calib", per_class=3, size=(8, 8), seed=5)
    _corrupt(calib)
    tiny_config["data"]["calibration"] = {"root": str(calib), "workers": 0}
    tiny_config["variants"] = [{"engine": "torch"}, {"engine": "onnxruntime", "precision": "int8", "method": "max"}]
    with pytest.raises(DataError, match="broken.png"):
        api.run(tiny_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_missing_calibration_cache_file(tiny_config, tmp_path):
    tiny_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt",
                                "calibration_cache": str(tmp_path / "none.cache")}]
    with pytest.raises(QDeployError, match=r"variants\[0\].calibration_cache: file .*none.cache does not exist"):
        api.run(tiny_config, tmp_path / "out", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_out_folder_with_an_older_run_is_replaced_whole(tiny_config, tmp_path):
    tiny_config["bench"] = {"enabled": False}
    out = tmp_path / "out"
    tiny_config["variants"] = [{"engine": "torch"}, {"engine": "onnxruntime"}]
    api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    first = json.loads((out / "results.json").read_text())
    assert (out / "model.onnx").is_file()
    # a second run with other variants: nothing of the first run survives
    tiny_config["variants"] = [{"engine": "torch"}]
    api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    second = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in second["variants"]] == ["torch-fp32"] and second["created"] >= first["created"]
    assert not (out / "model.onnx").exists()
    # a run that stops on bad input leaves the last complete run untouched
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    tiny_config["model"]["preprocess"]["input_size"] = [8]
    with pytest.raises(QDeployError):
        api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    tiny_config["model"]["preprocess"]["input_size"] = [8, 8]
    tiny_config["data"]["eval"]["root"] = str(tmp_path / "missing")
    with pytest.raises(DataError):
        api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if ".staging-" in p.name or ".old-" in p.name]


def test_out_folder_with_foreign_files_is_refused(tiny_config, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("do not delete")
    with pytest.raises(QDeployError, match="holds files that qdeploy did not write"):
        api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    assert (out / "thesis.tex").read_text() == "do not delete"


BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "huggingface_hub" or name.startswith("huggingface_hub."):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
sys.meta_path.insert(0, Block())
"""


@pytest.mark.slow
def test_missing_modelopt_dependency_is_named(tmp_path):
    """ModelOpt's init imports huggingface_hub; without it the user must read which package to install."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    code = ("from qdeploy.quantize.modelopt_import import import_modelopt\n"
            "from qdeploy.errors import QDeployError\n"
            "try:\n    import_modelopt('modelopt.torch.quantization')\nexcept QDeployError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERR NVIDIA ModelOpt needs the package 'huggingface_hub'" in p.stdout, p.stdout + p.stderr
    assert "pip install huggingface-hub" in p.stdout
