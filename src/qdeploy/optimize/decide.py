"""The decisions of ``qdeploy optimize``, as plain functions: split, budget, standard error, ranking.

Kept free of engines and files so each rule is tested on numbers: a silent wrong choice here is the product's worst
failure (a "within budget" artifact that is not).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

import numpy as np

from qdeploy.config import BudgetSpec
from qdeploy.evaluate.verdict_rules import EPS, RULE_MIN_AGREEMENT, SIBLING_GAP, SIBLINGS_NEEDED, agreement_rule
from qdeploy.tasks import get_task


@dataclass
class Verdict:
    within: bool
    margin: float        # how far inside (+) or outside (-) the budget, in the budget's own unit
    why: str
    # what rejected it (None: within): the budget's own kind (max_drop, relative, min_agreement), the agreement floor
    # (verdict_rules.RULE_MIN_AGREEMENT: below budget.min_agreement; verdict_rules.RULE_SIBLINGS: far below its INT8
    # siblings), or
    # "unmeasured" (no metric or no agreement to decide on)
    rule: Optional[str] = None


def agreement_floor(agreement: Optional[float], min_agreement: float, siblings=(), se: Optional[float] = None,
                    z: float = 0.0, default: bool = False) -> Verdict:
    """The agreement floor every budget decision includes: is ``agreement`` (share of predictions identical to FP32's on
    the same images, a fraction) high enough, whatever the accuracy? The rules are qdeploy run's degraded rules
    (evaluate.verdict_rules.agreement_rule): below ``min_agreement``, or more than verdict_rules.SIBLING_GAP below the
    median of ``siblings`` (the other INT8 candidates' agreements, when there are verdict_rules.SIBLINGS_NEEDED of them).

    As in :func:`budget_check`, ``se`` (a fraction) and ``z`` put the decision on the one-sided lower bound
    ``agreement - z*se`` (both rules test it), so a candidate is only called clear of the floor when it is, with that
    confidence. ``margin``: the bound minus the floor (or the sibling gap left), a fraction; ``default``: the floor is
    the default (budget.min_agreement not given), said in ``why``."""
    if agreement is None:
        return Verdict(False, -1.0, "no agreement with FP32 measured: the agreement floor cannot be checked", "unmeasured")
    k = z * se if se is not None and z > 0 else 0.0
    bound = agreement - k
    shown = f"agreement with FP32 {100 * agreement:.2f} %" + (f" (lower bound {100 * bound:.2f} %)" if k else "")
    floor = f"{100 * min_agreement:.2f} %" + (" (default)" if default else "")
    siblings = [float(x) for x in siblings]
    margin = bound - min_agreement
    if len(siblings) >= SIBLINGS_NEEDED:
        margin = min(margin, SIBLING_GAP - (statistics.median(siblings) - bound))
    rule = agreement_rule(bound, min_agreement, siblings)
    if rule is None:
        return Verdict(True, margin, f"{shown} ≥ {floor} floor")
    if rule[0] == RULE_MIN_AGREEMENT:
        why = (f"{shown} below the {floor} agreement floor (budget.min_agreement): not within budget, whatever its "
               "accuracy")
    else:
        why = (f"{shown} is {100 * (rule[1] - bound):.2f} points below the median {100 * rule[1]:.2f} % of its "
               f"{len(siblings)} INT8 siblings (more than the {100 * SIBLING_GAP:g}-point sibling gap): not within "
               "budget, whatever its accuracy")
    return Verdict(False, margin, why, rule[0])


def budget_check(budget: BudgetSpec, reference: Optional[float], metric: Optional[float], agreement: Optional[float],
                 se: Optional[float] = None, z: float = 0.0, *, agreement_se: Optional[float] = None,
                 siblings=()) -> Verdict:
    """Is a candidate within ``budget`` of the FP32 reference? Metrics are fractions (0.9173), drops in points.

    ``se`` (points for a drop, a fraction for agreement) and ``z``: decide on the one-sided confidence bound
    (drop + z*se, agreement - z*se) instead of the point estimate, so that a candidate at the edge of the budget on the
    search split is not taken for one that is inside it (on held-out images it lands on either side).

    Every budget includes the agreement floor (:func:`agreement_floor`, budget.floor: min_agreement or its default,
    and the siblings rule over ``siblings``), decided on the bound of ``agreement`` with ``agreement_se`` (a fraction;
    for an agreement budget ``se`` is that already). A candidate below the floor is never within budget, whatever its
    accuracy: a drop budget alone lets a collapsed model through when FP32 is poor or the labels are few. ``margin``
    stays in the budget's unit; a floor shortfall counts in percentage points of images for a drop budget."""
    k = z * se if se is not None and z > 0 else 0.0
    default_floor = budget.min_agreement is None
    if budget.agreement_only:
        if agreement is None:
            return Verdict(False, -1.0, "no agreement with FP32 measured", "unmeasured")
        margin = agreement - k - budget.min_agreement
        bound = f" (lower bound {100 * (agreement - k):.2f} %)" if k else ""
        own = Verdict(margin >= -1e-12, margin,
                      f"agreement {100 * agreement:.2f} %{bound} vs minimum {100 * budget.min_agreement:.2f} %")
        if not own.within:
            own.rule = budget.kind
            return own
        # the threshold is the budget itself: what the floor adds is the siblings rule
        floor = agreement_floor(agreement, budget.min_agreement, siblings, se, z)
        return own if floor.within else Verdict(False, min(own.margin, floor.margin), floor.why, floor.rule)
    if reference is None or metric is None:
        return Verdict(False, -1.0, "no task metric (labels) measured; use budget.min_agreement without labels",
                       "unmeasured")
    drop_points = 100.0 * (reference - metric)
    allowed = budget.allowed_points(reference)
    margin = allowed - drop_points - k
    bound = f" (upper bound {drop_points + k:.2f})" if k else ""
    own = Verdict(margin >= -1e-9, margin, f"drop {drop_points:.2f} points{bound} vs allowed {allowed:.2f}",
                  None if margin >= -1e-9 else budget.kind)
    floor = agreement_floor(agreement, budget.floor, siblings, agreement_se, z, default=default_floor)
    if not floor.within:
        return Verdict(False, min(own.margin, 100.0 * floor.margin), f"{floor.why}; {own.why}", floor.rule)
    return Verdict(own.within, own.margin, f"{own.why}; {floor.why}", own.rule)


def paired_drop_se(reference_correct: np.ndarray, candidate_correct: np.ndarray) -> float:
    """Standard error (points) of the accuracy drop between two models on the *same* samples: only the samples on which
    they differ carry variance (McNemar), so it is far below the binomial error of either accuracy."""
    d = reference_correct.astype(np.float64) - candidate_correct.astype(np.float64)
    n = len(d)
    return 100.0 * float(np.std(d, ddof=1) / math.sqrt(n)) if n > 1 else float("inf")


def agreement_se(per_sample: np.ndarray) -> float:
    """Standard error of the mean agreement over samples (per image for segmentation: pixels of one image are not
    independent draws, images are)."""
    n = len(per_sample)
    return float(np.std(per_sample.astype(np.float64), ddof=1) / math.sqrt(n)) if n > 1 else float("inf")


def z_of(confidence: float) -> float:
    """One-sided normal quantile; confidence 0.5 gives 0 (decide on the point estimate)."""
    return max(0.0, NormalDist().inv_cdf(confidence))


def metric_standard_error(metric: float, n: int) -> float:
    """Standard error of an accuracy-like fraction measured on ``n`` samples, in points (binomial)."""
    if n <= 0:
        return float("inf")
    p = min(max(metric, 0.0), 1.0)
    return 100.0 * math.sqrt(max(p * (1 - p), 1.0 / n) / n)


def resolution_warning(budget: BudgetSpec, reference: float, n_search: int, task: str) -> Optional[str]:
    """A sentence when the search split is too small to resolve the budget (max_drop/relative on classification)."""
    if not get_task(task).per_sample_standard_error or budget.agreement_only:
        return None
    allowed = budget.allowed_points(reference)
    se = metric_standard_error(reference, n_search)
    if allowed < se:
        return (f"the budget ({allowed:.2f} points) is below the standard error of the metric on the search split "
                f"(±{se:.2f} points on {n_search} images): the split cannot resolve accuracy that finely. Drops against "
                "FP32 on the same images are less noisy (only the changed predictions count), but a choice at the edge "
                "of the budget may not hold on the confirm split; use more images or a larger budget")
    return None


# Latencies within this fraction of the fastest count as a tie: timing on a shared machine moves p50 by a few percent
# run to run, so "fastest" among near-equal candidates would be decided by noise; the more accurate one wins instead.
LATENCY_TIE = 0.03


def margin_separates(a, b) -> bool:
    """Whether ``a``'s budget margin is larger than ``b``'s beyond the noise of the two: by more than one standard error
    of their difference (``se``, in the margin's unit: the drop's points or the agreement's fraction, as budget_check
    took it; independent errors assumed, which overstates the difference's error of two candidates scored on the same
    images, so the test errs toward "not separated"). Where either has no standard error, any larger margin counts.
    The one-standard-error rule of model selection (Breiman et al., 1984): prefer the other choice unless the more
    accurate one is more accurate by more than one standard error."""
    gap = (a.margin or 0.0) - (b.margin or 0.0)
    se_a, se_b = getattr(a, "se", None), getattr(b, "se", None)
    if se_a is None or se_b is None:
        return gap > 0
    return gap > math.hypot(se_a, se_b)


def fastest_within(candidates: list, tie: float = LATENCY_TIE):
    """The fastest candidate within budget (lowest ``rank_key``); among those within ``tie`` of it (latency keys only,
    i.e. positive), a more accurate one where its budget margin is larger than the fastest's beyond their noise
    (``margin_separates``): the fastest of those, and again from there, until none is. A speed tie is handed to
    accuracy only where accuracy can tell the two apart (FP16 against BF16 on a Swin-T at 224: drops of -0.1 and -0.3
    points, standard errors 0.10 and 0.17, on 1,000 images; the BF16 program chosen by its margin ran 0.5 % slower).
    Candidates are read by attribute (``within_budget``, ``rank_key``, ``margin``, ``se``): ``candidates.Candidate`` or
    anything shaped like it."""
    ok = [c for c in candidates if c.within_budget and c.rank_key is not None]
    if not ok:
        return None
    best = min(ok, key=lambda c: (c.rank_key, -(c.margin or 0.0)))
    if best.rank_key > 0:
        near = [c for c in ok if c.rank_key <= best.rank_key * (1 + tie)]
        while True:
            safer = [c for c in near if margin_separates(c, best)]
            if not safer:
                break
            best = min(safer, key=lambda c: (c.rank_key, -(c.margin or 0.0)))
    return best


# How far one timing each, minutes apart, has ordered two candidates wrongly on the Xeon, rounded up: ResNet-50 at 224,
# batch 1, 4 threads, the search timed NNCF's INT8 IR 21 % slower than OpenVINO on the ONNX Runtime-placement Q/DQ
# ONNX (6.625 vs 5.468 ms), and the harness's interleaved rounds timed it 10 % faster (5.04 vs 5.63 ms): 31 % apart
# (docs/results/realsize_cpu_xeon.json); one variant's round medians there span up to 2x. Within it of the fastest
# within budget, a candidate is a finalist of the final timing (steps/final_timing.py); beyond it, it cannot be the
# answer, so its evaluation is skipped (:func:`ruled_out_by_speed`)
FINALIST_BAND = 0.35


def settled_within(c, z: float = 0.0) -> bool:
    """Whether ``c`` is within budget for good: no candidate measured later can change that. Only the siblings rule
    looks at other candidates (an INT8 candidate more than SIBLING_GAP below its INT8 siblings' median agreement, on the
    bound), and no median exceeds 1, so an INT8 candidate whose agreement bound is at least 1 - SIBLING_GAP is settled
    (with the default agreement floor, 0.9, every INT8 candidate within budget is); a float one always is."""
    if not c.within_budget:
        return False
    if c.precision != "int8":
        return True
    if c.agreement is None:
        return False
    bound = c.agreement - (z * c.agreement_se if c.agreement_se is not None and z > 0 else 0.0)
    return bound >= 1 - SIBLING_GAP - EPS


def fastest_settled(candidates: list, z: float = 0.0):
    """The fastest timed candidate settled within budget (:func:`settled_within`), or None: what
    :func:`ruled_out_by_speed` measures a newcomer against."""
    return min((c for c in candidates if (c.rank_key or 0) > 0 and settled_within(c, z)),
               key=lambda c: c.rank_key, default=None)


def ruled_out_by_speed(rank_key: Optional[float], candidates: list, z: float = 0.0) -> Optional[str]:
    """Why a candidate whose latency key came out ``rank_key`` need not be evaluated (None: it may be the answer): it is
    more than FINALIST_BAND slower than the fastest candidate settled within budget so far (:func:`settled_within`), so
    whatever its accuracy it is neither the answer nor a finalist timed again; a later, faster answer only widens the
    gap. Evaluating such candidates was the search's largest cost at the deployed size (DeiT-S at 224, batch 1,
    4 threads on the Xeon: 25-43 s each for OpenVINO FP16 and the ONNX Runtime INT8 files, at 1.5-3x the latency of
    OpenVINO's INT8 and BF16 already within budget)."""
    best = fastest_settled(candidates, z)
    if rank_key is None or best is None:
        return None
    if rank_key <= best.rank_key * (1 + FINALIST_BAND):
        return None
    return (f"{rank_key / best.rank_key:.2f}x the latency of {best.variant} ({best.rank_key:.3f} ms), within budget "
            f"already: beyond the {100 * FINALIST_BAND:g} % band the answer is chosen in, so not evaluated")


def latency_ties(chosen, candidates: list, tie: float = LATENCY_TIE) -> list:
    """The other candidates within budget whose latency key is within ``tie`` of ``chosen``'s (either side)."""
    if chosen is None or chosen.rank_key is None or chosen.rank_key <= 0:
        return []
    return [c for c in candidates if c is not chosen and c.within_budget and c.rank_key is not None and c.rank_key > 0
            and abs(c.rank_key - chosen.rank_key) <= tie * chosen.rank_key]


def faster_at_one_batch_size(chosen, candidates: list, tie: float = LATENCY_TIE) -> list[str]:
    """Where one program cannot be the fastest at every ranked batch size: for each batch size, the candidate within
    budget that ran more than ``tie`` faster there than ``chosen`` (ranked on the geometric mean over all of them), said
    with how a user deploying at that size alone gets it."""
    mine = getattr(chosen, "latency_p50_by_batch", None) or {}
    if len(mine) < 2:
        return []
    said = []
    for b, p50 in mine.items():
        rivals = [(c.latency_p50_by_batch[b], c) for c in candidates if c is not chosen and c.within_budget
                  and (getattr(c, "latency_p50_by_batch", None) or {}).get(b) is not None]
        if p50 is None or not rivals:
            continue
        best, c = min(rivals, key=lambda r: r[0])
        if best < p50 / (1 + tie):
            said.append(f"at batch {b}, {c.variant} ran {best:.4g} ms against {chosen.variant}'s {p50:.4g} "
                        f"({100 * (1 - best / p50):.1f} % faster): one program is ranked on the geometric mean over the "
                        f"batch sizes; --batch-sizes {b} ranks on that size alone")
    return said


def fallback_for_speed(candidates: list, int8: list, tie: float = LATENCY_TIE):
    """An INT8 candidate worth a per-layer fallback although another candidate is within budget: the fastest INT8
    candidate outside the budget by its accuracy drop (``rejected_by`` max_drop: a fallback keeps the layers that cost
    accuracy in float; an agreement collapse is not that), faster than every candidate within budget by more than
    twice ``tie``. Why: on a CPU with several engines the fastest INT8 is often another engine's, a few tenths of a point
    outside a budget its slower sibling meets (measured on an AMX CPU, docs/results/cpu/cpu_goals_xeon_2026-11-26.json:
    ResNet-44 at batch 32, OpenVINO INT8 3.51 ms with a drop bound of 0.39 > 0.30, while the answer was BF16 at
    4.07 ms); without this, the fallback was tried only when no INT8 at all met the budget. Twice the tie: a fallback
    keeps at least one layer float, so it can win at most the start's lead, and a lead is only told from noise when it
    exceeds the noise of both timings it compares (each moves by up to ``tie``); a smaller lead buys minutes of
    rebuilds at the deployed size (ResNet-50 at 224 on the Xeon: NNCF's 3.5 % lead over OpenVINO's INT8 cost a
    fallback of NNCF rebuilds of 20-45 s each, whose trials then timed 2.45-3.88 ms against the start's 2.64 ms).
    None where latencies are not measured (rank keys are INT8 shares, not times) or nothing is faster by that much."""
    best = fastest_within(candidates, tie)
    if best is None or best.rank_key is None or best.rank_key <= 0:
        return None
    faster = [c for c in int8 if not c.within_budget and c.rejected_by == "max_drop" and leads(c, best, tie)]
    return min(faster, key=lambda c: c.rank_key) if faster else None


def leads(start, best, tie: float = LATENCY_TIE) -> bool:
    """Whether a model that reverting layers of ``start`` to float could make is worth searching for against ``best``
    (the fastest within budget): such a model is at best as fast as ``start``, so only a lead of ``start`` over ``best``
    larger than the noise of both timings (twice ``tie``) can pay. Read by the per-layer fallback for speed and by
    NNCF's accuracy control, which both only revert layers. False where either has no latency key."""
    if start.rank_key is None or start.rank_key <= 0:
        return False
    if best is None or best.rank_key is None or best.rank_key <= 0:
        return best is None
    return start.rank_key < best.rank_key * (1 - 2 * tie)


def best_effort(candidates: list):
    """When none is within budget: the one closest to it (largest margin), then the fastest."""
    scored = [c for c in candidates if c.margin is not None]
    return max(scored, key=lambda c: (c.margin, -(c.rank_key or 0.0))) if scored else None


def _speed(ref, rank_key: float) -> str:
    """A rank key in words: the p50, or the geometric mean of the p50s where several batch sizes are ranked."""
    several = getattr(ref, "latency_p50_by_batch", None)
    return (f"geometric mean of p50 over batch sizes {', '.join(several)}: {rank_key:.3f} ms" if several
            else f"p50 {rank_key:.3f} ms")


def _int8_offered(offers: list) -> bool:
    return any(getattr(c, "precision", None) == "int8" for c in offers)


def int8_slower_than_fp32(candidates: list) -> list[str]:
    """A line for each INT8 candidate measured slower than the fastest FP32 candidate (of any engine): the search never
    answers with one, and says so rather than leaving it out silently."""
    fp32 = [c for c in candidates if getattr(c, "precision", None) == "fp32" and (c.rank_key or 0) > 0]
    if not fp32:
        return []
    best = min(fp32, key=lambda c: c.rank_key)
    return [f"{c.variant} ({_speed(c, c.rank_key)}) is slower than the fastest FP32, {best.variant} "
            f"({_speed(best, best.rank_key)}): an INT8 candidate slower than FP32 is never the answer"
            for c in candidates if getattr(c, "precision", None) == "int8" and (c.rank_key or 0) > 0
            and c.rank_key > best.rank_key * (1 + LATENCY_TIE)]


def rejected_by_the_bound(chosen, candidates: list, budget: BudgetSpec, z: float, reference, siblings_of,
                          confidence: float, n_search: int) -> list[tuple]:
    """(candidate, line) for each candidate faster than ``chosen`` that is within the budget on its point estimate but not on the
    confidence bound the search decides on: on a split too small for the budget (an INT8 model that changes 3 % of
    1,000 predictions bounds about 0.56 points above its measured drop at 90 %) such candidates are as good as the
    chosen one by every measurement but the noise, and the user should know what would take them: the images the
    bound needs at that drop, or optimize.confidence 0.5 (the point estimate)."""
    if chosen is None or z <= 0 or reference is None or chosen.rank_key is None or budget.agreement_only:
        return []
    lines = []
    for c in sorted((c for c in candidates if not c.reference and c.ok and not c.within_budget and c.rank_key
                     and c.rank_key * (1 + LATENCY_TIE) < chosen.rank_key and c.se), key=lambda c: c.rank_key):
        point = budget_check(budget, reference.search_metric, c.search_metric, c.agreement, c.se, 0.0,
                             agreement_se=c.agreement_se, siblings=siblings_of(c))
        if not point.within:
            continue
        drop = 100.0 * (reference.search_metric - c.search_metric)
        room = budget.allowed_points(reference.search_metric) - drop
        need = math.ceil((z * c.se * math.sqrt(n_search) / room) ** 2) if room > 0 else None
        lines.append((c, f"{c.variant} ({_speed(c, c.rank_key)}, faster than {chosen.variant}) is within the budget on its "
                     f"point estimate (drop {drop:.2f} points) but not on the {100 * confidence:g} % bound "
                     f"({drop + z * c.se:.2f}) the search decides on"
                     + (f": at this drop the bound needs about {need} search images, not {n_search}" if need else "")
                     + "; more data.eval images, or optimize.confidence 0.5 (the point estimate, checked on the confirm "
                     "split), would take it"))
    return lines


def choose(candidates: list, measured: bool) -> tuple:
    """(chosen candidate, within budget on the search split, decision lines). ``candidates[0]`` is the FP32 reference.

    The reference is what the budget is measured against: when no other candidate is within budget that is a missed
    budget (exit 3, the best candidate written), never FP32 "meeting" it. But when candidates are within budget and the
    target's measured latency says FP32 is at least as fast (ONNX Runtime runs some INT8 graphs slower than FP32:
    unfused activations, requantization), FP32 is the fastest deployable artifact and the answer."""
    offers = [c for c in candidates if not c.reference]
    ref = candidates[0] if candidates else None
    timed = [c.rank_key for c in offers if c.rank_key is not None]
    slower = int8_slower_than_fp32(candidates) if measured else []
    if measured and ref is not None and ref.reference and ref.rank_key is not None and timed \
            and ref.rank_key <= min(timed) * (1 + LATENCY_TIE):
        return ref, True, slower + [f"FP32 ({_speed(ref, ref.rank_key)}) is at least as fast as every candidate (fastest "
                                    f"{_speed(ref, min(timed))}) on this target: the answer is FP32, "
                                    + ("INT8 brings no speed here" if _int8_offered(offers) else "nothing runs it faster here")]
    chosen = fastest_within(offers)
    if chosen is None:
        chosen = best_effort(offers) or ref
        return chosen, False, [f"no candidate within budget on the search split; best effort: "
                               f"{chosen.variant if chosen else 'none'}"]
    why = slower + [f"chosen: {chosen.variant} (fastest within budget on the search split"
           + ("" if measured else ", by INT8 share of compute") + ")"]
    ties = latency_ties(chosen, offers) if measured else []
    if ties:  # said, so that a rerun choosing one of these is read as noise, not as a different answer
        by_margin = any(c.rank_key < chosen.rank_key for c in ties)
        why.append(f"a tie: {', '.join(c.variant for c in ties)} within {100 * LATENCY_TIE:g} % of {chosen.variant}'s "
                   f"latency ({_speed(chosen, chosen.rank_key)}), closer than timing noise separates; "
                   + ("its budget margin, larger beyond one standard error, decided" if by_margin else
                      "no budget margin larger than the fastest's beyond one standard error: the fastest"))
    if measured:
        why += faster_at_one_batch_size(chosen, offers)
    if measured and ref.reference and fastest_within(offers + [ref]) is ref:
        why.append(f"FP32 ({_speed(ref, ref.rank_key)}) is at least as fast as every candidate within budget (best "
                   f"{chosen.variant}: {_speed(ref, chosen.rank_key)}) on this target: the answer is FP32, "
                   + ("INT8 brings no speed here" if _int8_offered(offers) else "nothing runs it faster here"))
        chosen = ref
    return chosen, True, why
