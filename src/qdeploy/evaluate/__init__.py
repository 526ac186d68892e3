"""Evaluate stage: accuracy metrics and agreement with the FP32 reference."""
from qdeploy.evaluate.metrics import ClassificationMetrics, SegmentationMetrics, agreement
from qdeploy.evaluate.runner import evaluate

__all__ = ["ClassificationMetrics", "SegmentationMetrics", "agreement", "evaluate"]
