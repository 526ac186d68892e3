"""``qdeploy optimize``: the fastest artifact within an accuracy budget, chosen on a search split and confirmed once on
a split the search never saw.

Protocol: data.eval (after its own count/complement, which keep calibration images out) is split, seeded, into a search
split (``search_fraction``) and its complement, the confirm split.
Every decision uses only the search split; the chosen artifact and the FP32 reference are evaluated once on the
confirm split, and a confirm result outside the budget is reported as such (exit code 3 from the CLI).

Candidates, cheapest first:
1. FP32, and INT8 PTQ with every method in ``optimize.methods`` (one statistics pass serves them all: the build
   stage's memo); FP16 where the target runs it (torch-cuda);
2. when no PTQ candidate is within budget: per-layer fallback from the best of them (``fallback.run_fallback``);
3. when that misses the budget or would leave more than ``max_float_fraction`` of the compute in float, and
   ``optimize.qat`` allows it: QAT from the best PTQ setting, with the fallback's float layers kept float.
Ranked by p50 latency measured on the target at ``batch_size``; for ``tensorrt`` without TensorRT, by the share of
compute ops in INT8 (the Q/DQ structure TensorRT will fuse), and the result says that TensorRT latency was not measured.

Resumable: each evaluated candidate (and each subset score) is stored under the cache folder, keyed by everything that
decides it; an interrupted search started again with the same config replays those and goes on.
"""
from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

import qdeploy
from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.config import OptimizeConfig, RunConfig, VariantSpec, parse_config
from qdeploy.data import ArrayBatches, make_batches, normalize, take
from qdeploy.engines.base import resolve_variant
from qdeploy.errors import ConfigError, QDeployError
from qdeploy.evaluate.metrics import agreement
from qdeploy.facts.tensorrt import tensorrt_version
from qdeploy.optimize.decide import (LATENCY_TIE, agreement_se, best_effort, budget_check, choose, paired_drop_se,
                                     resolution_warning, z_of)
from qdeploy.optimize.fallback import FallbackHooks, run_fallback
from qdeploy.optimize.sensitivity import layer_names_map, layer_sensitivity
from qdeploy.pipeline import as_config, copy_artifacts, open_run, run_variant
from qdeploy.preflight import check_qat_data
from qdeploy.report import tables as T
from qdeploy.report.optimize_page import write_optimize_report
from qdeploy.utils.atomic import write_json
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.hashing import sha256_json
from qdeploy.utils.log import log, warn


def _candidates(o: OptimizeConfig, trt: bool) -> tuple[list[dict], str, bool, Optional[str]]:
    """(variant specs, engine used, latency measured on the target, INT8 placement)."""
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
    if o.target == "tensorrt" and trt or o.target == "torch-cuda":
        specs.append({**base, "precision": "fp16", "name": "fp16"})
    if placement is not None:
        specs += [{**base, "precision": "int8", "method": m, "placement": placement, "name": f"int8-{m}"} for m in o.methods]
    return specs, base["engine"], measured, placement


def _metric_key(task: str) -> str:
    return "top1" if task == "classification" else "miou"


def _exclude(layers: list[str]) -> list[str]:
    return ["^" + re.escape(n) + "$" for n in layers]


class _Store:
    """Candidate results of one search (same model, data, split, settings), kept on disk so a search interrupted by
    a crash, a Ctrl-C or the time limit resumes where it stopped. Predictions are stored with each candidate: the
    fallback's subset and the agreement budget need them."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.hits = 0

    def _key(self, spec: dict, kind: str) -> str:
        return sha256_json({"spec": spec, "kind": kind})[:24]

    def get(self, spec: dict, kind: str):
        key = self._key(spec, kind)
        meta = self.folder / f"{key}.json"
        if not meta.is_file():
            return None
        try:
            data = json.loads(meta.read_text())
            preds = self.folder / f"{key}.npy"
            data["_predictions"] = np.load(preds) if preds.is_file() else None
        except (OSError, ValueError):
            return None  # a half-written entry from an interrupted process: evaluate again
        self.hits += 1
        return data

    def put(self, spec: dict, kind: str, data: dict, predictions: Optional[np.ndarray]) -> None:
        key = self._key(spec, kind)
        if predictions is not None:
            tmp = self.folder / f"{key}.tmp.npy"
            np.save(tmp, predictions)
            tmp.replace(self.folder / f"{key}.npy")
        write_json(self.folder / f"{key}.json", {k: v for k, v in data.items() if not k.startswith("_")})


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
    if not ev.labels and o.budget.min_agreement is None:
        kind = "max_drop" if o.budget.max_drop is not None else "relative"
        raise ConfigError(f"optimize.budget.{kind} compares the task metric, which needs labels, but data.eval has labels: "
                          "false; without labels use optimize.budget.min_agreement (the share of FP32's predictions kept)")
    if ev.subsplit is not None:
        raise ConfigError("optimize splits data.eval into search and confirm itself (data.eval.subsplit): remove subsplit "
                          "from data.eval (count/complement, to keep calibration images out, stay as they are)")
    trt = tensorrt_version() is not None and torch.cuda.is_available()
    bs = o.batch_size or max(cfg.bench.batch_sizes)
    listing = make_batches(ev, cfg.model.preprocess, task, progress=False)
    n = listing.num_samples
    n_search = max(1, round(o.search_fraction * n))
    if n_search >= n:
        raise ConfigError(f"data.eval has {n} images: too few to split into search and confirm")
    specs, engine, measured, placement = _candidates(o, trt)
    if o.qat != "off":
        if placement is None:
            raise ConfigError(f"optimize.qat {o.qat}: target {o.target} runs no INT8 candidates to train")
        cfg = cfg.model_copy(update={"qat": cfg.qat_settings().model_copy(update={"objective": o.qat})})
        check_qat_data(cfg, listing)  # training images exist and are not evaluation images, before any work
    base = cfg.model_dump(mode="json", exclude_none=True)
    base.pop("optimize", None)
    base["bench"] = {**base.get("bench", {}), "batch_sizes": [bs], "enabled": measured}
    search_cfg = dict(base, variants=specs, data={**base["data"], "eval": {**base["data"]["eval"],
                                                                           "subsplit": {"count": n_search, "seed": o.seed}}})
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    # keyed by what decides a candidate's numbers (model, data, split, timing settings), not by the candidate list: a
    # search resumed with other methods or fallback settings still replays the candidates it shares
    store = _Store(cache_root / "optimize" / sha256_json({"search": {k: v for k, v in search_cfg.items() if k != "variants"},
                                                          "optimize": o.model_dump(
        mode="json", include={"target", "seed", "search_fraction", "subset_size", "sensitivity_images"}),
        "qdeploy": qdeploy.__version__, "tensorrt": trt})[:20])
    decisions = [f"target {o.target}: candidates {', '.join(s['name'] for s in specs)} on engine {engine}; search split "
                 f"{n_search} of {n} data.eval images (seed {o.seed}), the other {n - n_search} confirm"]
    if o.target == "tensorrt" and not trt:
        decisions.append("TensorRT is not installed: TensorRT-placement artifacts are evaluated in ONNX Runtime with exact "
                         "Q/DQ and ranked by the share of compute in INT8; TensorRT latency was not measured")

    z = z_of(o.confidence)
    if z > 0:
        decisions.append(f"decisions on the one-sided {100 * o.confidence:g} % bound (z {z:.2f}) of each candidate's drop or "
                         "agreement, with its standard error paired over the search split"
                         + ("; mIoU has no per-sample standard error, so mIoU budgets use the point estimate"
                            if task == "segmentation" and o.budget.min_agreement is None else ""))

    def time_left() -> Optional[float]:
        return None if o.time_limit is None else o.time_limit - (time.perf_counter() - t_start)

    # ---- search
    candidates: list[dict] = []
    spec_of: dict[str, dict] = {}
    preds: dict[str, np.ndarray] = {}
    evaluations = {"full": 0, "subset": 0, "sensitivity": 0, "cached": 0}
    stages = {"ptq": None, "fallback": None, "qat": None}
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="qdeploy-optimize-") as scratch:
        ctx = open_run(parse_config(search_cfg), Path(scratch) / "search", stages=("eval", "bench") if measured else ("eval",),
                       cache_dir=cache_dir)
        try:
            ref: dict = {}
            macs: dict = {}
            fp32_onnx: Optional[Path] = None

            def full(spec: dict) -> dict:
                """Evaluate (and time) one candidate on the whole search split, or replay it from the store."""
                t0 = time.perf_counter()
                cached = store.get(spec, "full")
                if cached is not None:
                    evaluations["cached"] += 1
                    p = cached.pop("_predictions")
                    cand = cached
                else:
                    variant = resolve_variant(VariantSpec.model_validate(spec), len(candidates))
                    r = run_variant(ctx, variant)
                    evaluations["full"] += 1
                    p = r.predictions
                    if not ref:
                        if r.status != "ok" or (r.metrics.get(key) is None and o.budget.min_agreement is None):
                            raise ConfigError(f"the FP32 reference could not be evaluated on the search split: {r.reason}")
                    cand = _candidate(r, key, bs, measured, time.perf_counter() - t0, macs, fp32_onnx)
                    store.put(spec, "full", cand, p)
                first = not ref
                if first:
                    ref.update(cand)
                    ref["_predictions"] = p
                    if task == "classification" and ev.labels:  # for the paired standard error of each drop
                        ref["_labels"] = np.concatenate([np.asarray(y) for _, y in ctx.eval_batches])
                cand = {**_rescore(cand, ref, o, p, z), "reference": first}
                spec_of[cand["variant"]] = spec
                preds[cand["variant"]] = p
                candidates.append(cand)
                decisions.append(f"{cand['variant']}: {cand['budget']}" + (f", p50 {cand['latency_p50_ms']:.3f} ms"
                                                                            if cand.get("latency_p50_ms") is not None else "")
                                 + ("" if cand["status"] == "ok" else f" ({cand['status']}: {cand['reason']})")
                                 + (" [replayed from an earlier run]" if cached is not None else ""))
                return cand

            if placement is not None:  # every candidate of these targets starts from the ONNX: fail now, saying why
                try:
                    fp32_onnx = ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
                except QDeployError as e:
                    alone = " and TensorRT is not installed here, so there is no other path" if o.target == "tensorrt" and not trt else ""
                    raise ConfigError(f"optimize.target {o.target} works from the model's ONNX (TensorRT and ONNX Runtime "
                                      f"both parse it){alone}: {e}") from None
                # MACs per compute layer of the FP32 model (one image): the INT8 share of compute is weighted by them
                one = normalize(ctx.eval_batches.first(1)[0], ctx.cfg.model.preprocess)
                macs.update({d["name"]: d["macs"] or 0 for d in layer_sensitivity(fp32_onnx, one)})
            int8_specs = [sp for sp in specs if sp["precision"] == "int8"]
            plain = [sp for sp in specs if sp["precision"] != "int8"]
            full_specs = plain + (int8_specs if len(int8_specs) <= 1 else [])
            for i, spec in enumerate(full_specs):
                left = time_left()
                if i > 0 and left is not None and left <= 0:
                    timed_out = True
                    decisions.append(f"time limit {o.time_limit:g} s reached: {', '.join(s['name'] for s in full_specs[i:])} not tried")
                    break
                t0 = time.perf_counter()
                full(spec)
                if i == 0:
                    spent = time.perf_counter() - t0
                    if o.time_limit is not None and o.time_limit < spent:
                        raise ConfigError(f"optimize.time_limit {o.time_limit:g} s is shorter than one evaluation "
                                          f"({spent:.1f} s for the FP32 reference)")
                    warning = resolution_warning(o.budget, ref.get("search_metric") or 0.0, n_search, task)
                    if warning:
                        warn(warning)
                        decisions.append(warning)
            if len(int8_specs) > 1 and not timed_out:
                # Every PTQ method gives the same graph (one placement, only the scales differ), hence the same speed:
                # the methods are ranked by agreement with FP32 on a seeded subset, and only the best gets a full
                # evaluation (the runner-up too when the best misses the budget: near-equal methods swap places on a
                # few hundred samples). One statistics pass still serves every method.
                rng = np.random.default_rng(o.seed + 1)
                n_eval = len(ref["_predictions"])  # the images really decoded (on_error: skip may leave some out)
                idx = np.sort(rng.choice(n_eval, size=min(o.subset_size, n_eval), replace=False))
                sctx, ref_sub = _subset_context(ctx, idx, ref["_predictions"])
                scored = []
                for spec in int8_specs:
                    cached = store.get(spec, "subset-methods")
                    if cached is None:
                        r = run_variant(sctx, resolve_variant(VariantSpec.model_validate(spec), 0))
                        evaluations["subset"] += 1
                        score = agreement(r.predictions, ref_sub) if r.status == "ok" else None
                        cached = {"agreement": score, "status": r.status, "reason": r.reason}
                        store.put(spec, "subset-methods", cached, None)
                    else:
                        evaluations["cached"] += 1
                    scored.append((spec, cached))
                scored.sort(key=lambda t: -(t[1]["agreement"] if t[1]["agreement"] is not None else -1.0))
                decisions.append(f"PTQ methods ranked on a seeded subset of {len(idx)} search samples by agreement with FP32: "
                                 + ", ".join(f"{sp['name']} {100 * c['agreement']:.2f} %" if c["agreement"] is not None else
                                             f"{sp['name']} failed ({c['reason']})" for sp, c in scored))
                for rank, (spec, sub) in enumerate(scored):
                    if sub["agreement"] is None:
                        continue
                    if rank > 0 and (rank > 1 or any(c["within_budget"] for c in candidates if c["precision"] == "int8")):
                        candidates.append({"variant": spec["name"], "precision": "int8", "method": spec.get("method"),
                                           "status": "ranked on the subset only", "reason": None, "search_metric": None,
                                           "subset_agreement": sub["agreement"], "within_budget": False, "margin": None,
                                           "rank_key": None, "budget": "not evaluated on the whole search split",
                                           "latency_p50_ms": None, "int8_share": None, "float_layers": []})
                        spec_of[spec["name"]] = spec
                        continue
                    cand = full(spec)
                    cand["subset_agreement"] = sub["agreement"]
            ptq = [c for c in candidates if c["precision"] == "int8" and c["status"] == "ok"]
            stages["ptq"] = {"within_budget": [c["variant"] for c in ptq if c["within_budget"]]}
            # ---- per-layer fallback, then QAT: when no INT8 candidate is within budget (FP16 may be, and slower)
            slower = _int8_slower_than_fp32(candidates, ptq, measured)
            if slower:
                decisions.append(slower)
            if ptq and not any(c["within_budget"] for c in ptq) and not timed_out and not slower:
                start = best_effort(ptq)
                decisions.append(f"no PTQ candidate within budget on the search split; best: {start['variant']} "
                                 f"({start['budget']})")
                float_layers: list[str] = []
                missed_by_fallback = True
                if o.fallback:
                    fb = _fallback(ctx, o, start, spec_of[start["variant"]], full, ref, preds, store, evaluations, decisions,
                                   time_left)
                    stages["fallback"] = fb
                    if fb is not None:
                        float_layers = fb["float_layers"]
                        missed_by_fallback = not fb["within_budget"]
                if missed_by_fallback and o.qat != "off" and (time_left() is None or time_left() > 0):
                    qspec = {**spec_of[start["variant"]], "quantizer": "qat", "exclude": _exclude(float_layers),
                             "name": f"{start['variant']}-qat" + (f"-float{len(float_layers)}" if float_layers else "")}
                    decisions.append(f"QAT ({o.qat}) from {start['variant']}" + (f", with the fallback's {len(float_layers)} "
                                                                                 "float layers kept float" if float_layers else ""))
                    qc = full(qspec)
                    qc["stage"] = "qat"
                    qc["float_layers_fallback"] = float_layers
                    stages["qat"] = {"variant": qc["variant"], "within_budget": qc["within_budget"], "budget": qc["budget"]}
                elif missed_by_fallback and o.qat == "off":
                    decisions.append("QAT not allowed (optimize.qat: off): the search ends without training")
            left = time_left()
            if left is not None and left <= 0:
                timed_out = True
        finally:
            ctx.output.abort()
        chosen, budget_met_search, why = choose(candidates, measured)
        decisions += why
        if timed_out:
            decisions.append(f"time limit {o.time_limit:g} s: the chosen candidate is the best found so far")
        # ---- confirm: the reference and the chosen candidate, once, on the complement
        confirm_specs = [specs[0]] + ([spec_of[chosen["variant"]]] if chosen and chosen["variant"] != specs[0]["name"] else [])
        confirm_cfg = dict(base, variants=confirm_specs, bench={**base["bench"], "enabled": False},
                           data={**base["data"], "eval": {**base["data"]["eval"],
                                                          "subsplit": {"count": n_search, "seed": o.seed, "complement": True}}})
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
            public = [{k: v for k, v in c.items() if not k.startswith("_")} for c in candidates]
            summary = {
                "target": o.target, "budget": o.budget.model_dump(exclude_none=True), "batch_size": bs,
                "latency_measured": measured, "timed_out": timed_out,
                "chosen": {"variant": chosen["variant"] if chosen else None, "artifact": chosen_file,
                           "search_metric": chosen.get("search_metric") if chosen else None, "confirm_metric": chosen_metric,
                           "reference_confirm_metric": ref_metric, "confirm_agreement": agree,
                           "latency_p50_ms": chosen.get("latency_p50_ms") if chosen else None,
                           "reference_latency_p50_ms": ref_latency, "float_layers": chosen.get("float_layers") if chosen else None,
                           "int8_share": chosen.get("int8_share") if chosen else None,
                           "int8_ops_share": chosen.get("int8_ops_share") if chosen else None,
                           "float_macs_share": chosen.get("float_macs_share") if chosen else None,
                           "stage": ("reference" if chosen.get("reference") else chosen.get("stage", "ptq")) if chosen else None,
                           "setting": spec_of.get(chosen["variant"]) if chosen else None,
                           "best_so_far": timed_out},
                "budget_met": bool(budget_met_search and confirm.within), "budget_met_search": budget_met_search,
                "confirm": {"why": confirm.why, "margin": confirm.margin},
                "candidates": public, "stages": stages, "decisions": decisions, "evaluations": evaluations,
                "splits": {"search": n_search, "confirm": n - n_search, "seed": o.seed}, "metric": key,
                "time_s": round(time.perf_counter() - t_start, 2), "artifacts": artifacts,
                "resume_store": str(store.folder),
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


def _fallback(ctx, o: OptimizeConfig, start: dict, start_spec: dict, full, ref: dict, preds: dict, store: _Store,
              evaluations: dict, decisions: list, time_left) -> Optional[dict]:
    """Per-layer fallback from ``start`` (see fallback.py); None when the layers cannot be named for ``exclude``."""
    fp32_onnx = ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
    int8_of = lambda spec: resolve_variant(VariantSpec.model_validate(spec), 0)  # noqa: E731

    def spec_for(layers: list[str]) -> dict:
        if not layers:
            return start_spec
        return {**start_spec, "exclude": _exclude(layers), "name": f"{start_spec['name']}-float{len(layers)}-"
                + sha256_json(sorted(layers))[:6]}

    def artifact(layers: list[str]):
        return _onnx_of(ctx.builder.build(int8_of(spec_for(layers)).artifact_request()))

    # the subset: the search samples the best PTQ model disagrees with FP32 on most (NNCF: the 300 "worst"), seeded ties
    ref_p, start_p = ref.get("_predictions"), preds.get(start["variant"])
    if ref_p is None or start_p is None or ref_p.shape != start_p.shape:
        decisions.append("fallback skipped: no per-sample predictions to pick the subset from")
        return None
    per_sample = (ref_p != start_p).reshape(len(ref_p), -1).mean(axis=1)
    rng = np.random.default_rng(o.seed)
    order = np.lexsort((rng.random(len(per_sample)), -per_sample))
    subset_idx = np.sort(order[: min(o.subset_size, len(order))])
    sctx, ref_sub = _subset_context(ctx, subset_idx, ref_p)
    n_eval = len(ref_p)  # the images really decoded (on_error: skip may leave some out)
    sens_idx = np.sort(rng.choice(n_eval, size=min(o.sensitivity_images, n_eval), replace=False))
    sens_images = normalize(take(ctx.eval_batches, sens_idx)[0], ctx.cfg.model.preprocess)
    decisions.append(f"fallback from {start['variant']}: subset of {len(subset_idx)} search samples "
                     f"({int((per_sample > 0).sum())} disagree with FP32); SQNR on {len(sens_idx)} images")
    names_map: dict = {}
    ranked: dict = {}  # the SQNR pass is deterministic per float set: a re-ranking after an undo reuses it

    def sensitivity(layers: list[str]) -> list[dict]:
        key = tuple(sorted(layers))
        if key not in ranked:
            ranked[key] = _sensitivity(layers)
        return ranked[key]

    def _sensitivity(layers: list[str]) -> list[dict]:
        art = artifact(layers)
        evaluations["sensitivity"] += 1
        mapping = layer_names_map(fp32_onnx, art.path)
        if mapping is None:
            raise QDeployError(f"the compute layers of {art.path.name} cannot be paired with the FP32 ONNX's (different "
                               "op types or weight shapes in order), so no layer can be named for exclude")
        names_map.update(mapping)
        seg = ctx.cfg.model.task == "segmentation"
        report = layer_sensitivity(art.path, sens_images, batch_size=2 if seg else 16)
        return [{**d, "name": mapping.get(d["name"], d["name"])} for d in report]

    def subset_score(layers: list[str]) -> float:
        spec = spec_for(layers)
        cached = store.get(spec, "subset-fallback")
        if cached is not None:
            evaluations["cached"] += 1
            return cached["agreement"]
        r = run_variant(sctx, int8_of(spec))
        evaluations["subset"] += 1
        if r.status != "ok":
            raise QDeployError(f"fallback: {spec['name']} failed on the subset: {r.reason}")
        score = agreement(r.predictions, ref_sub)
        store.put(spec, "subset-fallback", {"agreement": score}, None)
        return score

    def full_eval(layers: list[str]) -> dict:
        cand = full(spec_for(layers))
        cand["stage"] = "fallback"
        cand["float_layers_fallback"] = list(layers)
        return cand

    hooks = FallbackHooks(sensitivity=sensitivity, subset_score=subset_score, full=full_eval, time_left=time_left,
                          log=lambda line: decisions.append(line))
    try:
        res = run_fallback(start, hooks, refine_top=o.refine_top, max_float_fraction=o.max_float_fraction)
    except QDeployError as e:
        decisions.append(f"fallback stopped: {e}")
        return None
    total = sum(res.macs.values()) or 1
    for c in res.candidates:  # the share of compute (MACs) each trial leaves in float
        c["float_macs_share"] = round(sum(res.macs.get(n, 0) for n in c.get("float_layers_fallback") or []) / total, 4)
    decisions.append(f"fallback: {res.stop}; {len(res.float_layers)} layers in float "
                     f"({100 * res.float_fraction:.1f} % of the compute)")
    return {"start": start["variant"], "float_layers": res.float_layers, "within_budget": res.within_budget,
            "stop": res.stop, "float_fraction": round(res.float_fraction, 4), "rankings": res.rankings,
            "subset_size": int(len(subset_idx)), "trials": [c["variant"] for c in res.candidates]}


def _int8_slower_than_fp32(candidates: list[dict], ptq: list[dict], measured: bool) -> Optional[str]:
    """A sentence when the target measures every PTQ candidate clearly slower than FP32 (ONNX Runtime on EfficientNet:
    3x). A partially quantized model (fallback, QAT) keeps most of that INT8 graph, so it is not expected to beat FP32,
    and the search does not spend evaluations on it; FP32 is then the answer (``decide.choose``)."""
    ref = candidates[0] if candidates else None
    times = [c["latency_p50_ms"] for c in ptq if c.get("latency_p50_ms")]
    if not measured or ref is None or not ref.get("latency_p50_ms") or not times:
        return None
    fastest = min(times)
    if fastest <= ref["latency_p50_ms"] * (1 + LATENCY_TIE):
        return None
    return (f"every PTQ candidate is slower than FP32 on this target (fastest {fastest:.3f} ms vs FP32 "
            f"{ref['latency_p50_ms']:.3f} ms): no fallback or QAT, a partially quantized model keeps most of that INT8 "
            "graph")


def _subset_context(ctx, idx: np.ndarray, ref_predictions: np.ndarray):
    """A run context that evaluates on the search-split samples ``idx`` only (no timing), and FP32's predictions there."""
    images, labels = take(ctx.eval_batches, idx)
    sub = ArrayBatches(images, labels, ctx.eval_batches.batch_size, ctx.eval_batches.class_names)
    return dataclasses.replace(ctx, eval_batches=sub, stages={"eval"}), ref_predictions[idx]


def _rescore(cand: dict, ref: dict, o: OptimizeConfig, p: Optional[np.ndarray], z: float) -> dict:
    """Budget verdict against the reference (replayed candidates and the reference itself included), on the one-sided
    confidence bound: the standard error is paired over the search split's samples (the same images for both)."""
    ref_p, labels = ref.get("_predictions"), ref.get("_labels")
    agree = agreement(p, ref_p) if p is not None and ref_p is not None else None
    se = None
    if agree is not None and p.shape == ref_p.shape:
        if o.budget.min_agreement is not None:
            se = agreement_se((p == ref_p).reshape(len(p), -1).mean(axis=1))
        elif labels is not None and p.ndim == 1 and len(labels) == len(p):
            valid = labels >= 0
            se = paired_drop_se(ref_p[valid] == labels[valid], p[valid] == labels[valid])
    v = budget_check(o.budget, ref.get("search_metric"), cand.get("search_metric"), agree, se, z)
    ok = cand["status"] == "ok"
    return {**cand, "agreement": agree, "se": se, "within_budget": ok and v.within, "margin": v.margin if ok else None,
            "budget": v.why}


def _onnx_of(artifact):
    """The (Q/DQ) ONNX behind an artifact: itself, or for a TensorRT engine the ONNX it was built from (its companion),
    which is what sensitivity, layer names and the Q/DQ structure read."""
    if artifact is None or artifact.kind != ArtifactKind.TRT_ENGINE:
        return artifact
    return next((c for c in artifact.companions if c.kind != ArtifactKind.TRT_ENGINE), None)


def _int8_macs_share(r, structure: dict, macs: Optional[dict], fp32_onnx: Optional[Path]) -> Optional[float]:
    """Share of the model's MACs in compute layers whose input and weights are both INT8 (what TensorRT runs in INT8),
    from the FP32 model's per-layer MACs; None when the Q/DQ layers cannot be paired with the FP32 ONNX's."""
    onnx_art = _onnx_of(r.artifact)
    if not macs or fp32_onnx is None or onnx_art is None or onnx_art.path is None or not structure.get("ops"):
        return None
    mapping = layer_names_map(fp32_onnx, onnx_art.path)
    if mapping is None:
        return None
    total = sum(macs.values()) or 1
    int8 = sum(macs.get(mapping.get(op["name"], op["name"]), 0) for op in structure["ops"] if op["int8_input"] and op["int8_weights"])
    return round(int8 / total, 4)


def _candidate(r, key: str, bs: int, measured: bool, seconds: float, macs: Optional[dict] = None,
               fp32_onnx: Optional[Path] = None) -> dict:
    metric = r.metrics.get(key) if r.metrics else None
    onnx_art = _onnx_of(r.artifact)
    structure = (onnx_art.info.get("structure") if onnx_art is not None else None) or {}
    ops = structure.get("compute_ops")
    int8_ops = (structure.get("compute_ops_int8", 0) / ops) if ops else (0.0 if r.variant.precision != "int8" else None)
    int8_share = (_int8_macs_share(r, structure, macs, fp32_onnx) if r.variant.precision == "int8" else 0.0)
    if int8_share is None:  # layers not pairable: the share of compute ops instead
        int8_share = int8_ops
    p50 = T.p50({"latency_ms": r.bench.get("latency_ms", {})}, str(bs)) if measured and r.status == "ok" else None
    rank = p50 if measured else (-(int8_share or 0.0))
    return {"variant": r.label, "precision": r.variant.precision, "method": r.variant.int8.method if r.variant.int8 else None,
            "quantizer": r.variant.int8.quantizer if r.variant.int8 else None,
            "status": r.status, "reason": r.reason, "search_metric": metric,
            "latency_p50_ms": p50, "rank_key": rank if r.status == "ok" else None, "int8_share": int8_share,
            "int8_ops_share": int8_ops,
            "float_layers": list(structure.get("compute_ops_float") or []), "time_s": round(seconds, 2)}
