"""Metrics against hand-computed values, and latency statistics."""
import numpy as np
import pytest

from qdeploy.benchmark.latency import fill_batch, latency_stats
from qdeploy.benchmark.memory import MemoryProbe
from qdeploy.evaluate import ClassificationMetrics, SegmentationMetrics, agreement


def test_topk_accumulates_over_batches():
    m = ClassificationMetrics()
    logits = np.array([[0.1, 0.9, 0, 0, 0, 0], [0.8, 0.1, 0.05, 0.03, 0.02, 0], [0, 0, 0, 0, 0.1, 0.2]])
    m.update(logits[:2], np.array([1, 2]))  # hit, top-3 only
    m.update(logits[2:], np.array([0]))  # 0 is tied-lowest → outside top-5 of 6 classes only if ranked 6th
    r = m.result()
    assert r["samples"] == 3 and r["top1"] == pytest.approx(1 / 3)
    ranks = np.argsort(-logits[2], kind="stable")
    expected_top5 = (2 + int(0 in ranks[:5])) / 3
    assert r["top5"] == pytest.approx(expected_top5)
    assert m.predictions.tolist() == [1, 0, 5]


def test_miou_from_one_confusion_matrix_ignores_void():
    m = SegmentationMetrics(num_classes=3, ignore_index=255, class_names=["a", "b", "c"])
    labels = np.array([[[0, 0, 1, 255]], [[2, 2, 2, 1]]])
    pred = np.array([[[0, 1, 1, 2]], [[2, 2, 0, 1]]])
    logits = np.eye(3)[pred].transpose(0, 3, 1, 2)  # one-hot logits whose argmax is `pred`
    m.update(logits[:1], labels[:1])
    m.update(logits[1:], labels[1:])
    r = m.result()
    # class a: tp1 fp1 fn1 → 1/3; b: tp2 fp1 fn0 → 2/3; c: tp2 fp0 fn1 → 2/3 (void pixel predicted c is ignored)
    assert r["per_class_iou"] == pytest.approx({"a": 1 / 3, "b": 2 / 3, "c": 2 / 3})
    assert r["miou"] == pytest.approx((1 / 3 + 2 / 3 + 2 / 3) / 3)
    assert r["pixel_acc"] == pytest.approx(5 / 7)
    assert r["excluded_pixels"] == 1


def test_absent_class_is_none_and_left_out_of_the_mean():
    m = SegmentationMetrics(num_classes=3, ignore_index=255)
    m.update_predictions(np.array([[[0, 1]]]), np.array([[[0, 1]]]))
    r = m.result()
    assert r["per_class_iou"]["2"] is None and r["miou"] == 1.0


def test_agreement():
    assert agreement(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 0.75
    assert agreement(np.array([1]), np.array([1, 2])) is None


def test_latency_stats_and_fill_batch():
    s = latency_stats(list(range(1, 101)))
    assert s["mean"] == 50.5 and s["p50"] == 50.5 and s["min"] == 1 and s["max"] == 100
    assert s["p99"] == pytest.approx(99.01) and s["p90"] == pytest.approx(90.1)
    imgs = np.arange(3 * 2, dtype=np.float32).reshape(3, 2, 1, 1)
    b = fill_batch(imgs, 7)
    assert b.shape == (7, 2, 1, 1) and b[3, 0, 0, 0] == imgs[0, 0, 0, 0]


def test_memory_probe_sees_a_real_allocation():
    with MemoryProbe() as probe:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB touched
        del block
    r = probe.result()
    assert r["rss_delta"] >= 50, r
    assert r["rss_peak"] >= r["rss_delta"]
