"""The detection task (issue 37): decoders, NMS, label tables and the geometry back to the original image, agreement,
the paired bootstrap of mAP, opset upgrade of a user's ONNX, config rules, and FastestDet end to end on ../shared
against an evaluation written without qdeploy (bench/suites/fastestdet_independent_eval.py)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from pydantic import ValidationError

from qdeploy.config import ModelSpec, Preprocess
from qdeploy.data.transforms import box_geometry, letterbox_geometry
from qdeploy.tasks import get_task
from qdeploy.tasks.detection import (LABELLED, DetectionPredictions, label_table, metrics_of_detections,
                                     unlabelled_table)
from qdeploy.tasks.detection_decode import (decode_fastestdet, decode_yolov5, decode_yolov8, load_decoder, matched, nms,
                                            postprocess)
from qdeploy.tasks.detection_metrics import DetectionMetrics, class_matches, map_change, mean_ap

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"


def _yolov8_output(boxes_xywh, scores):
    """(1, 4 + C, A) as Ultralytics exports it: cx cy w h rows then class scores."""
    return np.concatenate([np.asarray(boxes_xywh, np.float32).T, np.asarray(scores, np.float32).T])[None]


# ------------------------------------------------------------------------------------------------------ decoders
def test_yolov8_decoder_reads_both_layouts_and_nms_is_per_class():
    # 2 overlapping of class 0, one of class 1 on them, one apart; then empty anchors (a real head has thousands, more
    # than 4 + classes rows: that is how the layout is told)
    boxes = [[50, 50, 20, 20], [51, 50, 20, 20], [52, 50, 20, 20], [200, 100, 40, 30]] + [[10, 10, 4, 4]] * 6
    scores = [[0.9, 0.0], [0.8, 0.0], [0.0, 0.7], [0.1, 0.6]] + [[0.0, 0.0]] * 6
    out = _yolov8_output(boxes, scores)
    (b, s, c), = decode_yolov8(out, (320, 320))
    np.testing.assert_allclose(b[0], [40, 40, 60, 60])
    np.testing.assert_allclose(s[:4], [0.9, 0.8, 0.7, 0.6], rtol=1e-6)
    assert c[:4].tolist() == [0, 0, 1, 1]
    (b2, s2, c2), = decode_yolov8(out.transpose(0, 2, 1).copy(), (320, 320))  # (N, A, 4 + C) exports
    np.testing.assert_allclose(b2, b)
    kb, ks, kc = nms(b, s, c, 0.001, 0.5, 100)
    assert ks.tolist() == pytest.approx([0.9, 0.7, 0.6])  # the second class-0 box is suppressed, not class 1's
    assert kc.tolist() == [0, 1, 1]


def test_yolov5_scores_are_objectness_times_class():
    out = np.array([[[100, 100, 10, 10, 0.5, 0.2, 0.8]]], np.float32)
    (b, s, c), = decode_yolov5(out, (640, 640))
    assert s.tolist() == pytest.approx([0.4]) and c.tolist() == [1]
    np.testing.assert_allclose(b, [[95, 95, 105, 105]])


def test_fastestdet_decoding_follows_its_authors():
    """Cell (y=0, x=1) of a 2x2 grid: centre ((tanh(0) + 1) / 2, (tanh(0) + 0) / 2) = (0.5, 0) of the image, size
    sigmoid(0) = 0.5 of it, score obj^0.6 * cls^0.4 (its utils/tool.py handle_preds)."""
    out = np.zeros((1, 7, 2, 2), np.float32)
    out[0, 0, 0, 1] = 0.8          # objectness of cell (y=0, x=1)
    out[0, 5:, :, :] = 0.5
    out[0, 6, 0, 1] = 0.9          # class 1 there
    (b, s, c), = decode_fastestdet(out, (100, 200))
    k = 1  # cell (0, 1) in row-major order
    assert s[k] == pytest.approx(0.8 ** 0.6 * 0.9 ** 0.4) and c[k] == 1
    np.testing.assert_allclose(b[k], [(0.5 - 0.25) * 200, (0 - 0.25) * 100, (0.5 + 0.25) * 200, (0 + 0.25) * 100],
                               atol=1e-5)


@pytest.mark.parametrize("decoder, shape", [(decode_yolov8, (1, 3, 10)), (decode_yolov5, (1, 10, 5)),
                                            (decode_fastestdet, (1, 85, 22)), (decode_yolov8, (1, 84, 8400, 1))])
def test_a_decoder_names_the_layout_it_expects(decoder, shape):
    with pytest.raises(ValueError, match="expects .*the model gives"):
        decoder(np.zeros(shape, np.float32), (64, 64))


def test_a_user_decoder_from_a_file(tmp_path):
    f = tmp_path / "my_head.py"
    f.write_text("import numpy as np\n"
                 "def decode(output, input_hw):\n"
                 "    return [(np.array([[1., 2., 11., 12.]]), np.array([0.5]), np.array([2])) for _ in output]\n"
                 "def final(output, input_hw):\n"
                 "    return [(np.array([[1., 2., 11., 12.], [1., 2., 11., 12.]]), np.array([0.5, 0.4]), np.array([2, 2]))"
                 " for _ in output]\n"
                 "final.FINAL = True\n")
    dets = postprocess(load_decoder(f"{f}:decode"), np.zeros((2, 1)), (32, 32), 0.001, 0.5, 100, 3)
    assert len(dets) == 2 and dets[0][2].tolist() == [2]
    kept = postprocess(load_decoder(f"{f}:final"), np.zeros((1, 1)), (32, 32), 0.001, 0.5, 100, 3)
    assert len(kept[0][1]) == 2  # FINAL: its own NMS, kept as it is
    with pytest.raises(ValueError, match="class 2, outside the 2 classes"):
        postprocess(load_decoder(f"{f}:decode"), np.zeros((1, 1)), (32, 32), 0.001, 0.5, 100, 2)
    from qdeploy.errors import ConfigError
    with pytest.raises(ConfigError, match="has no function nope"):
        load_decoder(f"{f}:nope")


# -------------------------------------------------------------------------------------------- geometry, tables
def test_letterbox_geometry_is_ultralytics():
    # 640x480 into 352x352: r = 0.55, 352x264, 44 pixels of grey above and below
    assert letterbox_geometry(640, 480, (352, 352)) == (352, 264, 0, 44)
    pre = Preprocess(input_size=[352, 352], letterbox=True)
    assert box_geometry(640, 480, pre) == pytest.approx((0.55, 0.55, 0.0, 44.0))
    assert box_geometry(640, 480, Preprocess(input_size=[352, 352])) == pytest.approx((0.55, 352 / 480, 0, 0))


def test_letterboxed_image_is_padded_grey_and_centred():
    from PIL import Image

    from qdeploy.data.transforms import image_to_array

    img = Image.new("RGB", (64, 32), (200, 10, 10))
    arr = image_to_array(img, Preprocess(input_size=[64, 64], letterbox=True), "x.png")
    assert arr.shape == (3, 64, 64)
    assert (arr[:, :16] == 114).all() and (arr[:, 48:] == 114).all()  # 16 rows above, 16 below
    assert (arr[0, 16:48] == 200).all()


def _bound_task(decoder):
    spec = ModelSpec(source="x.onnx", task="detection", decode="yolov8",
                     preprocess={"input_size": [320, 320], "letterbox": True})
    task = get_task("detection").bind(spec)
    task.decoder = decoder
    return task


def test_boxes_come_back_to_the_original_image_through_the_letterbox():
    """A 640x480 image letterboxed into 320x320 (scale 0.5, 40 pixels of padding above): a detection at model pixels
    (100, 90)-(150, 140) is (200, 100)-(300, 200) in the original image, and scores AP 1 against that ground truth."""
    geometry = box_geometry(640, 480, Preprocess(input_size=[320, 320], letterbox=True))
    assert geometry == pytest.approx((0.5, 0.5, 0.0, 40.0))
    table = label_table(640, 480, geometry, np.array([[200, 100, 300, 200]]), np.array([1]), max_boxes=3)
    assert table.shape == (4, 7) and table[0, LABELLED] == 1 and table[2:, 0].tolist() == [-1, -1]
    task = _bound_task(lambda out, hw: [(np.array([[100, 90, 150, 140]], np.float32), np.array([0.9]), np.array([1]))])
    ev = task.make_metrics(class_names=["a", "b"])
    ev.update(np.zeros((1, 1), np.float32), table[None])
    np.testing.assert_allclose(ev.predictions[0, 0, :4], [200, 100, 300, 200])
    r = ev.result()
    assert r["map"] == pytest.approx(1.0) and r["per_class_ap"] == {"a": None, "b": pytest.approx(1.0)}


def test_an_unlabelled_image_counts_for_agreement_not_for_map():
    task = _bound_task(lambda out, hw: [(np.array([[1, 1, 9, 9]], np.float32), np.array([0.9]), np.array([0]))])
    ev = task.make_metrics(class_names=["a"])
    ev.update(np.zeros((1, 1), np.float32), unlabelled_table(np.zeros((3, 32, 32), np.uint8))[None])
    assert ev.result()["map"] is None and ev.result()["samples"] == 1
    assert ev.predictions.agreement_with(ev.predictions) == 1.0


# ------------------------------------------------------------------------------------------------------ agreement
def _preds(*images):
    a = np.zeros((len(images), 5, 6), np.float32)
    a[:, :, 5] = -1
    for i, dets in enumerate(images):
        for k, d in enumerate(dets):
            a[i, k] = d
    return DetectionPredictions(a, 0.25)


def test_agreement_counts_lost_and_added_boxes_but_not_a_score_at_the_threshold():
    ref = _preds([(0, 0, 10, 10, 0.9, 0), (20, 20, 30, 30, 0.6, 1)], [(0, 0, 10, 10, 0.3, 2)])
    assert ref.agreement_with(ref) == 1.0
    lost = _preds([(0, 0, 10, 10, 0.9, 0)], [(0, 0, 10, 10, 0.3, 2)])
    assert lost.agreement_with(ref) == pytest.approx(2 / 3)
    added = _preds([(0, 0, 10, 10, 0.9, 0), (20, 20, 30, 30, 0.6, 1), (40, 40, 50, 50, 0.8, 0)],
                   [(0, 0, 10, 10, 0.3, 2)])
    assert added.agreement_with(ref) == pytest.approx(3 / 4)
    wrong_class = _preds([(0, 0, 10, 10, 0.9, 1), (20, 20, 30, 30, 0.6, 1)], [(0, 0, 10, 10, 0.3, 2)])
    assert wrong_class.agreement_with(ref) == pytest.approx(2 / 4)
    flicker = _preds([(0, 0, 10, 10, 0.9, 0), (20, 20, 30, 30, 0.6, 1)], [(0, 0, 10, 10, 0.2, 2)])  # 0.3 → 0.2
    assert flicker.agreement_with(ref) == 1.0
    halved = _preds([(0, 0, 10, 10, 0.9, 0), (20, 20, 30, 30, 0.6, 1)], [(0, 0, 10, 10, 0.1, 2)])   # 0.3 → 0.1
    assert halved.agreement_with(ref) == pytest.approx(2 / 3)
    assert ref[[1, 0]].agreement_with(ref[[1, 0]]) == 1.0  # a subset stays DetectionPredictions
    from qdeploy.evaluate.metrics import agreement
    assert agreement(lost, ref) == pytest.approx(2 / 3)


def test_matching_uses_each_box_once():
    r = (np.array([[0, 0, 10, 10], [0, 0, 10, 10]], np.float32), np.array([0, 0]))
    o = (np.array([[0, 0, 10, 10]], np.float32), np.array([0]))
    assert matched(r, o) == (1, 2)


# ---------------------------------------------------------------------------------------- mAP's paired bootstrap
def _split(seed, noise):
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for _ in range(40):
        k = int(rng.integers(1, 5))
        xy = rng.random((k, 2)) * 300
        gt = np.concatenate([xy, xy + rng.random((k, 2)) * 80 + 10], 1)
        cls = rng.integers(0, 3, k)
        gts.append((gt, cls))
        dets.append((gt + np.random.default_rng(seed + 1).normal(0, noise, gt.shape), rng.random(k), cls))
    return gts, dets


def _metrics(gts, dets):
    m = DetectionMetrics(["a", "b", "c"])
    for (gt, gc), (db, ds, dc) in zip(gts, dets):
        m.update(gt, gc, db, ds, dc, (400, 400))
    return m


def test_bootstrap_map_equals_cocoeval_and_finds_a_real_drop():
    gts, good = _split(0, 2.0)
    _, bad = _split(0, 12.0)
    ref, worse = _metrics(gts, good), _metrics(gts, bad)
    assert mean_ap(class_matches(ref), np.ones(40)) == pytest.approx(ref.result()["map"], abs=1e-12)
    change = map_change(ref, worse, resamples=300)
    assert change["verdict"] == "worse" and change["drop_points"] > 5 and change["ci_low_points"] > 0
    same = map_change(ref, _metrics(gts, good), resamples=100)
    assert same["verdict"] == "no detectable change" and same["drop_points"] == 0


def test_metrics_of_detections_reads_the_tables():
    table = label_table(100, 100, (1, 1, 0, 0), np.array([[10, 10, 50, 50]]), np.array([0]), 1)
    pred = _preds([(10, 10, 50, 50, 0.9, 0)])[:1]
    assert metrics_of_detections(table[None], pred, ["a"]).result()["map"] == pytest.approx(1.0)


# -------------------------------------------------------------------------------------------------------- config
def test_detection_config_rules():
    pre = {"input_size": [64, 64]}
    with pytest.raises(ValidationError, match="needs model.decode"):
        ModelSpec(source="m.onnx", task="detection", preprocess=pre)
    with pytest.raises(ValidationError, match="applies to task detection only"):
        ModelSpec(source="m.onnx", task="classification", decode="yolov8", preprocess=pre)
    with pytest.raises(ValidationError, match="neither a built-in decoder"):
        ModelSpec(source="m.onnx", task="detection", decode="yolov99", preprocess=pre)
    with pytest.raises(ValidationError, match="crop would cut boxes"):
        ModelSpec(source="m.onnx", task="detection", decode="yolov8", preprocess={"input_size": [64, 64], "crop": 64})
    with pytest.raises(ValidationError, match="letterbox scales and pads"):
        Preprocess(input_size=[64, 64], resize=70, letterbox=True)
    spec = ModelSpec(source="m.onnx", task="detection", decode="head.py:decode", preprocess=pre)
    assert spec.nms.iou_threshold == 0.6 and spec.nms.max_detections == 100


def test_the_task_sets_the_agreement_floor():
    from qdeploy.config import RunConfig

    cfg = RunConfig(model={"source": "m.onnx", "task": "detection", "decode": "yolov8", "preprocess": {"input_size": [8, 8]}},
                    data={"eval": {"format": "voc", "root": "x", "classes": ["a"]}}, optimize={"target": "cpu"})
    assert cfg.eval.min_agreement == 0.8 and cfg.optimize.budget.floor == 0.8
    cls = RunConfig(model={"source": "m.onnx", "preprocess": {"input_size": [8, 8]}}, data={"eval": {"root": "x"}},
                    eval={"min_agreement": 0.7})
    assert cls.eval.min_agreement == 0.7


# ------------------------------------------------------------------------------------------ a user's opset-11 ONNX
def test_an_opset_11_onnx_is_upgraded_in_the_cache_and_the_users_file_untouched(tmp_path):
    from qdeploy.export.onnx import use_onnx_file

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1)).eval()
    path = tmp_path / "det.onnx"
    torch.onnx.export(model, torch.zeros(1, 3, 16, 16), str(path), opset_version=11, dynamo=False,
                      input_names=["x"], output_names=["y"])
    before = path.read_bytes()
    art = use_onnx_file(str(path), tmp_path / "cache")
    assert art.opset == 13 and art.path != path and path.read_bytes() == before
    assert next(o.version for o in onnx.load(str(art.path)).opset_import if o.domain in ("", "ai.onnx")) == 13
    x = np.random.default_rng(0).random((1, 3, 16, 16), dtype=np.float32)
    a = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    b = ort.InferenceSession(str(art.path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert use_onnx_file(str(path), tmp_path / "cache").path == art.path  # cached


# ------------------------------------------------------------------------------------- FastestDet, ../shared, run
@pytest.mark.realdata
@pytest.mark.slow
def test_fastestdet_fp32_map_equals_an_evaluation_written_without_qdeploy(tmp_path):
    if not (SHARED / "models/detection/fastestdet/FastestDet.onnx").is_file():
        pytest.skip("../shared/models/detection/fastestdet is absent")
    pytest.importorskip("cv2", reason="the independent evaluation and cv2-linear resize need opencv-python-headless")
    spec = importlib.util.spec_from_file_location("fastestdet_independent_eval", ROOT / "bench/suites/fastestdet_independent_eval.py")
    indep = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = indep
    spec.loader.exec_module(indep)
    expected = indep.evaluate(SHARED / "models/detection/fastestdet/FastestDet.onnx", SHARED / "data/detection/fruit-test",
                              SHARED / "models/detection/fastestdet/coco.names")

    import yaml

    from qdeploy.cli import main
    # the example as it stands (its paths made absolute), with 32 of its 256 calibration images and a short timing:
    # only FP32's mAP is compared with a number here, the INT8 variants need only be built, measured and compared
    example = ROOT / "examples/detection_fastestdet_fruit.yaml"
    cfg = yaml.safe_load(example.read_text())
    at = lambda p: str((example.parent / p).resolve())  # noqa: E731
    cfg["model"]["source"] = at(cfg["model"]["source"])
    cfg["data"]["eval"].update(root=at(cfg["data"]["eval"]["root"]), classes=at(cfg["data"]["eval"]["classes"]))
    cfg["data"]["calibration"].update(root=at(cfg["data"]["calibration"]["root"]), count=32)
    cfg["bench"] = {"batch_sizes": [1], "warmup": 1, "iterations": 5}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    assert main(["run", str(tmp_path / "c.yaml"), "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) in (0, 1)
    results = json.loads((out / "results.json").read_text())
    rows = {v["name"]: v for v in results["variants"]}
    fp32 = rows["onnxruntime-fp32"]["metrics"]
    assert fp32["map"] == pytest.approx(expected["map"], abs=1e-4)
    assert fp32["map50"] == pytest.approx(expected["map50"], abs=1e-4)
    assert fp32["per_class_ap"]["banana"] is not None and fp32["samples"] == 60
    int8 = [v for v in results["variants"] if v.get("precision") == "int8"]
    assert {v["quantization"]["placement"] for v in int8} == {"onnxruntime", "tensorrt"}
    for v in int8:  # each INT8 variant measured, its change tested by the bootstrap, its agreement given
        assert v["metrics"]["map"] is not None and v["agreement"] is not None
        assert v["accuracy_change"]["test"] == "paired bootstrap over images"
    # the report: per-class AP of the classes present, and the picture of a few images with every variant's boxes
    assert len(results["examples"]) == 4 and set(results["examples"][0]["detections"]) == set(rows)
    html = (out / "report.html").read_text()
    assert "Per-class AP@0.5:0.95 %" in html and "Detections, reference and INT8" in html
    i = html.index("Detections, reference and INT8")
    assert html.rfind("data:image/png;base64,", 0, i) > html.find("Per-class AP@0.5:0.95 %")


# ------------------------------------------------------------------------------------ placement of the prediction head
class _Head(torch.nn.Module):
    """A FastestDet-like head: backbone convs, then obj (sigmoid), box (raw) and class (softmax) convs concatenated."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())
        self.obj, self.box, self.cls = torch.nn.Conv2d(8, 1, 1), torch.nn.Conv2d(8, 4, 1), torch.nn.Conv2d(8, 3, 1)

    def forward(self, x):
        h = self.body(x)
        return torch.cat([torch.sigmoid(self.obj(h)), self.box(h), torch.softmax(self.cls(h), 1)], 1)


def _onnx_of(model, tmp_path, name):
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(model.eval(), torch.zeros(1, 3, 16, 16), str(path), opset_version=13, dynamo=False)
    return onnx.load(str(path))


def test_the_prediction_head_stays_float_and_classifiers_and_segmenters_do_not_change(tmp_path):
    from qdeploy.lint.placement import placement_plan, prediction_head

    det = _onnx_of(_Head(), tmp_path, "det")
    for placement in ("tensorrt", "onnxruntime"):
        plan = placement_plan(det, placement)
        rules = {n.op_type + ":" + (plan.decisions[n.name].rule if n.name in plan.decisions else "-") for n in det.graph.node}
        assert {"Conv:conv", "Conv:prediction-conv"} <= rules  # the backbone's convs stay INT8
        convs = [n for n in det.graph.node if n.op_type == "Conv"]
        assert [plan.decisions[n.name].rule for n in convs].count("prediction-conv") == 3
        assert "Concat:prediction-output" in rules and "Sigmoid:prediction-output" in rules
    cls = _onnx_of(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                       torch.nn.Flatten(), torch.nn.Linear(8, 5), torch.nn.Softmax(1)), tmp_path, "cls")
    seg = _onnx_of(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 1),
                                       torch.nn.Upsample(scale_factor=2, mode="bilinear")), tmp_path, "seg")
    from qdeploy.lint.qdq_graph import QdqGraph
    assert prediction_head(QdqGraph(cls)) == (set(), set()) and prediction_head(QdqGraph(seg)) == (set(), set())


class _SsdHead(torch.nn.Module):
    """An SSD-style head written as torchvision's SSD decodes: box deltas decoded against batch-tiled anchors by
    torchvision's own BoxCoder (centre = x1 + 0.5·w: an Add of two activations), clamped to the image, then
    concatenated with softmax scores."""

    def __init__(self):
        super().__init__()
        from torchvision.models.detection._utils import BoxCoder

        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())
        self.box, self.cls = torch.nn.Conv2d(8, 4, 1), torch.nn.Conv2d(8, 3, 1)
        self.coder = BoxCoder((10.0, 10.0, 5.0, 5.0))
        xy = torch.stack(torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="xy"), -1).reshape(-1, 2)
        self.register_buffer("anchors", torch.cat([xy - 2, xy + 2], 1), persistent=False)

    def forward(self, x):
        h = self.body(x)
        n = x.shape[0]
        deltas = self.box(h).flatten(2).transpose(1, 2)
        boxes = self.coder.decode_single(deltas.reshape(-1, 4), self.anchors.repeat(n, 1)).reshape(n, -1, 4)
        scores = torch.softmax(self.cls(h).flatten(2).transpose(1, 2), -1)
        return torch.cat([boxes.clamp(0, 16), scores], -1)


def test_an_ssd_box_decoding_behind_a_clamp_stays_float(tmp_path):
    """The walk from the output passes the clamp of the boxes (Clip): the anchor arithmetic is decoding, not a residual
    Add (one INT8 scale over pixel coordinates took torchvision's SSDlite on BCCD from mAP 40.3 to 8.7)."""
    from qdeploy.lint.placement import placement_plan

    det = _onnx_of(_SsdHead(), tmp_path, "ssd")
    assert "Clip" in {n.op_type for n in det.graph.node}
    for placement in ("tensorrt", "onnxruntime"):
        plan = placement_plan(det, placement)
        rule = {n.name: plan.decisions[n.name].rule for n in det.graph.node if n.name in plan.decisions}
        convs = [n.name for n in det.graph.node if n.op_type == "Conv"]
        assert [rule[c] == "prediction-conv" for c in convs] == [False, False, True, True]  # the box and class convs
        adds = [n.name for n in det.graph.node if n.op_type == "Add"]
        assert adds and all(rule.get(a) == "prediction-output" for a in adds), {a: rule.get(a) for a in adds}
        assert not plan.int8_compute() or set(plan.int8_compute()) <= set(convs[:2])


@pytest.mark.slow
def test_a_tensorrt_detector_variant_says_where_its_nms_runs(tmp_path):
    """Without TensorRT the variant is skipped, and still gets its trtexec lines and where the NMS runs."""
    from qdeploy.cli import main

    if not (SHARED / "models/detection/fastestdet/FastestDet.onnx").is_file():
        pytest.skip("../shared/models/detection/fastestdet is absent")
    (tmp_path / "voc").mkdir()
    from PIL import Image
    for i in range(2):
        Image.new("RGB", (64, 48), (i * 60, 90, 120)).save(tmp_path / "voc" / f"{i}.png")
        (tmp_path / "voc" / f"{i}.xml").write_text(
            f"<annotation><filename>{i}.png</filename><size><width>64</width><height>48</height></size><object>"
            "<name>apple</name><bndbox><xmin>5</xmin><ymin>5</ymin><xmax>30</xmax><ymax>30</ymax></bndbox></object>"
            "</annotation>")
    cfg = {"model": {"source": str(SHARED / "models/detection/fastestdet/FastestDet.onnx"), "task": "detection",
                     "decode": "fastestdet", "preprocess": {"input_size": [352, 352], "channel_order": "BGR"}},
           "data": {"eval": {"format": "voc", "root": str(tmp_path / "voc"), "batch_size": 1,
                             "classes": str(SHARED / "models/detection/fastestdet/coco.names")}},
           "variants": [{"engine": "tensorrt", "precision": "fp16"}], "bench": {"batch_sizes": [1], "iterations": 2}}
    import yaml
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--quiet", "run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) in (0, 1)
    v = json.loads((tmp_path / "out" / "results.json").read_text())["variants"][0]
    assert v["trtexec"] and "NMS" in v["details"]["postprocess"] and "EfficientNMS_TRT" in v["details"]["postprocess"]


@pytest.mark.realdata
@pytest.mark.slow
def test_the_bccd_detector_trained_here_reaches_its_recorded_map(tmp_path):
    """bench/weights/bccd_yolo.pt (bench/train/train_bccd.py) through qdeploy: BCCD's test split, FP32 in PyTorch,
    mAP@0.5 ≥ 0.80 (the detection task's acceptance bar) and equal to what the training script recorded
    (bench/weights/bccd_yolo.json)."""
    if not (SHARED / "data/detection/bccd").is_dir():
        pytest.skip("../shared/data/detection/bccd is absent")
    import yaml

    from qdeploy.cli import main

    cfg = yaml.safe_load((ROOT / "examples/detection_bccd.yaml").read_text())
    cfg["variants"] = [{"engine": "torch", "precision": "fp32"}]
    cfg["data"].pop("calibration")
    cfg["bench"] = {"batch_sizes": [1], "iterations": 2, "warmup": 1}
    cfg["model"]["source"] = str(ROOT / "bench/train/bccd_models.py:bccd_yolo")
    cfg["model"]["weights"] = str(ROOT / "bench/weights/bccd_yolo.pt")
    cfg["data"]["eval"]["root"] = str(SHARED / "data/detection/bccd")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--quiet", "run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"),
                 "--cache-dir", str(tmp_path / "cache")]) in (0, 1)
    m = json.loads((tmp_path / "out" / "results.json").read_text())["variants"][0]["metrics"]
    recorded = json.loads((ROOT / "bench/weights/bccd_yolo.json").read_text())["test_split"]
    assert m["map50"] >= 0.80
    assert m["map50"] == pytest.approx(recorded["map50"], abs=2e-3) and m["map"] == pytest.approx(recorded["map"], abs=2e-3)
