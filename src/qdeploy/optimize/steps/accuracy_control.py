"""NNCF's own answer to a missed budget, beside qdeploy's per-layer fallback: ``nncf.quantize_with_accuracy_control``
on the OpenVINO model, with qdeploy's metric on the search split as its validation function and the budget as its
``max_drop``. NNCF quantizes, validates, ranks the quantized layers by their effect on the metric and reverts them to
float group by group until the drop is within ``max_drop`` (nncf/quantization/algorithms/accuracy_control/). Its
result is measured as a candidate like any other (it may be the answer), and optimize.json's ``stages`` records what
it cost: the validation passes over the whole split, the per-item passes of its ranking, the layers it left float.

It runs on a target with OpenVINO where qdeploy's fallback ran (a budget PTQ missed, or a fallback for speed) or where
no INT8 candidate is within budget, so that the two answers to a missed budget are compared on the same model, budget
and split. Not where it could not pay: its start's drop is within max_drop already (NNCF returns it unchanged), or its
start is not faster than the answer within budget by more than the noise of two timings (``decide.leads``: NNCF only
reverts layers to float, so its answer is at best as fast as its start; ``optimize.accuracy_control: always`` runs it
there too, ``off`` never).

API used (nncf 3.4, nncf/quantization/quantize_model.py and accuracy_control/evaluator.py): ``quantize_with_accuracy_
control(model, calibration_dataset, validation_dataset, validation_fn, max_drop=, drop_type=ABSOLUTE, subset_size=,
model_type=, ignored_scope=, advanced_quantization_parameters=, advanced_accuracy_restorer_parameters=)``;
``validation_fn(compiled_model, items) -> (metric, None)`` (metric mode: NNCF ranks by each item's metric).
"""
from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import numpy as np

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.data import ArrayBatches, normalize, take
from qdeploy.errors import QDeployError
from qdeploy.evaluate.runner import evaluate
from qdeploy.optimize.candidates import Candidate, EngineCandidate
from qdeploy.optimize.decide import LATENCY_TIE, fastest_within, leads
from qdeploy.optimize.steps.base import Step, register_step

NAME = "openvino-int8-nncf-accuracy-control"


class _CompiledModel:
    """An OpenVINO compiled model behind the one method evaluate() calls on an engine."""

    def __init__(self, compiled, label: str):
        self.compiled, self.request = compiled, compiled.create_infer_request()
        self.variant = SimpleNamespace(label=label)

    def infer(self, batch: np.ndarray) -> np.ndarray:
        out = self.request.infer({0: np.ascontiguousarray(batch, dtype=np.float32)})
        return np.array(out[self.compiled.outputs[0]], dtype=np.float32, copy=True)


class SearchSplitValidation:
    """qdeploy's metric on the search split (or the items NNCF picks from it) for a model NNCF compiled; counts the
    passes it was asked for."""

    def __init__(self, s):
        self.s = s
        n = s.n_search
        self.images, self.labels = take(s.ctx.eval_batches, np.arange(n))
        self.n, self.full_passes, self.item_passes = n, 0, 0

    def __call__(self, compiled, items) -> tuple[float, None]:
        idx = np.asarray(list(items), dtype=np.int64)
        if len(idx) >= self.n:
            self.full_passes += 1
        else:
            self.item_passes += len(idx)
        s = self.s
        batches = ArrayBatches(self.images[idx], self.labels[idx], s.ctx.eval_batches.batch_size,
                               s.ctx.eval_batches.class_names)
        metrics, _ = evaluate(_CompiledModel(compiled, "nncf-accuracy-control"), batches, s.ctx.cfg.model.preprocess,
                              s.ctx.cfg.model.task, s.ctx.cfg.data.eval.ignore_index, batches.class_names,
                              desc="nncf accuracy control")
        return float(metrics[s.key]), None  # a fraction, like every metric qdeploy keeps

    def image(self, i: int) -> np.ndarray:
        return normalize(self.images[int(i):int(i) + 1], self.s.ctx.cfg.model.preprocess)


@register_step
class NncfAccuracyControlStep(Step):
    name = "nncf-accuracy-control"

    def run(self) -> None:
        s = self.s
        missed = not any(c.within_budget for c in s.int8() if c.ok)
        if s.timed_out or "openvino" not in s.target.also or (s.stages.get("fallback") is None and not missed):
            return
        if s.o.accuracy_control == "off":
            s.note("NNCF accuracy control not run: optimize.accuracy_control is off")
            return
        if s.o.budget.agreement_only or s.reference is None or s.reference.search_metric is None:
            s.note("NNCF accuracy control not run: it needs a metric budget (max_drop or relative) and labels")
            return
        own = EngineCandidate.planned_own_placement(s.target, "openvino")
        start = next((c for c in s.candidates if c.variant == own.variant and c.ok), None)
        if start is None:
            s.note("NNCF accuracy control not run: OpenVINO's own INT8 placement was not measured in this search")
            return
        allowed = s.o.budget.allowed_points(s.reference.search_metric)
        drop = 100.0 * (s.reference.search_metric - start.search_metric) if start.search_metric is not None else None
        if drop is not None and drop <= allowed:
            # NNCF's restorer validates the quantized model first and returns it unchanged when its drop is within
            # max_drop (a point estimate): the run would cost a quantization and two passes to give back this candidate
            s.note(f"NNCF accuracy control not run: {start.variant}'s drop on the search split, {drop:.3g} points, is "
                   f"within its max_drop {allowed:.3g} (NNCF judges the point estimate), so it would return that model "
                   "as it is")
            s.stages["nncf_accuracy_control"] = {"skipped": "the own placement's drop is within max_drop already",
                                                 "drop": round(drop, 4), "max_drop": allowed}
            return
        best = fastest_within(s.ok())
        timed = best is not None and (best.rank_key or 0) > 0 and (start.rank_key or 0) > 0
        if timed and not leads(start, best) and s.o.accuracy_control == "auto":
            # NNCF only reverts layers of start to float: its answer is at best as fast as start, and start's lead
            # over what is already within budget is inside the timing noise, so minutes of ranking could not pay
            s.note(f"NNCF accuracy control not run: it starts from {start.variant} ({start.latency_p50_ms:.3f} ms) and "
                   f"only reverts layers to float; {best.variant} is within budget at {best.latency_p50_ms:.3f} ms, "
                   f"not more than {2 * LATENCY_TIE:.0%} slower than that start, so no answer of it could be told faster")
            s.stages["nncf_accuracy_control"] = {"skipped": "its start is not faster than the answer within budget by "
                                                            "more than the timing noise",
                                                 "start": start.variant, "start_p50_ms": start.latency_p50_ms,
                                                 "within_budget": best.variant, "within_budget_p50_ms": best.latency_p50_ms}
            return
        try:
            record, cand = self.quantize(own)
        except QDeployError as e:
            s.note(f"NNCF accuracy control failed: {e}")
            s.stages["nncf_accuracy_control"] = {"error": str(e)}
            return
        s.stages["nncf_accuracy_control"] = record
        s.measure(cand, evaluate_anyway=True)  # the peer's answer: its accuracy is what the comparison reports
        record["result"] = {"variant": cand.variant, "within_budget": cand.within_budget, "budget": cand.verdict_text,
                            "latency_p50_ms": cand.latency_p50_ms}

    def quantize(self, own: Candidate) -> tuple[dict, Candidate]:
        """NNCF's accuracy-controlled INT8 IR of the OpenVINO model, and the candidate that runs it."""
        import onnx

        from qdeploy.export.openvino_ir import convert, save_ir
        from qdeploy.quantize.nncf_quantizer import NncfPlan, _import_nncf, ir_names_of, ir_structure
        from qdeploy.quantize.registry import QuantizeInputs

        s = self.s
        t0 = time.perf_counter()
        nncf = _import_nncf()
        from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

        variant = s.variant_of(own.spec)
        fp32 = s.ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        inputs = QuantizeInputs(fp32_onnx=fp32.path, preprocess=s.ctx.cfg.model.preprocess,
                                calibration=s.ctx.builder.calibration)
        plan = NncfPlan.of(nncf, onnx.load(str(fp32.path), load_external_data=False), inputs, variant.int8)
        builder = s.ctx.builder
        ov_model, _ = convert(fp32.path, builder.torch_model if builder.has_torch else None,
                              builder.check_inputs() if builder.has_torch else None)
        baseline = ir_structure(ov_model)
        names, _ = ir_names_of(plan.ignored_names(), ov_model)
        validation = SearchSplitValidation(s)
        allowed = s.o.budget.allowed_points(s.reference.search_metric)
        s.note(f"NNCF accuracy control: quantize_with_accuracy_control on the OpenVINO model, max_drop {allowed:.3g} "
               f"points of {s.key} on the {validation.n} search images")
        # the validation function returns the metric as qdeploy keeps it, a fraction; NNCF compares max_drop with the
        # difference of two of its values, so the budget's points go in as a fraction too
        with_restorer = AdvancedAccuracyRestorerParameters(ranking_subset_size=min(s.o.subset_size, validation.n))
        try:
            qmodel = nncf.quantize_with_accuracy_control(
                ov_model, nncf.Dataset(plan.dataset_source, lambda x: {plan.input_name: x}),
                nncf.Dataset(range(validation.n), validation.image), validation,
                max_drop=allowed / 100.0, drop_type=nncf.DropType.ABSOLUTE, subset_size=max(1, len(plan.dataset_source)),
                model_type=plan.model_type, ignored_scope=plan.ignored_scope(nncf, names),
                advanced_quantization_parameters=plan.advanced, advanced_accuracy_restorer_parameters=with_restorer)
        except Exception as e:  # noqa: BLE001 - NNCF's own failure ends the peer, not the search
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise QDeployError(f"{type(e).__name__}: {first}") from None
        structure = ir_structure(qmodel)
        folder = s.ctx.builder.cache_dir / "artifacts" / f"{NAME}-{s.store.folder.name}"
        xml = save_ir(qmodel, folder)
        record = {"evaluations_full_split": validation.full_passes, "item_evaluations": validation.item_passes,
                  "float_compute_ops": structure["float_compute_ops"],
                  "compute_ops_int8": structure["compute_ops_int8"], "compute_ops": baseline["compute_ops"],
                  "max_drop": allowed, "time_s": round(time.perf_counter() - t0, 1), "nncf": nncf.__version__}
        s.note(f"NNCF accuracy control: {structure['compute_ops_int8']} of {structure['compute_ops']} compute ops INT8, "
               f"{validation.full_passes} passes over the split and {validation.item_passes} per-image evaluations, "
               f"{record['time_s']:.0f} s")
        cand = EngineCandidate({**own.spec, "name": NAME})
        self.s.prebuilt[NAME] = lambda built: dataclasses.replace(
            built, path=xml, fingerprint=f"{built.fingerprint}-accuracy-control", cache_hit=False,
            produced_by=f"NNCF {nncf.__version__} quantize_with_accuracy_control on the OpenVINO model",
            info={**built.info, "structure": structure, "accuracy_control": record})
        return record, cand

