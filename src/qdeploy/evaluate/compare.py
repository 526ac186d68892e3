"""Paired comparisons of evaluated variants against the reference, on the images they were all evaluated on.

Called once all variants are evaluated (``pipeline.assemble_results``): predictions come from
:func:`qdeploy.evaluate.evaluate`, labels from the same batches (:func:`qdeploy.evaluate.runner.eval_labels`).
The statistics are :mod:`qdeploy.evaluate.stats`'.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import numpy as np

from qdeploy.evaluate.stats import (MAX_CONFUSION_CELLS, accuracy_change_of, miou_change, near_chance,
                                    per_image_confusion)
from qdeploy.tasks import get_task


def paired_changes(batches, task: str, reference_pred: Optional[np.ndarray], predictions: Mapping[str, np.ndarray],
                   ignore_index: int = 255, num_classes: Optional[int] = None) -> dict[str, dict]:
    """``{variant: accuracy_change}`` of every variant in ``predictions`` against ``reference_pred``.

    As the task's ``paired_comparison`` says (qdeploy.tasks). ``mcnemar`` (classification): top-1 per image, exact
    McNemar + Agresti–Min interval (:func:`stats.accuracy_change_of`); nothing when no image is labelled. ``bootstrap``
    (segmentation): mIoU, paired bootstrap over images from per-image confusion matrices
    (:func:`stats.miou_change`); nothing when ``num_classes`` is unknown or images × classes² exceeds
    ``MAX_CONFUSION_CELLS`` (then the verdict falls back to agreement, and the report says which rule decided).
    """
    if reference_pred is None or not predictions:
        return {}
    return _PAIRED_COMPARISONS[get_task(task).paired_comparison](batches, reference_pred, predictions, ignore_index,
                                                                 num_classes)


def _top1_changes(batches, reference_pred: np.ndarray, predictions: Mapping[str, np.ndarray], ignore_index: int,
                  num_classes: Optional[int]) -> dict[str, dict]:
    """McNemar's test per variant on the labelled images (:func:`stats.accuracy_change_of`)."""
    from qdeploy.evaluate.runner import eval_labels

    labels = eval_labels(batches)
    out = {name: accuracy_change_of(reference_pred, pred, labels) for name, pred in predictions.items()}
    return {k: v for k, v in out.items() if v is not None}


def _miou_changes(batches, reference_pred: np.ndarray, predictions: Mapping[str, np.ndarray], ignore_index: int,
                  num_classes: Optional[int]) -> dict[str, dict]:
    """A paired bootstrap over images of each variant's mIoU change (:func:`stats.miou_change`), from per-image
    confusion matrices."""
    n = len(reference_pred)
    if not num_classes or n * num_classes ** 2 > MAX_CONFUSION_CELLS:
        return {}
    names = [k for k, p in predictions.items() if p is not None and p.shape == reference_pred.shape]
    cms: dict[str, list] = {k: [] for k in ["\0reference", *names]}
    start = 0
    for _, labels in batches:  # a replay when the batches are cached; labels are not kept for the whole split
        labels = np.asarray(labels)
        stop = start + len(labels)
        if stop > n:
            return {}
        cms["\0reference"].append(per_image_confusion(reference_pred[start:stop], labels, num_classes, ignore_index))
        for k in names:
            cms[k].append(per_image_confusion(predictions[k][start:stop], labels, num_classes, ignore_index))
        start = stop
    if start != n:
        return {}
    ref = np.concatenate(cms.pop("\0reference"))
    out = {k: miou_change(ref, np.concatenate(v), num_classes) for k, v in cms.items()}
    return {k: v for k, v in out.items() if v is not None}


def _map_changes(batches, reference_pred: np.ndarray, predictions: Mapping[str, np.ndarray], ignore_index: int,
                 num_classes: Optional[int]) -> dict[str, dict]:
    """A paired bootstrap over images of each variant's mAP change (tasks.detection_metrics.map_change), against the
    label tables of the split (read again: a replay when the batches are cached)."""
    from qdeploy.tasks.detection import metrics_of_detections
    from qdeploy.tasks.detection_metrics import map_change

    names = getattr(batches, "class_names", None)
    tables = [np.asarray(y) for _, y in batches]
    if not names or not tables:
        return {}
    tables = np.concatenate(tables)
    n = len(tables)
    if reference_pred is None or len(reference_pred) != n:
        return {}
    ref = metrics_of_detections(tables, reference_pred, names)
    out = {k: map_change(ref, metrics_of_detections(tables, p, names))
           for k, p in predictions.items() if p is not None and len(p) == n}
    return {k: v for k, v in out.items() if v is not None}


# Task.paired_comparison → how the changes are computed
_PAIRED_COMPARISONS = {"mcnemar": _top1_changes, "bootstrap": _miou_changes, "bootstrap-map": _map_changes}


def reference_chance(batches, reference_pred: Optional[np.ndarray]) -> tuple[Optional[dict], str]:
    """(:func:`stats.near_chance` of the reference's top-1, how chance was set) on the labelled images of a
    classification split; (None, "") without labels or predictions. Chance = the share of the most frequent label
    (what always answering that class scores; 1/classes on balanced data)."""
    if reference_pred is None:
        return None, ""
    from qdeploy.evaluate.runner import eval_labels

    labels = eval_labels(batches)
    pred = np.asarray(reference_pred).ravel()
    if len(pred) != len(labels):
        return None, ""
    labelled = labels >= 0
    n = int(labelled.sum())
    if n == 0:
        return None, ""
    counts = np.bincount(labels[labelled])
    classes = int((counts > 0).sum())
    chance = float(counts.max() / n)
    basis = (f"1/{classes} classes" if counts.max() * classes == n
             else f"the most frequent of {classes} classes' share of the labels")
    return near_chance(int((pred == labels)[labelled].sum()), n, chance), basis
