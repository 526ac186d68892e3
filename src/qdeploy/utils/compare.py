"""One comparison of two models' outputs on the same inputs (export checks, Q/DQ checks, later the linter)."""
from __future__ import annotations

import numpy as np


def compare_outputs(got: np.ndarray, ref: np.ndarray) -> dict:
    """Max absolute difference and the *smallest* per-sample cosine similarity of ``got`` vs ``ref``.

    Per sample, not over the batch: one broken image must not hide behind seven good ones. Raises
    ValueError on a shape mismatch (callers turn it into their own message).
    """
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape:
        raise ValueError(f"output shape {got.shape} differs from the reference's {ref.shape}")
    n = len(got) if got.ndim else 1
    a = got.reshape(n, -1).astype(np.float64)
    b = ref.reshape(n, -1).astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    # divided only where both norms are non-zero: an absolute epsilon in the denominator (it was 1e-30) turned the
    # cosine of two equal outputs of magnitude 1e-31 (a random-weight model's logits) into ~0
    both = (na > 0) & (nb > 0)
    cos = np.divide(np.sum(a * b, 1), na * nb, out=np.zeros(n), where=both)
    cos[(na == 0) & (nb == 0)] = 1.0  # two all-zero outputs agree (a zero vector has no direction to compare)
    return {
        "samples": int(n),
        "max_abs_diff": float(np.max(np.abs(a - b))) if a.size else 0.0,
        "min_cosine": float(np.min(cos)) if len(cos) else 1.0,
        "mean_cosine": float(np.mean(cos)) if len(cos) else 1.0,
        "median_cosine": float(np.median(cos)) if len(cos) else 1.0,
        "samples_below_0.99": int(np.sum(cos < 0.99)),
        "max_abs_reference": float(np.max(np.abs(b))) if b.size else 0.0,
    }
