"""The answer of a run: which variants collapsed, and which one to deploy.

Pure functions on variant records and the results dict (no I/O, no engines), so the pipeline calls
them once the measurements are in, and the reports only show what they decided:

    mark_degraded(results["variants"], task)            # INT8 variants whose accuracy collapsed
    results["recommendation"] = recommend(results)      # fastest variant within tolerance
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping

from qdeploy.report import tables as T

# An INT8 variant whose agreement is this far (as a fraction) below the median of its INT8 siblings is
# degraded even above min_agreement: its calibration went wrong where the others' did not.
SIBLING_GAP = 0.10
SIBLINGS_NEEDED = 2  # with one sibling there is no telling which of the two is the odd one
# Winner and runner-up whose p50s differ by less than this share are a tie on a real machine.
CLOSE_P50 = 0.05
_EPS = 1e-9  # a difference of exactly the threshold (0.5 points, 0.10) is not "beyond" it

METRIC_NAMES = {"top1": "top-1", "top5": "top-5", "miou": "mIoU", "pixel_acc": "pixel accuracy"}


def _metric(task: str) -> tuple[str, str]:
    key = T.METRICS.get(task, T.METRICS["classification"])[0][0]
    return key, METRIC_NAMES.get(key, key)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if x >= 0.1 else f"{x:.3f} ms"  # sub-0.1 ms models keep 3 significant-ish digits


# ---------------------------------------------------------------------------- degraded INT8 variants
def mark_degraded(variants: list[dict], task: str, min_agreement: float = 0.9) -> None:
    """Set ``status = "degraded"`` (with a ``reason`` naming the numbers) on INT8 variants whose accuracy
    collapsed. In place; only variants with ``precision == "int8"``, status ``ok`` and an ``agreement``
    (share of predictions identical to the reference's) are considered. Two rules:

    1. threshold: ``agreement < min_agreement``;
    2. siblings: ``agreement`` more than ``SIBLING_GAP`` (0.10) below the median agreement of the other
       ok INT8 variants, when there are at least ``SIBLINGS_NEEDED`` (2) of them. It catches one broken
       calibration method among several healthy ones even when it clears the threshold.

    Both rules read the agreements as they were on entry, so the result does not depend on the order of
    ``variants``. Degraded variants keep all their measurements; they are never recommended.
    """
    key, metric = _metric(task)
    what = "predictions" if task == "classification" else "pixel predictions"
    int8 = [v for v in variants if v.get("precision") == "int8" and v.get("status") == "ok"
            and T.num(v.get("agreement")) is not None]
    agreement = {id(v): T.num(v["agreement"]) for v in int8}
    reasons = {}
    for v in int8:
        a = agreement[id(v)]
        value = T.num(T.section(v, "metrics").get(key))
        own = f" (its {metric} {_pct(value)})" if value is not None else ""
        if a < min_agreement - _EPS:
            reasons[id(v)] = (f"INT8 accuracy collapsed: {_pct(a)} of its {what} agree with the reference's, "
                              f"below the {_pct(min_agreement)} minimum{own}")
            continue
        siblings = [(str(o.get("name")), agreement[id(o)]) for o in int8 if o is not v]
        if len(siblings) < SIBLINGS_NEEDED:
            continue
        median = statistics.median(x for _, x in siblings)
        if median - a > SIBLING_GAP + _EPS:
            reasons[id(v)] = (f"INT8 accuracy collapsed against its sibling INT8 variants: {_pct(a)} of its {what} "
                              f"agree with the reference's, {100 * (median - a):.2f} points below their median "
                              f"{_pct(median)} ({', '.join(n for n, _ in siblings)}){own}")
    for v in int8:
        if id(v) in reasons:
            v["status"] = "degraded"
            v["reason"] = reasons[id(v)]
    # no silent precision (TensorRT): an engine that asked for FP16/INT8 and runs mostly FP32 is not what was asked for
    for v in variants:
        shortfall = T.section(v, "tensorrt_engine").get("precision_shortfall")
        if shortfall and v.get("status") == "ok":
            v["status"], v["reason"] = "degraded", f"TensorRT built a different precision: {shortfall}"


# ---------------------------------------------------------------------------- recommendation
def _not_ok_why(v: Mapping) -> str | None:
    status = v.get("status")
    if status == "ok":
        return None
    if status == "degraded":
        return f"degraded: {v.get('reason') or 'INT8 accuracy collapsed'}"
    return T.status_text(v)  # "failed at build: …", "skipped at check: …"


def _default_batch_size(order: list[str], measured: dict[str, set[str]]) -> str | None:
    """The smallest batch size every candidate measured; else the one most of them measured (smallest on ties)."""
    if not measured:
        return None
    common = set.intersection(*measured.values())
    for bs in order:
        if bs in common:
            return bs
    counts = {bs: sum(bs in m for m in measured.values()) for bs in order}
    best = max(counts.values(), default=0)
    return next((bs for bs in order if counts[bs] == best), None) if best else None


def recommend(results: Mapping, tolerance: float = 0.5, batch_size: str | int | None = None) -> dict:
    """The variant to deploy: the fastest (p50 at ``batch_size``) among those that ran ``ok`` (not degraded,
    skipped or failed), whose latency is their deployment engine's (``speed_is_deployment``) and whose
    headline metric (top-1 / mIoU) is at most ``tolerance`` percentage points below the reference's
    (``results["reference"]``; more accurate than the reference is fine).

    ``batch_size`` defaults to the smallest batch size every such variant measured. Returns
    ``{"variant", "runner_up", "tolerance", "metric", "batch_size", "reason", "excluded"}``: ``variant``
    is None (and ``reason`` says why) when nothing qualifies; ``excluded`` maps every variant other than
    the winner and the runner-up to why it is not recommended.
    """
    task = T.task(results)
    key, metric = _metric(task)
    tolerance = float(tolerance)
    out = {"variant": None, "runner_up": None, "tolerance": tolerance, "metric": key, "batch_size": None,
           "reason": "", "excluded": {}}
    excluded: dict[str, str] = {}
    ref = T.reference(results)
    ref_name = str(results.get("reference")) if ref is not None else None
    ref_value = T.num(T.section(ref, "metrics").get(key)) if ref is not None else None

    accurate = []
    for v in T.variants(results):
        name = str(v.get("name"))
        value = T.num(T.section(v, "metrics").get(key))
        why = _not_ok_why(v)
        if why is None and value is None:
            why = f"no {metric} measured"
        if why is None and ref_value is None:
            why = f"no reference {metric} to compare with"
        if why is None and 100 * (ref_value - value) > tolerance + _EPS:
            why = f"{metric} {100 * (value - ref_value):+.2f} points vs the reference (tolerance {tolerance:g})"
        if why is None and not T.deploys_speed(v):
            why = "speed not its deployment engine's: its latency was measured in another runtime"
        if why is None:
            accurate.append(v)
        else:
            excluded[name] = why

    order = T.batch_sizes(results)
    measured = {str(v.get("name")): {bs for bs in order if T.p50(v, bs) is not None} for v in accurate}
    bs = str(batch_size) if batch_size is not None else _default_batch_size(order, measured)
    out["batch_size"] = bs
    candidates = []
    for v in accurate:
        if bs is not None and T.p50(v, bs) is not None:
            candidates.append(v)
        else:
            excluded[str(v.get("name"))] = f"no latency at batch {bs}" if bs is not None else "no latency measured"
    candidates.sort(key=lambda v: T.p50(v, bs))  # stable: ties keep the config's order

    if not candidates:
        out["reason"] = "No variant recommended on this machine: " + _nothing_qualifies(
            results, metric, ref_value, tolerance, accurate, bs)
        out["excluded"] = excluded
        return out

    winner, runner = candidates[0], (candidates[1] if len(candidates) > 1 else None)
    for rank, v in enumerate(candidates[2:], start=3):
        excluded[str(v.get("name"))] = (f"slower: p50 {_ms(T.p50(v, bs))} at batch {bs} "
                                        f"(rank {rank} of {len(candidates)})")
    out.update(variant=str(winner.get("name")), runner_up=str(runner.get("name")) if runner else None,
               excluded=excluded,
               reason=_winner_reason(results, winner, runner, candidates, bs, key, metric, ref, ref_value, tolerance))
    return out


def _nothing_qualifies(results: Mapping, metric: str, ref_value: float | None, tolerance: float,
                       accurate: list, bs: str | None) -> str:
    if results.get("reference") is None:
        return f"there is no reference variant to compare {metric} with (was the eval stage run?)."
    if ref_value is None:
        samples = ((results.get("variants") or [{}])[0].get("metrics") or {})
        if samples.get("labelled_samples") == 0:
            return (f"data.eval has no labels (labels: false), so there is no {metric}: compare the variants by their "
                    "agreement with the reference, or use qdeploy optimize with budget.min_agreement.")
        return f"the reference {results['reference']} has no {metric} (was the eval stage run?)."
    if not accurate:
        return (f"no variant that ran ok, with its deployment engine's speed, is within {tolerance:g} points "
                f"of the reference's {metric} ({_pct(ref_value)}).")
    where = f"at batch {bs}" if bs is not None else "at any batch size"
    return (f"none of the {len(accurate)} variant(s) within {tolerance:g} points of the reference's {metric} "
            f"has a latency {where} (was the bench stage run?).")


def _winner_reason(results, winner, runner, candidates, bs, key, metric, ref, ref_value, tolerance) -> str:
    name = str(winner.get("name"))
    wp = T.p50(winner, bs)
    ref_p50 = T.p50(ref, bs) if ref is not None and T.is_ok(ref) and T.deploys_speed(ref) else None
    if winner is ref:
        speed = "; it is the reference"
    elif ref_p50:
        speed = f", {ref_p50 / wp:.1f}× {ref.get('name')}"
    else:
        speed = ""
    n = len(candidates)
    text = (f"{name}: fastest p50 on this machine at batch {bs} ({_ms(wp)}{speed}) among {n} "
            f"variant{'s' if n != 1 else ''} within {tolerance:g} points of the reference's {metric} "
            f"({_pct(ref_value)})")
    value = T.num(T.section(winner, "metrics").get(key))
    if winner is not ref and value is not None:
        text += f"; its {metric} {_pct(value)} ({100 * (value - ref_value):+.2f})"
    text += "."
    if runner is None:
        return text + " No runner-up: no other variant qualifies."
    rp = T.p50(runner, bs)
    text += f" Runner-up {runner.get('name')} ({_ms(rp)})."
    noise = []
    for v in (winner, runner):
        stats = T.latency_stats(v, bs)
        if T.noisy(stats):
            cv = T.num(stats.get("cv"))
            noise.append(f"{v.get('name')}'s timing is noisy" + (f", CV {100 * cv:.1f} %" if cv is not None else ""))
    gap = (rp - wp) / rp if rp else 0.0
    if gap < CLOSE_P50:
        noise.append(f"their p50s differ by only {100 * gap:.1f} %")
    if noise:
        text += (f" The lead over {runner.get('name')} is within noise ({'; '.join(noise)}): "
                 "on this machine both are about as fast.")
    return text
