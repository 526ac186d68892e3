"""Accuracy metrics accumulated batch by batch, so a whole split never has to sit in memory as logits."""
from __future__ import annotations

from typing import Optional

import numpy as np

# the metric accumulators live with their task (qdeploy.tasks); imported from here by the stages after evaluate
from qdeploy.tasks.classification import ClassificationMetrics
from qdeploy.tasks.segmentation import SegmentationMetrics

__all__ = ["ClassificationMetrics", "SegmentationMetrics", "agreement"]


def agreement(pred: np.ndarray, reference: np.ndarray) -> Optional[float]:
    """Fraction of predictions (labels or pixels) equal to the reference variant's; predictions that define their own
    agreement (detections: ``tasks.detection.DetectionPredictions``) are asked for it."""
    own = getattr(pred, "agreement_with", None)
    if own is not None and reference is not None:
        return own(reference)
    if pred is None or reference is None or pred.shape != reference.shape or pred.size == 0:
        return None
    return float(np.mean(pred == reference))
