"""The answer of a run: which variants collapsed, which one to deploy, and what the reader must know first.

Pure functions on variant records and the results dict (no I/O, no engines), so the pipeline calls
them once the measurements are in, and the reports only show what they decided:

    mark_degraded(results["variants"], task, tolerance=0.5)  # INT8 variants that dropped or agree too little
    results["recommendation"] = recommend(results)          # fastest variant within tolerance
    results["warnings"] = run_warnings(results, chance)     # reference near chance, every INT8 variant failed

The statistics themselves (exact McNemar, Agresti–Min and bootstrap intervals, the binomial chance test) are in
:mod:`qdeploy.evaluate.stats`; the agreement rules and the two warnings, which ``qdeploy optimize`` applies too, in
:mod:`qdeploy.evaluate.verdict_rules`.
"""
from __future__ import annotations

from collections.abc import Mapping

from qdeploy.config import DEFAULT_MIN_AGREEMENT
from qdeploy.evaluate.stats import ratio_of_medians
from qdeploy.evaluate.verdict_rules import (EPS, RULE_MIN_AGREEMENT, SIBLING_GAP, agreement_rule, int8_failure_warning,
                                            near_chance_warning)
from qdeploy.report import tables as T
from qdeploy.tasks import DEFAULT_TASK, TASKS, get_task

# Winner and runner-up whose p50s differ by less than this share are a tie on a real machine.
CLOSE_P50 = 0.05

# a metric key's name in sentences: each task's headline, and the report's other columns
METRIC_NAMES = {**{t.metric: t.metric_label for t in TASKS.values()},
                "top5": "top-5", "pixel_acc": "pixel accuracy", "map50": "mAP@0.5"}


def _metric(task: str) -> tuple[str, str]:
    key = T.METRICS.get(task, T.METRICS[DEFAULT_TASK])[0][0]
    return key, METRIC_NAMES.get(key, key)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if x >= 0.1 else f"{x:.3f} ms"  # sub-0.1 ms models keep 3 significant-ish digits


def change_text(change: Mapping) -> str:
    """An ``accuracy_change`` in one phrase: "no detectable change: -0.05 points (95 % CI -2.01 to +1.91, exact
    McNemar p = 1 on 2,000 images)"."""
    drop = T.num(change.get("drop_points"))
    return (f"{change.get('verdict') or '?'}: {T.DASH if drop is None else f'{-drop:+.2f}'} points "
            f"({_evidence(change)})")


def change_brief(change: Mapping) -> str:
    """The verdict and its evidence, without the change itself: "no detectable change, 95 % CI -1.05 to +2.71,
    exact McNemar p = 0.55 on 359 images"."""
    return f"{change.get('verdict') or '?'}, {_evidence(change)}"


def _evidence(change: Mapping) -> str:
    conf = T.num(change.get("confidence"))
    lo, hi, p = T.num(change.get("ci_low_points")), T.num(change.get("ci_high_points")), T.num(change.get("p_value"))
    n = T.num(change.get("n"))
    ci = (f"{100 * conf:.0f} % CI " if conf is not None else "CI ") + (
        f"{-hi:+.2f} to {-lo:+.2f}" if lo is not None and hi is not None else T.DASH)
    return (f"{ci}, {change.get('test') or 'test'} p = {T.DASH if p is None else f'{p:.2g}'}"
            + (f" on {n:,.0f} images" if n is not None else ""))


# ---------------------------------------------------------------------------- degraded INT8 variants
def mark_degraded(variants: list[dict], task: str, min_agreement: float = DEFAULT_MIN_AGREEMENT,
                  tolerance: float = 0.5) -> None:
    """Set ``status = "degraded"`` (with a ``reason`` naming the rule and its numbers) on INT8 variants whose
    accuracy dropped or whose predictions are not the reference's. In place; only variants with
    ``precision == "int8"`` and status ``ok`` are considered. Three rules, each enough on its own:

    A. change (with labels: the variant carries an ``accuracy_change`` against the reference, see
       :mod:`qdeploy.evaluate.stats`): degraded when the change is a detectable drop (``verdict == "worse"``: exact
       McNemar test on the images only one of the two models gets right, p < 0.05, McNemar 1947 / Dietterich 1998, for
       classification; a 95 % paired bootstrap interval over images that excludes 0 for segmentation mIoU, Efron &
       Tibshirani 1993) **and** the measured drop exceeds ``tolerance`` points (``report.tolerance``, the
       recommendation's own bar). A significant drop smaller than the tolerance is reported ("worse") without
       marking the variant.
    1. threshold (``eval.min_agreement``): ``agreement < min_agreement`` (agreement: share of predictions, or
       pixels, identical to the reference's on the same images);
    2. siblings: ``agreement`` more than ``SIBLING_GAP`` (0.10) below the median agreement of the other INT8
       variants, when there are at least ``SIBLINGS_NEEDED`` (2) of them. It catches one broken calibration method
       among several healthy ones even when it clears the threshold.

    The agreement rules (1, 2: ``verdict_rules.agreement_rule``, shared with ``qdeploy optimize``'s agreement floor) apply with
    and without labels: a variant that agrees with the reference on less than ``min_agreement`` of the images is
    degraded even when McNemar sees "no detectable change" in top-1. A near-chance or random-weight reference makes
    accuracy blind (a collapsed model that answers the most frequent class scores what the reference scores), while
    agreement still says the variant is not the reference's model. The reason then names the rule, the agreement
    and, with labels, the accuracy change that did not catch it.

    The rules read the records as they were on entry, so the result does not depend on the order of
    ``variants``. Degraded variants keep all their measurements; they are never recommended.
    """
    key, metric = _metric(task)
    what = get_task(task).predictions_word
    tolerance = float(tolerance)
    candidates = [v for v in variants if v.get("precision") == "int8" and v.get("status") == "ok"]
    reasons: dict[int, list[str]] = {}
    for v in candidates:
        change = T.section(v, "accuracy_change")
        drop = T.num(change.get("drop_points"))
        if change.get("verdict") == "worse" and drop is not None and drop > tolerance + EPS:
            name = METRIC_NAMES.get(str(change.get("metric")), metric)
            a = T.num(v.get("agreement"))
            reasons.setdefault(id(v), []).append(
                f"INT8 {name} dropped beyond the {tolerance:g}-point tolerance: "
                f"{_pct(T.num(change.get('reference')) or 0)} → {_pct(T.num(change.get('variant')) or 0)}, "
                + change_text(change) + (f"; agreement with the reference {_pct(a)}" if a is not None else ""))
    int8 = [v for v in candidates if T.num(v.get("agreement")) is not None]
    agreement = {id(v): T.num(v["agreement"]) for v in int8}
    for v in int8:
        a = agreement[id(v)]
        siblings = [(str(o.get("name")), agreement[id(o)]) for o in int8 if o is not v]
        rule = agreement_rule(a, min_agreement, [x for _, x in siblings])
        if rule is None:
            continue
        value = T.num(T.section(v, "metrics").get(key))
        own = f" (its {metric} {_pct(value)})" if value is not None else ""
        change = T.section(v, "accuracy_change")
        if change.get("verdict") and not reasons.get(id(v)):
            # labelled: say what the accuracy test saw, and why agreement overrules it
            own += (f"; the paired test of its {metric} ({change_text(change)}) cannot see this: a model that "
                    "agrees this little is not the reference's, whatever its accuracy")
        if rule[0] == RULE_MIN_AGREEMENT:
            text = (f"INT8 accuracy collapsed: {_pct(a)} of its {what} agree with the reference's, "
                    f"below the {_pct(min_agreement)} minimum (eval.min_agreement){own}")
        else:
            median = rule[1]
            text = (f"INT8 accuracy collapsed against its sibling INT8 variants: {_pct(a)} of its {what} "
                    f"agree with the reference's, {100 * (median - a):.2f} points below their median "
                    f"{_pct(median)} ({', '.join(n for n, _ in siblings)}; more than the "
                    f"{100 * SIBLING_GAP:g}-point sibling gap){own}")
        reasons.setdefault(id(v), []).append(text)
    for v in candidates:
        if id(v) in reasons:
            v["status"] = "degraded"
            v["reason"] = "; ".join(reasons[id(v)])
    # no silent precision (TensorRT): an engine that asked for FP16/INT8 and runs mostly FP32 is not what was asked for
    for v in variants:
        shortfall = T.section(v, "tensorrt_engine").get("precision_shortfall")
        if shortfall and v.get("status") == "ok":
            v["status"], v["reason"] = "degraded", f"TensorRT built a different precision: {shortfall}"


# ---------------------------------------------------------------------------- what the headline opens with
def run_warnings(results: Mapping, near_chance_check: Mapping | None = None, chance_basis: str = "") -> list[dict]:
    """What every report must say before the recommendation: ``[{"code", "message", ...}]``, most basic first."""
    out = [near_chance_warning(results, near_chance_check or {}, chance_basis),
           int8_failure_warning(T.variants(results))]
    return [w for w in out if w is not None]


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
    the winner and the runner-up to why it is not recommended. A winner other than the reference also gets
    ``speedup`` (:func:`speedup`: the ratio of p50s with its 95 % bootstrap interval); the reason states the ratio
    with that interval, and none at all when either timing is noisy (benchmark.latency: scatter around the p50, drift, batch inversion): a 34.7× from a
    timing with a CV of 143 % is not a headline.
    """
    task = T.task(results)
    key, metric = _metric(task)
    tolerance = float(tolerance)
    out = {"variant": None, "runner_up": None, "tolerance": tolerance, "metric": key, "batch_size": None,
           "reason": "", "excluded": {}}
    excluded: dict[str, str] = {}
    ref = T.reference(results)
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
        if why is None and 100 * (ref_value - value) > tolerance + EPS:
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
    gain = speedup(results, winner, bs) if winner is not T.reference(results) else None
    if gain is not None:
        out["speedup"] = gain
    out.update(variant=str(winner.get("name")), runner_up=str(runner.get("name")) if runner else None,
               excluded=excluded,
               reason=_winner_reason(winner, runner, candidates, bs, key, metric, ref, ref_value, tolerance, gain))
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


def speedup(results: Mapping, v: Mapping, bs: str | None) -> dict | None:
    """The reference's p50 over ``v``'s at batch ``bs``, with a 95 % percentile-bootstrap interval of the ratio of
    medians from both latency samples (``latency_samples_ms``; :func:`qdeploy.evaluate.stats.ratio_of_medians`), and
    whether either timing is noisy (``tables.noisy``: scatter, drift or a batch inversion), in which case the ratio is
    not headlined: ``withheld`` says why (``tables.ratio_withheld``, the rule every report applies to a speed-up).
    None without a reference whose speed is its deployment engine's, or without both p50s."""
    ref = T.reference(results)
    if bs is None or ref is None or not T.is_ok(ref) or not T.deploys_speed(ref) or not T.deploys_speed(v):
        return None
    rp, vp = T.p50(ref, bs), T.p50(v, bs)
    if not rp or not vp:
        return None
    out = {"reference": str(ref.get("name")), "batch_size": bs, "ratio": rp / vp, "ci_low": None, "ci_high": None,
           "confidence": None, "noisy": [str(x.get("name")) for x in (ref, v) if T.noisy(T.latency_stats(x, bs))],
           "withheld": T.ratio_withheld([(x.get("name"), T.latency_stats(x, bs)) for x in (ref, v)])}
    samples = [T.at_batch(T.section(x, "latency_samples_ms"), bs) for x in (ref, v)]
    if all(isinstance(s, list) and s for s in samples):
        boot = ratio_of_medians(*samples)
        if boot is not None:
            out.update(ci_low=boot[1], ci_high=boot[2], confidence=0.95)
    return out


def speedup_text(s: Mapping) -> str:
    """``3.3× torch-fp32 (95 % CI 3.2–3.4×)``; for a noisy timing, that no ratio is given and why (``withheld``)."""
    ref = s.get("reference")
    if s.get("withheld") or s.get("noisy"):
        why = s.get("withheld") or f"timing too noisy ({', '.join(map(str, s['noisy']))})"
        return f"speed-up over {ref} not stated: {why}"
    text = f"{s['ratio']:.1f}× {ref}"
    lo, hi = T.num(s.get("ci_low")), T.num(s.get("ci_high"))
    if lo is not None and hi is not None:
        text += f" (95 % CI {lo:.2f}–{hi:.2f}×)"
    return text


def _winner_reason(winner, runner, candidates, bs, key, metric, ref, ref_value, tolerance, gain) -> str:
    name = str(winner.get("name"))
    wp = T.p50(winner, bs)
    if winner is ref:
        speed = "; it is the reference"
    elif gain is not None:
        speed = ", " + speedup_text(gain)
    else:
        speed = ""
    n = len(candidates)
    text = (f"{name}: fastest p50 on this machine at batch {bs} ({_ms(wp)}{speed}) among {n} "
            f"variant{'s' if n != 1 else ''} within {tolerance:g} points of the reference's {metric} "
            f"({_pct(ref_value)})")
    value = T.num(T.section(winner, "metrics").get(key))
    if winner is not ref and value is not None:
        change = T.section(winner, "accuracy_change")
        text += f"; its {metric} {_pct(value)} ({100 * (value - ref_value):+.2f}" + (
            f": {change_brief(change)})" if change.get("verdict") else ")")
    text += "."
    if runner is None:
        return text + " No runner-up: no other variant qualifies."
    rp = T.p50(runner, bs)
    text += f" Runner-up {runner.get('name')} ({_ms(rp)})."
    noise = []
    said = set(gain["noisy"]) if gain is not None else set()  # reasons the speed-up clause already gave
    for v in (winner, runner):
        stats = T.latency_stats(v, bs)
        if T.noisy(stats):
            noise.append(f"{v.get('name')}'s timing is noisy"
                         + (f", {T.noise_text(stats)}" if str(v.get("name")) not in said else ""))
    gap = (rp - wp) / rp if rp else 0.0
    if gap < CLOSE_P50:
        noise.append(f"their p50s differ by only {100 * gap:.1f} %")
    if noise:
        text += (f" The lead over {runner.get('name')} is within noise ({'; '.join(noise)}): "
                 "on this machine both are about as fast.")
    return text
