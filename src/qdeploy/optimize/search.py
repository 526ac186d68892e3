"""``qdeploy optimize``: the fastest artifact within an accuracy budget, chosen on a search split and confirmed once on
a split the search never saw.

Protocol: data.eval (after its own count/complement, which keep calibration images out) is split, seeded, into a search
split (``search_fraction``) and its complement, the confirm split.
Every decision uses only the search split; the chosen artifact and the FP32 reference are evaluated once on the
confirm split, and a confirm result outside the budget is reported as such (exit code 3 from the CLI).

Shape: :func:`optimize` validates and plans (prepare.py), opens a search session (session.py: the run context, the
resume store, the reference), runs the steps its target lists (``Target.steps``; steps/: the FP32 reference and
floats, PTQ methods, the CPU engines' placements, fallback and QAT, or the PyTorch runtimes), decides (decide.choose,
plain functions on the candidates' numbers) and confirms (steps/confirm.py). Ranked by p50 latency measured on the
target at ``batch_size``; for ``tensorrt`` without TensorRT, by the share of compute ops in INT8 (the Q/DQ structure
TensorRT will fuse), and the result says that TensorRT latency was not measured.

Within budget: the budget (max_drop or relative on the task metric, or min_agreement alone) and, in every decision, the
agreement floor (decide.agreement_floor: budget.min_agreement, default 0.9, and the siblings rule qdeploy run's degraded
mark uses), so a candidate that no longer makes FP32's predictions is never "within budget" because FP32 is poor.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import qdeploy
from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.config import RunConfig, check_output_folder, parse_config
from qdeploy.models.loader import model_fingerprint
from qdeploy.optimize.candidates import TIMED_ONLY, sibling_agreements
from qdeploy.optimize.decide import choose, rejected_by_the_bound, z_of
from qdeploy.optimize.prepare import SearchPlan, prepare_search
from qdeploy.optimize.session import ResultStore, SearchSession, resume_identity
from qdeploy.optimize.steps import STEPS
from qdeploy.optimize.steps.confirm import confirm
from qdeploy.pipeline import as_config, open_run
from qdeploy.evaluate.verdict_rules import SIBLING_GAP, SIBLINGS_NEEDED, int8_failure_warning
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import OutputDir
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.hashing import sha256_json
from qdeploy.utils.log import each_warning_once

# the targets whose candidates score the same whatever their timing settings (batch size, threads): a search for another
# deployment of the same model replays each candidate's accuracy and only times it again. Not on a GPU: a TensorRT
# engine is built for its batch sizes (optimization profile), and another build may pick other tactics
SCORES_SHARED_ACROSS_TIMINGS = ("onnxruntime-cpu", "cpu")


def optimize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    with each_warning_once():  # the search and the confirm run open the same model: one warning each
        return _optimize(config, out_dir, cache_dir)


def _model_identity(builder) -> str:
    """The FP32 model's content fingerprint: weights (and code) of a PyTorch source, the bytes of an ONNX or Keras one."""
    if builder.has_torch:
        return model_fingerprint(builder.spec, builder.torch_model())
    return builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).fingerprint


def _open_session(plan: SearchPlan, ctx, cache_root: Path, t_start: float) -> SearchSession:
    """The session, with its resume stores keyed by what decides a candidate's numbers (the model's bytes, data, split,
    timing settings), not by the candidate list: a search resumed with other methods or fallback settings still replays
    the candidates it shares, and a model file retrained in place (same path, new weights) is never answered with old
    numbers."""
    o, search_cfg = plan.o, plan.search_cfg
    identity = {
        "search": {k: v for k, v in search_cfg.items() if k not in ("variants", "bench")},
        "model": _model_identity(ctx.builder),
        "optimize": o.model_dump(mode="json", include={"target", "seed", "search_fraction", "subset_size",
                                                       "sensitivity_images"}),
        "qdeploy": qdeploy.__version__, "tensorrt": plan.tensorrt, "environment": resume_identity(plan.target.measured)}
    store = ResultStore(cache_root / "optimize" / sha256_json({**identity, "bench": search_cfg["bench"]})[:20])
    untimed = (ResultStore(cache_root / "optimize-accuracy" / sha256_json(identity)[:20])
               if o.target in SCORES_SHARED_ACROSS_TIMINGS else None)
    return SearchSession(o, plan.target, ctx, store, get_task(plan.cfg.model.task).metric, plan.batch_size,
                         z_of(o.confidence), t_start, planned=plan.planned, n_search=plan.n_search,
                         rank_batches=list(search_cfg["bench"]["batch_sizes"]) if plan.target.torch_program else [],
                         cache_root=cache_root, untimed=untimed,
                         limit_covers_saving=o.time_limit is not None and (plan.cfg.optimize is None
                                                                           or plan.cfg.optimize.time_limit is None))


def _announce(s: SearchSession, plan: SearchPlan) -> None:
    """The search's first decision lines: what it will try, on which split, against which budget."""
    o, task = plan.o, plan.cfg.model.task
    s.note(f"target {o.target}: candidates {', '.join(c.variant for c in plan.planned)} on engine "
           f"{plan.target.engine_name}; search split {plan.n_search} of {plan.n} data.eval images (seed {o.seed}), the "
           f"other {plan.n - plan.n_search} confirm")
    s.note(f"budget: {o.budget_text(task)}; a candidate below the agreement floor, or more than "
           f"{100 * SIBLING_GAP:g} points below the median agreement of {SIBLINGS_NEEDED} or more INT8 siblings, is "
           "never within budget, whatever its accuracy")
    if plan.target.note:
        s.note(plan.target.note)
    if s.z > 0:
        the_task = get_task(task)
        s.note(f"decisions on the one-sided {100 * o.confidence:g} % bound (z {s.z:.2f}) of each candidate's drop or "
               "agreement, with its standard error paired over the search split"
               + (f"; {the_task.metric_label} has no per-sample standard error, so {the_task.metric_label} budgets "
                  "use the point estimate" if not the_task.per_sample_standard_error and not o.budget.agreement_only
                  else ""))


def _search(s: SearchSession) -> list:
    """Run the target's steps in order; the steps, for what they add once the answer is chosen."""
    steps = [STEPS[name](s) for name in s.target.steps]
    try:
        for step in steps:
            step.run()
    finally:
        s.ctx.output.abort()
    if s.out_of_time():
        s.timed_out = True
    return steps


def _decide(s: SearchSession, steps: list):
    """The answer on the search split (decide.choose), each step's afterword, and the warning when every INT8
    candidate failed."""
    chosen, budget_met_search, why = choose(s.candidates, s.target.measured)
    for line in why:
        s.note(line)
    if s.target.measured and s.reference is not None:
        bound_only = rejected_by_the_bound(chosen, s.candidates, s.o.budget, s.z, s.reference,
                                           lambda c: sibling_agreements(c, s.candidates), s.o.confidence,
                                           len(s.reference.predictions))
        for _, line in bound_only:
            s.note(line, warning=True)
        if bound_only:
            s.stages["faster_within_point_estimate_only"] = [c.variant for c, _ in bound_only]
    if s.timed_out:
        s.note(f"time limit {s.o.time_limit:g} s: the chosen candidate is the best found so far")
    for step in steps:
        step.after_choice(chosen)
    # an INT8 candidate timed too slow to be evaluated ran: slower than the answer, not failed
    int8_failed = (int8_failure_warning([{**c.to_json(), "name": c.variant} for c in s.int8()])
                   if any(c.precision == "int8" for c in s.planned)
                   and not any(c.status == TIMED_ONLY for c in s.int8()) else None)
    if int8_failed is not None:
        int8_failed["message"] = int8_failed["message"].replace("INT8 variant", "INT8 candidate")
        s.warnings.append(int8_failed)
        s.note(int8_failed["message"], warning=True)
    return chosen, budget_met_search


def _optimize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    t_start = time.perf_counter()
    cfg = as_config(config)
    # --out is written only after the confirm split, maybe an hour from now: refuse a bad one before any work
    check_output_folder(cfg, out_dir, cache_dir)
    OutputDir(out_dir).abort()
    plan = prepare_search(cfg)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with tempfile.TemporaryDirectory(prefix="qdeploy-optimize-") as scratch:
        ctx = open_run(parse_config(plan.search_cfg), Path(scratch) / "search",
                       stages=("eval", "bench") if plan.target.measured else ("eval",), cache_dir=cache_dir)
        s = _open_session(plan, ctx, cache_root, t_start)
        try:
            _announce(s, plan)
            steps = _search(s)
            chosen, budget_met_search = _decide(s, steps)
            s.stages["search_s"] = round(time.perf_counter() - t_start, 1)
            if s.o.time_limit is not None:
                s.note(f"search: {s.stages['search_s']:.0f} s of optimize.time_limit {s.o.time_limit:g} s; saving the "
                       "chosen artifact and its confirm run follow, "
                       + ("within it (the default limit covers them: its compiles left room)" if s.limit_covers_saving
                          else "outside the limit (one set by the user bounds the search)"))
            return confirm(s, plan, chosen, budget_met_search, out_dir, cache_dir)
        finally:
            if s.aoti_probe is not None:  # no background compile outlives the search
                s.aoti_probe.close()


__all__ = ["optimize"]
