"""A detector exported with NMS inside its ONNX graph (``model.decode: onnx-nms``, issue 37): ONNX NonMaxSuppression
and TensorRT's EfficientNMS_TRT nodes, built here the way end-to-end exports write them onto a real exported head.

What is checked: the node's settings are read (box coding, thresholds, per-image maximum, class-agnostic); the graph
cut at the node gives exactly the head's boxes and scores; qdeploy's detections on the cut graph are the ones ONNX
Runtime's own NonMaxSuppression selects in the uncut graph; the CLI evaluates such a model end to end, and refuses the
mismatches (another decoder on an NMS graph, onnx-nms without NMS or without ONNX) with one line, exit 2.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import yaml
from onnx import helper, numpy_helper
from PIL import Image
from torch import nn

from qdeploy.cli import main
from qdeploy.config import ModelSpec
from qdeploy.errors import ModelError
from qdeploy.export.onnx import use_onnx_file
from qdeploy.tasks.detection_nms_graph import HEAD_OUTPUT, cut_at_nms, find_graph_nms
from qdeploy.tasks.detection import graph_nms_settings
from qdeploy.tasks.detection_decode import postprocess

pytestmark = pytest.mark.fast

A, C, SIZE = 64, 3, 32  # anchors (an 8x8 grid), classes, input pixels


class Head(nn.Module):
    """A YOLOv8-style head: (N, 4 + C, A), cx cy w h in input pixels, then C sigmoid class scores."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(8))
        self.head = nn.Conv2d(16, 4 + C, 1)
        gy, gx = torch.meshgrid(torch.arange(8.0), torch.arange(8.0), indexing="ij")
        self.register_buffer("grid", torch.stack([gx, gy]).reshape(1, 2, A))  # each anchor's cell, as YOLO's

    def forward(self, x):
        h = self.head(self.body(x)).flatten(2)
        cxcy = (self.grid + torch.sigmoid(h[:, :2])) * (SIZE / 8)
        wh = torch.sigmoid(h[:, 2:4]) * SIZE / 3
        return torch.cat([cxcy, wh, torch.sigmoid(h[:, 4:] * 3)], 1)


def _raw_head(path: Path) -> Path:
    torch.onnx.export(Head().eval(), torch.rand(1, 3, SIZE, SIZE), str(path), input_names=["images"],
                      output_names=["head"], opset_version=13, dynamo=False,
                      dynamic_axes={"images": {0: "n"}, "head": {0: "n"}})
    return path


def _append(raw: Path, out: Path, kind: str, iou=0.5, score=0.05, max_boxes=1000, center=True, agnostic=False):
    """The raw head's graph with an NMS node appended, as end-to-end exports write it: boxes (N, A, 4) and scores
    ((N, C, A) for NonMaxSuppression, (N, A, C) for EfficientNMS_TRT) sliced from the transposed head."""
    m = onnx.load(str(raw))
    g = m.graph
    const = lambda name, arr: g.initializer.append(numpy_helper.from_array(np.asarray(arr), name))  # noqa: E731
    const("s0", np.array([0], np.int64)), const("s4", np.array([4], np.int64)), const("s_end", np.array([4 + C], np.int64))
    const("ax2", np.array([2], np.int64))
    g.node.extend([
        helper.make_node("Transpose", ["head"], ["t"], perm=[0, 2, 1], name="to_nac"),
        helper.make_node("Slice", ["t", "s0", "s4", "ax2"], ["boxes_cxcywh"], name="boxes"),
        helper.make_node("Slice", ["t", "s4", "s_end", "ax2"], ["scores_nac"], name="scores"),
    ])
    boxes = "boxes_cxcywh"
    if not center:  # corners, computed in the graph
        const("half", np.array([0.5], np.float32))
        const("s2", np.array([2], np.int64))
        g.node.extend([
            helper.make_node("Slice", ["boxes_cxcywh", "s0", "s2", "ax2"], ["cxcy"]),
            helper.make_node("Slice", ["boxes_cxcywh", "s2", "s4", "ax2"], ["wh"]),
            helper.make_node("Mul", ["wh", "half"], ["half_wh"]),
            helper.make_node("Sub", ["cxcy", "half_wh"], ["xy0"]),
            helper.make_node("Add", ["cxcy", "half_wh"], ["xy1"]),
            helper.make_node("Concat", ["xy0", "xy1"], ["boxes_xyxy"], axis=2),
        ])
        boxes = "boxes_xyxy"
    del g.output[:]
    if kind == "onnx":
        const("max_out", np.array([max_boxes], np.int64)), const("iou", np.array([iou], np.float32))
        const("score", np.array([score], np.float32))
        g.node.extend([
            helper.make_node("Transpose", ["scores_nac"], ["scores_nca"], perm=[0, 2, 1]),
            helper.make_node("NonMaxSuppression", [boxes, "scores_nca", "max_out", "iou", "score"], ["selected"],
                             center_point_box=1 if center else 0, name="nms"),
        ])
        g.output.append(helper.make_tensor_value_info("selected", onnx.TensorProto.INT64, [None, 3]))
    else:  # TensorRT's plugin node, as YOLOv8-TensorRT's export writes it (no domain: TensorRT finds it by name)
        g.node.append(helper.make_node(
            "EfficientNMS_TRT", [boxes, "scores_nac"], ["num_dets", "det_boxes", "det_scores", "det_classes"],
            name="batched_nms", background_class=-1, box_coding=1 if center else 0, iou_threshold=iou,
            max_output_boxes=max_boxes, plugin_version="1", score_activation=0, score_threshold=score,
            class_agnostic=1 if agnostic else 0))
        for name, t in (("num_dets", onnx.TensorProto.INT32), ("det_boxes", onnx.TensorProto.FLOAT),
                        ("det_scores", onnx.TensorProto.FLOAT), ("det_classes", onnx.TensorProto.INT32)):
            g.output.append(helper.make_tensor_value_info(name, t, None))
    onnx.save(m, str(out))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("graph_nms")
    raw = _raw_head(d / "raw.onnx")
    return {"dir": d, "raw": raw,
            "onnx": _append(raw, d / "onnx_nms.onnx", "onnx", iou=0.5, score=0.05),
            "onnx_corners": _append(raw, d / "onnx_nms_xyxy.onnx", "onnx", iou=0.45, score=0.1, center=False),
            "trt": _append(raw, d / "trt_nms.onnx", "trt", iou=0.6, score=0.2, max_boxes=50, agnostic=True)}


def test_the_nms_node_settings_are_read(models):
    g = find_graph_nms(onnx.load(str(models["onnx"])))
    assert (g.op, g.box_coding, g.scores_layout, g.iou_threshold, g.max_detections) == \
        ("NonMaxSuppression", "cxcywh", "NCA", 0.5, None)
    assert g.score_threshold == pytest.approx(0.05)
    g = find_graph_nms(onnx.load(str(models["onnx_corners"])))
    assert g.box_coding == "xyxy" and g.iou_threshold == pytest.approx(0.45)
    g = find_graph_nms(onnx.load(str(models["trt"])))
    assert (g.op, g.box_coding, g.scores_layout, g.max_detections, g.class_agnostic) == \
        ("EfficientNMS_TRT", "cxcywh", "NAC", 50, True)
    assert g.iou_threshold == pytest.approx(0.6) and g.score_threshold == pytest.approx(0.2)
    assert find_graph_nms(onnx.load(str(models["raw"]))) is None


@pytest.mark.parametrize("kind", ["onnx", "onnx_corners", "trt"])
def test_the_cut_graph_gives_the_heads_boxes_and_scores(models, kind):
    proto = onnx.load(str(models[kind]))
    cut = cut_at_nms(proto, find_graph_nms(proto))
    onnx.checker.check_model(cut)
    x = np.random.default_rng(1).random((2, 3, SIZE, SIZE), dtype=np.float32)
    got = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    head = ort.InferenceSession(str(models["raw"]), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    want = head.transpose(0, 2, 1).copy()
    if kind == "onnx_corners":
        want[..., :2], want[..., 2:4] = want[..., :2] - want[..., 2:4] / 2, want[..., :2] + want[..., 2:4] / 2
    assert got.shape == (2, A, 4 + C)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert len(cut.graph.output) == 1 and cut.graph.output[0].name == HEAD_OUTPUT
    assert not any(n.op_type in ("NonMaxSuppression", "EfficientNMS_TRT") for n in cut.graph.node)


@pytest.mark.parametrize("kind", ["onnx", "onnx_corners"])
def test_qdeploys_detections_are_the_ones_onnx_runtimes_nms_selects(models, kind, tmp_path):
    """The uncut graph in ONNX Runtime (its NonMaxSuppression kernel) and qdeploy's cut graph + class-wise NMS with the
    node's thresholds select the same (image, class, box) triples."""
    x = np.random.default_rng(2).random((3, 3, SIZE, SIZE), dtype=np.float32)
    selected = ort.InferenceSession(str(models[kind]), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    head = ort.InferenceSession(str(models["raw"]), providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
    boxes_cxcywh = head[:, :4].transpose(0, 2, 1)
    want = set()
    for b, c, a in selected:
        cx, cy, w, h = boxes_cxcywh[b, a]
        want.add((int(b), int(c), *np.round([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 3)))
    assert len(want) > 10  # the model keeps some boxes of several classes

    art = use_onnx_file(str(models[kind]), tmp_path / "cache", decode="onnx-nms")
    assert art.output_name == HEAD_OUTPUT
    out = ort.InferenceSession(str(art.path), providers=["CPUExecutionProvider"]).run(None, {art.input_name: x})[0]
    spec = ModelSpec(source=str(models[kind]), task="detection", decode="onnx-nms", nms={"max_detections": 100000},
                     preprocess={"input_size": [SIZE, SIZE]})
    decoder, nms = graph_nms_settings(spec)
    assert nms.max_detections == 100000 and nms.iou_threshold == find_graph_nms(onnx.load(str(models[kind]))).iou_threshold
    dets = postprocess(decoder, out, (SIZE, SIZE), nms.score_threshold, nms.iou_threshold, nms.max_detections, C,
                       nms.class_agnostic)
    got = {(i, int(c), *np.round(box, 3)) for i, (bx, _, cl) in enumerate(dets) for box, c in zip(bx, cl)}
    assert got == want


def test_efficient_nms_settings_reach_the_task(models):
    spec = ModelSpec(source=str(models["trt"]), task="detection", decode="onnx-nms",
                     preprocess={"input_size": [SIZE, SIZE]})
    decoder, nms = graph_nms_settings(spec)
    assert (nms.max_detections, nms.class_agnostic) == (50, True)
    assert nms.iou_threshold == pytest.approx(0.6) and nms.score_threshold == pytest.approx(0.2)
    # a setting the config names wins over the node's
    spec = ModelSpec(source=str(models["trt"]), task="detection", decode="onnx-nms", nms={"iou_threshold": 0.7},
                     preprocess={"input_size": [SIZE, SIZE]})
    assert graph_nms_settings(spec)[1].iou_threshold == pytest.approx(0.7)


def test_refused_graphs(models, tmp_path):
    with pytest.raises(ModelError, match="onnx-nms"):
        use_onnx_file(str(models["onnx"]), tmp_path / "c", decode="yolov8")
    with pytest.raises(ModelError, match="no NMS node"):
        use_onnx_file(str(models["raw"]), tmp_path / "c", decode="onnx-nms")
    m = onnx.load(str(models["trt"]))
    next(n for n in m.graph.node if n.op_type == "EfficientNMS_TRT").attribute.append(
        helper.make_attribute("background_class", 0))
    del_dup = [a for a in next(n for n in m.graph.node if n.op_type == "EfficientNMS_TRT").attribute
               if a.name == "background_class"]
    assert len(del_dup) == 2  # the appended one is read last
    bad = tmp_path / "background.onnx"
    onnx.save(m, str(bad))
    with pytest.raises(ModelError, match="background_class"):
        find_graph_nms(onnx.load(str(bad)), str(bad))


# ---- the CLI, end to end on a small VOC folder -------------------------------------------------------------------
def _project(root: Path, model: Path) -> Path:
    (root / "voc").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(root / "voc" / f"{i}.png")
        (root / "voc" / f"{i}.xml").write_text(
            f"<annotation><filename>{i}.png</filename><size><width>{SIZE}</width><height>{SIZE}</height><depth>3</depth>"
            "</size><object><name>a</name><bndbox><xmin>2</xmin><ymin>3</ymin><xmax>20</xmax><ymax>24</ymax></bndbox>"
            "</object><object><name>c</name><bndbox><xmin>10</xmin><ymin>8</ymin><xmax>30</xmax><ymax>30</ymax>"
            "</bndbox></object></annotation>")
    cfg = {"model": {"source": str(model), "task": "detection", "decode": "onnx-nms",
                     "preprocess": {"input_size": [SIZE, SIZE]}},
           "data": {"eval": {"format": "voc", "root": "voc", "classes": ["a", "b", "c"], "batch_size": 2, "workers": 0}},
           "variants": [{"engine": "onnxruntime"}],
           "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 2}}
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return root / "cfg.yaml"


def _run(cfg: Path, out: Path, capsys, monkeypatch, tmp_path) -> tuple[int, str]:
    monkeypatch.setenv("QDEPLOY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(cfg.parent)
    code = main(["run", str(cfg), "--out", str(out)])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_cli_runs_an_efficient_nms_model(models, tmp_path, capsys, monkeypatch):
    cfg = _project(tmp_path / "p", models["trt"])
    d = yaml.safe_load(cfg.read_text())
    d["variants"].append({"engine": "tensorrt", "precision": "fp16"})  # its trtexec lines and NMS note, without TensorRT
    cfg.write_text(yaml.safe_dump(d))
    code, text = _run(cfg, tmp_path / "out", capsys, monkeypatch, tmp_path)
    assert code in (0, 1), text[-3000:]  # 1: the TensorRT variant is skipped where TensorRT is not installed
    assert "EfficientNMS_TRT" in text
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    row = next(v for v in res["variants"] if v["engine"] == "onnxruntime")
    assert row["status"] == "ok" and row["metrics"]["map"] is not None
    note = next(v for v in res["variants"] if v["engine"] == "tensorrt")["details"]["postprocess"]
    assert "cut the graph" in note and "class-agnostic" in note and "IoU 0.6" in note and "50 per image" in note


@pytest.mark.parametrize("case, edit, needle", [
    ("another-decoder-on-an-nms-graph", {"decode": "yolov8"}, "onnx-nms"),
    ("onnx-nms-without-nms", {"source": "RAW"}, "no NMS node"),
    ("onnx-nms-on-a-pytorch-source", {"source": "torchvision:resnet18", "weights": "random"}, "not a .onnx"),
])
def test_cli_refuses(models, tmp_path, capsys, monkeypatch, case, edit, needle):
    cfg = _project(tmp_path / "p", models["trt"])
    d = yaml.safe_load(cfg.read_text())
    d["model"].update({k: (str(models["raw"]) if v == "RAW" else v) for k, v in edit.items()})
    cfg.write_text(yaml.safe_dump(d))
    code, text = _run(cfg, tmp_path / "out", capsys, monkeypatch, tmp_path)
    assert code == 2, text[-2000:]
    assert needle in text and "Traceback" not in text
    assert not (tmp_path / "out" / "results.json").exists()
    assert os.listdir(tmp_path / "p" / "voc")  # the user's data untouched
