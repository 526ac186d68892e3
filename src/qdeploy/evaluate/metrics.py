"""Accuracy metrics accumulated batch by batch, so a whole split never has to sit in memory as logits."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


class ClassificationMetrics:
    """Top-1/top-5 accuracy; keeps the top-1 predictions for agreement with the reference variant."""

    def __init__(self, topk: Sequence[int] = (1, 5)):
        self.topk = tuple(topk)
        self.correct = {k: 0 for k in self.topk}
        self.count = 0      # labelled samples
        self.samples = 0    # all samples
        self._preds: list[np.ndarray] = []

    def update(self, logits: np.ndarray, labels: np.ndarray) -> None:
        if logits.ndim != 2:
            raise ValueError(f"classification output must be (N, classes); got shape {logits.shape}")
        k_max = min(max(self.topk), logits.shape[1])
        # a stable sort: equal logits (INT8 outputs tie often) rank by class index, so top-1 is exactly argmax's choice
        # and every tool that reads these logits agrees on it (argpartition breaks ties arbitrarily)
        top = np.argsort(-logits, axis=1, kind="stable")[:, :k_max]
        labelled = labels >= 0  # images without a label (data labels: false) count for agreement, not accuracy
        hits = (top == labels[:, None]) & labelled[:, None]
        for k in self.topk:
            self.correct[k] += int(hits[:, :k].any(axis=1).sum())
        self.count += int(labelled.sum())
        self.samples += len(labels)
        self._preds.append(top[:, 0].astype(np.int32))

    @property
    def predictions(self) -> np.ndarray:
        return np.concatenate(self._preds) if self._preds else np.zeros(0, np.int32)

    def result(self) -> dict:
        out = {f"top{k}": (self.correct[k] / self.count if self.count else None) for k in self.topk}
        out["samples"] = self.samples
        if self.count != self.samples:
            out["labelled_samples"] = self.count
        return out


class SegmentationMetrics:
    """mIoU, pixel accuracy and per-class IoU from one confusion matrix over the whole split.

    Pixels whose label is ``ignore_index`` (or outside [0, classes)) are excluded. A class that is
    absent from both ground truth and predictions has no IoU (None) and is left out of the mean.
    """

    def __init__(self, num_classes: int, ignore_index: int, class_names: Optional[Sequence[str]] = None):
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        self.confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
        self.count = 0
        self.excluded_pixels = 0
        self._preds: list[np.ndarray] = []

    def update(self, logits: np.ndarray, labels: np.ndarray) -> None:
        if logits.ndim != 4:
            raise ValueError(f"segmentation output must be (N, classes, H, W); got shape {logits.shape}")
        if logits.shape[2:] != labels.shape[1:]:
            raise ValueError(f"segmentation output is {logits.shape[2:]} but labels are {labels.shape[1:]}")
        pred = logits.argmax(axis=1).astype(np.int64)
        self.update_predictions(pred, labels)

    def update_predictions(self, pred: np.ndarray, labels: np.ndarray) -> None:
        c = self.num_classes
        valid = (labels != self.ignore_index) & (labels >= 0) & (labels < c)
        self.excluded_pixels += int(labels.size - valid.sum())
        self.confusion += np.bincount(labels[valid] * c + pred[valid], minlength=c * c).reshape(c, c)
        self.count += len(labels)
        self._preds.append(pred.astype(np.uint8 if c <= 256 else np.int32))

    @property
    def predictions(self) -> np.ndarray:
        return np.concatenate(self._preds) if self._preds else np.zeros(0, np.uint8)

    def result(self) -> dict:
        cm = self.confusion.astype(np.float64)
        tp = np.diag(cm)
        union = cm.sum(0) + cm.sum(1) - tp
        iou = [float(t / u) if u > 0 else None for t, u in zip(tp, union)]
        present = [x for x in iou if x is not None]
        total = cm.sum()
        return {
            "miou": float(np.mean(present)) if present else None,
            "pixel_acc": float(tp.sum() / total) if total else None,
            "per_class_iou": dict(zip(self.class_names, iou)),
            "samples": self.count,
            "excluded_pixels": self.excluded_pixels,
        }


def agreement(pred: np.ndarray, reference: np.ndarray) -> Optional[float]:
    """Fraction of predictions (labels or pixels) equal to the reference variant's."""
    if pred is None or reference is None or pred.shape != reference.shape or pred.size == 0:
        return None
    return float(np.mean(pred == reference))
