"""`qdeploy lint` on other tools' Q/DQ output for a real model (CIFAR-10 ResNet-20, ../shared), and the
safe fixes checked on real images in ONNX Runtime.

What qdeploy finds in them (recorded in docs/tensorrt.md):
- ONNX Runtime ``quantize_static`` (QDQ format, its defaults): uint8 asymmetric activations (QD017, not
  TensorRT INT8) and Q/DQ on both inputs of every residual Add (QD001, its QLinearAdd form).
- ModelOpt ``modelopt.onnx.quantization.quantize`` (int8, max): residual Adds in the fusible form.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import shared_path
from qdeploy import api
from qdeploy.data import make_batches, normalize
from qdeploy.lint import fix_onnx, lint_onnx

pytestmark = [pytest.mark.realdata, pytest.mark.slow]


@pytest.fixture(scope="module")
def resnet20(tmp_path_factory):
    """The FP32 ONNX of ResNet-20 (qdeploy's export) and 256 real test images, preprocessed."""
    root = shared_path("models", "cifar10-resnet")
    data = shared_path("data", "cifar10")
    out = tmp_path_factory.mktemp("r20")
    cfg = {"model": {"source": f"{root}/cifar_resnet.py:resnet20", "weights": f"{root}/resnet20.pt",
                     "preprocess": {"input_size": [32, 32], "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
           "data": {"eval": {"root": f"{data}/test", "count": 256, "seed": 0, "batch_size": 256},
                    "calibration": {"root": f"{data}/train", "count": 64, "seed": 0, "batch_size": 64}}}
    summary = api.export(cfg, out / "export", cache_dir=out / "cache")
    config = api.parse_config(cfg)
    pre, task = config.model.preprocess, config.model.task
    images = normalize(next(iter(make_batches(config.data.eval, pre, task)))[0], pre)
    calib = normalize(next(iter(make_batches(config.data.calibration, pre, task)))[0], pre)
    return summary["copied_to"], np.ascontiguousarray(images), np.ascontiguousarray(calib), out


def _predict(path, x):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0].argmax(1)


def test_lint_onnxruntime_quantize_static_output_and_fix_it(resnet20):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    fp32, images, calib, out = resnet20

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{"input": calib[i:i + 16]} for i in range(0, len(calib), 16)])

        def get_next(self):
            return next(self.it, None)

    qdq = out / "ort_qdq.onnx"
    quantize_static(fp32, str(qdq), Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    report = lint_onnx(qdq)
    rules = {f.rule for f in report.findings}
    assert {"QD017", "QD001"} <= rules
    assert report.verdict == "blocks INT8" and report.structure["residual_add_forms"] == {"conv-path-quantized": 9}
    # --fix drops the conv-path Q/DQ of every residual Add; on real images the predictions barely move
    fixed = fix_onnx(qdq, out / "ort_qdq_fixed.onnx")
    assert fixed.fixed["QD001"] == 9 and fixed.structure["residual_add_forms"] == {"fusible": 9}
    before, after = _predict(qdq, images), _predict(out / "ort_qdq_fixed.onnx", images)
    assert (before == after).mean() >= 0.97  # one rounding step fewer per block: within 3 % of predictions


def test_lint_modelopt_onnx_quantization_output(resnet20):
    pytest.importorskip("onnx_graphsurgeon", reason="ModelOpt's ONNX quantization needs onnx-graphsurgeon (test extra)")
    try:
        from modelopt.onnx.quantization import quantize as modelopt_quantize
    except ImportError as e:
        pytest.skip(f"modelopt.onnx.quantization not importable: {e}")
    fp32, images, calib, out = resnet20
    path = out / "modelopt_int8.onnx"
    modelopt_quantize(fp32, quantize_mode="int8", calibration_data=calib, calibration_method="max",
                      calibration_eps=["cpu"], output_path=str(path))
    report = lint_onnx(path)
    # ModelOpt places residual Q/DQ the way TensorRT wants (its build_non_residual_input_map); qdeploy agrees
    assert report.structure["residual_add_forms"].get("fusible", 0) >= 6
    assert "QD001" not in {f.rule for f in report.findings}
    assert not any(f.rule in ("QD015", "QD016", "QD017") for f in report.findings)
    if any(f.fixable for f in report.findings):
        fixed = fix_onnx(path, out / "modelopt_fixed.onnx")
        agree = (_predict(path, images) == _predict(out / "modelopt_fixed.onnx", images)).mean()
        assert agree >= 0.97, agree
