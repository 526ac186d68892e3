"""Semantic segmentation: a label map per image, mIoU from one confusion matrix, a paired bootstrap over images."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from qdeploy.tasks.base import Task, register_task


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


class Segmentation(Task):
    name = "segmentation"
    metric, metric_label = "miou", "mIoU"
    metric_columns = (("miou", "mIoU %"), ("pixel_acc", "Pixel acc %"))
    per_class_scores = "per_class_iou"
    predictions_word = "pixel predictions"
    pixel_labels = True
    dataset_format = "segnet"
    program_output = "argmax"
    paired_comparison = "bootstrap"
    per_sample_standard_error = False  # mIoU is a ratio of sums over the split, not a mean over images
    reference_chance = False  # the near-chance check is of top-1 (evaluate/compare.reference_chance)
    sensitivity_batch_size = 2  # per-pixel activations

    def make_metrics(self, num_classes: Optional[int] = None, ignore_index: int = 255,
                     class_names: Optional[Sequence[str]] = None, topk: Sequence[int] = (1, 5)) -> SegmentationMetrics:
        return SegmentationMetrics(num_classes, ignore_index, self.names_for(class_names, num_classes))

    def unlabelled_label(self, image: np.ndarray, ignore_index: int = 255) -> np.ndarray:
        return np.full(image.shape[1:], ignore_index, dtype=np.int64)

    def metrics_of_program(self, outputs: np.ndarray, labels: np.ndarray, num_classes: Optional[int] = None,
                           ignore_index: int = 255, class_names: Optional[Sequence[str]] = None) -> SegmentationMetrics:
        # the outputs are per-pixel classes: without the reference's class count, the largest class seen bounds it
        metrics = SegmentationMetrics(num_classes or int(outputs.max()) + 1, ignore_index, class_names)
        metrics.update_predictions(outputs.astype(np.int64), labels)
        return metrics


SEGMENTATION = register_task(Segmentation())
