"""INT8 on the model class where post-training quantization breaks: squeeze-excitation + SiLU/hardswish.

EfficientNet-B0 and MobileNetV3-Large trained on CIFAR-10 (../shared/models/cifar10-dev), ONNX Runtime-
targeted placement (uint8 asymmetric activations, ORT's own Q/DQ placement, which also quantizes the
sigmoid / hard-sigmoid gates that feed QLinearMul), all five range methods, 512 calibration images from
cifar10/train, 1,500 seeded images of cifar10/test. Entropy calibration can collapse these models to chance
(10.64 % / 10.00 % when it clips every value of the gates, see ranges.entropy_amax); no method may do that.
About 1-2 minutes per model on 2 cores. Full-test-set numbers are in docs/int8-accuracy.md.
"""
import json
from pathlib import Path

import pytest

from conftest import shared_path
from qdeploy import api

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

METHODS = ("max", "entropy", "percentile", "mse", "mean-minmax")
MODELS = {  # file stem -> (torchvision architecture, input size)
    "efficientnet_b0_48": ("efficientnet_b0", 48),
    "mobilenet_v3_large_64": ("mobilenet_v3_large", 64),
}
EVAL_IMAGES = 1500


def _ort_int8_variant(method: str) -> dict:
    """The ONNX Runtime-placement INT8 variant with one range method."""
    return {"engine": "onnxruntime", "precision": "int8", "method": method, "placement": "onnxruntime", "threads": 2}


def _config(name: str) -> dict:
    arch, size = MODELS[name]
    weights = shared_path("models", "cifar10-dev", f"{name}.pt")
    return {
        "model": {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10}, "weights": str(weights),
                  "preprocess": {"input_size": [size, size], "resize": [size, size],
                                 "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
        "data": {"eval": {"root": str(shared_path("data", "cifar10", "test")), "count": EVAL_IMAGES, "seed": 0, "batch_size": 250},
                 "calibration": {"root": str(shared_path("data", "cifar10", "train")), "count": 512, "seed": 0}},
        "variants": [{"engine": "onnxruntime", "threads": 2}] + [_ort_int8_variant(m) for m in METHODS],
        "bench": {"enabled": False},
    }


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_range_method_keeps_the_ort_int8_model_far_from_chance(name, tmp_path):
    results = api.run(_config(name), tmp_path / "out", cache_dir=tmp_path / "cache")
    fp32, *int8 = results["variants"]
    # degraded (agreement below eval.min_agreement) is allowed for the weakest method; failing is not
    assert all(v["status"] in ("ok", "degraded") for v in results["variants"]), [v["reason"] for v in results["variants"]]
    assert results["recommendation"]["variant"] not in {v["name"] for v in results["variants"] if v["status"] == "degraded"}
    assert fp32["metrics"]["samples"] == EVAL_IMAGES
    ref = fp32["metrics"]["top1"]
    assert ref > 0.75  # README: 80.52 % / 87.61 % on the full test set
    top1 = {v["quantization"]["method"]: v["metrics"]["top1"] for v in int8}
    agreement = {v["quantization"]["method"]: v["agreement"] for v in int8}
    assert set(top1) == set(METHODS)
    for method in METHODS:
        # chance is 10 %; the collapse gave 10-11 % top-1 and ~10 % agreement. The weakest method here
        # (max on EfficientNet-B0, where PTQ of this model class is known to hurt) measured FP32 - 15.5 points
        # on these 1,500 images (-13.9 on the full test set).
        assert top1[method] >= ref - 0.20, (method, top1, ref)
        assert agreement[method] >= 0.65, (method, agreement)
    # the default method (issue #8) holds on both: measured -0.40 / -0.24 on the full test set
    assert top1["mean-minmax"] >= ref - 0.015, (top1, ref)
    # 512 images are enough for it: no "too few images" warning on the model class it is the default for
    mm = next(v for v in int8 if v["quantization"]["method"] == "mean-minmax")
    assert not [w for w in mm["quantization"]["warnings"] if w["kind"] == "too-few-images"], mm["quantization"]["warnings"]
    # entropy, the method that collapsed, lands with the others: within 6 points of FP32
    # (measured on the full test set: -0.4 on EfficientNet-B0, -4 on MobileNetV3, as ModelOpt's TensorRT placement)
    assert top1["entropy"] >= ref - 0.06, (top1, ref)
    # the collapse itself: a range ending within one histogram bin of the tensor's observed minimum, i.e.
    # every value clipped to one constant (23 tensors of EfficientNet-B0, 15 of MobileNetV3 before). The
    # max variant's ranges are the observed [min, max] of every tensor.
    ranges = {v["quantization"]["method"]: {t: r[:3] for t, r in json.loads(Path(v["quantization"]["cache"]).read_text())["ranges"].items()}
              for v in int8}  # [lo, hi, amax] (+ per-channel extremes of depthwise inputs)
    observed = ranges["max"]
    for method, rs in ranges.items():
        collapsed = [t for t, (lo, hi, _) in rs.items()
                     if observed[t][0] > 0 and observed[t][1] - observed[t][0] > observed[t][1] / 1024
                     and hi - observed[t][0] <= observed[t][1] / 2048]
        assert not collapsed, (method, collapsed[:5])
