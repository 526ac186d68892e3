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

from qdeploy.utils.bootstrap import paired_bootstrap_change


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


# ------------------------------------------------------------------------------------------ paired bootstrap of mAP
RECALL_POINTS = np.linspace(0.0, 1.0, 101)  # COCOeval's recThrs


class _ClassMatches:
    """One class's detections over the split as COCOeval matched them (area "all", 100 detections per image): in
    COCOeval's score order, each detection's image, its match per IoU threshold, its ignore flag; and each image's
    count of non-ignored ground-truth boxes. :meth:`ap` recomputes COCOeval's accumulate() for any image weights."""

    def __init__(self, scores, images, tp, ignored, gt_per_image):
        order = np.argsort(-scores, kind="mergesort")
        self.images, self.tp, self.ignored = images[order], tp[:, order], ignored[:, order]
        self.gt_per_image = gt_per_image

    def ap(self, weights: np.ndarray) -> Optional[float]:
        """The class's AP (mean over IoU thresholds of 101-point interpolated precision) with image i counted
        ``weights[i]`` times; None where the weighted split has no ground truth of the class (COCOeval's -1)."""
        npig = float(weights @ self.gt_per_image)
        if npig == 0:
            return None
        w = weights[self.images]
        aps = []
        for t in range(self.tp.shape[0]):
            keep = (~self.ignored[t]) & (w > 0)
            wt = w[keep]
            tp = np.cumsum(self.tp[t, keep] * wt)
            fp = np.cumsum((~self.tp[t, keep]) * wt)
            recall = tp / npig
            precision = tp / np.maximum(tp + fp, np.spacing(1))
            precision = np.maximum.accumulate(precision[::-1])[::-1] if precision.size else precision
            idx = np.searchsorted(recall, RECALL_POINTS, side="left")
            q = np.zeros(len(RECALL_POINTS))
            ok = idx < len(precision)
            q[ok] = precision[idx[ok]]
            aps.append(q.mean())
        return float(np.mean(aps))


def class_matches(metrics: DetectionMetrics) -> list[_ClassMatches]:
    """COCOeval's per-image matching of ``metrics`` (evaluate() once), per class with ground truth or detections. Kept
    on ``metrics`` until it gets another image: the reference's is read once for every variant compared with it."""
    cached = metrics.__dict__.get("_class_matches")
    if cached is not None and cached[0] == metrics.count:
        return cached[1]
    from pycocotools.cocoeval import COCOeval

    gt, dt = metrics._coco_objects()
    ev = COCOeval(gt, dt, iouType="bbox")
    ev.params.areaRng, ev.params.areaRngLbl = [ev.params.areaRng[0]], ["all"]
    with contextlib.redirect_stdout(io.StringIO()):
        ev.evaluate()
    n_img, n_t = len(ev.params.imgIds), len(ev.params.iouThrs)
    out = []
    for k, cat in enumerate(ev.params.catIds):
        scores, images, tp, ignored = [], [], [], []
        gt_count = np.zeros(n_img)
        for i in range(n_img):
            e = ev.evalImgs[k * n_img + i]
            if e is None:
                continue
            gt_count[i] = int(np.sum(np.asarray(e["gtIgnore"]) == 0))
            d = len(e["dtScores"])
            if d:
                scores.extend(e["dtScores"])
                images.extend([i] * d)
                tp.append(np.asarray(e["dtMatches"]) > 0)
                ignored.append(np.asarray(e["dtIgnore"], bool))
        if not gt_count.any() and not scores:
            continue
        tp = np.concatenate(tp, 1) if tp else np.zeros((n_t, 0), bool)
        ignored = np.concatenate(ignored, 1) if ignored else np.zeros((n_t, 0), bool)
        out.append(_ClassMatches(np.asarray(scores, float), np.asarray(images, int), tp, ignored, gt_count))
    metrics._class_matches = (metrics.count, out)
    return out


def mean_ap(classes: list[_ClassMatches], weights: np.ndarray) -> Optional[float]:
    """mAP@0.5:0.95 over the classes with ground truth under ``weights`` (COCOeval's stats[0] at weights 1)."""
    aps = [a for a in (c.ap(weights) for c in classes) if a is not None]
    return float(np.mean(aps)) if aps else None


def map_change(reference: DetectionMetrics, variant: DetectionMetrics, alpha: float = 0.05, resamples: int = 1000,
               seed: int = 0) -> Optional[dict]:
    """The mAP change of a variant against the reference on the same images: a paired percentile bootstrap over images
    (Efron & Tibshirani 1993, ch. 13; as ``evaluate.stats.miou_change`` for mIoU): images are resampled with
    replacement, the same images for both models, and each model's mAP is recomputed from COCOeval's per-image matches
    (the matching is per image, so resampling reuses it; AP as COCOeval's accumulate, area "all", 100 detections).
    None without images or ground truth."""
    n = reference.count
    if n == 0 or variant.count != n:
        return None
    ref_c, var_c = class_matches(reference), class_matches(variant)
    ones = np.ones(n)
    ref, var = mean_ap(ref_c, ones), mean_ap(var_c, ones)
    if ref is None or var is None:
        return None
    rng = np.random.default_rng(seed)
    drops = []
    for _ in range(resamples):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)
        a, b = mean_ap(ref_c, w), mean_ap(var_c, w)
        if a is not None and b is not None:
            drops.append(a - b)
    if not drops:
        return None
    return paired_bootstrap_change("map", n, ref, var, np.asarray(drops), alpha, len(drops))
