"""``qdeploy optimize`` (issue #11, first slice): the fastest artifact within an accuracy budget, chosen on a search
split and confirmed once on a split the search never saw.

Protocol: data.eval is split, seeded, into a search split (``search_fraction``) and its complement, the confirm split.
Every decision uses only the search split; the chosen artifact and the FP32 reference are evaluated once on the
confirm split, and a confirm result outside the budget is reported as such (exit code 3 from the CLI).

Candidates, cheapest first: FP32, then INT8 PTQ with every method in ``optimize.methods`` (one statistics pass serves
them all: the build stage's memo). Ranked by p50 latency measured on the target at ``batch_size``; for ``tensorrt``
without TensorRT, by the share of compute ops in INT8 (the Q/DQ structure TensorRT will fuse), and the result says
that TensorRT latency was not measured. Not yet (see docs): per-layer fallback, QAT, FP16 candidates, resuming an
interrupted search.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import torch

from qdeploy.config import OptimizeConfig, RunConfig, parse_config
from qdeploy.data import make_batches
from qdeploy.errors import ConfigError
from qdeploy.evaluate.metrics import agreement
from qdeploy.lint.tensorrt_confirm import tensorrt_version
from qdeploy.optimize.decide import best_effort, budget_check, fastest_within, resolution_warning
from qdeploy.pipeline import as_config, copy_artifacts, open_run, run_variant
from qdeploy.report import tables as T
from qdeploy.report.optimize_page import write_optimize_report
from qdeploy.utils.atomic import write_json
from qdeploy.utils.log import log, warn


def _candidates(o: OptimizeConfig, trt: bool) -> tuple[list[dict], str, bool]:
    """(variant specs, engine used, latency measured on the target)."""
    if o.target == "onnxruntime-cpu":
        base, placement, measured = {"engine": "onnxruntime", "device": "cpu"}, "onnxruntime", True
    elif o.target == "tensorrt":
        # without TensorRT the TensorRT-placement artifacts are evaluated in ONNX Runtime (exact Q/DQ) and ranked by
        # their INT8 share of compute; with it, the engines are built and timed
        base, placement, measured = ({"engine": "tensorrt"}, "tensorrt", True) if trt else \
            ({"engine": "onnxruntime", "device": "cpu"}, "tensorrt", False)
    else:
        base, placement, measured = {"engine": "torch", "device": "cuda"}, None, True
    specs = [{**base, "precision": "fp32", "name": "fp32"}]
    if placement is not None:
        specs += [{**base, "precision": "int8", "method": m, "placement": placement, "name": f"int8-{m}"} for m in o.methods]
    else:
        specs.append({**base, "precision": "fp16", "name": "fp16"})
    return specs, base["engine"], measured


def _metric_key(task: str) -> str:
    return "top1" if task == "classification" else "miou"


def optimize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    t_start = time.perf_counter()
    cfg = as_config(config)
    o = cfg.optimize or OptimizeConfig()
    task = cfg.model.task
    key = _metric_key(task)
    # ---- validate before any work
    if o.target == "torch-cuda" and not torch.cuda.is_available():
        raise ConfigError("optimize.target torch-cuda: no CUDA GPU is visible to PyTorch")
    ev = cfg.data.eval
    if ev.count is not None or ev.complement:
        raise ConfigError("optimize splits data.eval into search and confirm itself: remove count/complement from data.eval")
    trt = tensorrt_version() is not None and torch.cuda.is_available()
    bs = o.batch_size or max(cfg.bench.batch_sizes)
    listing = make_batches(ev, cfg.model.preprocess, task, progress=False)
    n = listing.num_samples
    n_search = max(1, round(o.search_fraction * n))
    if n_search >= n:
        raise ConfigError(f"data.eval has {n} images: too few to split into search and confirm")
    specs, engine, measured = _candidates(o, trt)
    base = cfg.model_dump(mode="json", exclude_none=True)
    base.pop("optimize", None)
    base["bench"] = {**base.get("bench", {}), "batch_sizes": [bs], "enabled": measured}
    search_cfg = dict(base, variants=specs, data={**base["data"], "eval": {**base["data"]["eval"], "count": n_search, "seed": o.seed}})
    decisions = [f"target {o.target}: candidates {', '.join(s['name'] for s in specs)} on engine {engine}; search split "
                 f"{n_search} of {n} data.eval images (seed {o.seed}), the other {n - n_search} confirm"]
    if o.target == "tensorrt" and not trt:
        decisions.append("TensorRT is not installed: TensorRT-placement artifacts are evaluated in ONNX Runtime with exact "
                         "Q/DQ and ranked by the share of compute in INT8; TensorRT latency was not measured")
    # ---- search
    candidates, records, evaluations = [], {}, {"full": 0, "subset": 0}
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="qdeploy-optimize-") as scratch:
        ctx = open_run(parse_config(search_cfg), Path(scratch) / "search", stages=("eval", "bench") if measured else ("eval",),
                       cache_dir=cache_dir)
        try:
            ref_record = None
            for i, variant in enumerate(ctx.variants):
                elapsed = time.perf_counter() - t_start
                if o.time_limit is not None and i > 0 and elapsed > o.time_limit:
                    timed_out = True
                    decisions.append(f"time limit {o.time_limit:g} s reached after {elapsed:.0f} s: "
                                     f"{', '.join(v.label for v in ctx.variants[i:])} not tried")
                    break
                t0 = time.perf_counter()
                r = run_variant(ctx, variant)
                evaluations["full"] += 1
                records[variant.label] = r
                if i == 0:
                    ref_record = r
                    if r.status != "ok" or (r.metrics.get(key) is None and o.budget.min_agreement is None):
                        raise ConfigError(f"the FP32 reference could not be evaluated on the search split: {r.reason}")
                    spent = time.perf_counter() - t0
                    if o.time_limit is not None and o.time_limit < spent:
                        raise ConfigError(f"optimize.time_limit {o.time_limit:g} s is shorter than one evaluation "
                                          f"({spent:.1f} s for the FP32 reference)")
                    warning = resolution_warning(o.budget, r.metrics.get(key) or 0.0, n_search, task)
                    if warning:
                        warn(warning)
                        decisions.append(warning)
                cand = _candidate(r, ref_record, key, o, bs, measured, time.perf_counter() - t0)
                candidates.append(cand)
                decisions.append(f"{cand['variant']}: {cand['budget']}" + (f", p50 {cand['latency_p50_ms']:.3f} ms"
                                                                            if cand.get("latency_p50_ms") is not None else "")
                                 + ("" if cand["status"] == "ok" else f" ({cand['status']}: {cand['reason']})"))
        finally:
            ctx.output.abort()
        chosen = fastest_within(candidates)
        budget_met_search = chosen is not None
        if chosen is None:
            chosen = best_effort(candidates)
            decisions.append(f"no candidate within budget on the search split; best effort: {chosen['variant'] if chosen else 'none'}")
        else:
            decisions.append(f"chosen: {chosen['variant']} (fastest within budget on the search split"
                             + ("" if measured else ", by INT8 share of compute") + ")")
        # ---- confirm: the reference and the chosen candidate, once, on the complement
        confirm_specs = [specs[0]] + ([s for s in specs if s["name"] == chosen["variant"]] if chosen and chosen["variant"] != "fp32" else [])
        confirm_cfg = dict(base, variants=confirm_specs, bench={**base["bench"], "enabled": False},
                           data={**base["data"], "eval": {**base["data"]["eval"], "count": n_search, "seed": o.seed, "complement": True}})
        cctx = open_run(parse_config(confirm_cfg), out_dir, stages=("eval",), cache_dir=cache_dir)
        try:
            crecords = [run_variant(cctx, v) for v in cctx.variants]
            evaluations["full"] += len(crecords)
            cref, cchosen = crecords[0], crecords[-1]
            ref_metric, chosen_metric = cref.metrics.get(key), cchosen.metrics.get(key)
            agree = agreement(cchosen.predictions, cref.predictions) if cchosen is not cref else 1.0
            confirm = budget_check(o.budget, ref_metric, chosen_metric, agree)
            artifacts = copy_artifacts(cctx, [cchosen]) if cchosen.artifact is not None else []
            chosen_file = next((a["path"] for a in artifacts if a["kind"].startswith("onnx")), None)
            decisions.append(f"confirm split: {chosen['variant'] if chosen else 'none'} {confirm.why}: "
                             + ("within budget" if confirm.within else "OUTSIDE the budget"))
            ref_latency = candidates[0].get("latency_p50_ms") if candidates else None
            summary = {
                "target": o.target, "budget": o.budget.model_dump(exclude_none=True), "batch_size": bs,
                "latency_measured": measured, "timed_out": timed_out,
                "chosen": {"variant": chosen["variant"] if chosen else None, "artifact": chosen_file,
                           "search_metric": chosen.get("search_metric") if chosen else None, "confirm_metric": chosen_metric,
                           "reference_confirm_metric": ref_metric, "confirm_agreement": agree,
                           "latency_p50_ms": chosen.get("latency_p50_ms") if chosen else None,
                           "reference_latency_p50_ms": ref_latency, "float_layers": chosen.get("float_layers") if chosen else None,
                           "int8_share": chosen.get("int8_share") if chosen else None,
                           "best_so_far": timed_out},
                "budget_met": bool(budget_met_search and confirm.within), "budget_met_search": budget_met_search,
                "confirm": {"why": confirm.why, "margin": confirm.margin},
                "candidates": candidates, "decisions": decisions, "evaluations": evaluations,
                "splits": {"search": n_search, "confirm": n - n_search, "seed": o.seed}, "metric": key,
                "time_s": round(time.perf_counter() - t_start, 2), "artifacts": artifacts,
                "not_yet": ["per-layer fallback", "QAT", "FP16 candidates on tensorrt", "resuming an interrupted search"],
            }
            write_json(cctx.output.path("optimize.json"), summary)
            write_optimize_report(summary, cctx.output.path("optimize.html"), f"qdeploy optimize: {cfg.model.source}")
            final = cctx.output.commit()
            summary["out"] = str(final)
        finally:
            cctx.output.abort()
    for line in decisions:
        log(f"optimize: {line}")
    return summary


def _candidate(r, ref, key: str, o: OptimizeConfig, bs: int, measured: bool, seconds: float) -> dict:
    metric = r.metrics.get(key) if r.metrics else None
    agree = agreement(r.predictions, ref.predictions) if r.predictions is not None and ref.predictions is not None else None
    v = budget_check(o.budget, ref.metrics.get(key) if ref.metrics else None, metric, agree)
    structure = (r.artifact.info.get("structure") if r.artifact is not None else None) or {}
    ops = structure.get("compute_ops")
    int8_share = (structure.get("compute_ops_int8", 0) / ops) if ops else (0.0 if r.variant.precision != "int8" else None)
    p50 = T.p50({"latency_ms": r.bench.get("latency_ms", {})}, str(bs)) if measured else None
    rank = p50 if measured else (-(int8_share or 0.0))
    return {"variant": r.label, "precision": r.variant.precision, "method": r.variant.int8.method if r.variant.int8 else None,
            "status": r.status, "reason": r.reason, "search_metric": metric, "agreement": agree,
            "within_budget": r.status == "ok" and v.within, "margin": v.margin if r.status == "ok" else None, "budget": v.why,
            "latency_p50_ms": p50, "rank_key": rank if r.status == "ok" else None, "int8_share": int8_share,
            "float_layers": list(structure.get("compute_ops_float") or []), "time_s": round(seconds, 2)}
