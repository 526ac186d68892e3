"""The judgement rules on measurements that ``qdeploy run`` and ``qdeploy optimize`` share, on plain numbers and
records: the agreement rules (a variant or candidate whose predictions are not the reference's), the statuses of a
variant that ran, and the two warnings a report opens with.

Below the report and optimize stages so both read one definition: ``report.verdict.mark_degraded`` marks INT8
variants with :func:`agreement_rule`, ``optimize.decide.agreement_floor`` rejects candidates with it.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping

# A variant that ran and was measured: ``ok``, or ``degraded`` (measured, but its accuracy collapsed: never recommended).
RAN_STATUSES = ("ok", "degraded")

# An INT8 variant whose agreement is this far (as a fraction) below the median of its INT8 siblings is
# degraded even above min_agreement: its calibration went wrong where the others' did not.
SIBLING_GAP = 0.10
SIBLINGS_NEEDED = 2  # with one sibling there is no telling which of the two is the odd one
EPS = 1e-9  # a difference of exactly a threshold (0.5 points, 0.10) is not "beyond" it

# Which agreement rule rejected a variant or candidate (``Verdict.rule``, a variant's reason, ``rejected_by``).
RULE_MIN_AGREEMENT = "min_agreement"
RULE_SIBLINGS = "siblings"

# results["warnings"][i]["code"]: what the headline opens with (and what `qdeploy run`'s exit code reads)
NEAR_CHANCE = "reference-near-chance"
INT8_ALL_FAILED = "every-int8-variant-failed"
NEAR_CHANCE_CAUSES = ("input size (model.preprocess input_size/resize/crop: a 32x32 model fed 224x224?)",
                      "normalisation (preprocess mean/std, RGB vs L)",
                      "class order (data.eval classes/class_names vs the order the model was trained with)",
                      "weights (model.weights not loaded, or of another model)")


def agreement_rule(agreement: float, min_agreement: float, siblings=()) -> tuple[str, float] | None:
    """The two agreement rules on numbers (agreement with the reference as a fraction): ``(RULE_MIN_AGREEMENT,
    min_agreement)`` when ``agreement`` is below ``min_agreement``; else ``(RULE_SIBLINGS, median)`` when it is more than
    ``SIBLING_GAP`` below the ``median`` agreement of ``siblings`` (the other INT8 variants' agreements) and there are
    at least ``SIBLINGS_NEEDED`` of them; else None. A difference of exactly a threshold is not beyond it."""
    if agreement < min_agreement - EPS:
        return RULE_MIN_AGREEMENT, min_agreement
    siblings = list(siblings)
    if len(siblings) >= SIBLINGS_NEEDED:
        median = statistics.median(siblings)
        if median - agreement > SIBLING_GAP + EPS:
            return RULE_SIBLINGS, median
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def near_chance_warning(results: Mapping, check: Mapping, chance_basis: str = "") -> dict | None:
    """The ``reference-near-chance`` warning from :func:`qdeploy.evaluate.stats.near_chance`'s ``check`` on the
    reference's top-1, or None when the reference is clearly above chance."""
    if not check or not check.get("near"):
        return None
    ref = results.get("reference")
    n = float(check["n"])
    message = (f"The reference {ref}'s top-1 {_pct(check['top1'])} is near chance ({_pct(check['chance'])}"
               + (f", {chance_basis}" if chance_basis else "") + f"): not clearly above {_pct(check['threshold'])} "
               f"(exact binomial test, one-sided p = {check['p_value']:.2g} on {n:,.0f} labelled images). The model or "
               "its inputs are likely wrong; check the " + "; the ".join(NEAR_CHANCE_CAUSES)
               + ". Every comparison below is against a reference that does not work.")
    return {"code": NEAR_CHANCE, "message": message, "variant": ref,
            **{k: check[k] for k in ("top1", "chance", "threshold", "p_value", "n", "alpha", "skill") if k in check}}


def int8_failure_warning(variants: list[Mapping]) -> dict | None:
    """The ``every-int8-variant-failed`` warning when the run had INT8 variants and none of them ran (each failed or
    was skipped), naming each one's stage and reason; None otherwise."""
    int8 = [v for v in variants if v.get("precision") == "int8"]
    if not int8 or any(v.get("status") in RAN_STATUSES for v in int8):
        return None
    parts = {}
    for v in int8:
        stage = str(v.get("failed_stage") or "?") + (" (skipped)" if v.get("status") == "skipped" else "")
        parts[str(v.get("name"))] = f"{stage}: {v.get('reason') or 'no reason given'}"
    every = "every INT8 variant failed" if all(v.get("status") == "failed" for v in int8) else \
        "no INT8 variant ran (every one failed or was skipped)"
    message = f"{every[0].upper()}{every[1:]}: " + "; ".join(f"{k}: {why}" for k, why in parts.items())
    return {"code": INT8_ALL_FAILED, "message": message, "variants": parts}
