"""COCO-style detection metrics by pycocotools' own COCOeval on in-memory COCO objects (groundwork, not registered).

:class:`DetectionMetrics` collects, per image, the ground truth (boxes ``xyxy`` in pixels, class ids) and the
detections (boxes ``xyxy`` in the same pixels, scores, class ids); :meth:`DetectionMetrics.result` builds the two COCO
objects pycocotools expects (boxes as ``x y w h``, image ids 1..N in update order, category id = class id + 1) and
runs ``COCOeval(iouType="bbox")`` with its default parameters, so the numbers are COCO's:

* ``map`` (mAP@[.5:.95]), ``map50``, ``map75``, ``ar100`` (AR with at most 100 detections per image), all over the
  area range "all"; COCOeval keeps at most 100 detections per image *and class* (its ``maxDets``), the highest scored;
* ``per_class_ap``: class name → AP@[.5:.95], None for a class without ground truth boxes; the mAP is the mean over
  the classes with ground truth (a detection of a class absent from the ground truth changes nothing, COCO's rule);
* every metric is None where COCOeval gives -1 (no ground truth box at all).

Ground truth areas are the boxes' ``w*h`` (COCO's own files use the mask area: only the small/medium/large ranges,
not reported here, would differ); no ground truth is crowd.
"""
from __future__ import annotations

import contextlib
import io
from typing import Optional, Sequence

import numpy as np


def _boxes(a, what: str) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return np.zeros((0, 4))
    if a.ndim != 2 or a.shape[1] != 4:
        raise ValueError(f"{what} must be (N, 4) xyxy; got shape {a.shape}")
    return a


def _vector(a, n: int, what: str, dtype) -> np.ndarray:
    a = np.asarray(a, dtype=dtype).reshape(-1)
    if len(a) != n:
        raise ValueError(f"{what} has {len(a)} entries for {n} boxes")
    return a


class DetectionMetrics:
    """COCO mAP of one split. ``class_names``: the name of each class id (0-based), used for ``per_class_ap`` and to
    check the ids (an id outside it is a bug of the caller: ValueError)."""

    def __init__(self, class_names: Sequence[str]):
        self.class_names = list(class_names)
        self._gt: list[tuple[np.ndarray, np.ndarray]] = []
        self._dt: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._sizes: list[tuple[int, int]] = []

    @property
    def count(self) -> int:
        return len(self._gt)

    def _ids(self, ids, n, what) -> np.ndarray:
        ids = _vector(ids, n, what, np.int64)
        bad = ids[(ids < 0) | (ids >= len(self.class_names))]
        if len(bad):
            raise ValueError(f"{what}: class id {int(bad[0])} outside 0..{len(self.class_names) - 1}")
        return ids

    def update(self, gt_boxes, gt_classes, det_boxes, det_scores, det_classes,
               image_size: Optional[tuple[int, int]] = None) -> None:
        """Add one image: its ground truth and its detections (any number, either may be empty).
        ``image_size`` (width, height) is recorded in the COCO image entry only (COCOeval does not read it)."""
        gt_boxes = _boxes(gt_boxes, "gt_boxes")
        det_boxes = _boxes(det_boxes, "det_boxes")
        gt_classes = self._ids(gt_classes, len(gt_boxes), "gt_classes")
        det_classes = self._ids(det_classes, len(det_boxes), "det_classes")
        det_scores = _vector(det_scores, len(det_boxes), "det_scores", np.float64)
        self._gt.append((gt_boxes, gt_classes))
        self._dt.append((det_boxes, det_scores, det_classes))
        self._sizes.append(tuple(image_size) if image_size else (0, 0))

    # ------------------------------------------------------------------------------------------ the COCO datasets
    def coco_ground_truth(self) -> dict:
        """The ground truth as a COCO dataset dict (what ``COCO()`` loads from an annotation JSON)."""
        anns = []
        for img_id, (boxes, classes) in enumerate(self._gt, 1):
            for (x0, y0, x1, y1), c in zip(boxes.tolist(), classes.tolist()):
                w, h = x1 - x0, y1 - y0
                anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": c + 1,
                             "bbox": [x0, y0, w, h], "area": w * h, "iscrowd": 0})
        return {"images": [{"id": i, "width": w, "height": h} for i, (w, h) in enumerate(self._sizes, 1)],
                "annotations": anns,
                "categories": [{"id": i + 1, "name": n} for i, n in enumerate(self.class_names)]}

    def coco_detections(self) -> list[dict]:
        """The detections as a COCO results list (what ``COCO.loadRes`` reads from a results JSON)."""
        out = []
        for img_id, (boxes, scores, classes) in enumerate(self._dt, 1):
            for (x0, y0, x1, y1), s, c in zip(boxes.tolist(), scores.tolist(), classes.tolist()):
                out.append({"image_id": img_id, "category_id": c + 1, "bbox": [x0, y0, x1 - x0, y1 - y0],
                            "score": s})
        return out

    def _coco_objects(self):
        from pycocotools.coco import COCO

        gt = COCO()
        gt.dataset = self.coco_ground_truth()
        dt = COCO()
        # loadRes' own fields for bbox results (area = w*h, id from 1, iscrowd 0); built directly because loadRes
        # refuses an empty list (an engine that detects nothing is a result, mAP 0)
        dets = [dict(d, area=d["bbox"][2] * d["bbox"][3], id=i, iscrowd=0)
                for i, d in enumerate(self.coco_detections(), 1)]
        dt.dataset = {"images": list(gt.dataset["images"]), "categories": list(gt.dataset["categories"]),
                      "annotations": dets}
        with contextlib.redirect_stdout(io.StringIO()):
            gt.createIndex()
            dt.createIndex()
        return gt, dt

    def result(self) -> dict:
        from pycocotools.cocoeval import COCOeval

        out = {"map": None, "map50": None, "map75": None, "ar100": None,
               "per_class_ap": {n: None for n in self.class_names}, "samples": self.count,
               "gt_boxes": int(sum(len(b) for b, _ in self._gt)),
               "detections": int(sum(len(b) for b, _, _ in self._dt))}
        if not self.count or not out["gt_boxes"]:
            return out
        gt, dt = self._coco_objects()
        ev = COCOeval(gt, dt, iouType="bbox")
        with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints its progress and table
            ev.evaluate()
            ev.accumulate()
            ev.summarize()

        def value(v: float) -> Optional[float]:
            return None if v < 0 else float(v)

        out.update(map=value(ev.stats[0]), map50=value(ev.stats[1]), map75=value(ev.stats[2]),
                   ar100=value(ev.stats[8]))
        precision = ev.eval["precision"]  # [IoU thresholds, recall thresholds, classes, areas, maxDets]
        a_all = list(ev.params.areaRngLbl).index("all")
        m_100 = list(ev.params.maxDets).index(100)
        for k, cat in enumerate(ev.params.catIds):
            p = precision[:, :, k, a_all, m_100]
            p = p[p > -1]
            out["per_class_ap"][self.class_names[cat - 1]] = float(p.mean()) if p.size else None
        return out
