"""INT8 post-training quantization: one candidate per range method (``optimize.methods``).

Every method gives the same graph (one placement, only the scales differ), hence the same speed: the methods are
ranked by agreement with FP32 on a seeded subset, and only the best gets a full evaluation (the runner-up too when the
best misses the budget: near-equal methods swap places on a few hundred samples). One statistics pass still serves
every method (the build stage's memo). A method that fails is listed with its stage and reason.

Where a candidate is already settled within budget, the first method is timed before any ranking, on its engine and
on the target's other engines (the same Q/DQ ONNX): when every one of them is ruled out by that timing
(decide.ruled_out_by_speed), no method of the placement can be the answer, and the other calibrations and the subset
runs are not made. On Swin-T at 224 on a 16-core Xeon they were 302 s of a 478 s search, every method's graph at 3.9x
the latency of OpenVINO BF16 within budget (docs/realsize-cpu.md).
"""
from __future__ import annotations

import numpy as np

from qdeploy.evaluate.metrics import agreement
from qdeploy.optimize.candidates import SAME_GRAPH_RULED_OUT, TIMED_ONLY, PtqCandidate
from qdeploy.optimize.decide import budget_check, fastest_settled
from qdeploy.optimize.session import untimed_spec
from qdeploy.optimize.steps.base import Step, register_step
from qdeploy.pipeline import run_variant
from qdeploy.report import tables as T


@register_step
class PtqStep(Step):
    name = "ptq"

    def run(self) -> None:
        s = self.s
        ptq = [c for c in s.planned if isinstance(c, PtqCandidate)]
        if len(ptq) == 1:
            if s.timed_out:
                s.stop_for_time(ptq)
            else:
                s.measure_all(ptq)
        elif ptq and not s.timed_out and not self.ruled_out_before_ranking(ptq):
            self.rank_methods(ptq)
        s.stages["ptq"] = {"within_budget": [c.variant for c in s.int8()
                                             if c.ok and c.within_budget and isinstance(c, PtqCandidate)],
                           "not_built_same_graph": [c.variant for c in ptq if c.status == SAME_GRAPH_RULED_OUT]}

    def ruled_out_before_ranking(self, ptq: list[PtqCandidate]) -> bool:
        """Time the first method (and its Q/DQ ONNX on the target's other engines) before ranking; True when each was
        ruled out by its timing or could not run, so the other methods are not built (listed, with why), and the
        placements the cpu-engines step derives (float op types, quantized conv outputs) start from this method's
        ranges. False: the ranking goes on (what was measured here stays measured)."""
        from qdeploy.optimize.steps.cpu_engines import twins

        s = self.s
        if s.speed_gate(ptq[0]) is None or fastest_settled(s.candidates, s.z) is None:
            return False  # nothing could rule it out: the ranking's subset runs are cheaper than a full evaluation
        probe = s.measure(ptq[0])
        if probe.status != TIMED_ONLY:
            return False
        others = twins(s.target, probe)
        if not s.measure_all(others):  # the time limit: the other methods are named as not tried
            s.stop_for_time(ptq[1:])
            return True
        if any(c.ok for c in others):
            return False
        why = ("timed before ranking the range methods, it was ruled out on every engine that runs it ("
               + "; ".join(f"{c.variant}: {T.status_text(c.to_json())}" for c in [probe, *others]) + ")")
        for cand in ptq[1:]:
            cand.same_graph_ruled_out(probe, why)
            s.candidates.append(cand)
        s.note(f"{probe.variant}: {why}; {', '.join(c.variant for c in ptq[1:])} not built (the same graph: only the "
               "scales differ)")
        return True

    def subset_scores(self, ptq: list[PtqCandidate], sctx, ref_sub) -> list[tuple[PtqCandidate, dict]]:
        """Each method's agreement with FP32 on the subset (or its failure), best first."""
        s = self.s
        scored = []
        for cand in ptq:
            cached = s.scores.get(untimed_spec(cand.spec), "subset-methods")
            if cached is None:
                r = run_variant(sctx, s.variant_of(cand.spec))
                s.evaluations["subset"] += 1
                score = agreement(r.predictions, ref_sub) if r.status == "ok" else None
                result = {"agreement": score, "status": r.status, "reason": r.reason, "failed_stage": r.failed_stage}
                s.scores.put(untimed_spec(cand.spec), "subset-methods", result, None)
            else:
                s.evaluations["cached"] += 1
                result = cached[0]
            scored.append((cand, result))
        scored.sort(key=lambda t: -(t[1]["agreement"] if t[1]["agreement"] is not None else -1.0))
        return scored

    def rank_methods(self, ptq: list[PtqCandidate]) -> None:
        s, o = self.s, self.s.o
        rng = np.random.default_rng(o.seed + 1)
        n_eval = len(s.reference.predictions)  # the images really decoded (on_error: skip may leave some out)
        idx = np.sort(rng.choice(n_eval, size=min(o.subset_size, n_eval), replace=False))
        scored = self.subset_scores(ptq, *s.subset_context(idx))
        s.note(f"PTQ methods ranked on a seeded subset of {len(idx)} search samples by agreement with FP32: "
               + ", ".join(f"{c.variant} {100 * r['agreement']:.2f} %" if r["agreement"] is not None else
                           f"{c.variant} failed ({r.get('failed_stage') or '?'}: {r['reason']})" for c, r in scored))
        for rank, (cand, result) in enumerate(scored):
            if cand in s.candidates:  # timed before the ranking: measured already
                cand.subset_agreement = result["agreement"]
                continue
            if result["agreement"] is None:  # failed on the subset: listed, with where and why
                cand.status, cand.reason = result.get("status") or "failed", result.get("reason")
                cand.failed_stage = result.get("failed_stage")
                cand.score(budget_check(o.budget, None, None, None), None, None)
                s.candidates.append(cand)
                continue
            # the runner-up only where the best missed the budget by its accuracy: every method is the same graph, so
            # one timed too slow to be evaluated (TIMED_ONLY) rules out the others too
            if rank > 0 and (rank > 1 or any(c.within_budget or c.status == TIMED_ONLY
                                             for c in s.int8() if isinstance(c, PtqCandidate))):
                cand.subset_only(result["agreement"])
                s.candidates.append(cand)
                continue
            s.measure(cand).subset_agreement = result["agreement"]
