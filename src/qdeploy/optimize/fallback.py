"""Per-layer fallback: keep the layers that hurt most in float, one at a time, until the budget is met.

The algorithm of NNCF's ``quantize_with_accuracy_control``, with a cheap first cut:
1. rank the quantized layers by one-pass local SQNR (``sensitivity.layer_sensitivity``), lowest first;
2. refine the top ``refine_top`` by reverting each alone and measuring agreement with FP32 on a subset of the search
   split made of the samples the quantized model gets most wrong (NNCF ranks every group this way; the SQNR cut keeps
   the cost at ``refine_top`` subset evaluations per ranking instead of one per layer);
3. revert greedily in that order, one full search-split evaluation per revert; a revert that moves the model away
   from FP32 (lower agreement on the search split) is undone (a float layer that does not help costs speed for
   nothing) and the remaining layers are ranked again on the current model;
4. stop when within budget, when the next revert would leave more than ``max_float_fraction`` of the compute (MACs) in
   float, when no layer is left, at the time limit, or (a fallback for speed) when the model is no longer faster than
   the answer already within budget, or when its ranking has no signal (no refined layer's revert gains more than one
   subset sample).

Agreement with FP32, not the task metric, ranks layers: recovering FP32's accuracy means recovering its predictions,
and on a few hundred samples agreement counts every changed prediction where accuracy counts only the net label hits
(lower variance, and it works without labels). Budget decisions still use the task metric on the whole search split,
with the agreement floor (decide.agreement_floor) as in every budget decision.

Everything that builds or evaluates is passed in, so this file is the decision logic alone and is tested on numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class FallbackHooks:
    """What the fallback needs from the search. Layer names are the FP32 ONNX's (what ``exclude`` matches)."""

    sensitivity: Callable[[list[str]], list[dict]]   # float layers so far -> [{name, sqnr_db, macs, quantized}], ranked
    subset_score: Callable[[list[str]], float]       # float layers -> agreement with FP32 on the subset
    full: Callable[[list[str]], Any]                 # float layers -> measured candidate (within_budget, margin, ...)
    time_left: Callable[[], Optional[float]]         # seconds left, None = no limit
    log: Callable[[str], None]
    # the model so far -> why going on cannot pay (None: go on). A fallback for speed (decide.fallback_for_speed) stops
    # once it is no faster than the answer already within budget: every further float layer only adds time
    pointless: Optional[Callable[[Any], Optional[str]]] = None
    # samples in the subset the ranking scores on: a gain of one sample is one flipped prediction, not a signal
    subset_size: Optional[int] = None
    for_speed: bool = False  # a fallback for speed: an answer within budget exists, so the loop is optional work


@dataclass
class FallbackResult:
    float_layers: list[str]
    candidates: list = field(default_factory=list)
    stop: str = ""
    within_budget: bool = False
    float_fraction: float = 0.0
    rankings: list[dict] = field(default_factory=list)
    macs: dict = field(default_factory=dict)   # {layer: MACs per sample} of every compute layer


def _ranking(hooks: FallbackHooks, floated: list[str], rejected: set, refine_top: int) -> tuple[list[str], dict, dict]:
    """(layer order to try, {name: macs} of every compute layer, the ranking's record for the log/report)."""
    layers = hooks.sensitivity(floated)
    macs = {d["name"]: d.get("macs") or 0 for d in layers}
    order = [d["name"] for d in layers if d.get("quantized") and d["name"] not in floated and d["name"] not in rejected]
    top = order[:refine_top]
    base = hooks.subset_score(floated)
    gains = {n: hooks.subset_score(floated + [n]) - base for n in top}
    refined = sorted(top, key=lambda n: -gains[n])
    sqnr = {d["name"]: d.get("sqnr_db") for d in layers}
    record = {"floated": list(floated), "subset_agreement": base,
              "refined": [{"layer": n, "sqnr_db": sqnr.get(n), "subset_gain": round(gains[n], 6)} for n in refined]}
    return refined + order[refine_top:], macs, record


def _no_signal(hooks: FallbackHooks, record: dict) -> Optional[str]:
    """Why a fallback for speed should stop at this ranking (None: go on). It is optional work (an answer within budget
    exists) whose trials can each cost a rebuild; when no refined layer's revert moves more than one sample of the
    subset toward FP32, the ranking cannot tell a helpful layer from a flip, and trying its layers one after another is
    a walk through all of them."""
    if not hooks.for_speed or not hooks.subset_size or not record["refined"]:
        return None
    best = max(r["subset_gain"] for r in record["refined"])
    if best * hooks.subset_size > 1 + 1e-9:
        return None
    return (f"no refined layer's revert moves more than one of the {hooks.subset_size} subset samples toward FP32 "
            f"(best gain {best * hooks.subset_size:+.0f} samples): no layer to try for speed")


def _moved_away(trial, current) -> bool:
    """Did reverting the layer move the model away from FP32? Judged by agreement with FP32 on the whole search split
    when both have it: every changed prediction counts, so it is far less noisy than the drop in accuracy (on 5,000
    images a 0.1-point accuracy change is 5 net labels, within the flips a float layer can cause either way). The
    budget itself is still decided on the task metric."""
    if trial.agreement is not None and current.agreement is not None:
        return trial.agreement < current.agreement
    return trial.margin is not None and current.margin is not None and trial.margin < current.margin


def run_fallback(start, hooks: FallbackHooks, *, refine_top: int, max_float_fraction: float) -> FallbackResult:
    """From ``start`` (the best PTQ candidate, not within budget), revert layers until within budget or a stop."""
    floated: list[str] = []
    rejected: set = set()
    current = start
    res = FallbackResult(float_layers=[])
    order, macs, record = _ranking(hooks, floated, rejected, refine_top)
    res.rankings.append(record)
    total = sum(macs.values()) or 1
    hooks.log(f"fallback: {len(order)} quantized layers ranked by SQNR; top {min(refine_top, len(order))} refined on the "
              f"subset: " + ", ".join(f"{r['layer']} ({r['subset_gain']:+.4f})" for r in record["refined"]))
    while True:
        if current.within_budget:
            res.stop = "within budget"
            break
        why = _no_signal(hooks, record)
        if why:
            res.stop = why
            break
        why = hooks.pointless(current) if hooks.pointless is not None else None
        if why:
            res.stop = why
            break
        left = hooks.time_left()
        if left is not None and left <= 0:
            res.stop = "time limit"
            break
        if not order:
            res.stop = "no quantized layer left to revert"
            break
        name = order.pop(0)
        share = sum(macs.get(n, 0) for n in floated + [name]) / total
        if share > max_float_fraction:
            res.stop = (f"reverting {name} would leave {100 * share:.1f} % of the compute in float "
                        f"(max_float_fraction {100 * max_float_fraction:.0f} %)")
            break
        trial = hooks.full(floated + [name])
        res.candidates.append(trial)
        worse = _moved_away(trial, current)
        agree = trial.agreement
        hooks.log(f"fallback: {name} in float -> {trial.verdict_text}"
                  + (f", agreement {100 * agree:.2f} %" if agree is not None and "agreement" not in str(trial.verdict_text) else "")
                  + ("; further from FP32 than without it: undone, re-ranking" if worse else ""))
        if worse:
            rejected.add(name)
            order, macs, record = _ranking(hooks, floated, rejected, refine_top)
            res.rankings.append(record)
            continue
        floated.append(name)
        current = trial
    res.float_layers = floated
    res.within_budget = bool(current.within_budget)
    res.float_fraction = sum(macs.get(n, 0) for n in floated) / total
    res.macs = macs
    return res


__all__ = ["FallbackHooks", "FallbackResult", "run_fallback"]
