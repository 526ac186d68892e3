"""COCO detection metrics (tasks/detection_metrics.py): perfect detections, a case computed by hand, and equality with
pycocotools run directly on the same data written as COCO JSON files."""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

pytest.importorskip("pycocotools")

from qdeploy.tasks.detection_metrics import DetectionMetrics  # noqa: E402

CLASSES = ["cat", "dog", "bird"]


def random_split(seed: int = 0, images: int = 12):
    """Ground truth and noisy detections (shifted boxes, false positives, misses, wrong classes) per image."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(images):
        n = int(rng.integers(0, 6))
        xy = rng.uniform(0, 200, (n, 2))
        wh = rng.uniform(8, 80, (n, 2))
        gt = np.concatenate([xy, xy + wh], 1)
        gt_cls = rng.integers(0, 3, n)
        keep = rng.uniform(size=n) > 0.2
        det = gt[keep] + rng.normal(0, 4, (int(keep.sum()), 4))
        det[:, 2:] = np.maximum(det[:, 2:], det[:, :2] + 1)
        det_cls = np.where(rng.uniform(size=len(det)) > 0.1, gt_cls[keep], rng.integers(0, 3, len(det)))
        fp = int(rng.integers(0, 4))
        fxy = rng.uniform(0, 200, (fp, 2))
        det = np.concatenate([det, np.concatenate([fxy, fxy + rng.uniform(8, 60, (fp, 2))], 1)])
        det_cls = np.concatenate([det_cls, rng.integers(0, 3, fp)])
        scores = rng.uniform(0.05, 1.0, len(det))
        out.append((gt, gt_cls, det, scores, det_cls))
    return out


def filled(split) -> DetectionMetrics:
    m = DetectionMetrics(CLASSES)
    for gt, gt_cls, det, scores, det_cls in split:
        m.update(gt, gt_cls, det, scores, det_cls, image_size=(300, 300))
    return m


def test_perfect_detections_score_one():
    m = DetectionMetrics(CLASSES)
    for gt, gt_cls, *_ in random_split(1):
        m.update(gt, gt_cls, gt, np.linspace(1, 0.5, len(gt)), gt_cls)
    m.update([], [], [], [], [])  # an image without objects and without detections
    r = m.result()
    for key in ("map", "map50", "map75", "ar100"):
        assert r[key] == pytest.approx(1.0, abs=1e-12), key
    assert r["per_class_ap"] == {n: pytest.approx(1.0, abs=1e-12) for n in CLASSES}
    assert r["samples"] == 13 and r["gt_boxes"] == r["detections"] > 0


def test_hand_computed_average_precision():
    # one class, three ground truth boxes; detections by score: TP (IoU 1), FP (no overlap), a box of IoU 0.625.
    # IoU thresholds .50/.55/.60 (3 of 10): recall 1/3 at precision 1, 2/3 at precision 2/3 → COCO's 101-point
    # interpolated precision is 1 on recall 0..0.33 (34 points), 2/3 on 0.34..0.66 (33), 0 beyond: AP = 56/101.
    # Thresholds .65...95 (7): the third detection is a FP too: AP = 34/101.
    m = DetectionMetrics(["cat", "dog"])
    m.update([[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50]], [0, 0, 0],
             [[0, 0, 10, 10], [60, 60, 70, 70], [20, 20, 30, 26.25]], [0.9, 0.8, 0.7], [0, 0, 0])
    r = m.result()
    assert r["map50"] == pytest.approx(56 / 101, abs=1e-12)
    assert r["map75"] == pytest.approx(34 / 101, abs=1e-12)
    assert r["map"] == pytest.approx((3 * 56 + 7 * 34) / 1010, abs=1e-12)
    assert r["ar100"] == pytest.approx((3 * 2 / 3 + 7 * 1 / 3) / 10, abs=1e-12)
    assert r["per_class_ap"] == {"cat": pytest.approx(r["map"], abs=1e-15), "dog": None}  # dog: no ground truth


def test_a_detection_of_a_class_without_ground_truth_changes_nothing():
    m = DetectionMetrics(CLASSES)
    m.update([[0, 0, 10, 10]], [0], [[0, 0, 10, 10], [0, 0, 10, 10]], [0.9, 0.95], [0, 2])
    r = m.result()
    # COCOeval's precision is tp / (tp + fp + eps): one detection gives 1 - 2.2e-16, not 1
    assert r["map"] == pytest.approx(1.0, abs=1e-12)
    assert r["per_class_ap"] == {"cat": pytest.approx(1.0, abs=1e-12), "dog": None, "bird": None}


def test_no_detections_and_no_ground_truth():
    m = DetectionMetrics(CLASSES)
    m.update([[0, 0, 10, 10]], [1], np.zeros((0, 4)), [], [])
    assert m.result()["map"] == 0.0 and m.result()["per_class_ap"]["dog"] == 0.0
    empty = DetectionMetrics(CLASSES)
    empty.update([], [], [[0, 0, 5, 5]], [0.5], [0])
    assert empty.result()["map"] is None and DetectionMetrics(CLASSES).result()["samples"] == 0


def test_bad_inputs_are_caller_bugs():
    m = DetectionMetrics(CLASSES)
    with pytest.raises(ValueError, match="det_boxes must be"):
        m.update([], [], [[0, 0, 1]], [0.5], [0])
    with pytest.raises(ValueError, match="det_scores has 2 entries for 1 boxes"):
        m.update([], [], [[0, 0, 1, 1]], [0.5, 0.1], [0])
    with pytest.raises(ValueError, match="class id 3 outside 0..2"):
        m.update([[0, 0, 1, 1]], [3], [], [], [])
    assert m.count == 0


def test_equals_pycocotools_run_directly_on_json_files(tmp_path):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    split = random_split(0, images=15)
    ours = filled(split).result()
    assert 0.1 < ours["map"] < 0.9  # a case that is neither trivial nor empty

    # the same data written as COCO files, independently of DetectionMetrics' own conversion
    images, anns, results = [], [], []
    for img_id, (gt, gt_cls, det, scores, det_cls) in enumerate(split, 101):
        images.append({"id": img_id, "width": 300, "height": 300, "file_name": f"{img_id}.jpg"})
        for b, c in zip(gt, gt_cls):
            anns.append({"id": len(anns) + 1, "image_id": img_id, "category_id": int(c) * 10 + 1, "iscrowd": 0,
                         "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "area": (b[2] - b[0]) * (b[3] - b[1])})
        for b, s, c in zip(det, scores, det_cls):
            results.append({"image_id": img_id, "category_id": int(c) * 10 + 1, "score": float(s),
                            "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]]})
    cats = [{"id": i * 10 + 1, "name": n} for i, n in enumerate(CLASSES)]
    (tmp_path / "gt.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    (tmp_path / "res.json").write_text(json.dumps(results))
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(tmp_path / "gt.json"))
        ev = COCOeval(gt, gt.loadRes(str(tmp_path / "res.json")), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()

    for key, i in (("map", 0), ("map50", 1), ("map75", 2), ("ar100", 8)):
        assert ours[key] == pytest.approx(ev.stats[i], abs=1e-9), key
    for k, name in enumerate(CLASSES):
        p = ev.eval["precision"][:, :, k, 0, 2]
        assert ours["per_class_ap"][name] == pytest.approx(p[p > -1].mean(), abs=1e-9), name
