"""Run an engine over the evaluation split and accumulate metrics."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from qdeploy.config import Preprocess
from qdeploy.data import normalize
from qdeploy.engines.base import Engine
from qdeploy.evaluate.metrics import ClassificationMetrics, SegmentationMetrics
from qdeploy.utils.log import progress


def evaluate(
    engine: Engine,
    batches,
    preprocess: Preprocess,
    task: str,
    ignore_index: int = 255,
    class_names: Optional[Sequence[str]] = None,
    desc: str = "eval",
):
    """Return ``(metrics dict, predictions)``; predictions feed the agreement check."""
    metrics = None
    with progress(desc, batches.num_samples) as advance:
        for images, labels in batches:
            logits = engine.infer(normalize(images, preprocess))
            if not np.all(np.isfinite(logits)):
                raise FloatingPointError(f"{engine.variant.label}: the model produced NaN/Inf outputs")
            if metrics is None:
                if task == "classification":
                    metrics = ClassificationMetrics()
                else:
                    names = class_names if class_names and len(class_names) == logits.shape[1] else None
                    metrics = SegmentationMetrics(logits.shape[1], ignore_index, names)
            metrics.update(logits, np.asarray(labels))
            advance(len(images))
    if metrics is None:
        raise ValueError("the evaluation split produced no batches")
    return metrics.result(), metrics.predictions
