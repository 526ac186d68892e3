"""Issue 37: a real detector with NMS inside its ONNX graph, end to end — the BCCD detector trained here
(bench/weights/bccd_yolo.pt) exported as its users' end-to-end exports write it, then `qdeploy run` with
`model.decode: onnx-nms` (FP32 and INT8 of both placements, ONNX Runtime, BCCD's test split).

  python bench/suites/graph_nms_bccd.py --out runs/graph-nms [--kind trt|onnx]

The export: torch.onnx.export of the raw head (N, 4 + 3, A: cx cy w h in input pixels, sigmoid class scores), then
the head transposed and sliced into boxes (N, A, 4) and scores, fed to
- ``trt``: TensorRT's EfficientNMS_TRT node (YOLOv8-TensorRT's export: box_coding 1, score_activation 0, IoU 0.6,
  score 0.001, 100 per image: the thresholds of a mAP evaluation), which ONNX Runtime cannot run: qdeploy cuts it off;
- ``onnx``: ONNX's NonMaxSuppression (center_point_box 1, same thresholds, 100 per class).
The same weights with `decode: yolov8` (one class per box) are run beside it for comparison; the NMS graph's
candidates are every (box, class) pair, as the operators take them, so its mAP may differ slightly.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
import yaml
from onnx import helper, numpy_helper

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "train"      # bccd_models.py
WEIGHTS = HERE.parent / "weights"  # bccd_yolo.pt
SHARED = Path(os.environ.get("QDEPLOY_SHARED", HERE.parents[2] / "shared"))
BCCD = SHARED / "data" / "detection" / "bccd"


def export(kind: str, out: Path) -> Path:
    sys.path.insert(0, str(TRAIN))
    import bccd_models

    model = bccd_models.bccd_yolo()
    sd = torch.load(WEIGHTS / "bccd_yolo.pt", map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
    raw = out / "bccd_yolo_raw.onnx"
    torch.onnx.export(model.eval(), torch.rand(1, 3, 320, 320), str(raw), input_names=["images"], output_names=["head"],
                      opset_version=17, dynamo=False, dynamic_axes={"images": {0: "n"}, "head": {0: "n"}})
    m = onnx.load(str(raw))
    g = m.graph
    classes = 3

    def const(name, arr):
        g.initializer.append(numpy_helper.from_array(np.asarray(arr), name))

    const("s0", np.array([0], np.int64)), const("s4", np.array([4], np.int64))
    const("s_end", np.array([4 + classes], np.int64)), const("ax2", np.array([2], np.int64))
    g.node.extend([helper.make_node("Transpose", ["head"], ["t"], perm=[0, 2, 1]),
                   helper.make_node("Slice", ["t", "s0", "s4", "ax2"], ["boxes"]),
                   helper.make_node("Slice", ["t", "s4", "s_end", "ax2"], ["scores"])])
    del g.output[:]
    if kind == "trt":
        g.node.append(helper.make_node("EfficientNMS_TRT", ["boxes", "scores"],
                                       ["num_dets", "det_boxes", "det_scores", "det_classes"], name="EfficientNMS_TRT",
                                       background_class=-1, box_coding=1, iou_threshold=0.6, max_output_boxes=100,
                                       plugin_version="1", score_activation=0, score_threshold=0.001))
        for name, t in (("num_dets", onnx.TensorProto.INT32), ("det_boxes", onnx.TensorProto.FLOAT),
                        ("det_scores", onnx.TensorProto.FLOAT), ("det_classes", onnx.TensorProto.INT32)):
            g.output.append(helper.make_tensor_value_info(name, t, None))
    else:
        const("max_out", np.array([100], np.int64)), const("iou", np.array([0.6], np.float32))
        const("score", np.array([0.001], np.float32))
        g.node.extend([helper.make_node("Transpose", ["scores"], ["scores_nca"], perm=[0, 2, 1]),
                       helper.make_node("NonMaxSuppression", ["boxes", "scores_nca", "max_out", "iou", "score"],
                                        ["selected"], center_point_box=1, name="NonMaxSuppression")])
        g.output.append(helper.make_tensor_value_info("selected", onnx.TensorProto.INT64, [None, 3]))
    path = out / f"bccd_yolo_{kind}_nms.onnx"
    onnx.save(m, str(path))
    return path


def config(source: str, decode: str, weights=None) -> dict:
    data = {"format": "voc", "root": str(BCCD), "classes": ["RBC", "WBC", "Platelets"], "batch_size": 8,
            "bad_boxes": "skip"}
    return {"model": {"source": source, **({"weights": weights} if weights else {}), "task": "detection",
                      "decode": decode, "preprocess": {"input_size": [320, 320], "letterbox": True}},
            "data": {"eval": {**data, "split": "test"}, "calibration": {**data, "split": "train"}},
            "variants": [{"engine": "onnxruntime", "precision": "fp32"},
                         {"engine": "onnxruntime", "precision": "int8", "placement": "onnxruntime"},
                         {"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt"}],
            "bench": {"batch_sizes": [8], "warmup": 3, "iterations": 20}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/graph-nms"))
    ap.add_argument("--kind", choices=["trt", "onnx"], default="trt")
    args = ap.parse_args()
    if not BCCD.is_dir():
        raise SystemExit(f"skipped: {BCCD} is absent (../shared's BCCD)")
    args.out.mkdir(parents=True, exist_ok=True)
    model = export(args.kind, args.out)
    rows = {}
    for name, cfg in (("onnx-nms", config(str(model), "onnx-nms")),
                      ("yolov8 (same weights, raw head)", config(f"{TRAIN / 'bccd_models.py'}:bccd_yolo", "yolov8",
                                                                  str(WEIGHTS / "bccd_yolo.pt")))):
        c = args.out / f"{'nms' if name == 'onnx-nms' else 'raw'}.yaml"
        c.write_text(yaml.safe_dump(cfg))
        run = args.out / c.stem
        p = subprocess.run([sys.executable, "-m", "qdeploy", "run", str(c), "--out", str(run)], text=True)
        res = json.loads((run / "results.json").read_text())
        rows[name] = {v["name"]: {k: v.get("metrics", {}).get(k) for k in ("map", "map50")} | {"status": v["status"]}
                      for v in res["variants"]}
        print(f"{name} (exit {p.returncode}): {json.dumps(rows[name])}", flush=True)
    (args.out / "graph_nms_bccd.json").write_text(json.dumps({"kind": args.kind, "model": str(model), "rows": rows},
                                                             indent=1))


if __name__ == "__main__":
    main()
