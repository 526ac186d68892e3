"""One search on the search split: what every step of ``qdeploy optimize`` shares.

The session holds the run context, the candidates measured so far, the decisions made and why (each logged once, when
it is made), the FP32 reference and what the steps need from each other (the FP32 ONNX and its MACs). Measuring a
candidate is the same for every kind (:meth:`SearchSession.measure`): a full evaluation, and timing where the target
is measured, or a replay from the resume store.

Resumable: each evaluated candidate (and each subset score) is stored under the cache folder, keyed by everything that
decides it (:func:`resume_identity`); an interrupted search started again with the same config replays those and goes
on.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from rich.markup import escape

import qdeploy
from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.config import OptimizeConfig, VariantSpec
from qdeploy.data import ArrayBatches, normalize, take
from qdeploy.engines.base import resolve_variant
from qdeploy.errors import ConfigError, QDeployError
from qdeploy.evaluate.compare import reference_chance
from qdeploy.optimize.candidates import Candidate, Target, onnx_of, record_p50, rejudge, rescore, sibling_agreements
from qdeploy.optimize.decide import resolution_warning, ruled_out_by_speed
from qdeploy.optimize.sensitivity import layer_sensitivity
from qdeploy.pipeline import build_variant, run_variant
from qdeploy.evaluate.verdict_rules import near_chance_warning
from qdeploy.sysinfo import cpu_model, dist_version
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import write_json
from qdeploy.utils.hashing import sha256_json, source_fingerprint
from qdeploy.utils.log import log, warn

# every library that builds, quantizes, compiles or runs a candidate: another version may give other numbers, or
# fail or succeed where this one did not (a build that failed on a broken dependency must not be replayed as failed
# once the dependency is fixed)
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


class ResultStore:
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
class SearchSession:
    """One search on the search split: the candidates measured so far, the decisions made and why, and what the steps
    need from each other (the reference, the FP32 ONNX and its MACs)."""

    o: OptimizeConfig
    target: Target
    ctx: object
    store: ResultStore
    key: str  # the task's headline metric in a record's metrics
    batch_size: int
    z: float
    t_start: float
    planned: list = dataclasses.field(default_factory=list)  # the first candidates (candidates.plan), cheapest first
    n_search: int = 0  # images in the search split
    candidates: list = dataclasses.field(default_factory=list)
    decisions: list = dataclasses.field(default_factory=list)
    warnings: list = dataclasses.field(default_factory=list)
    evaluations: dict = dataclasses.field(default_factory=lambda: {"full": 0, "subset": 0, "sensitivity": 0, "cached": 0,
                                                                   "timed_only": 0, "ruled_out_by_speed": 0})
    stages: dict = dataclasses.field(default_factory=lambda: {"ptq": None, "fallback": None, "qat": None})
    timed_out: bool = False
    reference: Optional[Candidate] = None
    labels: Optional[np.ndarray] = None
    macs: dict = dataclasses.field(default_factory=dict)
    fp32_onnx: Optional[Path] = None
    rank_batches: list = dataclasses.field(default_factory=list)  # ranked on the geometric mean of their p50s
    cache_root: Optional[Path] = None
    untimed: Optional[ResultStore] = None  # accuracy-only results (scores, subset agreements), keyed without timing
    aoti_probe: object = None  # PyTorch targets: artifacts.torch_program.AotiProbe, running in the background
    int8_op_profile: Optional[dict] = None  # CPU targets: per-op-class time of an INT8 candidate vs FP32
    profiles: dict = dataclasses.field(default_factory=dict)  # candidate variant → its op-class profile (or None)
    prebuilt: dict = dataclasses.field(default_factory=dict)  # variant → replaces the artifact its settings build (run_in)
    # the time limit is the PyTorch targets' default, which covers the whole optimize (saving and confirm included);
    # a limit the user sets bounds the search alone
    limit_covers_saving: bool = False

    @property
    def scores(self) -> ResultStore:
        """Where accuracy-only results go: the untimed store (shared by searches that differ in timing only)."""
        return self.untimed or self.store

    # ---- the log and the clock
    def note(self, line: str, warning: bool = False) -> None:
        self.decisions.append(line)
        # a decision is plain text: its brackets ("[replayed ...]", layer names) are not console markup
        (warn if warning else log)(f"optimize: {escape(line)}" if not warning else line)

    def time_left(self) -> Optional[float]:
        return None if self.o.time_limit is None else self.o.time_limit - (time.perf_counter() - self.t_start)

    def out_of_time(self) -> bool:
        left = self.time_left()
        return left is not None and left <= 0

    def stop_for_time(self, untried: list[Candidate]) -> None:
        """The time limit ends the search here: ``untried`` are named as not tried."""
        self.timed_out = True
        self.note(f"time limit {self.o.time_limit:g} s reached: {', '.join(c.variant for c in untried)} not tried")

    # ---- building and measuring
    def variant_of(self, spec: dict, index: int = 0):
        return resolve_variant(VariantSpec.model_validate(spec), index)

    def built_onnx(self, spec: dict):
        """The ONNX artifact a candidate's spec builds (from the build cache when built before). For OpenVINO's own INT8
        (an IR, whose ops carry OpenVINO's names) it is NNCF's Q/DQ ONNX of the same settings: the same placement by
        the same tool, on the FP32 ONNX's node names, which is what layer names, sensitivity and exclude read."""
        request = self.variant_of(spec).artifact_request()
        if request.kind == ArtifactKind.OPENVINO_IR_INT8:
            request = ArtifactRequest(ArtifactKind.ONNX_INT8, request.int8)
        return onnx_of(self.ctx.builder.build(request))

    def load_fp32_onnx(self) -> None:
        """The FP32 ONNX every candidate of an INT8 target starts from (failing now, saying why) and the MACs per
        compute layer (one image): the INT8 share of compute is weighted by them."""
        try:
            self.fp32_onnx = self.ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
        except QDeployError as e:
            alone = " and TensorRT is not installed here, so there is no other path" if not self.target.measured else ""
            raise ConfigError(f"optimize.target {self.o.target} works from the model's ONNX (TensorRT and ONNX Runtime "
                              f"both parse it){alone}: {e}") from None
        one = normalize(self.ctx.eval_batches.first(1)[0], self.ctx.cfg.model.preprocess)
        self.macs.update({d["name"]: d["macs"] or 0 for d in layer_sensitivity(self.fp32_onnx, one)})

    def measure(self, cand: Candidate, evaluate_anyway: bool = False) -> Candidate:
        """Evaluate (and time) one candidate on the whole search split, or replay it from the store. A kind that may
        skip its evaluation is timed first (:meth:`speed_gate`) unless ``evaluate_anyway``."""
        t0 = time.perf_counter()
        cached = self.store.get(cand.spec, "full")
        if cached is not None:
            self.evaluations["cached"] += 1
            cand.load(*cached)
        else:
            self._run(cand, t0, evaluate_anyway)
        if cand.reference and self.reference is None:
            self.reference = cand
            if get_task(self.ctx.cfg.model.task).per_sample_standard_error and self.ctx.cfg.data.eval.labels:
                # for the paired standard error of each drop
                self.labels = np.concatenate([np.asarray(y) for _, y in self.ctx.eval_batches])
        rescore(cand, self.reference, self.labels, self.o, self.z, sibling_agreements(cand, self.candidates))
        self.candidates.append(cand)
        self.note(f"{cand.variant}: {cand.verdict_text}" + (f", p50 {cand.latency_p50_ms:.3f} ms" if cand.latency_p50_ms is not None else "")
                  + (" [replayed from an earlier run]" if cand.replayed else "")
                  + (" [scores replayed from a search timed at another batch size or thread count; timed here]"
                     if cand.scores_replayed else ""))
        if cand.precision == "int8" and cand.ok:
            self.rescore_siblings(cand)
        return cand

    def _run(self, cand: Candidate, t0: float, evaluate_anyway: bool = False) -> None:
        """Run the candidate (timed only, where a search timed otherwise scored it) and store its numbers."""
        scored = (self.untimed.get(untimed_spec(cand.spec), "scores")
                  if self.untimed and "bench" in self.ctx.stages else None)
        variant = self.variant_of(cand.spec, len(self.candidates))
        if scored is None:
            r = self.run_in(self.ctx, variant, None if evaluate_anyway else self.speed_gate(cand))
            self.evaluations["full" if r.eval_skipped is None else "ruled_out_by_speed"] += 1
        else:  # scored under another batch size or thread count: timed only
            r = run_variant(dataclasses.replace(self.ctx, stages={"bench"}), variant)
            r.metrics, r.predictions = scored[0]["metrics"], scored[1]
            self.evaluations["timed_only"] += 1
        cand.measure(r, self.key, self.batch_size, self.target.measured, time.perf_counter() - t0, self.macs,
                     self.fp32_onnx, self.rank_batches)
        if cand.reference and (not cand.ok or (cand.search_metric is None and not self.o.budget.agreement_only)):
            raise ConfigError(f"the FP32 reference could not be evaluated on the search split: {cand.reason}")
        if r.eval_skipped is None:  # a candidate ruled out by this search's answers so far is run again by the next
            self.store.put(cand.spec, "full", cand.measured_json(), cand.predictions)
        if self.untimed and cand.ok and scored is None and r.metrics:
            self.untimed.put(untimed_spec(cand.spec), "scores", {"metrics": r.metrics}, r.predictions)
        cand.scores_replayed = scored is not None

    def run_in(self, ctx, variant, evaluate_if=None):
        """run_variant in ``ctx``; a variant whose model a step made outside the builder (``prebuilt``: its name → how
        to replace the artifact the builder makes for its settings) runs that model."""
        if self.prebuilt.get(variant.label) is None:
            return run_variant(ctx, variant, evaluate_if=evaluate_if)
        return run_variant(ctx, variant, self._built(ctx, variant), evaluate_if=evaluate_if)

    def speed_gate(self, cand: Candidate):
        """For a kind that may skip its evaluation (``Candidate.evaluated_only_if_fast``) on a target whose latency is
        measured at one batch size: the check run_variant makes after timing it (decide.ruled_out_by_speed against the
        candidates within budget so far). None: evaluated whatever its speed."""
        if not (cand.evaluated_only_if_fast and self.target.measured and not self.rank_batches
                and "bench" in self.ctx.stages):
            return None

        def gate(record) -> Optional[str]:
            return ruled_out_by_speed(record_p50(record, self.batch_size), self.candidates, self.z)

        return gate

    def _built(self, ctx, variant):
        record = build_variant(ctx, variant)
        replace = self.prebuilt.get(variant.label)
        if record.ok and replace is not None:
            record.artifact = replace(record.artifact)
        return record

    def built_record(self, spec: dict):
        """The build record of a measured candidate's artifact (from the build cache; a ``prebuilt`` model where a step
        made it), for a step that loads it again; raises QDeployError when it cannot be built."""
        record = self._built(self.ctx, self.variant_of(spec))
        if not record.ok or record.artifact is None:
            raise QDeployError(record.reason or f"{spec.get('name')}: no artifact")
        return record

    def measure_all(self, planned: list[Candidate], evaluate_anyway: tuple = ()) -> bool:
        """Measure each candidate in turn (once per variant), those named in ``evaluate_anyway`` evaluated whatever
        their speed; False when the time limit stopped it (the rest are named as not tried)."""
        for i, cand in enumerate(planned):
            if self.out_of_time():
                self.stop_for_time(planned[i:])
                return False
            if not any(c.variant == cand.variant for c in self.candidates):
                self.measure(cand, evaluate_anyway=cand.variant in evaluate_anyway)
        return True

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
                          f"after {newcomer.variant}: {c.verdict_text}")

    def check_reference(self, spent: float, images: Optional[int] = None) -> None:
        """What the reference's evaluation tells before any other candidate: the time limit is long enough, the search
        split (``images``: its size; default the planned one) can resolve the budget, the reference is clearly above
        chance."""
        o = self.o
        if o.time_limit is not None and o.time_limit < spent:
            raise ConfigError(f"optimize.time_limit {o.time_limit:g} s is shorter than one evaluation "
                              f"({spent:.1f} s for the FP32 reference)")
        n = images if images is not None else self.n_search
        warning = resolution_warning(o.budget, self.reference.search_metric or 0.0, n, self.ctx.cfg.model.task)
        if warning:
            self.note(warning, warning=True)
        if self.labels is not None:
            check, basis = reference_chance(self.ctx.eval_batches, self.reference.predictions)
            chance = near_chance_warning({"reference": self.reference.variant}, check or {}, basis)
            if chance is not None:
                self.warnings.append(chance)
                self.note(chance["message"], warning=True)

    # ---- views
    def subset_context(self, idx: np.ndarray):
        """A run context that evaluates on the search-split samples ``idx`` only (no timing), and FP32's predictions
        there."""
        images, labels = take(self.ctx.eval_batches, idx)
        sub = ArrayBatches(images, labels, self.ctx.eval_batches.batch_size, self.ctx.eval_batches.class_names)
        return dataclasses.replace(self.ctx, eval_batches=sub, stages={"eval"}), self.reference.predictions[idx]

    def int8(self) -> list[Candidate]:
        return [c for c in self.candidates if c.precision == "int8"]

    def ok(self) -> list[Candidate]:
        return [c for c in self.candidates if c.ok]


__all__ = ["RESUME_LIBRARIES", "ResultStore", "SearchSession", "resume_identity", "untimed_spec"]
