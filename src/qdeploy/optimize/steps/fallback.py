"""Where PTQ misses the budget: per-layer fallback from the best PTQ candidate (the loop of optimize/fallback.py, run
on this search by :class:`PerLayerFallback`), then QAT when ``optimize.qat`` allows it. Also a fallback for speed: a
faster INT8 outside the budget by its drop, while slower candidates meet it (``decide.fallback_for_speed``)."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.artifacts.types import IR_KINDS
from qdeploy.data import normalize, take
from qdeploy.errors import QDeployError
from qdeploy.evaluate.metrics import agreement
from qdeploy.optimize.candidates import Candidate, EngineCandidate, FallbackCandidate, PtqCandidate, QatCandidate, onnx_of
from qdeploy.optimize.decide import LATENCY_TIE, best_effort, fallback_for_speed, fastest_within, leads
from qdeploy.optimize.fallback import FallbackHooks, run_fallback
from qdeploy.optimize.sensitivity import layer_names_map, layer_sensitivity, with_float_activations
from qdeploy.optimize.session import untimed_spec
from qdeploy.optimize.steps.base import Step, register_step
from qdeploy.pipeline import build_variant, run_variant
from qdeploy.tasks import get_task
from qdeploy.utils.hashing import sha256_json


def int8_slower_than_fp32(ref: Optional[Candidate], ptq: list[Candidate], measured: bool) -> Optional[str]:
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


class PerLayerFallback:
    """Per-layer fallback from ``start``, in the spirit of NNCF's accuracy-control loop: a ranker (local SQNR, the top
    layers refined by their agreement gain on the subset of the samples the start disagrees with FP32 on most) and
    the loop that reverts one layer at a time (optimize/fallback.py). ``to_beat``: the fastest candidate within
    budget, for a fallback made for speed (it stops once slower)."""

    def __init__(self, s, start: Candidate, to_beat: Optional[Candidate] = None):
        self.s, self.start, self.to_beat = s, start, to_beat
        self.fp32_onnx = s.fp32_onnx or s.ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
        self.ranked: dict = {}  # the SQNR pass is deterministic per float set: a re-ranking after an undo reuses it
        self.trials: list[Candidate] = []
        # NNCF re-collects its statistics for every ignored scope (tens of seconds a build on a transformer): its layers
        # are ranked on its own model with the layer's activation Q/DQ bypassed (sensitivity.with_float_activations);
        # the trials that follow are NNCF builds. Every other quantizer rebuilds from cached ranges in about a second
        self.proxy_ranking = False
        self.names_of: dict = {}  # a built model's path -> {its layer: the FP32 ONNX's name}
        self.proxy_dir: Optional[Path] = None

    # ---- the data it ranks on
    def pick_samples(self) -> bool:
        """The subset (the search samples the start disagrees with FP32 on most: NNCF's 300 "worst", seeded ties) and
        the images of the SQNR pass; False when there are no per-sample predictions to pick from."""
        s, o = self.s, self.s.o
        ref_p, start_p = s.reference.predictions, self.start.predictions
        if ref_p is None or start_p is None or ref_p.shape != start_p.shape:
            s.note("fallback skipped: no per-sample predictions to pick the subset from")
            return False
        per_sample = (ref_p != start_p).reshape(len(ref_p), -1).mean(axis=1)
        rng = np.random.default_rng(o.seed)
        order = np.lexsort((rng.random(len(per_sample)), -per_sample))
        self.subset_idx = np.sort(order[: min(o.subset_size, len(order))])
        self.sctx, self.ref_sub = s.subset_context(self.subset_idx)
        n_eval = len(ref_p)  # the images really decoded (on_error: skip may leave some out)
        sens_idx = np.sort(rng.choice(n_eval, size=min(o.sensitivity_images, n_eval), replace=False))
        self.sens_images = normalize(take(s.ctx.eval_batches, sens_idx)[0], s.ctx.cfg.model.preprocess)
        s.note(f"fallback from {self.start.variant}: subset of {len(self.subset_idx)} search samples "
               f"({int((per_sample > 0).sum())} disagree with FP32); SQNR on {len(sens_idx)} images")
        return True

    def spec(self, layers: list[str]) -> dict:
        return FallbackCandidate.planned(self.start, layers).spec

    # ---- the hooks of fallback.run_fallback
    def sensitivity(self, layers: list[str]) -> list[dict]:
        k = tuple(sorted(layers))
        if k not in self.ranked:
            art = self.s.built_onnx(self.spec(layers))
            self.s.evaluations["sensitivity"] += 1
            mapping = layer_names_map(self.fp32_onnx, art.path)
            if mapping is None:
                raise QDeployError(f"the compute layers of {art.path.name} cannot be paired with the FP32 ONNX's (different "
                                   "op types or weight shapes in order), so no layer can be named for exclude")
            report = layer_sensitivity(art.path, self.sens_images,
                                       batch_size=get_task(self.s.ctx.cfg.model.task).sensitivity_batch_size)
            self.ranked[k] = [{**d, "name": mapping.get(d["name"], d["name"])} for d in report]
        return self.ranked[k]

    def subset_record(self, layers: list[str]):
        """run_variant's record on the subset: the real build, or (proxy_ranking) the build without the last layer
        with that layer reading float activations. The ranking always scores the current float set plus one layer."""
        s = self.s
        if not (self.proxy_ranking and layers):
            return run_variant(self.sctx, s.variant_of(self.spec(layers)))
        variant = s.variant_of(self.spec(layers[:-1]))
        record = build_variant(self.sctx, variant)
        if record.ok:
            # an OpenVINO INT8 IR is ranked on NNCF's Q/DQ ONNX of the same settings (session.built_onnx)
            art = s.built_onnx(self.spec(layers[:-1])) if record.artifact.kind in IR_KINDS else onnx_of(record.artifact)
            if art.path not in self.names_of:  # one pairing per built model, not one per layer ranked on it
                self.names_of[art.path] = layer_names_map(self.fp32_onnx, art.path) or {}
            names = {a for a, f in self.names_of[art.path].items() if f == layers[-1]}
            path = self.proxy_dir / f"{art.path.stem}-{sha256_json(layers)[:12]}.onnx"
            if not names or not with_float_activations(art.path, names, path):
                raise QDeployError(f"fallback: {layers[-1]} has no activation Q/DQ to bypass in {art.path.name}")
            record.artifact = dataclasses.replace(art, path=path, fingerprint=f"{art.fingerprint}-{path.stem}",
                                                  cache_hit=False, companions=[])
        return run_variant(self.sctx, variant, record)

    def subset_score(self, layers: list[str]) -> float:
        s = self.s
        spec = untimed_spec(self.spec(layers))
        kind = "subset-fallback-proxy" if self.proxy_ranking and layers else "subset-fallback"
        cached = s.scores.get(spec, kind)
        if cached is not None:
            s.evaluations["cached"] += 1
            return cached[0]["agreement"]
        r = self.subset_record(layers)
        s.evaluations["subset"] += 1
        if r.status != "ok":
            raise QDeployError(f"fallback: {spec['name']} failed on the subset: {r.reason}")
        score = agreement(r.predictions, self.ref_sub)
        s.scores.put(spec, kind, {"agreement": score}, None)
        return score

    def full(self, layers: list[str]) -> Candidate:
        trial = self.s.measure(FallbackCandidate.planned(self.start, layers))
        self.trials.append(trial)
        return trial

    def pointless(self, current: Candidate) -> Optional[str]:
        to_beat = self.to_beat
        if to_beat is None or current.rank_key is None or to_beat.rank_key is None:
            return None
        if current.rank_key < to_beat.rank_key * (1 - LATENCY_TIE):
            return None
        return (f"{current.variant} (p50 {current.rank_key:.3f} ms) is no faster than {to_beat.variant} "
                f"({to_beat.rank_key:.3f} ms), already within budget: a further float layer only adds time")

    # ---- the loop
    def run(self) -> Optional[dict]:
        """The fallback's record for optimize.json; None when the layers cannot be named for ``exclude``."""
        s, o = self.s, self.s.o
        if not self.pick_samples():
            return None
        hooks = FallbackHooks(sensitivity=self.sensitivity, subset_score=self.subset_score, full=self.full,
                              time_left=s.time_left, log=s.note, pointless=self.pointless,
                              subset_size=len(self.subset_idx), for_speed=self.to_beat is not None)
        self.proxy_dir = Path(tempfile.mkdtemp(prefix="qdeploy-fallback-"))
        try:
            self.proxy_ranking = s.built_onnx(self.spec([])).info.get("quantizer") == "nncf"
            if self.proxy_ranking:
                s.note(f"fallback: {self.start.variant} is an NNCF model, rebuilt by NNCF for every ignored scope: its "
                       "layers are ranked on it with each one's activation Q/DQ bypassed (no rebuild); each trial is an "
                       "NNCF build")
            res = run_fallback(self.start, hooks, refine_top=o.refine_top, max_float_fraction=o.max_float_fraction)
        except QDeployError as e:
            s.note(f"fallback stopped: {e}")
            return None
        finally:
            shutil.rmtree(self.proxy_dir, ignore_errors=True)
        total = sum(res.macs.values()) or 1
        for c in self.trials:  # the share of compute (MACs) each trial leaves in float
            c.float_macs_share = round(sum(res.macs.get(n, 0) for n in c.float_layers_fallback) / total, 4)
        s.note(f"fallback: {res.stop}; {len(res.float_layers)} layers in float "
               f"({100 * res.float_fraction:.1f} % of the compute)")
        return {"start": self.start.variant, "float_layers": res.float_layers, "within_budget": res.within_budget,
                "stop": res.stop, "float_fraction": round(res.float_fraction, 4), "rankings": res.rankings,
                "subset_size": int(len(self.subset_idx)), "trials": [c.variant for c in res.candidates]}


@register_step
class FallbackStep(Step):
    name = "fallback"

    def run(self) -> None:
        s = self.s
        ok_ptq = [c for c in s.int8() if c.ok and isinstance(c, PtqCandidate)]
        slower = int8_slower_than_fp32(s.reference, ok_ptq, s.target.measured)
        if slower:
            s.note(slower)
        if s.timed_out or not ok_ptq:
            return
        if not any(c.within_budget for c in s.int8() if c.ok) and not slower:
            start = self.recovery_start(ok_ptq)
            if start is not None:
                self.recover(start)
        elif s.o.fallback and s.target.measured:
            self.for_speed()

    def recovery_start(self, ok_ptq: list[Candidate]) -> Optional[Candidate]:
        """Where the recovery starts (the PTQ candidate closest to the budget), among those that could still be the
        answer. Per-layer fallback and QAT keep the start's INT8 graph (fallback adds float layers), so their answer is
        at best as fast as the start: where a float candidate of another precision or engine (BF16, OpenVINO's FP32) is
        within budget already, only a start that leads it beyond the timing noise of both (``decide.leads``) can pay,
        and None (said, and recorded in stages) when no PTQ candidate does. DeiT-S at 224 on the AMX Xeon: the
        fallback from ONNX Runtime's INT8 (16.7 ms) spent 108 s of rebuilds while OpenVINO's BF16 was within budget at
        7.2 ms."""
        s = self.s
        floats = fastest_within([c for c in s.ok() if not c.reference and c.precision != "int8"])
        if not s.target.measured or floats is None or (floats.rank_key or 0) <= 0:
            return best_effort(ok_ptq)
        leaders = [c for c in ok_ptq if leads(c, floats)]
        if leaders:
            return best_effort(leaders)
        fastest = min(ok_ptq, key=lambda c: c.rank_key or float("inf"))
        s.note(f"no PTQ candidate within budget on the search split; no fallback or QAT: they keep the INT8 graph of "
               f"their start, so they are at best as fast as it, and the fastest PTQ candidate, {fastest.variant} "
               f"({fastest.latency_p50_ms:.3f} ms), does not lead {floats.variant}, within budget at "
               f"{floats.latency_p50_ms:.3f} ms, by more than {2 * LATENCY_TIE:.0%}")
        s.stages["fallback"] = {"skipped": "no PTQ candidate is faster than a float candidate within budget by more "
                                           "than the timing noise", "fastest_ptq": fastest.variant,
                                "fastest_ptq_p50_ms": fastest.latency_p50_ms, "within_budget": floats.variant,
                                "within_budget_p50_ms": floats.latency_p50_ms}
        return None

    def recover(self, start: Candidate) -> None:
        """No INT8 candidate within budget (FP16 may be, and slower): per-layer fallback, then QAT."""
        s, o = self.s, self.s.o
        s.note(f"no PTQ candidate within budget on the search split; best: {start.variant} ({start.verdict_text})")
        float_layers: list[str] = []
        missed_by_fallback = True
        if o.fallback:
            fb = PerLayerFallback(s, start).run()
            s.stages["fallback"] = fb
            if fb is not None:
                float_layers = fb["float_layers"]
                missed_by_fallback = not fb["within_budget"]
        if missed_by_fallback and o.qat != "off" and not s.out_of_time():
            s.note(f"QAT ({o.qat}) from {start.variant}" + (f", with the fallback's {len(float_layers)} float layers kept "
                                                            "float" if float_layers else ""))
            qc = s.measure(QatCandidate.planned(start, float_layers))
            s.stages["qat"] = {"variant": qc.variant, "within_budget": qc.within_budget, "budget": qc.verdict_text}
        elif missed_by_fallback and o.qat == "off":
            s.note("QAT not allowed (optimize.qat: off): the search ends without training")

    def for_speed(self) -> None:
        """A faster INT8 (often another engine's) misses the budget by its drop while slower candidates meet it: its
        fallback may be the fastest answer within budget (decide.fallback_for_speed). Also where every ONNX Runtime
        INT8 is slower than FP32: that says nothing of another engine's INT8."""
        s = self.s
        start = fallback_for_speed(s.ok(), [c for c in s.int8() if c.ok and isinstance(c, (PtqCandidate, EngineCandidate))])
        if start is None:
            return
        best = fastest_within(s.ok())
        s.note(f"{start.variant} ({start.latency_p50_ms:.3f} ms) is faster than the fastest candidate within budget, "
               f"{best.variant} ({best.latency_p50_ms:.3f} ms), and outside the budget by its drop ({start.verdict_text}): "
               "per-layer fallback from it")
        s.stages["fallback"] = PerLayerFallback(s, start, to_beat=best).run()
