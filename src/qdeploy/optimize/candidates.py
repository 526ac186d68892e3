"""What ``qdeploy optimize`` may answer with: one class per candidate kind, and the targets that plan them.

A candidate kind says what it is (its name and description), how it is built (the variant spec ``run_variant`` builds
it from, derived from the kind's own inputs: a float precision, a PTQ method, a fallback's float layers, a QAT
objective) and how it is shown (its row in optimize.json and the tables). Measuring is the same for every kind: a full
evaluation, and timing where the target is measured, on the search split (:meth:`Candidate.measure`). Deciding is
plain functions on numbers (decide.py), which read the measured fields only.

A new kind (the GPU target's compiled and graph-captured candidates, a second CPU engine) is one class here,
registered by its ``kind`` name, and one line in its target's :func:`plan`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, Optional, get_args

import numpy as np

from qdeploy.artifacts import ArtifactKind
from qdeploy.config import OptimizeConfig, OptimizeTarget
from qdeploy.optimize.decide import budget_check
from qdeploy.optimize.sensitivity import layer_names_map
from qdeploy.report import tables as T
from qdeploy.utils.hashing import sha256_json
from qdeploy.utils.registry import registrar

CANDIDATE_KINDS: dict[str, type["Candidate"]] = {}


register = registrar(CANDIDATE_KINDS, "candidate kind", key=lambda cls: cls.kind)


# ---------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    """Where the answer runs: the engine every candidate uses, the INT8 placement (None: no INT8 candidates), the
    reduced float precisions worth trying there, and whether latency is measured on it (ranked by it) or not.
    ``runtimes``: for PyTorch targets, how the model may run besides eager (CUDA-graph replay, torch.compile); the
    answer is then a saved program (artifacts/torch_program.py), not an ONNX."""

    name: str
    engine: dict
    placement: Optional[str]
    floats: tuple[str, ...] = ()
    measured: bool = True
    note: Optional[str] = None
    runtimes: tuple[str, ...] = ()
    tf32: bool = False  # FP32 with TF32 math is a candidate of its own (NVIDIA GPUs from Ampere on)
    graph_capture: bool = False  # each float candidate also as a CUDA graph (engine option cuda_graphs)
    # other CPU engines whose candidates this target weighs next to its own (cpu: OpenVINO beside ONNX Runtime): their
    # FP32 (and FP16 where the CPU runs it), their INT8 from the same Q/DQ ONNX, and their own placement (NNCF)
    also: tuple[str, ...] = ()
    threads: Optional[int] = None  # CPU targets: intra-op threads every candidate runs and is timed with (None: all cores)
    # the search's steps, in order, by their names in optimize.steps.STEPS: each proposes and measures one kind of
    # candidate
    steps: tuple[str, ...] = ("floats", "ptq", "fallback")

    @property
    def engine_name(self) -> str:
        return self.engine["engine"]

    def engine_spec(self, engine: Optional[str] = None) -> dict:
        """The variant fields every candidate on ``engine`` (default: the target's own) starts from."""
        spec = dict(self.engine) if engine in (None, self.engine_name) else {"engine": engine}
        return {**spec, "threads": self.threads} if self.threads else spec

    @property
    def torch_program(self) -> bool:
        return bool(self.runtimes)


_ORT_CPU = {"engine": "onnxruntime", "device": "cpu"}
_CPU_STEPS = ("floats", "engine-placements", "ptq", "cpu-engines", "fallback", "nncf-accuracy-control", "final-timing")
_TORCH_STEPS = ("torch-runtimes",)
TARGETS = {
    "onnxruntime-cpu": Target("onnxruntime-cpu", _ORT_CPU, "onnxruntime", steps=_CPU_STEPS),
    # the CPU answer from either engine: ONNX Runtime's candidates (the FP32 reference, its INT8 placement) and
    # OpenVINO's (engines/openvino_engine.py), each an artifact the user deploys with that engine
    "cpu": Target("cpu", _ORT_CPU, "onnxruntime", also=("openvino",), steps=_CPU_STEPS),
    "tensorrt": Target("tensorrt", {"engine": "tensorrt"}, "tensorrt", ("fp16",)),
    "torch-cuda": Target("torch-cuda", {"engine": "torch", "device": "cuda"}, None, ("fp16", "bf16"),
                         runtimes=("eager", "cudagraph", "compile"), tf32=True, steps=_TORCH_STEPS),
    "torch-cpu": Target("torch-cpu", {"engine": "torch", "device": "cpu"}, None, (), runtimes=("eager", "compile"),
                        steps=_TORCH_STEPS),
    # the same ONNX as the CPU answer on ONNX Runtime's CUDA execution provider (onnxruntime-gpu, installed instead of the
    # CPU build: docs/onnxruntime-cuda.md): FP32 and FP16, each also replayed as a CUDA graph on bound buffers
    "onnxruntime-cuda": Target("onnxruntime-cuda", {"engine": "onnxruntime", "device": "cuda"}, None, ("fp16",),
                               graph_capture=True, steps=("floats", "ptq")),
}
if set(TARGETS) != set(get_args(OptimizeTarget)):
    raise RuntimeError(f"optimize.candidates.TARGETS {sorted(TARGETS)} and config.OptimizeTarget "
                       f"{sorted(get_args(OptimizeTarget))} name different targets")


def target_for(name: str, tensorrt_available: bool) -> Target:
    t = TARGETS[name]
    if name == "tensorrt" and not tensorrt_available:
        # the TensorRT-placement artifacts are evaluated in ONNX Runtime (exact Q/DQ) and ranked by their INT8 share of
        # compute; FP16 would only be ONNX Runtime's FP16, which says nothing about TensorRT's
        return replace(t, engine=_ORT_CPU, floats=(), measured=False,
                       note="TensorRT is not installed: TensorRT-placement artifacts are evaluated in ONNX Runtime with "
                            "exact Q/DQ and ranked by the share of compute in INT8; TensorRT latency was not measured")
    if name == "torch-cuda" and tf32_supported() is False:
        return replace(t, tf32=False)
    return t


def tf32_supported() -> Optional[bool]:
    """TF32 tensor cores exist from compute capability 8.0 (Ampere) on; None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()[0] >= 8


def plan(o: OptimizeConfig, target: Target) -> list["Candidate"]:
    """The first candidates of a search, cheapest first: the FP32 reference, the target's float precisions, one PTQ
    candidate per method. Fallback and QAT candidates are planned later, from the best PTQ result; a PyTorch target's
    CUDA-graph and compiled candidates later too, from the precisions within budget (optimize/steps/torch_runtimes.py)."""
    out: list[Candidate] = [(TorchFp32Reference if target.torch_program else Fp32Reference).planned(target)]
    if target.torch_program:
        if target.tf32:
            out.append(EagerCandidate.planned(target, "fp32", tf32=True))
        out += [EagerCandidate.planned(target, p) for p in target.floats]
        return out
    out += [FloatCandidate.planned(target, p) for p in target.floats]
    for engine in target.also:
        out += [EngineCandidate.planned_float(target, engine, p) for p in engine_floats(engine)]
    if target.graph_capture:
        out += [FloatCandidate.planned(target, p, cuda_graphs=True) for p in ("fp32", *target.floats)]
    if target.placement is not None:
        out += [PtqCandidate.planned(target, m) for m in o.methods]
    return out


# ---------------------------------------------------------------------------- candidates
TIMED_ONLY = "timed only"  # a candidate's status when its timing ruled it out before its evaluation
# a range method not built: another method's graph (the same one: only the scales differ) was timed first and ruled
# out on every engine that runs it, so no method of that placement can be the answer
SAME_GRAPH_RULED_OUT = "not built (same graph timed)"


def record_p50(record, batch_size: int) -> Optional[float]:
    """A run_variant record's p50 (ms) at ``batch_size``: what a candidate is ranked by, and what decides whether it
    is evaluated at all (session.SearchSession.speed_gate)."""
    return T.p50({"latency_ms": record.bench.get("latency_ms", {})}, str(batch_size))


@dataclass(eq=False)
class Candidate:
    """One candidate: its spec (how it is built) and, once measured, its numbers on the search split."""

    kind: ClassVar[str] = "candidate"
    stage: ClassVar[str] = "ptq"          # which step of the search proposed it
    reference: ClassVar[bool] = False
    # timed before it is evaluated, and not evaluated where its timing rules it out (decide.ruled_out_by_speed): the
    # kinds whose accuracy no later step needs once a faster candidate is within budget. Not the reference (what the
    # budget is measured against), nor a fallback or QAT trial (the loop that made it reads its accuracy)
    evaluated_only_if_fast: ClassVar[bool] = False

    spec: dict
    status: str = "planned"  # planned | ok | failed | skipped | ranked on the subset only | timed only | not built (…)
    reason: Optional[str] = None
    failed_stage: Optional[str] = None    # the pipeline stage that failed (export, calibrate, build, eval, bench)
    search_metric: Optional[float] = None
    latency_p50_ms: Optional[float] = None
    latency_p50_by_batch: Optional[dict] = None  # batch size → p50 (ms), every batch size ranked on
    noisy: Optional[bool] = None          # a timed batch size flagged noisy by benchmark.latency (scatter, drift, batch)
    rank_key: Optional[float] = None      # lower is better: p50, or -INT8 share where latency is not measured
    int8_share: Optional[float] = None    # of the MACs, in layers with INT8 input and weights
    int8_ops_share: Optional[float] = None
    int8_share_basis: Optional[str] = None  # "macs", or why the share of compute ops stands in for it
    float_layers: list = field(default_factory=list)
    time_s: Optional[float] = None
    agreement: Optional[float] = None
    se: Optional[float] = None
    within_budget: bool = False
    margin: Optional[float] = None
    verdict_text: str = ""                # the budget verdict in words (decide.Verdict.why), or why it was not scored
    agreement_se: Optional[float] = None  # per-image standard error of the agreement (the floor's bound)
    rejected_by: Optional[str] = None     # the rule that put it outside the budget: decide.Verdict.rule
    subset_agreement: Optional[float] = None
    replayed: bool = False
    scores_replayed: bool = False  # accuracy from a search of the same model timed otherwise (batch, threads)
    # a finalist timed again in interleaved rounds (steps/final_timing.py): its first p50 and each round's median
    search_p50_ms: Optional[float] = None
    retimed_p50s_ms: Optional[list] = None
    predictions: Optional[np.ndarray] = field(default=None, repr=False)

    # ---- what it is
    @property
    def variant(self) -> str:
        return self.spec["name"]

    @property
    def precision(self) -> str:
        return self.spec["precision"]

    @property
    def method(self) -> Optional[str]:
        return self.spec.get("method")

    @property
    def quantizer(self) -> Optional[str]:
        return self.spec.get("quantizer") or (None if self.precision != "int8" else "ptq")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def timed(self) -> bool:
        """Ran on the target: evaluated (ok), or timed and ruled out by that timing (TIMED_ONLY)."""
        return self.status in ("ok", TIMED_ONLY)

    def describe(self) -> str:
        return self.variant

    def deploy(self, artifact: str) -> Optional[str]:
        """The engine call that runs ``artifact`` as this candidate was measured, where the artifact alone does not say
        it (None: loading the file is enough)."""
        return None

    # ---- how it is measured
    def measure(self, record, key: str, batch_size: int, measured: bool, seconds: float,
                macs: Optional[dict] = None, fp32_onnx: Optional[Path] = None,
                rank_batches: Optional[list] = None) -> None:
        """Take the numbers of a finished ``run_variant`` record (the same for every kind). Ranked by the p50 at
        ``batch_size``, or by the geometric mean of the p50s at ``rank_batches`` (every batch size counts by ratio)."""
        self.status, self.reason, self.failed_stage = record.status, record.reason, record.failed_stage
        ran = self.ok
        if ran and record.eval_skipped:  # timed, and ruled out by that timing: no accuracy, never within budget
            self.status, self.reason = TIMED_ONLY, record.eval_skipped
        self.search_metric = record.metrics.get(key) if record.metrics else None
        onnx_art = onnx_of(record.artifact)
        structure = (onnx_art.info.get("structure") if onnx_art is not None else None) or {}
        ops = structure.get("compute_ops")
        int8 = self.precision == "int8"
        self.int8_ops_share = (structure.get("compute_ops_int8", 0) / ops) if ops else (None if int8 else 0.0)
        self.int8_share = int8_macs_share(record, structure, macs, fp32_onnx) if int8 else 0.0
        self.int8_share_basis = "macs"
        if self.int8_share is None:  # layers not pairable: the share of compute ops instead, and the report says so
            self.int8_share = self.int8_ops_share
            self.int8_share_basis = "compute ops (its layers could not be paired with the FP32 ONNX's to weigh them by MACs)"
        self.latency_p50_ms = record_p50(record, batch_size) if measured and ran else None
        rank = self.latency_p50_ms if measured else -(self.int8_share or 0.0)
        if measured and ran:
            self.noisy = any(bool(v.get("noisy")) for v in (record.bench.get("latency_ms") or {}).values())
        if measured and ran and rank_batches:
            lat = {"latency_ms": record.bench.get("latency_ms", {})}
            self.latency_p50_by_batch = {str(b): T.p50(lat, str(b)) for b in rank_batches}
            rank = geomean(self.latency_p50_by_batch.values())
        self.rank_key = rank if ran else None  # a timed-only candidate keeps its speed (choose: FP32 may be the answer)
        self.float_layers = list(structure.get("compute_ops_float") or [])
        self.time_s = round(seconds, 2)
        self.predictions = record.predictions

    def score(self, budget_verdict, agreement: Optional[float], se: Optional[float],
              agreement_se: Optional[float] = None) -> None:
        """The budget verdict against the reference (decide.budget_check's, the agreement floor included), kept with
        the candidate; ``rejected_by`` names the rule that put it outside the budget (None: within, or not run)."""
        self.agreement, self.se, self.agreement_se = agreement, se, agreement_se
        self.within_budget = self.ok and budget_verdict.within
        self.margin = budget_verdict.margin if self.ok else None
        self.rejected_by = budget_verdict.rule if self.ok and not budget_verdict.within else None
        self.verdict_text = budget_verdict.why if self.ok else T.status_text(self.to_json())

    # ---- how it is shown and stored
    _MEASURED = ("status", "reason", "failed_stage", "search_metric", "latency_p50_ms", "latency_p50_by_batch", "noisy",
                 "rank_key", "int8_share",
                 "int8_ops_share", "int8_share_basis", "float_layers", "time_s")

    def measured_json(self) -> dict:
        """The numbers a resumed search replays (the budget verdict is recomputed against the reference)."""
        return {k: getattr(self, k) for k in self._MEASURED}

    def load(self, data: dict, predictions: Optional[np.ndarray]) -> None:
        for k in self._MEASURED:
            if k in data:
                setattr(self, k, data[k])
        self.predictions = predictions
        self.replayed = True

    def to_json(self) -> dict:
        """optimize.json's row (the keys it always had, plus kind, stage and failed_stage)."""
        return {"variant": self.variant, "kind": self.kind, "stage": self.stage, "reference": self.reference,
                "precision": self.precision, "method": self.method, "quantizer": self.quantizer,
                **{k: getattr(self, k) for k in self._MEASURED},
                "agreement": self.agreement, "se": self.se, "agreement_se": self.agreement_se,
                "within_budget": self.within_budget, "margin": self.margin, "rejected_by": self.rejected_by,
                "budget": self.verdict_text, "replayed": self.replayed, "scores_replayed": self.scores_replayed,
                **({"subset_agreement": self.subset_agreement} if self.subset_agreement is not None else {}),
                **({"search_p50_ms": self.search_p50_ms, "retimed_p50s_ms": self.retimed_p50s_ms}
                   if self.retimed_p50s_ms is not None else {}),
                "description": self.describe()}


@register
@dataclass(eq=False)
class Fp32Reference(Candidate):
    """The FP32 model on the target: what every budget is measured against, and an answer when nothing is faster."""

    kind: ClassVar[str] = "fp32"
    stage: ClassVar[str] = "reference"
    reference: ClassVar[bool] = True

    @classmethod
    def planned(cls, target: Target) -> "Fp32Reference":
        return cls({**target.engine_spec(), "precision": "fp32", "name": "fp32"})

    def describe(self) -> str:
        return "FP32 reference"


@register
@dataclass(eq=False)
class FloatCandidate(Candidate):
    """A reduced float precision (FP16, BF16) the target runs natively: no calibration, no accuracy budget surprise."""

    kind: ClassVar[str] = "float"
    stage: ClassVar[str] = "float"
    evaluated_only_if_fast: ClassVar[bool] = True

    @classmethod
    def planned(cls, target: Target, precision: str, cuda_graphs: bool = False) -> "FloatCandidate":
        spec = {**target.engine_spec(), "precision": precision, "name": precision + ("-cudagraph" if cuda_graphs else "")}
        return cls({**spec, "cuda_graphs": True} if cuda_graphs else spec)

    def describe(self) -> str:
        return self.precision.upper() + (", CUDA graph replay" if self.spec.get("cuda_graphs") else "")


@register
@dataclass(eq=False)
class PtqCandidate(Candidate):
    """INT8 by post-training calibration with one range method, on the target's placement."""

    kind: ClassVar[str] = "int8-ptq"
    stage: ClassVar[str] = "ptq"
    evaluated_only_if_fast: ClassVar[bool] = True

    @classmethod
    def planned(cls, target: Target, method: str, quantized_conv_outputs: bool = False,
                float_ops: tuple[str, ...] = ()) -> "PtqCandidate":
        """``float_ops``: op types left float because the profile of this placement measured their INT8 form slower."""
        spec = {**target.engine_spec(), "precision": "int8", "method": method, "placement": target.placement,
                "name": f"int8-{method}" + ("-qconv" if quantized_conv_outputs else "")
                + (f"-float-{'+'.join(float_ops)}" if float_ops else "")}
        if quantized_conv_outputs:
            spec["quantized_conv_outputs"] = True
        if float_ops:
            spec["exclude_ops"] = list(float_ops)
        return cls(spec)

    def subset_only(self, agreement: float) -> None:
        """Ranked below another method on the subset and not evaluated on the whole search split (same graph, so the
        same speed: only the best method needs the full evaluation)."""
        self.status, self.subset_agreement = "ranked on the subset only", agreement
        self.verdict_text = "not evaluated on the whole search split"

    def same_graph_ruled_out(self, timed: "Candidate", why: str) -> None:
        """Not built: ``timed``, another range method of this placement (the same graph), was timed and ruled out on
        every engine that runs its Q/DQ ONNX; ``why`` says by what."""
        self.status, self.reason = SAME_GRAPH_RULED_OUT, f"the same graph as {timed.variant} (only the scales differ): {why}"
        self.verdict_text = f"not built: {self.reason}"

    def describe(self) -> str:
        return (f"INT8 PTQ, {self.method} ranges, {self.spec.get('placement')} placement"
                + (", conv outputs quantized (QLinearConv before the activations kept whole)"
                   if self.spec.get("quantized_conv_outputs") else "")
                + (f", {', '.join(self.spec['exclude_ops'])} left float (measured slower in INT8)"
                   if self.spec.get("exclude_ops") else ""))


def engine_floats(engine: str) -> tuple[str, ...]:
    """The float precisions ``engine`` runs on this CPU: FP32, and FP16 / BF16 where OpenVINO's CPU plugin lists them
    as native (never on a CPU without: engines/openvino_engine.precision_problem)."""
    if engine == "openvino":
        from qdeploy.engines.openvino_engine import precision_problem

        # BF16 before FP16: at least as fast wherever both are native (AMX-BF16 from Sapphire Rapids on, AMX-FP16 only
        # from Granite Rapids), so the search times FP16 against it and skips FP16's evaluation where it is far slower
        return ("fp32",) + tuple(p for p in ("bf16", "fp16") if precision_problem(p) is None)
    return ("fp32",)


def _with_float_precision(spec: dict, float_precision: str) -> dict:
    """An INT8 engine candidate's spec with its float layers' precision (OpenVINO's ``float_precision`` option): named
    ``-bf16`` and carrying the option unless f32, the engine's default for INT8 in qdeploy."""
    if float_precision == "f32":
        return spec
    return {**spec, "name": f"{spec['name']}-{float_precision}", "float_precision": float_precision}


@register
@dataclass(eq=False)
class EngineCandidate(Candidate):
    """A candidate on another CPU engine than the target's own (OpenVINO on target cpu): its float precisions, its
    INT8 from the same Q/DQ ONNX as an ONNX Runtime PTQ candidate, or its own placement (NNCF). The artifact is the
    ONNX that engine compiles, so the user deploys it with that engine."""

    kind: ClassVar[str] = "engine"
    stage: ClassVar[str] = "engine"
    evaluated_only_if_fast: ClassVar[bool] = True

    @property
    def engine(self) -> str:
        return self.spec["engine"]

    @classmethod
    def planned_float(cls, target: Target, engine: str, precision: str) -> "EngineCandidate":
        return cls({**target.engine_spec(engine), "precision": precision, "name": f"{engine}-{precision}"})

    @classmethod
    def planned_twin(cls, target: Target, engine: str, of: Candidate, float_precision: str = "f32") -> "EngineCandidate":
        """The same INT8 Q/DQ ONNX as ``of`` (an ONNX Runtime PTQ candidate), run by ``engine``; ``float_precision``
        as for planned_own_placement."""
        int8 = {k: v for k, v in of.spec.items() if k not in ("engine", "device", "threads", "name")}
        return cls(_with_float_precision({**target.engine_spec(engine), **int8, "name": f"{engine}-{of.variant}"},
                                         float_precision))

    @classmethod
    def planned_own_placement(cls, target: Target, engine: str, method: str = "mean-minmax",
                              float_precision: str = "f32", nncf_scheme=None) -> "EngineCandidate":
        """``float_precision`` bf16: the layers the INT8 model leaves float run in BF16 (OpenVINO's float_precision
        option), as OpenVINO's CPU plugin runs an INT8 model by default on a CPU with native BF16.
        ``nncf_scheme`` (lint/placement.NncfScheme): NNCF's scheme where not the one Int8Config's nncf_model_type auto
        picks; its float op types become the config's exclude_ops."""
        name = f"{engine}-int8-{method}-{'nncf' if engine == 'openvino' else engine}"
        spec = {**target.engine_spec(engine), "precision": "int8", "method": method, "placement": engine, "name": name}
        if nncf_scheme is not None:
            spec.update(nncf_model_type=nncf_scheme.model_type, name=f"{name}-{nncf_scheme.label}")
            if nncf_scheme.float_ops:
                spec["exclude_ops"] = list(nncf_scheme.float_ops)
        return cls(_with_float_precision(spec, float_precision))

    def deploy(self, artifact: str) -> Optional[str]:
        """The engine call that runs ``artifact`` as this candidate was measured (a BF16 candidate's artifact is the FP32
        ONNX: the precision hint is what makes it BF16)."""
        if self.engine != "openvino":
            return None
        from qdeploy.engines.openvino_engine import deploy_line

        return deploy_line(artifact, self.precision, self.spec.get("threads"), self.spec.get("float_precision", "f32"))

    def describe(self) -> str:
        name = {"openvino": "OpenVINO"}.get(self.engine, self.engine)
        if self.precision != "int8":
            return f"{name} {self.precision.upper()}"
        bf16 = ", float layers in BF16" if self.spec.get("float_precision") == "bf16" else ""
        if self.spec.get("placement") == self.engine:
            scheme = f", NNCF's {self.spec['nncf_model_type']} scheme" if self.spec.get("nncf_model_type") else ""
            return f"{name} INT8, {self.method} ranges, its own placement (NNCF){scheme}{bf16}"
        return (f"{name} INT8 on the ONNX Runtime-placement Q/DQ ONNX ({self.method} ranges"
                + (", conv outputs quantized" if self.spec.get("quantized_conv_outputs") else "") + f"){bf16}")

    def to_json(self) -> dict:
        return {**super().to_json(), "engine": self.engine}


def program_settings(spec: dict, batch_sizes, input_shape):
    """What artifacts/torch_program.py saves for a PyTorch candidate (the FP32 reference included) with this spec."""
    from qdeploy.artifacts.torch_program import ProgramSettings

    mode = spec.get("compile") or None
    return ProgramSettings(device=spec.get("device", "cpu"), precision=spec["precision"],
                           channels_last=bool(spec.get("channels_last")), tf32=bool(spec.get("tf32")),
                           compile="default" if mode is True else mode, cuda_graphs=bool(spec.get("cuda_graphs")),
                           torchao=spec.get("torchao"), freezing=bool(spec.get("freezing")),
                           patch_matmul=bool(spec.get("patch_matmul")),
                           depthwise_stencil=bool(spec.get("depthwise_stencil")),
                           gelu_epilogue=bool(spec.get("gelu_epilogue")),
                           batch_sizes=tuple(int(b) for b in batch_sizes), input_shape=tuple(input_shape))


def geomean(values) -> Optional[float]:
    vals = [float(v) for v in values if v is not None]
    if not vals or min(vals) <= 0:
        return None
    return float(np.exp(np.mean(np.log(vals))))


@dataclass(eq=False)
class TorchCandidate(Candidate):
    """A PyTorch way of running the model on the target (precision, memory layout, TF32, runtime). Cheap to time, so
    every one is timed briefly first (``brief``); only the few that can win are measured fully (evaluation + timing).
    Its deployable artifact is a saved program (``program_settings``: what artifacts/torch_program.py saves)."""

    kind: ClassVar[str] = "torch"
    stage: ClassVar[str] = "torch"
    runtime: ClassVar[str] = "eager"
    brief_p50_ms: Optional[dict] = None     # batch size → p50 of the brief timing
    brief_rank: Optional[float] = None      # geometric mean of brief_p50_ms
    compile_s: Optional[float] = None       # load + first calls (torch.compile's compile time, graph capture)
    exported: Optional[bool] = None         # compiled: from its exported program (True) or from the model (False)

    @classmethod
    def _spec(cls, target: Target, precision: str, channels_last: bool, tf32: bool, suffix: str, **options) -> dict:
        name = "-".join([precision + ("-tf32" if tf32 else "")] + (["cl"] if channels_last else []) + [suffix])
        spec = {**target.engine, "precision": precision, "name": name, "channels_last": channels_last, **options}
        if tf32:
            spec["tf32"] = True
        return spec

    @property
    def channels_last(self) -> bool:
        return bool(self.spec.get("channels_last"))

    @property
    def tf32(self) -> bool:
        return bool(self.spec.get("tf32"))

    @property
    def compile_mode(self) -> Optional[str]:
        mode = self.spec.get("compile") or None
        return "default" if mode is True else mode

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.spec.get("cuda_graphs"))

    def timed_briefly(self, p50_by_batch: dict, compile_s: float) -> None:
        self.brief_p50_ms = {str(b): round(v, 5) for b, v in p50_by_batch.items()}
        self.brief_rank = geomean(p50_by_batch.values())
        self.compile_s = round(compile_s, 2)
        if self.status == "planned":
            self.status = "timed briefly only"
            self.verdict_text = "not evaluated (a faster candidate was measured fully)"

    def _layout(self) -> str:
        return ", channels_last" if self.channels_last else ""

    def _precision_text(self) -> str:
        return self.precision.upper() + (" (TF32 math)" if self.tf32 else " (strict, no TF32)"
                                         if self.precision == "fp32" and self.spec.get("device") == "cuda" else "")

    def to_json(self) -> dict:
        return {**super().to_json(), "runtime": self.runtime, "channels_last": self.channels_last, "tf32": self.tf32,
                "compile": self.compile_mode, "cuda_graphs": self.cuda_graphs, "brief_p50_ms": self.brief_p50_ms,
                "compile_s": self.compile_s, "compiled_from_export": self.exported}


@register
@dataclass(eq=False)
class EagerCandidate(TorchCandidate):
    """PyTorch eager in a precision and layout: what the model costs with no capture or compilation."""

    kind: ClassVar[str] = "torch-eager"
    runtime: ClassVar[str] = "eager"

    @classmethod
    def planned(cls, target: Target, precision: str, channels_last: bool = False, tf32: bool = False) -> "EagerCandidate":
        return cls(cls._spec(target, precision, channels_last, tf32, "eager"))

    def describe(self) -> str:
        return f"PyTorch eager, {self._precision_text()}{self._layout()}"


@register
@dataclass(eq=False)
class CudaGraphCandidate(TorchCandidate):
    """Eager kernels captured once per input shape into a CUDA graph and replayed: no per-op launch cost, which
    dominates small models at small batches."""

    kind: ClassVar[str] = "torch-cudagraph"
    runtime: ClassVar[str] = "cudagraph"

    @classmethod
    def planned(cls, target: Target, precision: str, channels_last: bool = False,
                tf32: bool = False) -> "CudaGraphCandidate":
        return cls(cls._spec(target, precision, channels_last, tf32, "cudagraph", cuda_graphs=True))

    def describe(self) -> str:
        return f"CUDA-graph replay of eager PyTorch, {self._precision_text()}{self._layout()}"


@register
@dataclass(eq=False)
class CompiledCandidate(TorchCandidate):
    """torch.compile (Inductor: fused Triton/C++ kernels) in a mode, optionally replayed as CUDA graphs."""

    kind: ClassVar[str] = "torch-compile"
    runtime: ClassVar[str] = "compile"

    @classmethod
    def planned(cls, target: Target, precision: str, channels_last: bool, tf32: bool, mode: str,
                cuda_graphs: bool) -> "CompiledCandidate":
        short = {"default": "compile", "max-autotune-no-cudagraphs": "autotune"}.get(mode, mode)
        return cls(cls._spec(target, precision, channels_last, tf32, short + ("-cudagraph" if cuda_graphs else ""),
                             compile=mode, cuda_graphs=cuda_graphs))

    def describe(self) -> str:
        return (f"torch.compile ({self.compile_mode}){' + CUDA graphs' if self.cuda_graphs else ''}, "
                f"{self._precision_text()}{self._layout()}")


@dataclass(eq=False)
class RewrittenCandidate(CompiledCandidate):
    """A compiled candidate compiled again with one rewrite switched on (``option``, a TorchOptions flag): the same
    model and precision, numerics moved a little, so evaluated on its own. A subclass names the flag, the variant's
    suffix (= its ``runtime``), ``label`` (what the search's notes call it) and ``detail`` (its description's tail)."""

    option: ClassVar[str]
    label: ClassVar[str]
    detail: ClassVar[str] = ""

    @classmethod
    def planned_from(cls, base: "CompiledCandidate") -> "RewrittenCandidate":
        return cls({**base.spec, cls.option: True, "name": f"{base.variant}-{cls.runtime}"})

    def describe(self) -> str:
        return f"{super().describe()}, {self.label}{self.detail}"


@register
@dataclass(eq=False)
class FrozenCandidate(RewrittenCandidate):
    """Inductor's freezing: the weights folded in as constants (conv-BN folding, constant folding; facts/inductor.py);
    the numerics move where BatchNorm is folded into the convolution's weights."""

    kind: ClassVar[str] = "torch-frozen"
    runtime: ClassVar[str] = "frozen"
    option: ClassVar[str] = "freezing"
    label: ClassVar[str] = "Inductor freezing"
    detail: ClassVar[str] = " (weights folded in as constants)"


@register
@dataclass(eq=False)
class PatchMatmulCandidate(RewrittenCandidate):
    """The patch convolutions (stride equal to kernel) as one matmul over the patches (facts/patch_matmul.py): the same
    arithmetic, summed in another order."""

    kind: ClassVar[str] = "torch-patchmm"
    runtime: ClassVar[str] = "patchmm"
    option: ClassVar[str] = "patch_matmul"
    label: ClassVar[str] = "patch convolutions as matmuls"


@register
@dataclass(eq=False)
class DepthwiseStencilCandidate(RewrittenCandidate):
    """The depthwise convolutions as stencils Inductor fuses (facts/depthwise_stencil.py), not cuDNN's kernels: the same
    arithmetic, summed in FP32 in another order."""

    kind: ClassVar[str] = "torch-dwstencil"
    runtime: ClassVar[str] = "dwstencil"
    option: ClassVar[str] = "depthwise_stencil"
    label: ClassVar[str] = "depthwise convolutions as fused stencils"


@register
@dataclass(eq=False)
class GeluEpilogueCandidate(RewrittenCandidate):
    """Each Linear whose only user is a GELU as one cuBLASLt matmul with the bias and the GELU in its epilogue
    (facts/gelu_epilogue.py): the GELU's tanh approximation, computed on the FP32 accumulator."""

    kind: ClassVar[str] = "torch-geluepi"
    runtime: ClassVar[str] = "geluepi"
    option: ClassVar[str] = "gelu_epilogue"
    label: ClassVar[str] = "GELU in the matmul's epilogue"


@register
@dataclass(eq=False)
class TorchaoCandidate(CompiledCandidate):
    """A compiled candidate whose Linear layers torchao quantized (FP8 or INT8, facts/torchao.py): faster only where
    the Linear layers' matmuls, not launches or convolutions, bound the time."""

    kind: ClassVar[str] = "torch-ao"
    runtime: ClassVar[str] = "torchao"

    @classmethod
    def planned_from(cls, base: "CompiledCandidate", scheme: str) -> "TorchaoCandidate":
        spec = {**base.spec, "torchao": scheme, "name": f"{base.variant}-ao-{scheme}"}
        return cls(spec)

    def describe(self) -> str:
        return f"torchao {self.spec['torchao']} on the Linear layers, then {super().describe()}"


@register
@dataclass(eq=False)
class TorchFp32Reference(EagerCandidate):
    """The FP32 reference of a PyTorch target: eager, contiguous, strict FP32 (no TF32). Also the eager FP32 candidate."""

    kind: ClassVar[str] = "torch-fp32"
    stage: ClassVar[str] = "reference"
    reference: ClassVar[bool] = True

    @classmethod
    def planned(cls, target: Target) -> "TorchFp32Reference":
        return cls({**target.engine, "precision": "fp32", "name": "fp32"})

    def describe(self) -> str:
        return f"FP32 reference: {super().describe()}"


def exclude_patterns(layers: list[str]) -> list[str]:
    """``exclude`` regexes that match exactly these ONNX node names."""
    return ["^" + re.escape(n) + "$" for n in layers]


@register
@dataclass(eq=False)
class FallbackCandidate(Candidate):
    """A PTQ candidate with some layers kept float (the per-layer fallback's trial)."""

    kind: ClassVar[str] = "int8-fallback"
    stage: ClassVar[str] = "fallback"
    float_layers_fallback: list = field(default_factory=list)
    float_macs_share: Optional[float] = None

    @classmethod
    def planned(cls, start: Candidate, layers: list[str]) -> Candidate:
        if not layers:
            return start
        return cls({**start.spec, "exclude": exclude_patterns(layers),
                    "name": f"{start.spec['name']}-float{len(layers)}-" + sha256_json(sorted(layers))[:6]},
                   float_layers_fallback=list(layers))

    def describe(self) -> str:
        return f"INT8 PTQ ({self.method}) with {len(self.float_layers_fallback)} layers in float"

    def to_json(self) -> dict:
        return {**super().to_json(), "float_layers_fallback": self.float_layers_fallback,
                "float_macs_share": self.float_macs_share}


@register
@dataclass(eq=False)
class QatCandidate(Candidate):
    """Quantization-aware training from the best PTQ setting, the fallback's float layers kept float."""

    kind: ClassVar[str] = "int8-qat"
    stage: ClassVar[str] = "qat"
    float_layers_fallback: list = field(default_factory=list)

    @classmethod
    def planned(cls, start: Candidate, float_layers: list[str]) -> "QatCandidate":
        return cls({**start.spec, "quantizer": "qat", "exclude": exclude_patterns(float_layers),
                    "name": f"{start.variant}-qat" + (f"-float{len(float_layers)}" if float_layers else "")},
                   float_layers_fallback=list(float_layers))

    def describe(self) -> str:
        return f"INT8 QAT from {self.method} ranges" + (f", {len(self.float_layers_fallback)} layers in float"
                                                        if self.float_layers_fallback else "")

    def to_json(self) -> dict:
        return {**super().to_json(), "float_layers_fallback": self.float_layers_fallback}


# ---------------------------------------------------------------------------- scoring against the reference
def sibling_agreements(cand: Candidate, candidates: list) -> list[float]:
    """The agreements of ``cand``'s siblings for the agreement floor's siblings rule: the other INT8 candidates that
    ran and have an agreement on the whole search split (as qdeploy run compares an INT8 variant with the other INT8
    variants). A float candidate has none: the rule is about one INT8 calibration going wrong where others did not."""
    if cand.precision != "int8":
        return []
    return [c.agreement for c in candidates if c is not cand and c.precision == "int8" and c.ok and not c.reference
            and c.agreement is not None]


def rescore(cand: Candidate, ref: Candidate, labels: Optional[np.ndarray], o: OptimizeConfig, z: float,
            siblings=()) -> Candidate:
    """Budget verdict against the reference (replayed candidates and the reference itself included), on the one-sided
    confidence bound: the standard errors are paired over the search split's samples (the same images for both). The
    agreement floor (decide.agreement_floor) is part of it, with ``siblings`` (:func:`sibling_agreements`)."""
    from qdeploy.evaluate.metrics import agreement
    from qdeploy.optimize.decide import agreement_se, paired_drop_se

    p, ref_p = cand.predictions, ref.predictions
    agree = agreement(p, ref_p) if p is not None and ref_p is not None else None
    se = a_se = None
    if agree is not None and p.shape == ref_p.shape:
        # per image (segmentation: the share of its pixels), for the agreement budget and the floor alike
        a_se = agreement_se((p == ref_p).reshape(len(p), -1).mean(axis=1))
        if o.budget.agreement_only:
            se = a_se
        elif labels is not None and p.ndim == 1 and len(labels) == len(p):
            valid = labels >= 0
            se = paired_drop_se(ref_p[valid] == labels[valid], p[valid] == labels[valid])
    verdict = budget_check(o.budget, ref.search_metric, cand.search_metric, agree, se, z, agreement_se=a_se,
                           siblings=siblings)
    cand.score(verdict, agree, se, a_se)
    return cand


def rejudge(cand: Candidate, ref: Candidate, o: OptimizeConfig, z: float, siblings=()) -> Candidate:
    """The budget verdict again from the numbers :func:`rescore` kept (agreement and standard errors), with new
    ``siblings``: the siblings rule's median moves as INT8 candidates are measured, the candidate's numbers do not
    (no predictions compared again: segmentation masks are large)."""
    if cand.ok:
        verdict = budget_check(o.budget, ref.search_metric, cand.search_metric, cand.agreement, cand.se, z,
                               agreement_se=cand.agreement_se, siblings=siblings)
        cand.score(verdict, cand.agreement, cand.se, cand.agreement_se)
    return cand


# ---------------------------------------------------------------------------- the ONNX behind an artifact
def onnx_of(artifact):
    """The (Q/DQ) ONNX behind an artifact: itself, or for a TensorRT engine the ONNX it was built from (its companion),
    which is what sensitivity, layer names and the Q/DQ structure read."""
    if artifact is None or artifact.kind != ArtifactKind.TRT_ENGINE:
        return artifact
    return next((c for c in artifact.companions if c.kind != ArtifactKind.TRT_ENGINE), None)


def int8_macs_share(record, structure: dict, macs: Optional[dict], fp32_onnx: Optional[Path]) -> Optional[float]:
    """Share of the model's MACs in compute layers whose input and weights are both INT8 (what TensorRT runs in INT8),
    from the FP32 model's per-layer MACs; None when the Q/DQ layers cannot be paired with the FP32 ONNX's."""
    onnx_art = onnx_of(record.artifact)
    if not macs or fp32_onnx is None or onnx_art is None or onnx_art.path is None or not structure.get("ops"):
        return None
    mapping = layer_names_map(fp32_onnx, onnx_art.path)
    if mapping is None:
        return None
    total = sum(macs.values()) or 1
    int8 = sum(macs.get(mapping.get(op["name"], op["name"]), 0) for op in structure["ops"]
               if op["int8_input"] and op["int8_weights"])
    return round(int8 / total, 4)


__all__ = ["CANDIDATE_KINDS", "Candidate", "CompiledCandidate", "CudaGraphCandidate", "EagerCandidate",
           "EngineCandidate", "FallbackCandidate", "FloatCandidate", "Fp32Reference", "PtqCandidate", "QatCandidate", "SAME_GRAPH_RULED_OUT", "TARGETS", "TIMED_ONLY", "Target",
           "TorchCandidate", "TorchFp32Reference", "TorchaoCandidate", "engine_floats", "exclude_patterns", "geomean", "program_settings", "onnx_of", "plan", "record_p50", "rejudge", "rescore", "sibling_agreements", "target_for"]
