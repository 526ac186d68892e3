"""Image classification: one label per image, top-1 accuracy, McNemar's test on the images both variants classified."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from qdeploy.tasks.base import Task, register_task


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


class Classification(Task):
    name = "classification"
    metric, metric_label = "top1", "top-1"
    metric_columns = (("top1", "Top-1 %"), ("top5", "Top-5 %"))
    predictions_word = "predictions"
    pixel_labels = False
    dataset_format = "imagefolder"
    program_output = "logits"
    paired_comparison = "mcnemar"
    per_sample_standard_error = True
    reference_chance = True
    sensitivity_batch_size = 16

    def make_metrics(self, num_classes: Optional[int] = None, ignore_index: int = 255,
                     class_names: Optional[Sequence[str]] = None, topk: Sequence[int] = (1, 5)) -> ClassificationMetrics:
        return ClassificationMetrics(topk)

    def unlabelled_label(self, image: np.ndarray, ignore_index: int = 255) -> int:
        return -1  # data.datasets.UNLABELLED

    def metrics_of_program(self, outputs: np.ndarray, labels: np.ndarray, num_classes: Optional[int] = None,
                           ignore_index: int = 255, class_names: Optional[Sequence[str]] = None) -> ClassificationMetrics:
        metrics = ClassificationMetrics()
        metrics.update(outputs.astype(np.float32), labels.astype(np.int64))
        return metrics


CLASSIFICATION = register_task(Classification())
