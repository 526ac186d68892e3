"""The CPU engines' INT8: the other CPU engines' own placements (first), and the placements a measurement or a lint
finding asks for.

:class:`EnginePlacementsStep`, before ONNX Runtime's PTQ: each other engine's own placement (OpenVINO: NNCF).
:class:`CpuEnginesStep`, from the best PTQ method:
- the ONNX Runtime placement that keeps conv outputs quantized, when the default left convs float because ONNX Runtime
  has no INT8 conv with a float output (lint/placement.py);
- the placement the profile asks for: op types whose INT8 kernels ONNX Runtime's profiler measured slower than their
  float ones (on this model, CPU and batch size) left float (:data:`FLOAT_WHEN_SLOWER`);
- on the target's other engines (target cpu: OpenVINO) the same Q/DQ ONNX files, the best also with its float layers
  in BF16 where the CPU has native BF16.

Once the answer is chosen, where its INT8 graph spends its time against FP32, per op class, goes into optimize.json.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from qdeploy.data import normalize
from qdeploy.errors import QDeployError
from qdeploy.optimize.candidates import TIMED_ONLY, Candidate, EngineCandidate, PtqCandidate, Target, engine_floats
from qdeploy.optimize.decide import best_effort, fastest_within
from qdeploy.optimize.steps.base import Step, register_step

# op classes (benchmark/op_profile.op_class) that are also ONNX op types the placement can leave float without losing a
# compute op's INT8 kernel: data movement and elementwise work, whose INT8 form saves no arithmetic. Add and Mul
# (QLinearAdd / QLinearMul: dequantize, compute, requantize per element) were measured slower in INT8 than in float by
# this profile on both CPUs it ran on (an AVX-512 VNNI + AMX Xeon: docs/results/cpu/cpu_goals_xeon.json; a 2-core AVX2
# EPYC: docs/results/cpu/cpu_goals.json). Whether they are on a given CPU is what the profile measures, so no ISA flag is
# read here: the rule is the measurement, taken on the CPU that will run the model
FLOAT_WHEN_SLOWER = ("Transpose", "Reshape", "Concat", "Resize", "Softmax", "Sigmoid", "HardSigmoid", "MaxPool",
                     "AveragePool", "Split", "Slice", "Pad", "Add", "Mul")


def own_placement_problem(engine: str) -> Optional[str]:
    """Why ``engine``'s own INT8 placement cannot be made here (None: it can)."""
    from qdeploy.config import Int8Config
    from qdeploy.quantize.registry import NotApplicable, candidates as quantizers

    try:
        quantizers(Int8Config(placement=engine), has_torch=False)
    except (NotApplicable, QDeployError) as e:
        return str(e)
    return None


def twins(target: Target, best: Optional[Candidate], planned: list[Candidate] = ()) -> list[Candidate]:
    """The other engines' INT8 from the same Q/DQ ONNX files as ``best`` and ``planned`` (their own placements:
    :class:`EnginePlacementsStep`)."""
    out: list[Candidate] = []
    for engine in target.also:
        sources = ([best] if best is not None else []) + [c for c in planned if isinstance(c, PtqCandidate)
                                                          and not c.spec.get("exclude_ops")]
        out += [EngineCandidate.planned_twin(target, engine, c) for c in sources]
        # the same Q/DQ ONNX with its float layers in BF16, as for the own placement: faster than its f32-hinted twin on
        # some models and batch sizes, slower on others (docs/results/cpu/cpu_goals_xeon.json), so one candidate,
        # measured like the rest
        if best is not None and "bf16" in engine_floats(engine):
            out.append(EngineCandidate.planned_twin(target, engine, best, float_precision="bf16"))
    return out


@register_step
class EnginePlacementsStep(Step):
    """The target's other CPU engines' own INT8 placement (OpenVINO: NNCF on the OpenVINO model), f32 and, where the
    CPU has native BF16, BF16 float layers. Measured before ONNX Runtime's PTQ methods: it needs none of their
    calibrations, and it was the fastest INT8 on every row of the real-size CPU suite at 224 px
    (docs/results/realsize_cpu_xeon.json), so a search cut by its time limit has it."""

    name = "engine-placements"

    def run(self) -> None:
        s = self.s
        if s.timed_out or s.target.placement != "onnxruntime" or not s.target.measured:
            return
        planned: list[Candidate] = []
        for engine in s.target.also:
            problem = own_placement_problem(engine)
            if problem:
                s.note(f"{engine}'s own INT8 placement not tried: {problem}")
                continue
            # NNCF's scheme: the one a single quantization takes, and on a model with attention or LayerNorm another
            # too (lint/placement.NNCF_TRANSFORMER_WHY: no one scheme was the fastest within budget on every such model)
            for i, scheme in enumerate(self.nncf_schemes() if engine == "openvino" else (None,)):
                scheme = scheme if i else None  # the first is what auto picks: planned as auto, under the plain name
                planned.append(EngineCandidate.planned_own_placement(s.target, engine, nncf_scheme=scheme))
                # OpenVINO's CPU plugin runs an INT8 model's float layers in BF16 by default where the CPU has native
                # BF16 (AMX-BF16, AVX512-BF16): on a transformer those layers (attention, Softmax, LayerNorm, GELU) are
                # much of the time, and all-BF16 can beat the f32-hinted INT8 (docs/results/cpu/cpu_goals_xeon.json)
                if "bf16" in engine_floats(engine):
                    planned.append(EngineCandidate.planned_own_placement(s.target, engine, float_precision="bf16",
                                                                         nncf_scheme=scheme))
        # optimize.accuracy_control always: NNCF's loop starts from the own placement's accuracy, so that one is
        # evaluated even where its timing rules it out as an answer
        start = (EngineCandidate.planned_own_placement(s.target, "openvino").variant,) \
            if s.o.accuracy_control == "always" else ()
        s.measure_all(planned, evaluate_anyway=start)

    def nncf_schemes(self) -> tuple:
        """NNCF's schemes to measure (lint/placement.NncfScheme), the first the one Int8Config's nncf_model_type auto
        picks."""
        import onnx

        from qdeploy.lint.placement import nncf_schemes
        from qdeploy.utils.onnx_graph import OnnxGraph

        if self.s.fp32_onnx is None:
            return (None,)
        return nncf_schemes(OnnxGraph(onnx.load(str(self.s.fp32_onnx), load_external_data=False)))


@register_step
class CpuEnginesStep(Step):
    name = "cpu-engines"

    def run(self) -> None:
        s = self.s
        if s.timed_out or s.target.placement != "onnxruntime" or not s.target.measured:
            return
        measured = [c for c in s.int8() if c.ok and isinstance(c, PtqCandidate) and c.latency_p50_ms is not None]
        # a placement timed too slow under ONNX Runtime to be evaluated still gives its Q/DQ ONNX to the other engines,
        # which may run it faster (ResNet-50 at 224, 4 threads: 7.2 ms in ONNX Runtime, 4.6 ms in OpenVINO)
        timed_only = sorted((c for c in s.int8() if c.status == TIMED_ONLY and isinstance(c, PtqCandidate)),
                            key=lambda c: -(c.subset_agreement if c.subset_agreement is not None else -1.0))
        best = fastest_within(measured) or best_effort(measured) or next(iter(timed_only), None)
        planned = self.quantized_conv_outputs(best)
        if not s.measure_all(planned):
            return
        profiled = self.float_when_slower([c for c in [best, *planned] if c is not None])
        if profiled is not None:
            planned.append(profiled)
            if not s.measure_all(planned[-1:]):
                return
        s.measure_all(twins(s.target, best, planned))

    def quantized_conv_outputs(self, best: Optional[Candidate]) -> list[Candidate]:
        s = self.s
        if best is None:
            return []
        art = s.built_onnx(best.spec)
        float_convs = (art.info or {}).get("float_convs_without_int8_kernel") or [] if art is not None else []
        if not float_convs:
            return []
        s.note(f"{best.variant}: {len(float_convs)} convs left float because their outputs stay float (ONNX Runtime "
               "runs a conv in INT8 only as QLinearConv); trying them INT8 with quantized outputs")
        return [PtqCandidate.planned(s.target, best.method, quantized_conv_outputs=True)]

    def float_when_slower(self, placements: list[Candidate]) -> Optional[Candidate]:
        """The faster placement's twin with the op types its profile measured slower in INT8 left float (None: no such
        op type, or the same Q/DQ ONNX)."""
        s = self.s
        ort = [c for c in placements if c.timed and c.latency_p50_ms is not None]
        base = min(ort, key=lambda c: c.latency_p50_ms, default=None)
        profiled = self.profile(base) if base is not None and s.fp32_onnx is not None else None
        slower = [k for k in (profiled or {}).get("slower", []) if k in FLOAT_WHEN_SLOWER]
        if slower:  # ONNX Runtime adds nodes of its own (a Transpose before a Gemm, layout reorders): only the model's count
            import onnx

            in_model = {n.op_type for n in onnx.load(str(s.fp32_onnx), load_external_data=False).graph.node}
            slower = [k for k in slower if k in in_model]
        if not slower:
            return None
        cand = PtqCandidate.planned(s.target, base.method, bool(base.spec.get("quantized_conv_outputs")), tuple(slower))
        if self.same_onnx(cand, base):
            s.note(f"{base.variant}: {', '.join(slower)} measured slower in INT8 than in FP32, but leaving them float "
                   "gives the same Q/DQ ONNX (ONNX Runtime fuses them from their neighbours' Q/DQ): not tried")
            return None
        s.note(f"{base.variant}: {', '.join(slower)} measured slower in INT8 than in FP32 (ONNX Runtime profiler); "
               "trying them float")
        return cand

    def same_onnx(self, a: Candidate, b: Candidate) -> bool:
        """Whether two INT8 candidates' specs build byte-identical Q/DQ ONNX files (then they are one candidate)."""
        from qdeploy.utils.hashing import sha256_file

        paths = [self.s.built_onnx(c.spec).path for c in (a, b)]
        return sha256_file(paths[0]) == sha256_file(paths[1])

    # ---- the op-class profile
    def after_choice(self, chosen: Optional[Candidate]) -> None:
        """Where the INT8 graph spends its time against FP32, per op class (benchmark/op_profile.py): the chosen INT8
        candidate (in OpenVINO by its per-layer counters when OpenVINO runs it), or the fastest ONNX Runtime INT8
        candidate when the answer is not INT8 (why INT8 lost). The report shows the classes whose INT8 form costs more
        than float."""
        s = self.s
        if not s.target.measured or s.fp32_onnx is None or s.target.engine.get("device", "cpu") != "cpu":
            return
        ort_int8 = [c for c in s.int8() if c.timed and c.spec.get("engine") == "onnxruntime"
                    and c.latency_p50_ms is not None]
        if chosen is not None and chosen.ok and chosen.precision == "int8" and chosen.spec.get("engine") == "openvino":
            cand = chosen  # profiled by OpenVINO's per-layer counters, its INT8 graph against its FP32 graph
        else:
            cand = chosen if chosen in ort_int8 else min(ort_int8, key=lambda c: c.latency_p50_ms, default=None)
        if cand is None:
            return
        cmp = self.profile(cand)
        if cmp is not None:
            s.int8_op_profile = {"candidate": cand.variant, "chosen": cand is chosen, **cmp}

    def profile(self, cand: Candidate) -> Optional[dict]:
        """benchmark/op_profile's comparison of ``cand``'s INT8 ONNX with the FP32 ONNX at the ranked batch size and
        the target's threads (None, with a decision line, when it cannot be taken). Once per candidate."""
        s = self.s
        cache = s.profiles
        if cand.variant in cache:
            return cache[cand.variant]
        from qdeploy.benchmark.op_profile import int8_cost_by_op_class, summary_line

        cache[cand.variant] = None
        try:
            # OpenVINO's own INT8 is profiled as it runs: the IR itself
            art = (s.ctx.builder.build(s.variant_of(cand.spec).artifact_request())
                   if cand.spec.get("engine") == "openvino" else s.built_onnx(cand.spec))
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
