"""Evaluate stage: accuracy metrics, agreement with the FP32 reference, paired statistics of accuracy changes.

``evaluate``/``eval_labels`` (which need the engines, hence torch) load on first use, so that the report stage can
import :mod:`qdeploy.evaluate.stats` without pulling torch in.
"""
from qdeploy.evaluate.metrics import ClassificationMetrics, SegmentationMetrics, agreement

__all__ = ["ClassificationMetrics", "SegmentationMetrics", "agreement", "eval_labels", "evaluate"]


def __getattr__(name: str):
    if name in ("evaluate", "eval_labels"):
        from qdeploy.evaluate import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'qdeploy.evaluate' has no attribute {name!r}")
