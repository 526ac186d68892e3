"""End to end through the API and the CLI: real exports, real ONNX Runtime sessions, real files."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from conftest import write_image_folder
from qdeploy import api
from qdeploy.cli import main

HAS_CUDA = torch.cuda.is_available()


def _write_config(tmp_path, cfg, name="config.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_run_api_compares_variants(tiny_config, tmp_path):
    out = tmp_path / "out"
    results = api.run(tiny_config, out, cache_dir=tmp_path / "cache")
    by_name = {v["name"]: v for v in results["variants"]}
    t, o, h = by_name["torch-fp32"], by_name["onnxruntime-fp32"], by_name["torch-fp16"]
    assert t["status"] == o["status"] == "ok"
    assert t["metrics"]["samples"] == 18 and 0 <= t["metrics"]["top1"] <= 1
    assert o["metrics"]["top1"] == t["metrics"]["top1"] and o["agreement"] == 1.0
    for v in (t, o):
        assert set(v["latency_ms"]) == {"1", "4"}
        lat = v["latency_ms"]["4"]
        assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"] <= lat["max"]
        assert v["throughput_ips"]["4"] == pytest.approx(4000 / lat["mean"])
        assert len(v["latency_samples_ms"]["1"]) == 5
        assert v["memory_mb"]["rss_peak"] > 0
    assert o["memory_mb"]["artifact"] > 0
    if HAS_CUDA:
        assert h["status"] == "ok"
    else:
        assert h["status"] == "skipped" and "CUDA" in h["reason"]
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["schema"] == "qdeploy.results/2" and len(on_disk["variants"]) == 3
    assert on_disk["model"]["onnx"]["verify"]["passed"] is True
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "torch-fp16" in html
    assert (out / "report.md").read_text().count("onnxruntime-fp32") >= 2
    assert (out / "model.onnx").stat().st_size > 0
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_segmentation_pipeline_with_dict_output(tiny_model_file, tmp_path):
    root = tmp_path / "seg"
    rng = np.random.default_rng(0)
    for split in ("test",):
        (root / split).mkdir(parents=True)
        (root / f"{split}annot").mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)).save(root / split / f"f{i}.png")
            Image.fromarray(rng.integers(0, 4, (6, 10), dtype=np.uint8)).save(root / f"{split}annot" / f"f{i}.png")
    cfg = {
        "model": {"source": f"{tiny_model_file}:tiny_seg", "task": "segmentation", "output": "out", "preprocess": {"input_size": [6, 10]}},
        "data": {"eval": {"format": "segnet", "root": str(root), "ignore_index": 3, "workers": 0, "class_names": ["x", "y", "z"]}},
        "variants": [{"engine": "torch"}, {"engine": "onnxruntime"}],
        "bench": {"enabled": False},
    }
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    t, o = results["variants"]
    assert t["metrics"]["miou"] == pytest.approx(o["metrics"]["miou"])
    assert set(t["metrics"]["per_class_iou"]) == {"x", "y", "z"}
    assert o["agreement"] == 1.0 and t["latency_ms"] == {}


@pytest.mark.slow
def test_cli_stage_commands(tiny_config, tmp_path, capsys):
    cfg_path = _write_config(tmp_path, tiny_config)
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["export", str(cfg_path), "--out", str(tmp_path / "exp"), *cache]) == 0
    assert (tmp_path / "exp" / "model.onnx").is_file()
    assert json.loads((tmp_path / "exp" / "export.json").read_text())["verify"]["passed"]
    assert main(["--quiet", "eval", str(cfg_path), "--out", str(tmp_path / "ev"), "--variant", "onnxruntime-fp32", *cache]) == 0
    ev = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [v["name"] for v in ev["variants"]] == ["onnxruntime-fp32"]
    assert ev["variants"][0]["metrics"]["top1"] is not None and ev["variants"][0]["latency_ms"] == {}
    assert main(["--quiet", "bench", str(cfg_path), "--out", str(tmp_path / "be"), "--variant", "torch-fp32", "--batch-sizes", "2", *cache]) == 0
    be = json.loads((tmp_path / "be" / "results.json").read_text())
    assert be["variants"][0]["metrics"] == {} and list(be["variants"][0]["latency_ms"]) == ["2"]


def test_doctor_states_tensorrt_absence(capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "TensorRT is not installed" in info["tensorrt"] and "trtexec command lines" in info["tensorrt"]
    assert info["environment"]["cpu_count"] >= 1
    # the rows come from the engines' own declarations: INT8 runs on the ONNX Runtime CPU provider
    ort_cpu = next(r for r in info["engines"] if r["engine"] == "onnxruntime" and r["device"] == "cpu")
    assert ort_cpu["usable"] is True and "int8" in ort_cpu["precisions"]
    assert {r["engine"] for r in info["engines"]} == {"torch", "onnxruntime", "openvino", "tensorrt"}
    assert set(info["quantizers"]) == {"modelopt", "onnx", "qat", "nncf"}


# ---- bad input: one clear message, exit code 2, no traceback, nothing half-written ----------------

def _expect_user_error(tmp_path, capsys, cfg, *needles, out=None):
    cfg_path = _write_config(tmp_path, cfg, "bad.yaml")
    out = out or tmp_path / "bad-out"
    code = main(["run", str(cfg_path), "--out", str(out), "--cache-dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    if out.exists():
        assert not (out / "results.json").exists() and not (out / "report.html").exists()
        assert not [p for p in out.iterdir() if p.suffix == ".tmp"]
    return err


def test_missing_model_file(tiny_config, tmp_path, capsys):
    tiny_config["model"]["source"] = str(tmp_path / "gone.py") + ":net"
    _expect_user_error(tmp_path, capsys, tiny_config, "gone.py does not exist")


def test_factory_not_callable(tiny_config, tiny_model_file, tmp_path, capsys):
    tiny_config["model"]["source"] = f"{tiny_model_file}:NOT_CALLABLE"
    _expect_user_error(tmp_path, capsys, tiny_config, "not a callable factory")


def test_weights_that_do_not_match(tiny_config, tmp_path, capsys):
    path = tmp_path / "other.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    tiny_config["model"]["weights"] = str(path)
    _expect_user_error(tmp_path, capsys, tiny_config, "do not match the model architecture", "missing: conv.weight", "unexpected: weight")


def test_empty_image_folder(tiny_config, tmp_path, capsys):
    (tmp_path / "empty" / "a").mkdir(parents=True)
    tiny_config["data"]["eval"]["root"] = str(tmp_path / "empty")
    _expect_user_error(tmp_path, capsys, tiny_config, "no images found under")


def test_corrupt_image_is_named(tiny_config, image_folder, tmp_path, capsys):
    (image_folder / "b" / "broken.png").write_bytes(b"\x89PNG not really")
    _expect_user_error(tmp_path, capsys, tiny_config, "broken.png")


def test_class_folder_not_in_class_list(tiny_config, tmp_path, capsys):
    classes = tmp_path / "classes.txt"
    classes.write_text("a first\nb second\n")
    tiny_config["data"]["eval"]["classes"] = str(classes)
    _expect_user_error(tmp_path, capsys, tiny_config, "images/c is not listed", "classes.txt")


def test_label_png_of_the_wrong_size(tiny_model_file, tmp_path, capsys):
    root = tmp_path / "seg"
    (root / "test").mkdir(parents=True)
    (root / "testannot").mkdir()
    Image.new("RGB", (10, 6)).save(root / "test" / "f.png")
    Image.new("L", (9, 6)).save(root / "testannot" / "f.png")
    cfg = {
        "model": {"source": f"{tiny_model_file}:tiny_seg", "task": "segmentation", "output": "out", "preprocess": {"input_size": [6, 10]}},
        "data": {"eval": {"format": "segnet", "root": str(root), "workers": 0}},
        "variants": [{"engine": "torch"}],
    }
    _expect_user_error(tmp_path, capsys, cfg, "testannot/f.png", "9x6", "10x6")


def test_config_with_unknown_keys_and_wrong_types(tiny_config, tmp_path, capsys):
    tiny_config["bench"]["iterationz"] = 3
    tiny_config["data"]["eval"]["batch_size"] = "big"
    _expect_user_error(tmp_path, capsys, tiny_config, "bench.iterationz: unknown key (did you mean 'iterations'?)", "data.eval.batch_size")


def test_output_directory_not_writable(tiny_config, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = _expect_user_error(tmp_path, capsys, tiny_config, "output directory", out=blocker / "out")
    assert "a-file" in err


@pytest.mark.slow
def test_console_script_prints_no_traceback_and_debug_does(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {source: x.py:f, preprocess: {input_size: [8, 8]}}\ndata: {eval: {root: nowhere}}\nbogus: 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "qdeploy.cli", "run", str(cfg), "--out", str(tmp_path / "o")]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert "bogus: unknown key" in p.stderr and "Traceback" not in p.stderr
    p = subprocess.run(cmd[:3] + ["--debug"] + cmd[3:], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr


@pytest.mark.slow
def test_demo_trains_and_reports_above_95_percent(tmp_path, monkeypatch):
    from qdeploy.demo import run_demo

    results = run_demo(tmp_path / "demo", cache_dir=tmp_path / "cache")
    ok = [v for v in results["variants"] if v["status"] == "ok"]
    assert {v["engine"] for v in ok} == {"torch", "onnxruntime"}
    assert all(v["metrics"]["top1"] > 0.95 for v in ok), [v["metrics"] for v in ok]
    assert (tmp_path / "demo" / "report.html").is_file() and (tmp_path / "demo" / "config.yaml").is_file()


@pytest.mark.slow
def test_onnx_only_model_runs_in_onnxruntime_and_torch_is_skipped(tiny_config, tmp_path):
    exported = api.export(tiny_config, tmp_path / "exp", cache_dir=tmp_path / "cache")
    cfg = dict(tiny_config)
    cfg["model"] = {**tiny_config["model"], "source": exported["copied_to"], "weights": None}
    cfg["variants"] = [{"engine": "onnxruntime"}, {"engine": "torch"}]
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    o, t = results["variants"]
    assert o["status"] == "ok" and o["metrics"]["samples"] == 18 and o["agreement"] == 1.0
    assert t["status"] == "skipped" and "an ONNX or Keras model" in t["reason"]
    assert results["reference"] == "onnxruntime-fp32"
