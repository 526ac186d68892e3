"""Statistics with a stated uncertainty, for the verdicts (pure functions on numbers and arrays).

Every variant is evaluated on the *same* images as the reference, so accuracy changes are judged by paired
statistics (only the images on which the two differ carry information), not by comparing two accuracies
each with its own binomial error, and not by agreement (the share of identical predictions), which falls
on a low-confidence model whose top-1 does not move at all.

- :func:`accuracy_change` (classification): exact McNemar test on the discordant images and an
  Agresti–Min interval of the top-1 drop.
- :func:`miou_change` (segmentation): paired percentile bootstrap over images of the mIoU drop, from
  per-image confusion matrices (:func:`per_image_confusion`).
- :func:`ratio_of_medians` (speed-up): percentile bootstrap of the ratio of two median latencies.
- :func:`near_chance`: is a top-1 clearly above what guessing scores (exact binomial test)?
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np

from qdeploy.utils.bootstrap import change_verdict, paired_bootstrap_change

ALPHA = 0.05             # two-sided level of the accuracy-change tests (95 % intervals)
CONFIDENCE = 1 - ALPHA
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0       # results are reproducible: the same numbers give the same interval
# per-image confusion matrices above this many cells (images × classes²) are not bootstrapped (memory, time)
MAX_CONFUSION_CELLS = 20_000_000
# near chance: top-1 not clearly above min(2 × chance, chance + this share of the way to 100 %) (exact binomial, one-sided)
NEAR_CHANCE_SKILL = 0.10
NEAR_CHANCE_ALPHA = 0.01


def _binom_cdf(k: int, n: int, p: float) -> float:
    from scipy.stats import binom  # scipy comes with scikit-learn; imported here: the report imports this module

    return float(binom.cdf(k, n, p))


def _binom_sf(k: int, n: int, p: float) -> float:
    """P(X > k) for X ~ Binomial(n, p)."""
    from scipy.stats import binom

    return float(binom.sf(k, n, p))


# ---------------------------------------------------------------------------- classification: McNemar
def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs (McNemar 1947, exact conditional form:
    under "no change" each of the ``b + c`` discordant images is equally likely to favour either model, so
    min(b, c) is Binomial(b + c, 1/2)); 1.0 when there is no discordant image."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * _binom_cdf(min(b, c), n, 0.5))


def paired_drop_interval(n: int, b: int, c: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Interval of the accuracy drop ``(b - c) / n`` (a fraction) between two models on the same ``n`` images, where
    ``b`` images are right only for the first model and ``c`` only for the second: the Agresti–Min adjusted Wald
    interval (Agresti & Min 2005, Statistics in Medicine 24:729, 0.5 added to each of the four cells), which keeps
    its coverage with few discordant images where the plain Wald interval collapses to a point."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    b2, c2, n2 = b + 0.5, c + 0.5, n + 2.0
    d = (b2 - c2) / n2
    se = math.sqrt(max((b2 + c2) - (b2 - c2) ** 2 / n2, 0.0)) / n2
    return max(-1.0, d - z * se), min(1.0, d + z * se)


def accuracy_change(n: int, reference_correct: int, b: int, c: int, alpha: float = ALPHA) -> dict:
    """The top-1 change of a variant against the reference on the same ``n`` labelled images.

    ``reference_correct``: images the reference gets right; ``b``: right for the reference only; ``c``: right
    for the variant only. Returns fractions and points::

        {"metric": "top1", "test": "exact McNemar", "n", "reference", "variant", "drop_points",
         "ci_low_points", "ci_high_points", "confidence", "reference_only_correct": b, "variant_only_correct": c,
         "p_value", "verdict": "no detectable change" | "worse" | "better"}

    The verdict is the test's (McNemar 1947; recommended for comparing two classifiers on one test set by
    Dietterich 1998, Neural Computation 10:1895): "worse"/"better" only when p < ``alpha``; the interval
    (Agresti–Min) says how large the change may be. Example: 2,000 images, top-1 37.15 % → 37.10 % with 400
    images that changed side (b = 200, c = 199): p = 1.0, drop 0.05 points, 95 % CI about -1.9 to +2.0 points,
    "no detectable change", however low the agreement.
    """
    if n <= 0:
        raise ValueError("accuracy_change needs at least one labelled image")
    if not (0 <= b <= reference_correct <= n and 0 <= c <= n - reference_correct):
        raise ValueError(f"inconsistent counts: n={n}, reference_correct={reference_correct}, b={b}, c={c}")
    p = mcnemar_exact_p(b, c)
    lo, hi = paired_drop_interval(n, b, c, 1 - alpha)
    drop = (b - c) / n
    return {"metric": "top1", "test": "exact McNemar", "n": int(n), "reference": reference_correct / n,
            "variant": (reference_correct - b + c) / n, "drop_points": 100 * drop, "ci_low_points": 100 * lo,
            "ci_high_points": 100 * hi, "confidence": 1 - alpha, "reference_only_correct": int(b),
            "variant_only_correct": int(c), "p_value": p, "verdict": change_verdict(p < alpha, drop)}


def accuracy_change_of(reference_pred: np.ndarray, variant_pred: np.ndarray, labels: np.ndarray,
                       alpha: float = ALPHA) -> Optional[dict]:
    """:func:`accuracy_change` from top-1 predictions and labels (images with label < 0 are unlabelled and left out);
    None when nothing is labelled or the arrays do not line up."""
    reference_pred, variant_pred, labels = (np.asarray(a).ravel() for a in (reference_pred, variant_pred, labels))
    if not (len(reference_pred) == len(variant_pred) == len(labels)):
        return None
    labelled = labels >= 0
    n = int(labelled.sum())
    if n == 0:
        return None
    ref_ok = (reference_pred == labels)[labelled]
    var_ok = (variant_pred == labels)[labelled]
    return accuracy_change(n, int(ref_ok.sum()), int((ref_ok & ~var_ok).sum()), int((~ref_ok & var_ok).sum()), alpha)


# ---------------------------------------------------------------------------- segmentation: bootstrap over images
def per_image_confusion(pred: np.ndarray, labels: np.ndarray, num_classes: int, ignore_index: int) -> np.ndarray:
    """(N, classes²) int32 confusion counts of each image (row = label, column = prediction, flattened); pixels labelled
    ``ignore_index`` or outside [0, classes) are left out, as in :class:`~qdeploy.evaluate.metrics.SegmentationMetrics`."""
    c = num_classes
    pred = np.asarray(pred).reshape(len(pred), -1).astype(np.int64)
    labels = np.asarray(labels).reshape(len(labels), -1).astype(np.int64)
    out = np.zeros((len(pred), c * c), np.int32)
    for i, (p, y) in enumerate(zip(pred, labels)):
        valid = (y != ignore_index) & (y >= 0) & (y < c) & (p >= 0) & (p < c)
        out[i] = np.bincount(y[valid] * c + p[valid], minlength=c * c)
    return out


def _miou(cm: np.ndarray, c: int) -> np.ndarray:
    """mIoU of summed confusion matrices, shape (..., c²) → (...); classes absent from labels and predictions are
    left out of the mean (as SegmentationMetrics does)."""
    cm = cm.reshape(*cm.shape[:-1], c, c).astype(np.float64)
    tp = np.diagonal(cm, axis1=-2, axis2=-1)
    union = cm.sum(-1) + cm.sum(-2) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, tp / np.where(union > 0, union, 1), np.nan)
    present = union > 0
    counts = present.sum(-1)
    return np.where(counts > 0, np.nansum(iou, -1) / np.maximum(counts, 1), np.nan)


def miou_change(reference_cm: np.ndarray, variant_cm: np.ndarray, num_classes: int, alpha: float = ALPHA,
                resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Optional[dict]:
    """The mIoU change of a variant against the reference on the same images, from per-image confusion matrices
    (:func:`per_image_confusion`): a paired percentile bootstrap over images (Efron & Tibshirani 1993, ch. 13):
    images are resampled with replacement, the *same* images for both models, and mIoU is recomputed from the
    summed matrices each time (mIoU is not a mean over images, so there is no closed-form test). The verdict is
    "worse"/"better" when the ``1 - alpha`` interval of the drop excludes 0; ``p_value`` is the bootstrap's
    two-sided achieved significance (twice the smaller share of resampled drops on either side of 0).
    None when there are no images."""
    n = len(reference_cm)
    if n == 0 or len(variant_cm) != n:
        return None
    c = num_classes
    rng = np.random.default_rng(seed)
    ref_cm = reference_cm.astype(np.float64)
    var_cm = variant_cm.astype(np.float64)
    drops = np.empty(resamples)
    chunk = max(1, min(resamples, 4_000_000 // max(n, 1), 20_000_000 // max(c * c, 1)))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        idx = rng.integers(0, n, (size, n))
        weights = np.zeros((size, n))
        np.add.at(weights, (np.arange(size)[:, None], idx), 1.0)
        drops[start:start + size] = _miou(weights @ ref_cm, c) - _miou(weights @ var_cm, c)
    drops = drops[np.isfinite(drops)]
    ref, var = float(_miou(ref_cm.sum(0), c)), float(_miou(var_cm.sum(0), c))
    if not drops.size or not (math.isfinite(ref) and math.isfinite(var)):
        return None
    return paired_bootstrap_change("miou", n, ref, var, drops, alpha, resamples)


# ---------------------------------------------------------------------------- speed-up
def ratio_of_medians(numerator: Sequence[float], denominator: Sequence[float], confidence: float = CONFIDENCE,
                     resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Optional[tuple[float, float, float]]:
    """``median(numerator) / median(denominator)`` with its percentile-bootstrap interval (Efron & Tibshirani 1993,
    ch. 13): the two latency samples are independent timings, each resampled on its own. Returns
    (ratio, low, high), or None without samples. A speed-up is the reference's samples over the variant's."""
    a = np.asarray([x for x in numerator if x is not None], dtype=np.float64)
    b = np.asarray([x for x in denominator if x is not None], dtype=np.float64)
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not a.size or not b.size or np.median(b) <= 0:
        return None
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    ratios = ma / np.where(mb > 0, mb, np.nan)
    ratios = ratios[np.isfinite(ratios)]
    if not ratios.size:
        return None
    lo, hi = np.percentile(ratios, [50 * (1 - confidence), 100 - 50 * (1 - confidence)])
    return float(np.median(a) / np.median(b)), float(lo), float(hi)


# ---------------------------------------------------------------------------- chance level
def near_chance(correct: int, n: int, chance: float, skill: float = NEAR_CHANCE_SKILL,
                alpha: float = NEAR_CHANCE_ALPHA) -> dict:
    """Is a top-1 of ``correct`` / ``n`` near ``chance`` (what guessing scores: the most frequent class's share)?

    Rule: near chance unless an exact one-sided binomial test shows the top-1 above ``threshold`` at level ``alpha``
    (0.01), i.e. unless P(X ≥ correct | X ~ Binomial(n, threshold)) < alpha, with
    ``threshold = min(2 × chance, chance + skill × (1 - chance))``: twice chance, or ``skill`` (0.10) of the way
    from chance to 100 % (a chance-corrected accuracy, Cohen's kappa against a guessing rater, Cohen 1960) when
    that is lower. 19 % top-1 for 10 balanced classes, 55 % for 2, 2 % for 100, 0.2 % for 1,000. A model must
    *clearly* beat that bar: 12.5 % on a 10-class set is flagged on any number of images, 37 % is not from about
    40 images on. Returns {"near", "top1", "chance", "threshold", "p_value", "n", "alpha", "skill"}.
    """
    if n <= 0:
        raise ValueError("near_chance needs at least one labelled image")
    threshold = min(2.0 * chance, chance + skill * (1.0 - chance))
    p = 1.0 if correct <= 0 else _binom_sf(correct - 1, n, threshold)  # P(X >= correct)
    return {"near": bool(p >= alpha), "top1": correct / n, "chance": float(chance), "threshold": float(threshold),
            "p_value": float(p), "n": int(n), "alpha": alpha, "skill": skill}
