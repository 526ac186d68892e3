"""A YOLOv8 exactly as Ultralytics' own exporter writes it (bench/train/train_yolov8_ultralytics.py, trained on BCCD):
its graph keeps Ultralytics' structure (the DFL conv, the three strides' Concat, anchors built in the graph, dynamic
batch), and qdeploy's detection evaluation of it in ONNX Runtime FP32 reaches a real mAP on BCCD's test split.
Ultralytics itself is never imported: the ONNX file is the whole interface."""
from __future__ import annotations

import ast
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import shared_path

ROOT = Path(__file__).resolve().parents[1]
ONNX = ROOT / "bench/weights/bccd_yolov8_ultralytics.onnx"
CONFIG = ROOT / "bench/configs/bccd_yolov8_ultralytics.yaml"
# qdeploy measured mAP@0.5 0.724, mAP@0.5:0.95 0.452 on the test split (72 images; Ultralytics' own val: 0.721 /
# 0.441, bench/weights/bccd_yolov8_ultralytics.json); the floors sit well under them so that an ONNX Runtime, OpenCV
# or pycocotools update cannot fail them, while a wrong decode, letterbox or class order still does
MAP50_FLOOR, MAP_FLOOR = 0.60, 0.30


def _model():
    onnx = pytest.importorskip("onnx")
    if not ONNX.is_file():
        pytest.skip(f"{ONNX} absent: bench/train/train_yolov8_ultralytics.py writes it "
                    "(Ultralytics in a separate virtual environment)")
    return onnx.load(str(ONNX))


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_the_graph_is_ultralytics_yolov8_with_its_dfl_conv_and_stride_concats():
    from onnx import numpy_helper

    model = _model()
    g = model.graph
    made_by = {o: n for n in g.node for o in n.output}
    weights = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    meta = {p.key: p.value for p in model.metadata_props}
    record = json.loads(ONNX.with_suffix(".json").read_text())
    assert meta["author"] == "Ultralytics" and meta["head"] == "Detect" and meta["version"] == record["ultralytics"]
    # class order of the score rows: the exporter's names = the data.yaml the record lists = the config's classes
    assert list(ast.literal_eval(meta["names"]).values()) == record["classes"] == ["RBC", "WBC", "Platelets"]
    assert [i.name for i in g.input] == ["images"] and _dims(g.input[0]) == ["batch", 3, "height", "width"]
    assert [o.name for o in g.output] == ["output0"] and _dims(g.output[0]) == ["batch", 7, "anchors"]
    # DFL: softmax over 16 bins, then a 1x1 conv whose fixed weights are the bin indices (their expectation)
    dfl = [n for n in g.node if n.op_type == "Conv" and weights.get(n.input[1], np.zeros(0)).shape == (1, 16, 1, 1)]
    assert len(dfl) == 1 and made_by[dfl[0].input[0]].op_type == "Softmax"
    np.testing.assert_array_equal(weights[dfl[0].input[1]].ravel(), np.arange(16, dtype=np.float32))
    # the three strides' head outputs (box distributions, class logits) flattened and joined: two Concats of three
    # Reshapes of the prediction convs
    strides = [n for n in g.node if n.op_type == "Concat" and len(n.input) == 3
               and all(made_by[i].op_type == "Reshape" and made_by[made_by[i].input[0]].op_type == "Conv"
                       for i in n.input if i in made_by)]
    assert len(strides) == 2
    ops = Counter(n.op_type for n in g.node)
    assert ops["Range"] == 6 and ops["Softmax"] == 1  # anchors made in the graph for any height/width (dynamic=True)


def test_dynamic_batch_runs_in_onnx_runtime():
    ort = pytest.importorskip("onnxruntime")
    _model()
    session = ort.InferenceSession(str(ONNX), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        x = rng.random((batch, 3, 320, 320), dtype=np.float32)
        (out,) = session.run(None, {"images": x})
        assert out.shape == (batch, 7, 40 * 40 + 20 * 20 + 10 * 10)  # strides 8, 16, 32 at 320x320
        scores = out[:, 4:]
        assert np.isfinite(out).all() and scores.min() >= 0 and scores.max() <= 1
    (one,) = session.run(None, {"images": x[:1]})
    np.testing.assert_allclose(one, out[:1], rtol=1e-4, atol=1e-3)  # an image's output does not depend on its batch


@pytest.mark.realdata
@pytest.mark.slow
def test_qdeploy_evaluates_the_ultralytics_export_on_bccd(tmp_path):
    """qdeploy eval with the bench config (decode yolov8, 320x320 letterbox), ONNX Runtime FP32 only."""
    import yaml

    from qdeploy.cli import main

    _model()
    pytest.importorskip("cv2", reason="the config resizes with OpenCV (interpolation: cv2-linear), as Ultralytics does")
    bccd = shared_path("data", "detection", "bccd")
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model"]["source"] = str(ONNX)
    cfg["data"]["eval"]["root"] = str(bccd)
    cfg["data"].pop("calibration")
    cfg["variants"] = [{"engine": "onnxruntime", "precision": "fp32"}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--quiet", "eval", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    (row,) = json.loads((tmp_path / "out/results.json").read_text())["variants"]
    m = row["metrics"]
    assert m["samples"] == 72 and m["map50"] >= MAP50_FLOOR and m["map"] >= MAP_FLOOR, m
    assert all(m["per_class_ap"][c] > 0.05 for c in ("RBC", "WBC", "Platelets")), m["per_class_ap"]


@pytest.mark.realdata
@pytest.mark.slow
def test_openvino_int8_ir_of_the_ultralytics_export_stays_within_a_map_point(tmp_path):
    """Engine openvino's INT8 (NNCF on the OpenVINO model, the prediction head and the DFL decoding left float)
    compiles and runs on the export, within 1.0 mAP@0.5:0.95 point of FP32 on BCCD's test split."""
    import yaml

    from qdeploy import api

    _model()
    pytest.importorskip("cv2", reason="the config resizes with OpenCV (interpolation: cv2-linear), as Ultralytics does")
    bccd = shared_path("data", "detection", "bccd")
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model"]["source"] = str(ONNX)
    for split in ("eval", "calibration"):
        cfg["data"][split]["root"] = str(bccd)
    cfg["variants"] = [{"engine": "openvino"}, {"engine": "openvino", "precision": "int8"}]
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    fp32, int8 = results["variants"]
    assert fp32["status"] == "ok" and int8["status"] == "ok", (fp32["reason"], int8["reason"])
    assert int8["details"]["artifact"] == "openvino-int8-ov-mean-minmax/model.xml"
    assert abs(int8["metrics"]["map"] - fp32["metrics"]["map"]) <= 0.01, (int8["metrics"]["map"], fp32["metrics"]["map"])
    head = int8["quantization"]["ignored_scope"]["prediction_head"]
    assert "/model.22/dfl/conv/Conv" in head and "/model.22/dfl/conv/Conv" in int8["quantization"]["ignored_ir_nodes"]
