"""FastestDet on fruit-test, evaluated without qdeploy: the check of issue 37's `qdeploy run
examples/detection_fastestdet_fruit.yaml` FP32 mAP.

    python bench/suites/fastestdet_independent_eval.py [--onnx ../shared/models/detection/fastestdet/FastestDet.onnx]
        [--data ../shared/data/detection/fruit-test] [--json OUT.json]

Written from the authors' code (dog-qiuqiu/FastestDet @ 50473cd: test.py's preprocessing, utils/tool.py handle_preds with
the evaluation's conf_thresh 0.001 and its default nms_thresh 0.45), sharing no code with qdeploy: cv2.imread (BGR) →
cv2.resize INTER_LINEAR to 352x352 → /255 → ONNX Runtime → handle_preds (torch) → boxes scaled to the original image
→ ground truth from the VOC XMLs (ElementTree; the image's own size where an XML gives 0) → COCO JSON files on disk
→ pycocotools COCOeval (bbox). Class ids: COCO-80 order of coco.names (apple 47, banana 46, orange 49).
Needs opencv-python-headless (the test extra) and ../shared.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import torch
import torchvision

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared"


def handle_preds(preds: torch.Tensor, conf_thresh: float = 0.001, nms_thresh: float = 0.45) -> list:
    """The authors' utils/tool.py handle_preds (normalized xyxy, score, class per kept box), vectorised."""
    n, c, h, w = preds.shape
    pred = preds.permute(0, 2, 3, 1)
    pobj, preg, pcls = pred[..., 0], pred[..., 1:5], pred[..., 5:]
    score = (pobj ** 0.6) * (pcls.max(dim=-1)[0] ** 0.4)
    cls = pcls.argmax(dim=-1).float()
    gy, gx = torch.meshgrid([torch.arange(h), torch.arange(w)], indexing="ij")
    bw, bh = preg[..., 2].sigmoid(), preg[..., 3].sigmoid()
    bcx = (preg[..., 0].tanh() + gx) / w
    bcy = (preg[..., 1].tanh() + gy) / h
    boxes = torch.stack([bcx - 0.5 * bw, bcy - 0.5 * bh, bcx + 0.5 * bw, bcy + 0.5 * bh, score, cls], -1).reshape(n, -1, 6)
    out = []
    for p in boxes:
        p = p[p[:, 4] > conf_thresh]
        keep = torchvision.ops.batched_nms(p[:, :4], p[:, 4], p[:, 5], nms_thresh)
        out.append(p[keep])
    return out


def evaluate(onnx_path: Path, data: Path, names_file: Path) -> dict:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    names = [line.strip() for line in names_file.read_text().splitlines() if line.strip()]
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0].name
    images, anns, dets = [], [], []
    for img_id, xml in enumerate(sorted(data.glob("*.xml")), 1):
        root = ET.parse(xml).getroot()
        image = xml.with_suffix(".jpg")
        ori = cv2.imread(str(image))
        if ori is None:  # a PNG-in-JPG or palette file cv2 reads differently: decode through numpy
            raise SystemExit(f"cv2 cannot read {image}")
        H, W = ori.shape[:2]
        images.append({"id": img_id, "width": W, "height": H, "file_name": image.name})
        for obj in root.iter("object"):
            b = obj.find("bndbox")
            x0, y0, x1, y1 = (float(b.find(k).text) for k in ("xmin", "ymin", "xmax", "ymax"))
            x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, W), min(y1, H)
            anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": names.index(obj.find("name").text) + 1,
                         "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
        x = cv2.resize(ori, (352, 352), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)[None].astype(np.float32) / 255
        preds = torch.from_numpy(sess.run(None, {inp: x})[0])
        for x0, y0, x1, y1, s, c in handle_preds(preds)[0].tolist():
            x0, x1 = max(x0 * W, 0), min(x1 * W, W)
            y0, y1 = max(y0 * H, 0), min(y1 * H, H)
            dets.append({"image_id": img_id, "category_id": int(c) + 1, "bbox": [x0, y0, x1 - x0, y1 - y0], "score": s})
    with tempfile.TemporaryDirectory() as tmp:
        gt_file, dt_file = Path(tmp) / "gt.json", Path(tmp) / "dt.json"
        gt_file.write_text(json.dumps({"images": images, "annotations": anns,
                                       "categories": [{"id": i + 1, "name": n} for i, n in enumerate(names)]}))
        dt_file.write_text(json.dumps(dets))
        gt = COCO(str(gt_file))
        ev = COCOeval(gt, gt.loadRes(str(dt_file)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {"map": float(ev.stats[0]), "map50": float(ev.stats[1]), "images": len(images), "gt_boxes": len(anns),
            "detections": len(dets)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--onnx", type=Path, default=SHARED / "models/detection/fastestdet/FastestDet.onnx")
    ap.add_argument("--data", type=Path, default=SHARED / "data/detection/fruit-test")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    r = evaluate(a.onnx, a.data, a.onnx.parent / "coco.names")
    print(json.dumps(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
