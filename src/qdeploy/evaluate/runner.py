"""Run an engine over the evaluation split and accumulate metrics."""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import numpy as np

from qdeploy.config import Preprocess
from qdeploy.data import normalize
from qdeploy.engines.base import Engine
from qdeploy.tasks import get_task
from qdeploy.utils.log import progress

# Classification labels seen by the last complete evaluate() pass over a Batches object, so that the paired
# statistics (evaluate.stats) need no second decoding pass over data that is not cached.
_LABELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    task = get_task(task)
    metrics = None
    seen = []
    with progress(desc, batches.num_samples) as advance:
        for images, labels in batches:
            logits = engine.infer(normalize(images, preprocess))
            if not np.all(np.isfinite(logits)):
                raise FloatingPointError(f"{engine.variant.label}: the model produced NaN/Inf outputs")
            if metrics is None:
                metrics = task.make_metrics(logits.shape[1], ignore_index, class_names)
            metrics.update(logits, np.asarray(labels))
            if task.paired_comparison == "mcnemar":  # per-image labels are kept for eval_labels (McNemar's test)
                seen.append(np.asarray(labels).astype(np.int64, copy=False).ravel())
            advance(len(images))
    if metrics is None:
        raise ValueError("the evaluation split produced no batches")
    if seen:
        try:
            _LABELS[batches] = np.concatenate(seen)
        except TypeError:  # an object that cannot be weakly referenced: eval_labels reads the batches again
            pass
    return metrics.result(), metrics.predictions


def eval_labels(batches) -> np.ndarray:
    """The labels of ``batches`` in iteration order, flattened (classification: one per image; label < 0 = unlabelled).
    Taken from the last :func:`evaluate` pass over the same object when there was one; else read from the batches
    (a replay when they are cached, a second decoding pass when not)."""
    try:
        known = _LABELS.get(batches)
    except TypeError:
        known = None
    if known is not None:
        return known
    return np.concatenate([np.asarray(y).astype(np.int64, copy=False).ravel() for _, y in batches])
