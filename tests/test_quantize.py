"""INT8: calibrators against ModelOpt, Q/DQ placement, TensorRT cache, pipeline, bad input."""
import contextlib
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.calib.histogram import _compute_amax_entropy, _compute_amax_mse

from conftest import write_image_folder
from qdeploy import api
from qdeploy.errors import QDeployError
from qdeploy.quantize import read_trt_cache, write_trt_cache
from qdeploy.quantize.ranges import TensorRange, _numpy_hist, entropy_amax, mse_amax


def _hist(x):
    calib = HistogramCalibrator(num_bins=2048)
    calib.collect(torch.from_numpy(np.asarray(x, np.float32)))
    return _numpy_hist(calib)


DISTRIBUTIONS = {
    "relu-gaussian": lambda rng: np.maximum(rng.standard_normal(200_000), 0),
    "laplace-squared": lambda rng: rng.laplace(size=200_000) ** 2,
    "student-t": lambda rng: rng.standard_t(3, 200_000),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_entropy_is_exactly_modelopts(name):
    hist, edges = _hist(DISTRIBUTIONS[name](np.random.default_rng(1)))
    assert entropy_amax(hist, edges) == float(_compute_amax_entropy(hist.copy(), edges, 8, False))


@contextlib.contextmanager
def _mse_fix():
    """ModelOpt's ``_compute_amax_mse`` with its ``fake_tensor_quant`` arguments in their places (ranges.py's docstring:
    the positional (num_bits, unsigned) call lands in (bias, num_bits)): the objective ``mse_amax`` is checked against."""
    from modelopt.torch.quantization.calib import histogram

    original = histogram.fake_tensor_quant

    def fixed(inputs, amax, *args, **kwargs):
        if len(args) == 2 and not kwargs:  # the buggy (num_bits, unsigned) positional call
            return original(inputs, amax, None, *args)
        return original(inputs, amax, *args, **kwargs)

    histogram.fake_tensor_quant = fixed
    try:
        yield
    finally:
        histogram.fake_tensor_quant = original


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_mse_matches_modelopt_with_its_argument_bug_fixed(name):
    hist, edges = _hist(DISTRIBUTIONS[name](np.random.default_rng(2)))
    with _mse_fix():
        fixed = float(_compute_amax_mse(hist, edges, 8, False))
    assert mse_amax(hist, edges) == pytest.approx(fixed, rel=1e-6)


@pytest.mark.slow
def test_mse_gives_a_sane_range_for_a_gaussian():
    hist, edges = _hist(np.random.default_rng(3).standard_normal(200_000))
    ours = mse_amax(hist, edges)
    assert 2.5 < ours < 6.0  # a sane 8-bit MSE clip for N(0, 1)


def test_trt_cache_round_trip(tmp_path):
    ranges = {"input": TensorRange(-2.0, 2.5, 2.5), "/conv1/Conv_output_0": TensorRange(0, 6.35, 6.35)}
    path = write_trt_cache(tmp_path / "calib.cache", ranges)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("TRT-") and lines[2].startswith("/conv1/Conv_output_0: ")
    assert lines[2].split(": ")[1] == "3d4ccccd"  # big-endian float32 of 6.35 / 127 = 0.05
    back = read_trt_cache(path)
    assert back["input"] == pytest.approx(2.5, rel=1e-6) and back["/conv1/Conv_output_0"] == pytest.approx(6.35, rel=1e-6)


# ---- pipeline ---------------------------------------------------------------------------------

def _q_inputs(proto, index: int) -> list:
    """Input ``index`` (1 = scale, 2 = zero point) of every QuantizeLinear, stored as initializer or Constant."""
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    for n in proto.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = onnx.numpy_helper.to_array(next(a.t for a in n.attribute if a.name == "value"))
    return [consts[n.input[index]] for n in proto.graph.node
            if n.op_type == "QuantizeLinear" and len(n.input) > index and n.input[index] in consts]


def _zero_points(proto) -> list:
    return _q_inputs(proto, 2)


@pytest.fixture
def int8_config(tiny_model_file, tmp_path):
    evalset = write_image_folder(tmp_path / "eval", per_class=8, size=(16, 16), seed=1)
    calib = write_image_folder(tmp_path / "calib", per_class=10, size=(16, 16), seed=2)
    return {
        "model": {"source": f"{tiny_model_file}:tiny_res", "preprocess": {"input_size": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3}},
        "data": {"eval": {"root": str(evalset), "workers": 0, "batch_size": 8},
                 "calibration": {"root": str(calib), "workers": 0, "batch_size": 8, "count": 20, "seed": 0}},
        "variants": [
            {"engine": "onnxruntime"},
            {"engine": "onnxruntime", "precision": "int8", "method": "entropy"},
            {"engine": "onnxruntime", "precision": "int8", "method": "mse", "placement": "tensorrt"},
            {"engine": "onnxruntime", "precision": "int8", "method": "percentile", "placement": "tensorrt", "exclude": ["conv2"],
             "quantizer": "onnx"},
        ],
        "bench": {"enabled": False},
    }


def _artifact(out: Path, v: dict) -> Path:
    """The variant's deployable file, copied into the run's output folder."""
    return out / v["details"]["artifact"]


@pytest.mark.slow
def test_int8_variants_run_and_report_their_structure(int8_config, tmp_path):
    results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    fp32, ort8, trt8, partial = results["variants"]
    assert all(v["status"] == "ok" for v in results["variants"]), [v["reason"] for v in results["variants"]]
    for v in (ort8, trt8, partial):
        assert v["agreement"] >= 0.7 and v["note"]
        q = v["quantization"]
        assert q["samples"] == 20 and q["cache_hit"] is False
    assert "simulated" in trt8["note"]
    st = trt8["quantization"]["structure"]
    # TensorRT placement: conv2 (8→8 channels, not the first layer) is a conv TensorRT will not run in INT8, so it stays
    # float; the residual Add has only its skip input quantized (conv2's output is the conv path, fused into conv2)
    assert st["compute_ops"] == 3 and st["compute_ops_int8"] == 2
    assert st["residual_adds"] == 1 and st["residual_add_forms"] == {"fusible": 1}
    # the narrow conv left float is an explained finding, not a defect
    assert trt8["quantization"]["lint"]["verdict"] == "clean", trt8["quantization"]["lint"]
    assert trt8["quantization"]["excluded_small_channel_convs"] == ["conv2"]
    assert trt8["quantization"]["residual_adds"]["residual_add_0"]["skip"] == "rhs"
    # TensorRT placement: weights stay float behind Q/DQ, activations symmetric int8
    assert trt8["quantization"]["quantizer"] == "modelopt"  # PyTorch model → ModelOpt path by default
    assert trt8["quantization"]["residual_adds_with_quantizers"] == 1
    assert trt8["quantization"]["export_check"]["min_cosine"] > 0.99
    zero_points = _zero_points(onnx.load(_artifact(out, trt8)))
    assert zero_points and all(z.dtype == np.int8 and not z.any() for z in zero_points)
    assert any(z.dtype == np.uint8 for z in _zero_points(onnx.load(_artifact(out, ort8))))
    # partial quantization: the excluded conv is listed as float
    pst = partial["quantization"]["structure"]
    assert any("conv2" in n for n in partial["quantization"]["excluded_by_user"])
    assert any("conv2" in n for n in pst["compute_ops_float"] + pst["compute_ops_partly_quantized"])
    assert pst["compute_ops_int8"] == 2
    md = (tmp_path / "out" / "report.md").read_text()
    assert "INT8 artifacts" in md
    # the excluded conv is a lint finding explained by the config, listed in the report's lint table
    assert "TensorRT lint findings" in md and "explained: excluded by the config" in md
    assert partial["quantization"]["lint"]["verdict"] == "clean"
    # a TensorRT calibration cache was written for each INT8 artifact and names real tensors
    cache = read_trt_cache(out / "onnxruntime-int8-trt-mse.trtcache")
    assert "input" in cache and all(a > 0 for a in cache.values())
    # every deployable artifact is in the output folder and listed with its checksum and origin
    listed = {(a["variant"], a["kind"]): a for a in results["artifacts"]}
    assert listed[("onnxruntime-fp32", "onnx-fp32")]["path"] == "model.onnx"
    assert listed[(trt8["name"], "onnx-int8")]["produced_by"].startswith("quantizer modelopt (mse ranges, tensorrt placement)")
    assert listed[(trt8["name"], "tensorrt-calibration-cache")]["path"] == "onnxruntime-int8-trt-mse.trtcache"
    for a in results["artifacts"]:
        assert (out / a["path"]).is_file() and len(a["sha256"]) == 64 and a["inputs"]
    # the build is its own stage, with its own time and memory
    assert trt8["stages"]["build"]["status"] == "ok" and trt8["stages"]["build"]["memory_mb"]["rss_peak"] > 0


@pytest.mark.slow
def test_calibration_cache_hit_on_rerun(int8_config, tmp_path, capsys):
    int8_config["variants"] = int8_config["variants"][:2]
    api.run(int8_config, tmp_path / "a", cache_dir=tmp_path / "cache")
    again = api.run(int8_config, tmp_path / "b", cache_dir=tmp_path / "cache")
    assert again["variants"][1]["stages"]["build"]["cache_hit"] is True
    assert "cache hit" in capsys.readouterr().err
    assert (tmp_path / "b" / "onnxruntime-int8-entropy.onnx").is_file()


@pytest.mark.slow
def test_modelopt_exclude_by_module_name_is_an_explained_finding(int8_config, tmp_path):
    """ModelOpt names what it kept float by module (``conv1``); its exported nodes carry the module as a scope
    (``/model/conv1/Conv``): the lint must pair them, or a layer the user excluded reads as a defect (verdict blocks INT8)."""
    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt",
                                "quantizer": "modelopt", "exclude": ["conv1"]}]
    v = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")["variants"][0]
    q = v["quantization"]
    assert v["status"] == "ok" and q["excluded_by_user"] == ["conv1"], v.get("reason")
    assert q["lint"]["verdict"] == "clean", q["lint"]
    assert [f["nodes"] for f in q["lint"]["findings"] if "excluded by the config" in f["fix"]] == [["/model/conv1/Conv"]]


@pytest.mark.slow
def test_quantize_stage_command_and_trt_cache_as_input(int8_config, tmp_path):
    summary = api.quantize(int8_config, tmp_path / "q", cache_dir=tmp_path / "cache")
    name = "onnxruntime-int8-trt-onnx-percentile-excl-conv2"
    assert (tmp_path / "q" / "onnxruntime-int8-trt-mse.onnx").is_file()
    assert (tmp_path / "q" / f"{name}.onnx").is_file() and (tmp_path / "q" / "quantize.json").is_file()
    trt_cache = tmp_path / "q" / f"{name}.trtcache"
    int8_config["data"].pop("calibration")  # ranges come from the cache alone
    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "calibration_cache": str(trt_cache),
                                "exclude": ["conv2"]}]
    results = api.run(int8_config, tmp_path / "from-cache", cache_dir=tmp_path / "cache")
    v = results["variants"][0]
    assert v["status"] == "ok" and v["quantization"]["method"] == "tensorrt-cache"
    assert v["quantization"]["structure"] == summary["variants"][name]["structure"]


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_fewer_calibration_images_than_asked_warns_and_uses_them(int8_config, tmp_path):
    int8_config["data"]["calibration"]["count"] = 500
    int8_config["variants"] = int8_config["variants"][:2]
    with pytest.warns(UserWarning, match="500"):
        results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][1]["quantization"]["samples"] == 30


def test_no_calibration_data_is_an_error(int8_config, tmp_path):
    int8_config["data"].pop("calibration")
    with pytest.raises(QDeployError, match="needs calibration images: add data.calibration"):
        api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    int8_config["data"]["calibration"] = {"root": str(tmp_path / "empty"), "workers": 0}
    with pytest.raises(QDeployError, match="no images found"):
        api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")


def test_calibrating_on_the_evaluation_images_is_refused(int8_config, tmp_path):
    int8_config["data"]["calibration"]["root"] = int8_config["data"]["eval"]["root"]
    with pytest.raises(QDeployError, match="shares .* images with data.eval"):
        api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")


@pytest.mark.slow
def test_nan_activations_name_the_layer(int8_config, tmp_path):
    int8_config["model"]["kwargs"] = {"nan": True}
    int8_config["variants"] = [{"engine": "onnxruntime"}, {"engine": "onnxruntime", "precision": "int8", "method": "max"}]
    results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    fp32, int8 = results["variants"]
    assert fp32["status"] == "ok"  # one variant's failure does not stop the run
    assert int8["status"] == "failed" and int8["failed_stage"] == "build"
    assert re.search("NaN/Inf in tensor .* \\(output of layer '.*Sqrt", int8["reason"])


@pytest.mark.slow
def test_all_zero_channel_gets_a_floor_scale_not_a_division_by_zero(int8_config, tmp_path):
    int8_config["variants"] = [{"engine": "onnxruntime"}, {"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt"}]
    results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    v = results["variants"][1]
    assert v["status"] == "ok", v["reason"]
    proto = onnx.load(_artifact(tmp_path / "out", v))
    scales = np.concatenate([a.ravel() for a in _q_inputs(proto, 1)])
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)


@pytest.mark.slow
def test_exclude_pattern_that_matches_nothing_warns(int8_config, tmp_path, capsys):
    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "method": "max", "exclude": ["no_such_layer"]}]
    results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][0]["quantization"]["unmatched_patterns"] == ["no_such_layer"]
    assert "matches no layer" in capsys.readouterr().err


def _sequential_model_config(tmp_path, layers: str, size: int, variants: list) -> dict:
    """A config around ``nn.Sequential(<layers>)`` written to a model file, with tiny eval/calibration folders."""
    model_file = tmp_path / "seq_model.py"
    model_file.write_text(f"import torch\nfrom torch import nn\ndef net():\n    torch.manual_seed(0)\n    return nn.Sequential({layers})\n")
    evalset = write_image_folder(tmp_path / "eval", per_class=2, size=(size, size))
    calib = write_image_folder(tmp_path / "calib", per_class=4, size=(size, size), seed=3)
    return {
        "model": {"source": f"{model_file}:net", "preprocess": {"input_size": [size, size]}},
        "data": {"eval": {"root": str(evalset), "workers": 0}, "calibration": {"root": str(calib), "workers": 0}},
        "variants": variants, "bench": {"enabled": False},
    }


def test_op_the_quantizer_cannot_handle_is_left_float_and_listed(tmp_path):
    """An op kept out of the quantizer (here ConvTranspose via exclude_ops) stays float and is listed by name."""
    cfg = _sequential_model_config(
        tmp_path, "nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.ConvTranspose2d(4, 3, 2, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten()",
        8, [{"engine": "onnxruntime", "precision": "int8", "method": "max", "exclude_ops": ["ConvTranspose"]}])
    summary = api.quantize(cfg, tmp_path / "q", cache_dir=tmp_path / "cache")
    st = next(iter(summary["variants"].values()))["structure"]
    assert st["compute_ops"] == 2 and st["compute_ops_int8"] == 1
    assert any("ConvTranspose" in n for n in st["compute_ops_float"] + st["compute_ops_partly_quantized"])


@pytest.mark.slow
def test_trt_cache_that_does_not_match_the_model(int8_config, tmp_path):
    bad = tmp_path / "other.cache"
    write_trt_cache(bad, {"resnet/layer1/out": TensorRange(-1, 1, 1), "input": TensorRange(-1, 1, 1)})
    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "calibration_cache": str(bad)}]
    v = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")["variants"][0]
    assert v["status"] == "failed" and v["failed_stage"] == "build"
    assert re.search("does not match the model: 1 of 2 tensors .*resnet/layer1/out", v["reason"])


@pytest.mark.slow
def test_untraceable_model_falls_back_to_onnx_qdq_or_errors_when_modelopt_is_forced(int8_config, tiny_model_file, tmp_path, capsys):
    int8_config["model"]["source"] = f"{tiny_model_file}:branchy"
    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt"}]
    results = api.run(int8_config, tmp_path / "out", cache_dir=tmp_path / "cache")
    v = results["variants"][0]
    assert v["status"] == "ok" and v["quantization"]["quantizer"] == "onnx"
    assert "falling back to quantizer onnx" in capsys.readouterr().err
    int8_config["variants"][0]["quantizer"] = "modelopt"
    v = api.run(int8_config, tmp_path / "out2", cache_dir=tmp_path / "cache")["variants"][0]
    assert v["status"] == "failed" and v["failed_stage"] == "build" and "torch.fx cannot trace" in v["reason"]


@pytest.mark.slow
def test_constant_node_inputs_of_quantized_ops_get_ranges(tmp_path):
    """EfficientNet-style static 'same' padding exports Pad with Constant-node inputs; ORT's quantizer needs their ranges."""
    cfg = _sequential_model_config(
        tmp_path, "nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(3, 4, 3, stride=2), nn.ReLU6(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)",
        9, [{"engine": "onnxruntime"}, {"engine": "onnxruntime", "precision": "int8", "method": "max"}])
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][1]["status"] == "ok", results["variants"][1]["reason"]
    assert results["variants"][1]["quantization"]["structure"]["compute_ops_int8"] == 2


def test_quantize_cli_command(int8_config, tmp_path, capsys):
    import yaml

    from qdeploy.cli import main

    int8_config["variants"] = [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt"}]
    cfg = tmp_path / "q.yaml"
    cfg.write_text(yaml.safe_dump(int8_config))
    assert main(["quantize", str(cfg), "--out", str(tmp_path / "q"), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime-int8-trt-max" in out and "2/3 compute ops INT8; residual Adds: 1 fusible; TensorRT lint: clean" in out
    assert (tmp_path / "q" / "onnxruntime-int8-trt-max.trtcache").read_text().startswith("TRT-")
    int8_config["variants"] = [{"engine": "onnxruntime"}]
    cfg.write_text(yaml.safe_dump(int8_config))
    assert main(["quantize", str(cfg), "--out", str(tmp_path / "q2")]) == 2
    assert "no int8 variants to quantize" in capsys.readouterr().err


@pytest.mark.slow
def test_modelopt_histogram_methods_share_one_statistics_pass(int8_config, tmp_path):
    trt = {"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "quantizer": "modelopt"}
    int8_config["variants"] = [{**trt, "method": "entropy"}, {**trt, "method": "mse"}]
    shared = api.run(int8_config, tmp_path / "a", cache_dir=tmp_path / "cache-a")
    first, second = (v["quantization"] for v in shared["variants"])
    assert first["shared_statistics"] is False and second["shared_statistics"] is True
    int8_config["variants"] = [{**trt, "method": "mse"}]
    alone = api.run(int8_config, tmp_path / "b", cache_dir=tmp_path / "cache-b")["variants"][0]["quantization"]
    assert alone["shared_statistics"] is False
    import json

    ranges = [json.loads(Path(q["cache"]).read_text())["amax"] for q in (second, alone)]
    assert ranges[0] == ranges[1]  # sharing the pass changes nothing but time


@pytest.mark.slow
def test_a_quantizer_internal_error_is_one_line_with_what_to_try(tiny_config, tmp_path, monkeypatch, capsys):
    """Issue 21, item 4: ONNX Runtime's pre-processing stops with an AssertionError that has no text (a torchvision ViT
    did): the variant's reason names the library, says there was no message, and what to try; --debug prints the
    traceback. The error is raised by the real onnxruntime function."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from qdeploy.cli import main
    from qdeploy.quantize.onnx_quantizer import OnnxQdqQuantizer

    monkeypatch.setattr(OnnxQdqQuantizer, "quantize", lambda self, inputs, cfg, out: quant_pre_process(None, None))
    cfg = dict(tiny_config, variants=[{"engine": "onnxruntime"}, {"engine": "onnxruntime", "precision": "int8",
                                                                  "quantizer": "onnx", "placement": "onnxruntime"}],
               bench={"enabled": False})
    from conftest import write_image_folder

    calib = write_image_folder(tmp_path / "calib", seed=3)
    cfg["data"] = dict(cfg["data"], calibration=dict(cfg["data"]["eval"], root=str(calib)))
    import yaml

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    rc = main(["--debug", "run", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    v = results["variants"][1]
    assert rc == 4 and v["status"] == "failed" and v["failed_stage"] == "build"
    assert v["reason"].startswith("AssertionError inside onnxruntime (no message); try placement: tensorrt")
    assert "exclude" in v["reason"] and "\n" not in v["reason"]
    assert "Traceback" in capsys.readouterr().err and "traceback" in v["details"]


def test_adds_and_muls_left_float_run_as_float_in_onnxruntime(tmp_path):
    """optimize's FLOAT_WHEN_SLOWER placement (Add and Mul measured slower in INT8 by ONNX Runtime's profiler on both
    CPUs it ran on) must change what ONNX Runtime runs: with Add quantized its optimizer fuses it into QLinearAdd; left
    float by exclude_ops (with Mul), the same graph keeps a float Add and Mul and its convs stay INT8."""
    import onnxruntime as ort

    model_file = tmp_path / "residual.py"
    model_file.write_text(
        "import torch\nfrom torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.stem, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)\n"
        "        self.head = nn.Linear(8, 3)\n"
        "    def forward(self, x):\n"
        "        x = torch.relu(self.stem(x))\n"
        "        y = torch.relu(self.a(x) + x) * torch.sigmoid(self.b(x))\n"
        "        return self.head(y.mean((2, 3)))\n"
        "def net():\n    torch.manual_seed(0)\n    return Block()\n")
    cfg = _sequential_model_config(tmp_path, "nn.Identity()", 8, [
        {"engine": "onnxruntime", "precision": "int8", "method": "max", "name": "all"},
        {"engine": "onnxruntime", "precision": "int8", "method": "max", "name": "float-add-mul", "exclude_ops": ["Add", "Mul"]}])
    cfg["model"]["source"] = f"{model_file}:net"
    out = tmp_path / "q"
    summary = api.quantize(cfg, out, cache_dir=tmp_path / "cache")
    ops = {}
    for name, v in summary["variants"].items():
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        ort.InferenceSession(str(out / f"{name}.onnx"), so, providers=["CPUExecutionProvider"])
        ops[name] = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    assert "QLinearAdd" in ops["all"], ops["all"]  # (this Mul feeds a float ReduceMean: ONNX Runtime keeps it float)
    assert "QLinearAdd" not in ops["float-add-mul"] and {"Add", "Mul"} <= set(ops["float-add-mul"]), ops["float-add-mul"]
    assert ops["float-add-mul"].count("QLinearConv") == ops["all"].count("QLinearConv") >= 3
