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

Within budget: the budget (max_drop or relative on the task metric, or min_agreement alone) and, in every decision, the
agreement floor (decide.agreement_floor: budget.min_agreement, default 0.9, and the siblings rule qdeploy run's degraded
mark uses), so a candidate that no longer makes FP32's predictions is never "within budget" because FP32 is poor.

Shape: ``optimize()`` plans (candidates.plan: one typed candidate per kind, by target), evaluates them on the search
split (``_Search``: reference and floats, PTQ methods, fallback, QAT), decides (decide.choose, plain functions on the
candidates' numbers) and confirms. Every decision line is logged once, when it is made.

Resumable: each evaluated candidate (and each subset score) is stored under the cache folder, keyed by everything that
decides it; an interrupted search started again with the same config replays those and goes on.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
from rich.markup import escape

import qdeploy
from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.models.loader import model_fingerprint
from qdeploy.config import OptimizeConfig, RunConfig, VariantSpec, check_output_folder, parse_config, source_format
from qdeploy.data import ArrayBatches, make_batches, normalize, take
from qdeploy.engines.base import resolve_variant
from qdeploy.errors import ConfigError, QDeployError
from qdeploy.evaluate.compare import reference_chance
from qdeploy.evaluate.metrics import agreement
from qdeploy.facts.onnxruntime import cuda_ep_problem
from qdeploy.facts.tensorrt import tensorrt_version
from qdeploy.optimize.candidates import (Candidate, EngineCandidate, FallbackCandidate, PtqCandidate, QatCandidate, Target,
                                         engine_floats, onnx_of, plan, rejudge, rescore, sibling_agreements, target_for)
from qdeploy.optimize.decide import (LATENCY_TIE, best_effort, budget_check, choose, fallback_for_speed, fastest_within,
                                     resolution_warning, z_of)
from qdeploy.optimize.fallback import FallbackHooks, run_fallback
from qdeploy.optimize.sensitivity import layer_names_map, layer_sensitivity, with_float_activations
from qdeploy.optimize.torch_search import confirm_program, evaluate_torch
from qdeploy.pipeline import as_config, build_variant, copy_artifacts, open_run, run_variant
from qdeploy.preflight import check_qat_data
from qdeploy.report.optimize_page import write_optimize_report
from qdeploy.report.verdict import SIBLING_GAP, SIBLINGS_NEEDED, int8_failure_warning, near_chance_warning
from qdeploy.sysinfo import cpu_model, dist_version, environment
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import OutputDir, write_json
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.hashing import sha256_json, source_fingerprint
from qdeploy.utils.log import each_warning_once, log, warn

TORCH_TIME_LIMIT = 300.0  # seconds: optimize.time_limit's default for the PyTorch targets
CPU_TARGETS = ("onnxruntime-cpu", "cpu", "torch-cpu")


def _metric_key(task: str) -> str:
    return get_task(task).metric


# every library that builds, quantizes, compiles or runs a candidate: another version may give other numbers, or
# fail or succeed where this one did not (issue 35: a build that failed on a broken dependency was replayed as failed
# after the dependency was fixed)
RESUME_LIBRARIES = ("torch", "torchvision", "timm", "transformers", "numpy", "onnx", "onnxscript", "onnxruntime",
                    "onnxruntime-gpu", "openvino", "nncf", "nvidia-modelopt", "tensorrt", "polygraphy", "torchao",
                    "onnx2torch", "keras", "tensorflow", "tf2onnx", "triton")


@functools.lru_cache(maxsize=None)
def _code_fingerprint() -> str:
    return source_fingerprint(Path(qdeploy.__file__).parent)[:16]  # qdeploy's own code: 0.1.0 in every commit


def resume_identity(measured: bool) -> dict:
    """What, besides the model, data and settings, decides a candidate's result: the versions of RESUME_LIBRARIES
    (distribution metadata, nothing imported), a fingerprint of qdeploy's source, and for timed targets the machine
    (CPU model and count, the GPU): a store made under other code, libraries or hardware is never replayed."""
    ident = {"libraries": {d: dist_version(d) for d in RESUME_LIBRARIES}, "qdeploy_code": _code_fingerprint(),
             "python": platform.python_version()}
    if measured:
        ident["machine"] = {"cpu": cpu_model(), "cpus": os.cpu_count(),
                            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    return ident


def untimed_spec(spec: dict) -> dict:
    """A candidate's spec without what only changes its timing (the CPU threads it runs with)."""
    return {k: v for k, v in spec.items() if k != "threads"}


class _Store:
    """Candidate results of one search (same model, data, split, settings, code, libraries and, for timed targets,
    machine: ``resume_identity``), kept on disk so a search interrupted by a crash, a Ctrl-C or the time limit resumes
    where it stopped. Predictions are stored with each candidate: the fallback's subset and the agreement budget need
    them. Only results that ran are replayed: a failure is evaluated again, because whether it came from the
    candidate or from the environment (a library missing or broken, the GPU out of memory, a process killed) cannot be
    told reliably from its message, and an environment since fixed must not be answered with the old failure."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.hits = 0

    def _key(self, spec: dict, kind: str) -> str:
        return sha256_json({"spec": spec, "kind": kind})[:24]

    def get(self, spec: dict, kind: str) -> Optional[tuple[dict, Optional[np.ndarray]]]:
        key = self._key(spec, kind)
        meta = self.folder / f"{key}.json"
        if not meta.is_file():
            return None
        try:
            data = json.loads(meta.read_text())
            preds = self.folder / f"{key}.npy"
            predictions = np.load(preds) if preds.is_file() else None
        except (OSError, ValueError):
            return None  # a half-written entry from an interrupted process: evaluate again
        if data.get("status", "ok") != "ok":
            return None  # a failure: evaluated again (see the class docstring)
        self.hits += 1
        return data, predictions

    def put(self, spec: dict, kind: str, data: dict, predictions: Optional[np.ndarray]) -> None:
        key = self._key(spec, kind)
        if predictions is not None:
            tmp = self.folder / f"{key}.tmp.npy"
            np.save(tmp, predictions)
            tmp.replace(self.folder / f"{key}.npy")
        write_json(self.folder / f"{key}.json", data)


@dataclasses.dataclass
class _Search:
    """One search on the search split: the candidates measured so far, the decisions made and why (each logged once,
    when it is made), and what the stages need from each other (the reference, the FP32 ONNX and its MACs)."""

    o: OptimizeConfig
    target: Target
    ctx: object
    store: _Store
    key: str
    batch_size: int
    z: float
    t_start: float
    candidates: list = dataclasses.field(default_factory=list)
    decisions: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)
    evaluations: dict = dataclasses.field(default_factory=lambda: {"full": 0, "subset": 0, "sensitivity": 0, "cached": 0,
                                                                   "timed_only": 0})
    stages: dict = dataclasses.field(default_factory=lambda: {"ptq": None, "fallback": None, "qat": None})
    timed_out: bool = False
    reference: Optional[Candidate] = None
    labels: Optional[np.ndarray] = None
    macs: dict = dataclasses.field(default_factory=dict)
    fp32_onnx: Optional[Path] = None
    rank_batches: list = dataclasses.field(default_factory=list)  # ranked on the geometric mean of their p50s
    cache_root: Optional[Path] = None
    untimed: Optional[_Store] = None  # accuracy-only results (scores, subset agreements), keyed without timing settings
    aoti_probe: object = None  # PyTorch targets: artifacts.torch_program.AotiProbe, running in the background
    int8_op_profile: Optional[dict] = None  # CPU targets: per-op-class time of an INT8 candidate vs FP32
    profiles: dict = dataclasses.field(default_factory=dict)  # candidate variant → its op-class profile (or None)

    @property
    def scores(self) -> _Store:
        """Where accuracy-only results go: the untimed store (shared by searches that differ in timing only)."""
        return self.untimed or self.store

    def note(self, line: str, warning: bool = False) -> None:
        self.decisions.append(line)
        # a decision is plain text: its brackets ("[replayed ...]", layer names) are not console markup
        (warn if warning else log)(f"optimize: {escape(line)}" if not warning else line)

    def time_left(self) -> Optional[float]:
        return None if self.o.time_limit is None else self.o.time_limit - (time.perf_counter() - self.t_start)

    def out_of_time(self) -> bool:
        left = self.time_left()
        return left is not None and left <= 0

    def measure(self, cand: Candidate) -> Candidate:
        """Evaluate (and time) one candidate on the whole search split, or replay it from the store."""
        t0 = time.perf_counter()
        cached = self.store.get(cand.spec, "full")
        if cached is not None:
            self.evaluations["cached"] += 1
            cand.load(*cached)
        else:
            scored = self.untimed.get(untimed_spec(cand.spec), "scores") if self.untimed and "bench" in self.ctx.stages else None
            variant = resolve_variant(VariantSpec.model_validate(cand.spec), len(self.candidates))
            if scored is None:
                r = run_variant(self.ctx, variant)
                self.evaluations["full"] += 1
            else:  # scored under another batch size or thread count: timed only
                r = run_variant(dataclasses.replace(self.ctx, stages={"bench"}), variant)
                r.metrics, r.predictions = scored[0]["metrics"], scored[1]
                self.evaluations["timed_only"] += 1
            cand.measure(r, self.key, self.batch_size, self.target.measured, time.perf_counter() - t0, self.macs,
                         self.fp32_onnx, self.rank_batches)
            if cand.reference and (not cand.ok or (cand.search_metric is None and not self.o.budget.agreement_only)):
                raise ConfigError(f"the FP32 reference could not be evaluated on the search split: {cand.reason}")
            self.store.put(cand.spec, "full", cand.measured_json(), cand.predictions)
            if self.untimed and cand.ok and scored is None and r.metrics:
                self.untimed.put(untimed_spec(cand.spec), "scores", {"metrics": r.metrics}, r.predictions)
            cand.scores_replayed = scored is not None
        if cand.reference and self.reference is None:
            self.reference = cand
            if get_task(self.ctx.cfg.model.task).per_sample_standard_error and self.ctx.cfg.data.eval.labels:
                # for the paired standard error of each drop
                self.labels = np.concatenate([np.asarray(y) for _, y in self.ctx.eval_batches])
        rescore(cand, self.reference, self.labels, self.o, self.z, sibling_agreements(cand, self.candidates))
        self.candidates.append(cand)
        self.note(f"{cand.variant}: {cand.budget}" + (f", p50 {cand.latency_p50_ms:.3f} ms" if cand.latency_p50_ms is not None else "")
                  + (" [replayed from an earlier run]" if cand.replayed else "")
                  + (" [scores replayed from a search timed at another batch size or thread count; timed here]"
                     if cand.scores_replayed else ""))
        if cand.precision == "int8" and cand.ok:
            self.rescore_siblings(cand)
        return cand

    def rescore_siblings(self, newcomer: Candidate) -> None:
        """The agreement floor's siblings rule compares each INT8 candidate with the others: a new one moves their
        median, so the earlier ones are judged again from their kept numbers (nothing is re-run), and a verdict
        that changes is logged with its reason."""
        for c in self.int8():
            if c is newcomer or not c.ok:
                continue
            before = c.within_budget
            rejudge(c, self.reference, self.o, self.z, sibling_agreements(c, self.candidates))
            if c.within_budget != before:
                self.note(f"{c.variant}: {'now within budget' if c.within_budget else 'no longer within budget'} "
                          f"after {newcomer.variant}: {c.budget}")

    def subset_context(self, idx: np.ndarray):
        return _subset_context(self.ctx, idx, self.reference.predictions)

    def int8(self) -> list[Candidate]:
        return [c for c in self.candidates if c.precision == "int8"]


def _prepare(cfg: RunConfig):
    """Validate before any work, then plan: (optimize settings, target, planned candidates, search config, base config,
    images in data.eval, images in the search split, batch size, listing)."""
    o = cfg.optimize or OptimizeConfig()
    if o.target == "torch-cuda" and not torch.cuda.is_available():
        raise ConfigError("optimize.target torch-cuda: no CUDA GPU is visible to PyTorch")
    if o.target == "onnxruntime-cuda":
        problem = cuda_ep_problem()
        if problem:
            raise ConfigError(f"optimize.target onnxruntime-cuda: {problem}")
    if o.target.startswith("torch-") and source_format(cfg.model.source) != "pytorch":
        raise ConfigError(f"optimize.target {o.target} runs the PyTorch model, but model.source is an ONNX or Keras model "
                          f"({cfg.model.source}): use target onnxruntime-cpu or tensorrt, or give the PyTorch model")
    if o.target.startswith("torch-") and o.time_limit is None:
        # compiling is open-ended (max-autotune: minutes per model): the PyTorch targets are bounded by default
        o = o.model_copy(update={"time_limit": TORCH_TIME_LIMIT})
    ev = cfg.data.eval
    if not ev.labels and not o.budget.agreement_only:
        kind = "max_drop" if o.budget.max_drop is not None else "relative"
        raise ConfigError(f"optimize.budget.{kind} compares the task metric, which needs labels, but data.eval has labels: "
                          "false; without labels use optimize.budget.min_agreement (the share of FP32's predictions kept)"
                          + (f" alone: remove {kind}" if o.budget.min_agreement is not None else ""))
    if ev.subsplit is not None:
        raise ConfigError("optimize splits data.eval into search and confirm itself (data.eval.subsplit): remove subsplit "
                          "from data.eval (count/complement, to keep calibration images out, stay as they are)")
    trt = tensorrt_version() is not None and torch.cuda.is_available()
    target = target_for(o.target, trt)
    if o.threads:
        if o.target not in CPU_TARGETS:
            raise ConfigError(f"optimize.threads sets CPU threads; target {o.target} runs on a GPU")
        target = dataclasses.replace(target, threads=o.threads)
    bs = o.batch_size or max(cfg.bench.batch_sizes)
    listing = make_batches(ev, cfg.model.preprocess, cfg.model.task, progress=False)
    n = listing.num_samples
    n_search = max(1, round(o.search_fraction * n))
    if n_search >= n:
        raise ConfigError(f"data.eval has {n} images: too few to split into search and confirm")
    planned = plan(o, target)
    if o.qat != "off":
        if target.placement is None:
            raise ConfigError(f"optimize.qat {o.qat}: target {o.target} runs no INT8 candidates to train")
        cfg = cfg.model_copy(update={"qat": cfg.qat_settings().model_copy(update={"objective": o.qat})})
        check_qat_data(cfg, listing)  # training images exist and are not evaluation images, before any work
    base = cfg.model_dump(mode="json", exclude_none=True)
    base.pop("optimize", None)
    # a PyTorch target is ranked over every configured batch size (its artifact serves them all), unless one is named
    ranked = [bs] if o.batch_size or not target.torch_program else sorted(set(cfg.bench.batch_sizes))
    base["bench"] = {**base.get("bench", {}), "batch_sizes": ranked, "enabled": target.measured}
    if target.torch_program:
        # evaluated in batches of the largest timed size: torch.compile specialises on shapes, so another batch size
        # would compile again (a last, smaller batch is padded by the engine and by load_model.py)
        base["data"] = {**base["data"], "eval": {**base["data"]["eval"], "batch_size": max(ranked)}}
    search_cfg = dict(base, variants=[c.spec for c in planned],
                      data={**base["data"], "eval": {**base["data"]["eval"], "subsplit": {"count": n_search, "seed": o.seed}}})
    return o, target, planned, search_cfg, base, n, n_search, bs, trt


def optimize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    with each_warning_once():  # the search and the confirm run open the same model: one warning each
        return _optimize(config, out_dir, cache_dir)


def _model_identity(builder) -> str:
    """The FP32 model's content fingerprint: weights (and code) of a PyTorch source, the bytes of an ONNX or Keras one."""
    if builder.has_torch:
        return model_fingerprint(builder.spec, builder.torch_model())
    return builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).fingerprint


def _optimize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    t_start = time.perf_counter()
    cfg = as_config(config)
    # --out is written only after the confirm split, maybe an hour from now: refuse a bad one before any work
    check_output_folder(cfg, out_dir, cache_dir)
    OutputDir(out_dir).abort()
    o, target, planned, search_cfg, base, n, n_search, bs, trt = _prepare(cfg)
    task = cfg.model.task
    key = _metric_key(task)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    with tempfile.TemporaryDirectory(prefix="qdeploy-optimize-") as scratch:
        ctx = open_run(parse_config(search_cfg), Path(scratch) / "search",
                       stages=("eval", "bench") if target.measured else ("eval",), cache_dir=cache_dir)
        # keyed by what decides a candidate's numbers (the model's bytes, data, split, timing settings), not by the
        # candidate list: a search resumed with other methods or fallback settings still replays the candidates it
        # shares, and a model file retrained in place (same path, new weights) is never answered with old numbers
        identity = {
            "search": {k: v for k, v in search_cfg.items() if k not in ("variants", "bench")},
            "model": _model_identity(ctx.builder),
            "optimize": o.model_dump(mode="json", include={"target", "seed", "search_fraction", "subset_size",
                                                           "sensitivity_images"}),
            "qdeploy": qdeploy.__version__, "tensorrt": trt, "environment": resume_identity(target.measured)}
        store = _Store(cache_root / "optimize" / sha256_json({**identity, "bench": search_cfg["bench"]})[:20])
        # on a CPU what a candidate scores does not depend on how it is timed: a search for another deployment of the
        # same model (batch size, threads) replays each candidate's accuracy and only times it again. Not on a GPU: a
        # TensorRT engine is built for its batch sizes (optimization profile), and another build may pick other tactics
        untimed = (_Store(cache_root / "optimize-accuracy" / sha256_json(identity)[:20])
                   if o.target in ("onnxruntime-cpu", "cpu") else None)
        s = _Search(o, target, ctx, store, key, bs, z_of(o.confidence), t_start,
                    rank_batches=list(search_cfg["bench"]["batch_sizes"]) if target.torch_program else [],
                    cache_root=cache_root, untimed=untimed)
        s.note(f"target {o.target}: candidates {', '.join(c.variant for c in planned)} on engine {target.engine_name}; "
               f"search split {n_search} of {n} data.eval images (seed {o.seed}), the other {n - n_search} confirm")
        s.note(f"budget: {o.budget_text(task)}; a candidate below the agreement floor, or more than "
               f"{100 * SIBLING_GAP:g} points below the median agreement of {SIBLINGS_NEEDED} or more INT8 siblings, is "
               "never within budget, whatever its accuracy")
        if target.note:
            s.note(target.note)
        if s.z > 0:
            the_task = get_task(task)
            s.note(f"decisions on the one-sided {100 * o.confidence:g} % bound (z {s.z:.2f}) of each candidate's drop or "
                   "agreement, with its standard error paired over the search split"
                   + (f"; {the_task.metric_label} has no per-sample standard error, so {the_task.metric_label} budgets "
                      "use the point estimate" if not the_task.per_sample_standard_error and not o.budget.agreement_only
                      else ""))
        try:
            if target.torch_program:
                evaluate_torch(s, planned)
            else:
                _evaluate(s, planned, n_search)
        except BaseException:
            if s.aoti_probe is not None:  # no background compile outlives a failed search
                s.aoti_probe.close()
            raise
        finally:
            ctx.output.abort()
        # ---- decide, on the search split
        chosen, budget_met_search, why = choose(s.candidates, target.measured)
        for line in why:
            s.note(line)
        if s.timed_out:
            s.note(f"time limit {o.time_limit:g} s: the chosen candidate is the best found so far")
        _profile_int8(s, chosen)
        int8_failed = int8_failure_warning([{**c.to_json(), "name": c.variant} for c in s.int8()]) \
            if any(c.precision == "int8" for c in planned) else None
        if int8_failed is not None:
            int8_failed["message"] = int8_failed["message"].replace("INT8 variant", "INT8 candidate")
            s.warnings.append(int8_failed)
            s.note(int8_failed["message"], warning=True)
        try:
            summary = _confirm(s, cfg, o, base, chosen, budget_met_search, n, n_search, out_dir, cache_dir, t_start)
        finally:
            if s.aoti_probe is not None:
                s.aoti_probe.close()
    return summary


def _evaluate(s: _Search, planned: list[Candidate], n_search: int) -> None:
    """The search: the reference and the target's float candidates, the PTQ methods, then (when no INT8 candidate is
    within budget) the per-layer fallback and QAT."""
    o, ctx = s.o, s.ctx
    if s.target.placement is not None:  # every candidate of these targets starts from the ONNX: fail now, saying why
        try:
            s.fp32_onnx = ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
        except QDeployError as e:
            alone = " and TensorRT is not installed here, so there is no other path" if not s.target.measured else ""
            raise ConfigError(f"optimize.target {o.target} works from the model's ONNX (TensorRT and ONNX Runtime "
                              f"both parse it){alone}: {e}") from None
        # MACs per compute layer of the FP32 model (one image): the INT8 share of compute is weighted by them
        one = normalize(ctx.eval_batches.first(1)[0], ctx.cfg.model.preprocess)
        s.macs.update({d["name"]: d["macs"] or 0 for d in layer_sensitivity(s.fp32_onnx, one)})
    ptq = [c for c in planned if isinstance(c, PtqCandidate)]
    first = [c for c in planned if not isinstance(c, PtqCandidate)] + (ptq if len(ptq) <= 1 else [])
    for i, cand in enumerate(first):
        if i > 0 and s.out_of_time():
            s.timed_out = True
            s.note(f"time limit {o.time_limit:g} s reached: {', '.join(c.variant for c in first[i:])} not tried")
            break
        t0 = time.perf_counter()
        s.measure(cand)
        if i == 0:
            _after_reference(s, time.perf_counter() - t0, n_search)
    if len(ptq) > 1 and not s.timed_out:
        _rank_methods(s, ptq)
    ok_ptq = [c for c in s.int8() if c.ok]
    s.stages["ptq"] = {"within_budget": [c.variant for c in ok_ptq if c.within_budget]}
    if not s.timed_out:
        _placements_and_engines(s, ok_ptq)
        ok_ptq = [c for c in s.int8() if c.ok and isinstance(c, PtqCandidate)]
    # ---- per-layer fallback, then QAT: when no INT8 candidate is within budget (FP16 may be, and slower)
    slower = _int8_slower_than_fp32(s.reference, ok_ptq, s.target.measured)
    if slower:
        s.note(slower)
    if ok_ptq and not any(c.within_budget for c in s.int8() if c.ok) and not s.timed_out and not slower:
        start = best_effort(ok_ptq)
        s.note(f"no PTQ candidate within budget on the search split; best: {start.variant} ({start.budget})")
        float_layers: list[str] = []
        missed_by_fallback = True
        if o.fallback:
            fb = _fallback(s, start)
            s.stages["fallback"] = fb
            if fb is not None:
                float_layers = fb["float_layers"]
                missed_by_fallback = not fb["within_budget"]
        if missed_by_fallback and o.qat != "off" and not s.out_of_time():
            s.note(f"QAT ({o.qat}) from {start.variant}" + (f", with the fallback's {len(float_layers)} float layers kept "
                                                            "float" if float_layers else ""))
            qc = s.measure(QatCandidate.planned(start, float_layers))
            s.stages["qat"] = {"variant": qc.variant, "within_budget": qc.within_budget, "budget": qc.budget}
        elif missed_by_fallback and o.qat == "off":
            s.note("QAT not allowed (optimize.qat: off): the search ends without training")
    elif ok_ptq and o.fallback and s.target.measured and not s.timed_out:
        # a faster INT8 (often another engine's) misses the budget by its drop while slower candidates meet it: its
        # fallback may be the fastest answer within budget (decide.fallback_for_speed). Also where every ONNX Runtime
        # INT8 is slower than FP32 (``slower``, the AMX Xeon's transformers): that says nothing of OpenVINO's INT8
        start = fallback_for_speed([c for c in s.candidates if c.ok],
                                   [c for c in s.int8() if c.ok and isinstance(c, (PtqCandidate, EngineCandidate))])
        if start is not None:
            best = fastest_within([c for c in s.candidates if c.ok])
            s.note(f"{start.variant} ({start.latency_p50_ms:.3f} ms) is faster than the fastest candidate within budget, "
                   f"{best.variant} ({best.latency_p50_ms:.3f} ms), and outside the budget by its drop ({start.budget}): "
                   "per-layer fallback from it")
            s.stages["fallback"] = _fallback(s, start, to_beat=best)
    if s.out_of_time():
        s.timed_out = True


def _placements_and_engines(s: _Search, ok_ptq: list[Candidate]) -> None:
    """From the best PTQ method: the ONNX Runtime placement that keeps conv outputs quantized (when the default left
    convs float because ONNX Runtime has no INT8 conv with a float output: lint/placement.py), and on the target's other
    engines (target cpu: OpenVINO) the same Q/DQ ONNX files and the engine's own placement (NNCF)."""
    if s.target.placement != "onnxruntime" or not s.target.measured:
        return
    measured = [c for c in ok_ptq if isinstance(c, PtqCandidate) and c.latency_p50_ms is not None]
    best = fastest_within(measured) or best_effort(measured)
    planned: list[Candidate] = []
    if best is not None:
        art = onnx_of(s.ctx.builder.build(resolve_variant(VariantSpec.model_validate(best.spec), 0).artifact_request()))
        float_convs = (art.info or {}).get("float_convs_without_int8_kernel") or [] if art is not None else []
        if float_convs:
            s.note(f"{best.variant}: {len(float_convs)} convs left float because their outputs stay float (ONNX Runtime "
                   "runs a conv in INT8 only as QLinearConv); trying them INT8 with quantized outputs")
            planned.append(PtqCandidate.planned(s.target, best.method, quantized_conv_outputs=True))
    if not _measure_all(s, planned):
        return
    # the placement the profile asks for: op types whose INT8 kernels ONNX Runtime measured slower than their float ones
    # (on this model, CPU and batch size) left float, from the faster of the two placements above
    ort = [c for c in [best, *planned] if c is not None and c.ok and c.latency_p50_ms is not None]
    base = min(ort, key=lambda c: c.latency_p50_ms, default=None)
    profiled = _profile(s, base) if base is not None and s.fp32_onnx is not None else None
    slower = [k for k in (profiled or {}).get("slower", []) if k in FLOAT_WHEN_SLOWER]
    if slower:  # ONNX Runtime adds nodes of its own (a Transpose before a Gemm, layout reorders): only the model's count
        import onnx

        in_model = {n.op_type for n in onnx.load(str(s.fp32_onnx), load_external_data=False).graph.node}
        slower = [k for k in slower if k in in_model]
    if slower:
        cand = PtqCandidate.planned(s.target, base.method, bool(base.spec.get("quantized_conv_outputs")), tuple(slower))
        if _same_onnx(s, cand, base):
            s.note(f"{base.variant}: {', '.join(slower)} measured slower in INT8 than in FP32, but leaving them float "
                   "gives the same Q/DQ ONNX (ONNX Runtime fuses them from their neighbours' Q/DQ): not tried")
        else:
            s.note(f"{base.variant}: {', '.join(slower)} measured slower in INT8 than in FP32 (ONNX Runtime profiler); "
                   "trying them float")
            planned.append(cand)
            if not _measure_all(s, planned[-1:]):
                return
    twins: list[Candidate] = []
    for engine in s.target.also:
        sources = ([best] if best is not None else []) + [c for c in planned if isinstance(c, PtqCandidate)
                                                          and not c.spec.get("exclude_ops")]
        twins += [EngineCandidate.planned_twin(s.target, engine, c) for c in sources]
        # the same Q/DQ ONNX with its float layers in BF16, as for the own placement below; one candidate, measured
        # like the rest. On the Xeon (AMX) it was the answer for ResNet-20 batch 32 (1.434 vs 1.468 ms f32-hinted) and
        # DeepLabV3 batch 8 (32.9 vs 34.6 ms), and faster than its f32-hinted twin in 6 of 17 other rows, slower in
        # the rest (MobileViT batch 1: 5.2 vs 2.8 ms): docs/benchmarks.md, issue 36's eighth session
        if best is not None and "bf16" in engine_floats(engine):
            twins.append(EngineCandidate.planned_twin(s.target, engine, best, float_precision="bf16"))
        problem = own_placement_problem(engine)
        if problem:
            s.note(f"{engine}'s own INT8 placement not tried: {problem}")
        else:
            twins.append(EngineCandidate.planned_own_placement(s.target, engine))
            # OpenVINO's CPU plugin runs an INT8 model's float layers in BF16 by default where the CPU has native BF16
            # (AMX-BF16, AVX512-BF16): on a transformer those layers (attention, Softmax, LayerNorm, GELU) are much of
            # the time, and all-BF16 beat the f32-hinted INT8 on the Xeon (DeiT-tiny batch 32: 12.7 vs 15.6 ms)
            if "bf16" in engine_floats(engine):
                twins.append(EngineCandidate.planned_own_placement(s.target, engine, float_precision="bf16"))
    _measure_all(s, twins)


# op classes (benchmark/op_profile.op_class) that are also ONNX op types the placement can leave float without losing a
# compute op's INT8 kernel: data movement and elementwise work, whose INT8 form saves no arithmetic. Add and Mul
# (QLinearAdd / QLinearMul: dequantize, compute, requantize per element) were measured slower in INT8 than in float by
# this profile on both CPUs it ran on: Add in 9 of 12 rows on the Xeon (AVX-512 VNNI, AMX;
# docs/results/cpu_goals_xeon.json) and 15 of 18 on the 2-core AVX2 host (docs/results/cpu_goals.json), Mul in 4 of 12 and
# 11 of 18. Whether they are on a given CPU is what the profile measures, so no ISA flag is read here: the rule is the
# measurement, taken on the CPU that will run the model
FLOAT_WHEN_SLOWER = ("Transpose", "Reshape", "Concat", "Resize", "Softmax", "Sigmoid", "HardSigmoid", "MaxPool",
                     "AveragePool", "Split", "Slice", "Pad", "Add", "Mul")


def _same_onnx(s: _Search, a: Candidate, b: Candidate) -> bool:
    """Whether two INT8 candidates' specs build byte-identical Q/DQ ONNX files (then they are one candidate)."""
    from qdeploy.utils.hashing import sha256_file

    paths = [onnx_of(s.ctx.builder.build(resolve_variant(VariantSpec.model_validate(c.spec), 0).artifact_request())).path
             for c in (a, b)]
    return sha256_file(paths[0]) == sha256_file(paths[1])


def _measure_all(s: _Search, planned: list[Candidate]) -> bool:
    """Measure each candidate in turn; False when the time limit stopped it (the rest are named as not tried)."""
    for i, cand in enumerate(planned):
        if s.out_of_time():
            s.timed_out = True
            s.note(f"time limit {s.o.time_limit:g} s reached: {', '.join(c.variant for c in planned[i:])} not tried")
            return False
        if not any(c.variant == cand.variant for c in s.candidates):
            s.measure(cand)
    return True


def _profile_int8(s: _Search, chosen: Optional[Candidate]) -> None:
    """Where the INT8 graph spends its time against FP32, per op class (benchmark/op_profile.py): the chosen INT8
    candidate (in OpenVINO by its per-layer counters when OpenVINO runs it), or the fastest ONNX Runtime INT8 candidate
    when the answer is not INT8 (why INT8 lost). The report shows the classes whose INT8 form costs more than float."""
    if not s.target.measured or s.fp32_onnx is None or s.target.engine.get("device", "cpu") != "cpu":
        return
    ort_int8 = [c for c in s.candidates if c.ok and c.precision == "int8" and c.spec.get("engine") == "onnxruntime"
                and c.latency_p50_ms is not None]
    if chosen is not None and chosen.ok and chosen.precision == "int8" and chosen.spec.get("engine") == "openvino":
        cand = chosen  # profiled by OpenVINO's per-layer counters, its INT8 graph against its FP32 graph
    else:
        cand = chosen if chosen in ort_int8 else min(ort_int8, key=lambda c: c.latency_p50_ms, default=None)
    if cand is None:
        return
    cmp = _profile(s, cand)
    if cmp is not None:
        s.int8_op_profile = {"candidate": cand.variant, "chosen": cand is chosen, **cmp}


def _profile(s: _Search, cand: Candidate) -> Optional[dict]:
    """benchmark/op_profile's comparison of ``cand``'s INT8 ONNX with the FP32 ONNX at the ranked batch size and the
    target's threads (None, with a decision line, when it cannot be taken). Once per candidate."""
    cache = s.profiles
    if cand.variant in cache:
        return cache[cand.variant]
    from qdeploy.benchmark.op_profile import int8_cost_by_op_class, summary_line

    cache[cand.variant] = None
    try:
        art = onnx_of(s.ctx.builder.build(resolve_variant(VariantSpec.model_validate(cand.spec), 0).artifact_request()))
        images = normalize(s.ctx.eval_batches.first(s.batch_size)[0], s.ctx.cfg.model.preprocess)
        x = np.ascontiguousarray(np.resize(images, (s.batch_size, *images.shape[1:])).astype(np.float32))
        # about 5 s per graph: the candidate's p50 sets the number of profiled runs
        runs = int(min(20, max(3, 5000.0 / max(cand.latency_p50_ms, 1e-3))))
        t0 = time.perf_counter()
        engine = "openvino" if cand.spec.get("engine") == "openvino" else "onnxruntime"
        cmp = int8_cost_by_op_class(s.fp32_onnx, art.path, x, runs=runs, threads=s.target.threads, engine=engine)
    except (QDeployError, OSError, RuntimeError, ValueError) as e:  # a diagnostic: its failure must not sink the search
        s.note(f"per-op profile of {cand.variant} not taken: {type(e).__name__}: {e}")
        return None
    cmp["seconds"] = round(time.perf_counter() - t0, 1)
    s.note(f"{cand.variant}: " + summary_line(cmp))
    cache[cand.variant] = cmp
    return cmp


def own_placement_problem(engine: str) -> Optional[str]:
    """Why ``engine``'s own INT8 placement cannot be made here (None: it can)."""
    from qdeploy.config import Int8Config
    from qdeploy.quantize.registry import NotApplicable, candidates as quantizers

    try:
        quantizers(Int8Config(placement=engine), has_torch=False)
    except (NotApplicable, QDeployError) as e:
        return str(e)
    return None


def _after_reference(s: _Search, spent: float, n_search: int) -> None:
    """What the reference's evaluation tells before any other candidate: the time limit is long enough, the search
    split can resolve the budget, the reference is clearly above chance."""
    o = s.o
    if o.time_limit is not None and o.time_limit < spent:
        raise ConfigError(f"optimize.time_limit {o.time_limit:g} s is shorter than one evaluation "
                          f"({spent:.1f} s for the FP32 reference)")
    warning = resolution_warning(o.budget, s.reference.search_metric or 0.0, n_search, s.ctx.cfg.model.task)
    if warning:
        s.note(warning, warning=True)
    if s.labels is not None:
        check, basis = reference_chance(s.ctx.eval_batches, s.reference.predictions)
        chance = near_chance_warning({"reference": s.reference.variant}, check or {}, basis)
        if chance is not None:
            s.warnings.append(chance)
            s.note(chance["message"], warning=True)


def _rank_methods(s: _Search, ptq: list[PtqCandidate]) -> None:
    """Every PTQ method gives the same graph (one placement, only the scales differ), hence the same speed: the
    methods are ranked by agreement with FP32 on a seeded subset, and only the best gets a full evaluation (the
    runner-up too when the best misses the budget: near-equal methods swap places on a few hundred samples). One
    statistics pass still serves every method. A method that fails is listed with its stage and reason."""
    o = s.o
    rng = np.random.default_rng(o.seed + 1)
    n_eval = len(s.reference.predictions)  # the images really decoded (on_error: skip may leave some out)
    idx = np.sort(rng.choice(n_eval, size=min(o.subset_size, n_eval), replace=False))
    sctx, ref_sub = s.subset_context(idx)
    scored = []
    for cand in ptq:
        cached = s.scores.get(untimed_spec(cand.spec), "subset-methods")
        if cached is None:
            r = run_variant(sctx, resolve_variant(VariantSpec.model_validate(cand.spec), 0))
            s.evaluations["subset"] += 1
            score = agreement(r.predictions, ref_sub) if r.status == "ok" else None
            result = {"agreement": score, "status": r.status, "reason": r.reason, "failed_stage": r.failed_stage}
            s.scores.put(untimed_spec(cand.spec), "subset-methods", result, None)
        else:
            s.evaluations["cached"] += 1
            result = cached[0]
        scored.append((cand, result))
    scored.sort(key=lambda t: -(t[1]["agreement"] if t[1]["agreement"] is not None else -1.0))
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
        if rank > 0 and (rank > 1 or any(c.within_budget for c in s.int8())):
            cand.subset_only(result["agreement"])
            s.candidates.append(cand)
            continue
        s.measure(cand).subset_agreement = result["agreement"]


def _fallback(s: _Search, start: Candidate, to_beat: Optional[Candidate] = None) -> Optional[dict]:
    """Per-layer fallback from ``start`` (see fallback.py); None when the layers cannot be named for ``exclude``.
    ``to_beat``: the fastest candidate within budget, for a fallback made for speed (it stops once slower)."""
    o, ctx = s.o, s.ctx
    fp32_onnx = s.fp32_onnx or ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
    build_of = lambda spec: resolve_variant(VariantSpec.model_validate(spec), 0)  # noqa: E731

    def artifact(layers: list[str]):
        return onnx_of(ctx.builder.build(build_of(FallbackCandidate.planned(start, layers).spec).artifact_request()))

    # the subset: the search samples the best PTQ model disagrees with FP32 on most (NNCF: the 300 "worst"), seeded ties
    ref_p, start_p = s.reference.predictions, start.predictions
    if ref_p is None or start_p is None or ref_p.shape != start_p.shape:
        s.note("fallback skipped: no per-sample predictions to pick the subset from")
        return None
    per_sample = (ref_p != start_p).reshape(len(ref_p), -1).mean(axis=1)
    rng = np.random.default_rng(o.seed)
    order = np.lexsort((rng.random(len(per_sample)), -per_sample))
    subset_idx = np.sort(order[: min(o.subset_size, len(order))])
    sctx, ref_sub = s.subset_context(subset_idx)
    n_eval = len(ref_p)  # the images really decoded (on_error: skip may leave some out)
    sens_idx = np.sort(rng.choice(n_eval, size=min(o.sensitivity_images, n_eval), replace=False))
    sens_images = normalize(take(ctx.eval_batches, sens_idx)[0], ctx.cfg.model.preprocess)
    s.note(f"fallback from {start.variant}: subset of {len(subset_idx)} search samples "
           f"({int((per_sample > 0).sum())} disagree with FP32); SQNR on {len(sens_idx)} images")
    ranked: dict = {}  # the SQNR pass is deterministic per float set: a re-ranking after an undo reuses it

    def sensitivity(layers: list[str]) -> list[dict]:
        k = tuple(sorted(layers))
        if k not in ranked:
            art = artifact(layers)
            s.evaluations["sensitivity"] += 1
            mapping = layer_names_map(fp32_onnx, art.path)
            if mapping is None:
                raise QDeployError(f"the compute layers of {art.path.name} cannot be paired with the FP32 ONNX's (different "
                                   "op types or weight shapes in order), so no layer can be named for exclude")
            report = layer_sensitivity(art.path, sens_images,
                                       batch_size=get_task(ctx.cfg.model.task).sensitivity_batch_size)
            ranked[k] = [{**d, "name": mapping.get(d["name"], d["name"])} for d in report]
        return ranked[k]

    # NNCF re-collects its statistics for every ignored scope (tens of seconds a build on a transformer): its layers are
    # ranked on its own model with the layer's activation Q/DQ bypassed (sensitivity.with_float_activations); the
    # trials that follow are NNCF builds. Every other quantizer rebuilds from cached ranges in about a second.
    proxy_ranking = False  # set below, from the start's own build
    names_of: dict = {}  # a built model's path -> {its layer: the FP32 ONNX's name}

    def subset_record(layers: list[str]):
        """run_variant's record on the subset: the real build, or (proxy_ranking) the build without the last layer
        with that layer reading float activations. _ranking always scores the current float set plus one layer."""
        if not (proxy_ranking and layers):
            return run_variant(sctx, build_of(FallbackCandidate.planned(start, layers).spec))
        variant = build_of(FallbackCandidate.planned(start, layers[:-1]).spec)
        record = build_variant(sctx, variant)
        if record.ok:
            art = onnx_of(record.artifact)
            if art.path not in names_of:  # one pairing per built model, not one per layer ranked on it
                names_of[art.path] = layer_names_map(fp32_onnx, art.path) or {}
            names = {a for a, f in names_of[art.path].items() if f == layers[-1]}
            path = proxy_dir / f"{art.path.stem}-{sha256_json(layers)[:12]}.onnx"
            if not names or not with_float_activations(art.path, names, path):
                raise QDeployError(f"fallback: {layers[-1]} has no activation Q/DQ to bypass in {art.path.name}")
            record.artifact = dataclasses.replace(art, path=path, fingerprint=f"{art.fingerprint}-{path.stem}",
                                                  cache_hit=False, companions=[])
        return run_variant(sctx, variant, record)

    def subset_score(layers: list[str]) -> float:
        spec = untimed_spec(FallbackCandidate.planned(start, layers).spec)
        kind = "subset-fallback-proxy" if proxy_ranking and layers else "subset-fallback"
        cached = s.scores.get(spec, kind)
        if cached is not None:
            s.evaluations["cached"] += 1
            return cached[0]["agreement"]
        r = subset_record(layers)
        s.evaluations["subset"] += 1
        if r.status != "ok":
            raise QDeployError(f"fallback: {spec['name']} failed on the subset: {r.reason}")
        score = agreement(r.predictions, ref_sub)
        s.scores.put(spec, kind, {"agreement": score}, None)
        return score

    trials: list[Candidate] = []

    def full_eval(layers: list[str]) -> Candidate:
        trial = s.measure(FallbackCandidate.planned(start, layers))
        trials.append(trial)
        return trial

    def pointless(current: Candidate) -> Optional[str]:
        if to_beat is None or current.rank_key is None or to_beat.rank_key is None:
            return None
        if current.rank_key < to_beat.rank_key * (1 - LATENCY_TIE):
            return None
        return (f"{current.variant} (p50 {current.rank_key:.3f} ms) is no faster than {to_beat.variant} "
                f"({to_beat.rank_key:.3f} ms), already within budget: a further float layer only adds time")

    hooks = FallbackHooks(sensitivity=sensitivity, subset_score=subset_score, full=full_eval, time_left=s.time_left,
                          log=s.note, pointless=pointless)
    proxy_dir = Path(tempfile.mkdtemp(prefix="qdeploy-fallback-"))
    try:
        proxy_ranking = artifact([]).info.get("quantizer") == "nncf"
        if proxy_ranking:
            s.note(f"fallback: {start.variant} is an NNCF model, rebuilt by NNCF for every ignored scope: its layers are "
                   "ranked on it with each one's activation Q/DQ bypassed (no rebuild); each trial is an NNCF build")
        res = run_fallback(start, hooks, refine_top=o.refine_top, max_float_fraction=o.max_float_fraction)
    except QDeployError as e:
        s.note(f"fallback stopped: {e}")
        return None
    finally:
        shutil.rmtree(proxy_dir, ignore_errors=True)
    total = sum(res.macs.values()) or 1
    for c in trials:  # the share of compute (MACs) each trial leaves in float
        c.float_macs_share = round(sum(res.macs.get(n, 0) for n in c.float_layers_fallback) / total, 4)
    s.note(f"fallback: {res.stop}; {len(res.float_layers)} layers in float ({100 * res.float_fraction:.1f} % of the compute)")
    return {"start": start.variant, "float_layers": res.float_layers, "within_budget": res.within_budget,
            "stop": res.stop, "float_fraction": round(res.float_fraction, 4), "rankings": res.rankings,
            "subset_size": int(len(subset_idx)), "trials": [c.variant for c in res.candidates]}


def _confirm(s: _Search, cfg: RunConfig, o: OptimizeConfig, base: dict, chosen: Optional[Candidate],
             budget_met_search: bool, n: int, n_search: int, out_dir, cache_dir, t_start: float) -> dict:
    """The reference and the chosen candidate, once, on the complement of the search split; then optimize.json,
    optimize.html and the chosen artifact into --out."""
    ref = s.reference
    key = s.key
    # a PyTorch target's answer is a saved program: confirmed from --out in a fresh process (torch_search.confirm_program)
    program_target = s.target.torch_program and chosen is not None
    confirm_specs = [ref.spec] + ([chosen.spec] if chosen is not None and chosen is not ref and not program_target else [])
    confirm_cfg = dict(base, variants=confirm_specs, bench={**base["bench"], "enabled": False},
                       data={**base["data"], "eval": {**base["data"]["eval"],
                                                      "subsplit": {"count": n_search, "seed": o.seed, "complement": True}}})
    cctx = open_run(parse_config(confirm_cfg), out_dir, stages=("eval",), cache_dir=cache_dir)
    try:
        crecords = [run_variant(cctx, v) for v in cctx.variants]
        s.evaluations["full"] += len(crecords)
        cref, cchosen = crecords[0], crecords[-1]
        program = None
        if program_target:
            program, chosen = _confirm_a_program(s, cctx, chosen, cref, key)
            ref_metric = cref.metrics.get(key)
            if "error" in program:  # every attempt's failure was said by _confirm_a_program
                chosen_metric, agree = None, None
                confirm = budget_check(o.budget, ref_metric, None, None)
            else:
                chosen_metric = program["metrics"].get(key)
                agree = agreement(program.pop("predictions"), cref.predictions)
                confirm = budget_check(o.budget, ref_metric, chosen_metric, agree)
            artifacts = program.pop("artifacts", [])
            chosen_file = next((a["path"] for a in artifacts if a["kind"] == "torch-program"), None)
        else:
            ref_metric, chosen_metric = cref.metrics.get(key), cchosen.metrics.get(key)
            agree = agreement(cchosen.predictions, cref.predictions) if cchosen is not cref else 1.0
            confirm = budget_check(o.budget, ref_metric, chosen_metric, agree)
            artifacts = copy_artifacts(cctx, [cchosen]) if cchosen.artifact is not None else []
            chosen_file = next((a["path"] for a in artifacts if a["kind"].startswith("onnx")), None)
        s.note(f"confirm split{' (the saved program, in a fresh process)' if program_target else ''}: "
               f"{chosen.variant if chosen else 'none'} {confirm.why}: "
               + ("within budget" if confirm.within else "OUTSIDE the budget"))
        c = chosen
        summary = {
            "target": o.target, "budget": o.budget.model_dump(exclude_none=True),
            "budget_text": o.budget_text(cfg.model.task),
            # the agreement every candidate needed (budget.min_agreement or its default) and the siblings rule's numbers
            "agreement_floor": {"min_agreement": o.budget.floor, "default": o.budget.min_agreement is None,
                                "sibling_gap": SIBLING_GAP, "siblings_needed": SIBLINGS_NEEDED},
            "batch_size": s.batch_size,
            # the CPU threads every candidate ran and was timed with (GPU targets: None)
            "threads": (s.target.threads or os.cpu_count()) if o.target in CPU_TARGETS else None,
            "latency_measured": s.target.measured, "timed_out": s.timed_out,
            "chosen": {"variant": c.variant if c else None, "kind": c.kind if c else None, "artifact": chosen_file,
                       "search_metric": c.search_metric if c else None, "confirm_metric": chosen_metric,
                       "reference_confirm_metric": ref_metric, "confirm_agreement": agree,
                       "latency_p50_ms": c.latency_p50_ms if c else None,
                       "reference_latency_p50_ms": ref.latency_p50_ms if ref else None,
                       "reference_engine": ref.spec.get("engine") if ref else None,
                       "float_layers": c.float_layers if c else None,
                       "int8_share": c.int8_share if c else None, "int8_ops_share": c.int8_ops_share if c else None,
                       "int8_share_basis": c.int8_share_basis if c else None,
                       "float_macs_share": getattr(c, "float_macs_share", None),
                       "stage": c.stage if c else None, "setting": c.spec if c else None,
                       "description": c.describe() if c else None, "best_so_far": s.timed_out,
                       **({"deploy": c.deploy(chosen_file)} if c is not None and c.deploy(chosen_file) else {})},
            "budget_met": bool(budget_met_search and confirm.within), "budget_met_search": budget_met_search,
            **({"program": _program_summary(program, s)} if program is not None else {}),
            "confirm": {"why": confirm.why, "margin": confirm.margin},
            "warnings": s.warnings,
            **({"int8_op_profile": s.int8_op_profile} if s.int8_op_profile else {}),
            "int8_all_failed": any(w["code"] == "every-int8-variant-failed" for w in s.warnings),
            "candidates": [x.to_json() for x in s.candidates], "stages": s.stages, "decisions": s.decisions,
            "evaluations": s.evaluations, "splits": {"search": n_search, "confirm": n - n_search, "seed": o.seed},
            "environment": environment(),
            "metric": key, "time_s": round(time.perf_counter() - t_start, 2), "artifacts": artifacts,
            "resume_store": str(s.store.folder),
        }
        write_json(cctx.output.path("optimize.json"), summary)
        write_optimize_report(summary, cctx.output.path("optimize.html"), f"qdeploy optimize: {cfg.model.source}")
        final = cctx.output.commit()
        summary["out"] = str(final)
    finally:
        cctx.output.abort()
    return summary


def _confirm_a_program(s: _Search, cctx, chosen: Candidate, cref, key: str) -> tuple[dict, Candidate]:
    """(the confirmed program, the candidate it is): the chosen candidate saved and run from --out in a fresh process;
    where that fails (a program that ran in the search but not from the saved file: a CPU tensor the export kept, a
    compile that does not reload), the failure is said and the next fastest candidate within budget on the search split
    is saved and confirmed instead, down to FP32, so that a run never ends without an artifact while one can be saved
    and reloaded. What a failed attempt wrote into --out's staging folder is removed first."""
    staging = cctx.output.staging
    tried, errors, first_failure = [], [], None
    while True:
        before = {f.name for f in staging.iterdir()}
        program = confirm_program(s, cctx, chosen, cref, key)
        tried.append(chosen)
        if "error" not in program:
            if len(tried) > 1:
                program["replaces"] = [{"variant": c.variant, "error": e} for c, e in zip(tried, errors)]
            return program, chosen
        errors.append(program["error"])
        first_failure = first_failure or program
        s.note(f"{chosen.variant}: its saved program could not be confirmed from --out: {program['error']}",
               warning=True)
        for f in staging.iterdir():
            if f.name not in before and f.is_file():
                f.unlink()
        nxt = fastest_within([c for c in s.candidates if c.ok and all(c is not t for t in tried)])
        if nxt is None:  # none could be saved: the answer stays the chosen one, with its own failure
            return first_failure, tried[0]
        s.note(f"saving the next candidate within budget instead: {nxt.variant} ({nxt.budget})")
        chosen = nxt


def _program_summary(program: dict, s: _Search) -> dict:
    """optimize.json's ``program``: what was saved, how it loads, and what the fresh process measured."""
    fresh = program.get("fresh_process") or {}
    lat = fresh.get("latency_ms") or {}
    return {"error": program.get("error"), "replaces": program.get("replaces", []), "manifest": program.get("manifest"),
            "save_s": program.get("save_s"),
            "loader": "load_model.py", "fresh_process": fresh,
            "latency_p50_ms": {b: round(v["p50"], 5) for b, v in lat.items()},
            "first_call_s": {b: v.get("first_call_s") for b, v in lat.items()},
            "noisy": sorted(b for b, v in lat.items() if v.get("noisy")),
            "how_to_load": "import load_model; model = load_model.load(FOLDER); logits = model(images)  "
                           "# float32 NCHW, normalized as in model.preprocess; python load_model.py FOLDER --bench "
                           + ",".join(str(b) for b in s.rank_batches) + " reproduces the latency"}


def _int8_slower_than_fp32(ref: Optional[Candidate], ptq: list[Candidate], measured: bool) -> Optional[str]:
    """A sentence when the target measures every PTQ candidate clearly slower than FP32 (ONNX Runtime on EfficientNet:
    3x). A partially quantized model (fallback, QAT) keeps most of that INT8 graph, so it is not expected to beat FP32,
    and the search does not spend evaluations on it; FP32 is then the answer (``decide.choose``)."""
    times = [c.latency_p50_ms for c in ptq if c.latency_p50_ms]
    if not measured or ref is None or not ref.latency_p50_ms or not times:
        return None
    fastest = min(times)
    if fastest <= ref.latency_p50_ms * (1 + LATENCY_TIE):
        return None
    return (f"every PTQ candidate is slower than FP32 on this target (fastest {fastest:.3f} ms vs FP32 "
            f"{ref.latency_p50_ms:.3f} ms): no fallback or QAT, a partially quantized model keeps most of that INT8 "
            "graph")


def _subset_context(ctx, idx: np.ndarray, ref_predictions: np.ndarray):
    """A run context that evaluates on the search-split samples ``idx`` only (no timing), and FP32's predictions there."""
    images, labels = take(ctx.eval_batches, idx)
    sub = ArrayBatches(images, labels, ctx.eval_batches.batch_size, ctx.eval_batches.class_names)
    return dataclasses.replace(ctx, eval_batches=sub, stages={"eval"}), ref_predictions[idx]
