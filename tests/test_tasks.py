"""The task registry: each task's facts, its metrics on a hand-made batch, the error for an unknown task."""
import numpy as np
import pytest

from qdeploy.errors import ConfigError
from qdeploy.evaluate.metrics import ClassificationMetrics, SegmentationMetrics
from qdeploy.tasks import TASKS, get_task, task_of_metric


def test_the_registry_lists_the_three_tasks():
    assert list(TASKS) == ["classification", "detection", "segmentation"]
    assert all(get_task(name).name == name for name in TASKS)
    assert get_task(TASKS["segmentation"]) is TASKS["segmentation"]


def test_headline_metric_and_labels():
    cls, seg = get_task("classification"), get_task("segmentation")
    assert (cls.metric, cls.metric_label, cls.predictions_word) == ("top1", "top-1", "predictions")
    assert (seg.metric, seg.metric_label, seg.predictions_word) == ("miou", "mIoU", "pixel predictions")
    assert cls.metric_columns[0] == ("top1", "Top-1 %") and seg.metric_columns[0] == ("miou", "mIoU %")
    assert (cls.paired_comparison, seg.paired_comparison) == ("mcnemar", "bootstrap")
    assert cls.reference_chance and not seg.reference_chance
    assert not cls.pixel_labels and seg.pixel_labels
    assert task_of_metric("top1") is cls and task_of_metric("miou") is seg and task_of_metric("top5") is None


def test_classification_metrics_on_a_hand_made_batch():
    metrics = get_task("classification").make_metrics(topk=(1,))
    assert isinstance(metrics, ClassificationMetrics)
    logits = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], np.float32)
    metrics.update(logits, np.array([1, 0, 0, -1]))  # 2 of 3 labelled right; the last image is unlabelled
    assert metrics.result() == {"top1": 2 / 3, "samples": 4, "labelled_samples": 3}
    assert metrics.predictions.tolist() == [1, 0, 2, 2]


def test_segmentation_metrics_on_a_hand_made_batch():
    metrics = get_task("segmentation").make_metrics(num_classes=2, ignore_index=255, class_names=["bg", "fg"])
    assert isinstance(metrics, SegmentationMetrics)
    pred = np.array([[[0, 1], [1, 1]]])
    logits = np.stack([pred == 0, pred == 1], axis=1).astype(np.float32)  # (1, 2, 2, 2): argmax = pred
    metrics.update(logits, np.array([[[0, 1], [0, 255]]]))
    r = metrics.result()
    # bg: 1 hit, 1 missed → IoU 1/2; fg: 1 hit, 1 false → IoU 1/2; the ignored pixel is left out
    assert r["per_class_iou"] == {"bg": 0.5, "fg": 0.5} and r["miou"] == 0.5
    assert r["pixel_acc"] == pytest.approx(2 / 3) and r["excluded_pixels"] == 1


def test_an_unknown_task_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown task 'keypoints': model.task must be one of classification, detection, "
                                          "segmentation"):
        get_task("keypoints")
