"""INT8 post-training quantization: one candidate per range method (``optimize.methods``).

Every method gives the same graph (one placement, only the scales differ), hence the same speed: the methods are
ranked by agreement with FP32 on a seeded subset, and only the best gets a full evaluation (the runner-up too when the
best misses the budget: near-equal methods swap places on a few hundred samples). One statistics pass still serves
every method (the build stage's memo). A method that fails is listed with its stage and reason.
"""
from __future__ import annotations

import numpy as np

from qdeploy.evaluate.metrics import agreement
from qdeploy.optimize.candidates import TIMED_ONLY, PtqCandidate
from qdeploy.optimize.decide import budget_check
from qdeploy.optimize.session import untimed_spec
from qdeploy.optimize.steps.base import Step, register_step
from qdeploy.pipeline import run_variant


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
        elif ptq and not s.timed_out:
            self.rank_methods(ptq)
        s.stages["ptq"] = {"within_budget": [c.variant for c in s.int8()
                                             if c.ok and c.within_budget and isinstance(c, PtqCandidate)]}

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
