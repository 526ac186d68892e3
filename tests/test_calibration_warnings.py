"""Issue #8, bad input: a calibration set too small for the estimator, and activations that never vary."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import write_image_folder
from qdeploy import api
from qdeploy.quantize.collect import collect_activation_stats
from qdeploy.quantize.ranges import MEAN_MINMAX_RELATIVE_ERROR, calibration_facts, calibration_warnings, images_needed

DEAD_MODEL = '''
import torch
from torch import nn


class DeadBranch(nn.Module):
    """A ReLU whose pre-activations are all negative (a dead layer: its output is 0 on every image) feeds a conv."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.alive = nn.Conv2d(3, 16, 3, padding=1)
        self.dead = nn.Conv2d(3, 16, 3, padding=1)
        self.head = nn.Conv2d(16, 16, 3, padding=1)  # ≥ 16 channels: not left float as too narrow for TensorRT
        self.fc = nn.Linear(16, num_classes)
        with torch.no_grad():
            self.dead.weight.zero_()
            self.dead.bias.fill_(-1.0)

    def forward(self, x):
        return self.fc((self.head(torch.relu(self.dead(x))) + torch.relu(self.alive(x))).mean((2, 3)))


def dead_branch(num_classes=3):
    torch.manual_seed(0)
    return DeadBranch(num_classes)
'''


def _onnx(tmp_path, module):
    path = tmp_path / "m.onnx"
    torch.onnx.export(module.eval(), (torch.randn(1, 3, 8, 8),), str(path), input_names=["input"], output_names=["output"],
                      opset_version=17, dynamic_axes={"input": {0: "n"}}, dynamo=False)
    return path


def test_mean_minmax_warns_below_the_images_its_mean_needs(tmp_path):
    """Images whose brightness varies ±50 %: the per-image max varies with it, so a mean over 8 images is not
    stable to 5 %; the warning gives the count needed, and that count (computed on 400 images) silences it."""
    path = _onnx(tmp_path, torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3)))
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(400, 3, 8, 8)) * rng.uniform(0.5, 1.5, size=(400, 1, 1, 1))).astype(np.float32)
    big = collect_activation_stats(path, [x[i:i + 50] for i in range(0, 400, 50)], 400, histograms=False)
    needs = {n: images_needed("mean-minmax", 99.99, s.samples, s.sample_absmax_sum, s.sample_absmax_sq_sum, s.elements)
             for n, s in big.tensors.items()}
    # the spread measured on 400 images: cv ≈ 0.3 → (0.3 / 0.05)² ≈ 36 images
    assert 10 < max(needs.values()) < 400, needs
    assert not [w for w in calibration_warnings(calibration_facts(big, "mean-minmax"), "mean-minmax") if w["kind"] == "too-few-images"]
    small = collect_activation_stats(path, [x[:8]], 8, histograms=False)
    facts = calibration_facts(small, "mean-minmax")
    (w,) = [w for w in calibration_warnings(facts, "mean-minmax") if w["kind"] == "too-few-images"]
    assert w["needed"] > 8 and f"use at least {w['needed']} images" in w["message"]
    assert f"{int(MEAN_MINMAX_RELATIVE_ERROR * 100)} %" in w["message"]
    # only tensors that carry a quantizer count: none quantized, no warning
    assert not calibration_warnings(facts, "mean-minmax", quantized=set())
    # max takes the extreme of whatever it saw: no minimum follows from the estimator
    assert not [w for w in calibration_warnings(calibration_facts(small, "max"), "max") if w["kind"] == "too-few-images"]
    # percentile 99.99 on a tensor of 3·8·8 values per image needs 1 / (1e-4 · 192) = 53 images for its tail to hold a value
    assert images_needed("percentile", 99.99, 8, 1.0, 1.0, 192) == 53


@pytest.mark.slow
@pytest.mark.parametrize("quantizer", ["onnx", "modelopt"])
def test_dead_layer_is_named_in_results_and_report(tmp_path, quantizer):
    model_file = tmp_path / "dead.py"
    model_file.write_text(DEAD_MODEL)
    images = write_image_folder(tmp_path / "images", per_class=4)
    calib = write_image_folder(tmp_path / "calib", per_class=4, seed=1)
    variant = {"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt", "quantizer": quantizer}
    cfg = {"model": {"source": f"{model_file}:dead_branch", "task": "classification",
                     "preprocess": {"input_size": [8, 8], "mean": [0.5] * 3, "std": [0.25] * 3}},
           "data": {"eval": {"format": "imagefolder", "root": str(images), "batch_size": 4, "workers": 0},
                    "calibration": {"format": "imagefolder", "root": str(calib), "batch_size": 4, "workers": 0}},
           "variants": [{"engine": "onnxruntime"}, variant], "bench": {"enabled": False}}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    int8 = results["variants"][1]
    assert int8["status"] in ("ok", "degraded"), int8["reason"]
    warnings = int8["quantization"]["warnings"]
    dead = [w for w in warnings if w["kind"] == "all-zero"]
    assert dead, warnings
    # the layer is named: the dead ReLU (ONNX statistics) or the conv that reads its output (ModelOpt's quantizer)
    assert any("Relu" in w["layer"] or w["layer"] == "head" for w in dead), dead
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Calibration warnings" in report and dead[0]["layer"] in report
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["variants"][1]["quantization"]["warnings"] == warnings


def test_the_same_constant_on_every_block_is_one_warning_with_a_count():
    """Attention's sqrt(head_dim) is a constant activation in each of 12 blocks: one line, not twelve (issue 21)."""
    facts = {"samples": 64, "constants": [{"tensor": f"/blocks.{i}/attn/Sqrt_output_0", "value": 8.0} for i in range(12)]
             + [{"tensor": "/dead/Relu_output_0", "value": 0.0}],
             "producer": {f"/blocks.{i}/attn/Sqrt_output_0": f"/blocks.{i}/attn/Sqrt" for i in range(12)}}
    ws = calibration_warnings(facts, "max")
    assert len(ws) == 2
    sqrt = next(w for w in ws if w["kind"] == "constant")
    assert sqrt["count"] == 12 and len(sqrt["tensors"]) == 12 and sqrt["layers"][3] == "/blocks.3/attn/Sqrt"
    assert sqrt["message"].startswith("12 activations, e.g. '/blocks.0/attn/Sqrt_output_0' (output of layer "
                                      "'/blocks.0/attn/Sqrt'), are constant 8 on all 64 calibration images")
    dead = next(w for w in ws if w["kind"] == "all-zero")
    assert dead["count"] == 1 and dead["message"].startswith("activation '/dead/Relu_output_0'")
