"""The summary of a paired percentile bootstrap of a metric change (Efron & Tibshirani 1993, ch. 13), shared by the
mIoU test (evaluate/stats.miou_change) and the mAP test (tasks/detection_metrics.map_change): the two resample their
images differently, but state their result the same way."""
from __future__ import annotations

import numpy as np


def change_verdict(significant: bool, drop: float) -> str:
    if not significant:
        return "no detectable change"
    return "worse" if drop > 0 else "better"


def paired_bootstrap_change(metric: str, n: int, reference: float, variant: float, drops: np.ndarray, alpha: float,
                            resamples: int) -> dict:
    """``drops``: the resampled reference - variant differences (fractions). "worse"/"better" when the ``1 - alpha``
    percentile interval excludes 0; ``p_value``: twice the smaller share of drops on either side of 0."""
    lo, hi = np.percentile(drops, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    p = float(min(1.0, 2 * min(np.mean(drops <= 0), np.mean(drops >= 0))))
    drop = reference - variant
    significant = bool(lo > 0 or hi < 0)
    return {"metric": metric, "test": "paired bootstrap over images", "n": int(n), "reference": reference,
            "variant": variant, "drop_points": 100 * drop, "ci_low_points": 100 * float(lo),
            "ci_high_points": 100 * float(hi), "confidence": 1 - alpha, "resamples": int(resamples), "p_value": p,
            "verdict": change_verdict(significant, drop)}
