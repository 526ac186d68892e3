"""The run: open (validate everything) → build every artifact → per variant load/eval/bench → assemble → write.

``run``, ``export`` and ``quantize`` share one opening (:func:`open_run`): config resolved against the
engine table, output folder checked, data decoded, the model run once on a real batch. Only user
errors found there stop a run; once variants start, a failure is that variant's, recorded with the
stage that failed, and every other result is still written.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import numpy as np
import torch
import yaml

from qdeploy import __version__
from qdeploy.benchmark import benchmark
from qdeploy.artifacts import Artifact, ArtifactKind, ArtifactRequest, Builder
from qdeploy.artifacts.types import IR_KINDS
from qdeploy.config import RunConfig, check_output_folder, load_config, parse_config
from qdeploy.data import make_batches, normalize
from qdeploy.engines import Variant, create_engine, resolve_variants
from qdeploy.errors import QDeployError, VariantUnavailable
from qdeploy.evaluate import agreement, evaluate
from qdeploy.evaluate.verdict_rules import RAN_STATUSES
from qdeploy.preflight import check_calibration, check_model, check_qat_data, check_static_batch, fit_static_batch
from qdeploy.report import SCHEMA_VERSION, print_table, write_reports
from qdeploy.report.schema import STAGES
from qdeploy.report.verdict import mark_degraded, recommend, run_warnings
from qdeploy.sysinfo import environment
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import OutputDir, write_json
from qdeploy.utils.faults import kill_point
from qdeploy.utils.hashing import sha256_file
from qdeploy.utils.log import console, is_debug, log, warn
from qdeploy.utils.memory import MemoryProbe

# The measuring stages a run may leave out (`qdeploy eval`/`bench` run one; export and quantize none); every variant is
# built and loaded. The stages a variant record reports are report.schema.STAGES.
MEASURE_STAGES = ("eval", "bench")


def as_config(config: Union[RunConfig, dict, str, Path]) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return parse_config(config)
    return load_config(config)


# ---------------------------------------------------------------------------------------------
# Opening: everything the user can get wrong is found here, before any variant runs

@dataclass
class RunContext:
    cfg: RunConfig
    variants: list[Variant]
    stages: set
    output: OutputDir
    eval_batches: object
    calibration: Optional[object]
    builder: Builder
    model_check: dict = field(default_factory=dict)
    _bench_inputs: Optional[np.ndarray] = None
    _task: Optional[object] = None

    @property
    def task(self):
        """The model's task bound to the model (detection: its decoder and NMS settings), made once per run."""
        if self._task is None:
            self._task = get_task(self.cfg.model.task).bind(self.cfg.model)
        return self._task

    def bench_inputs(self) -> np.ndarray:
        """Real preprocessed images for timing, made once per run (every variant is timed on the same ones)."""
        if self._bench_inputs is None:
            n = max(self.cfg.bench.batch_sizes)
            self._bench_inputs = normalize(self.eval_batches.first(n)[0], self.cfg.model.preprocess)
        return self._bench_inputs


def open_run(config, out_dir, stages: Iterable[str] = MEASURE_STAGES, only: Optional[Iterable[str]] = None,
             cache_dir: Optional[Path] = None, variants_filter=None) -> RunContext:
    cfg, static_batch = fit_static_batch(as_config(config))
    stages = set(stages)
    if not cfg.eval.enabled:
        stages.discard("eval")
    if not cfg.bench.enabled:
        stages.discard("bench")
    variants = resolve_variants(cfg, only)
    if variants_filter is not None:
        variants = variants_filter(variants)
    check_output_folder(cfg, out_dir, cache_dir)  # --out holds no input, is outside the data and the cache
    output = OutputDir(out_dir)  # fail now, not after an hour of benchmarking
    try:
        pre = cfg.model.preprocess
        eval_batches = make_batches(cfg.data.eval, pre, cfg.model.task, desc="decode eval images")
        calibration = check_calibration(cfg, variants, eval_batches)
        check_static_batch(static_batch, calibration, "data.calibration")
        builder = Builder(cfg, cache_dir, calibration,
                          check_inputs=lambda: normalize(eval_batches.first(cfg.export.verify.samples)[0], pre))
        ctx = RunContext(cfg, variants, stages, output, eval_batches, calibration, builder)
        ctx.model_check = check_model(cfg, builder, eval_batches, decode_all="eval" in stages, static=static_batch)
        # the config was changed to fit a static batch: said once the checks passed (a user error stays one line)
        if static_batch is not None and "message" in static_batch:
            ctx.model_check["static_batch"] = static_batch
            warn(static_batch["message"])
    except BaseException:
        output.abort()
        raise
    return ctx


# ---------------------------------------------------------------------------------------------
# One variant

@dataclass
class StageRecord:
    status: str = "not_run"          # ok | failed | skipped | not_run
    time_s: Optional[float] = None
    error: Optional[str] = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"status": self.status, "time_s": None if self.time_s is None else round(self.time_s, 4), "error": self.error,
                **self.extra}


@dataclass
class VariantRecord:
    variant: Variant
    status: str = "ok"
    reason: Optional[str] = None
    failed_stage: Optional[str] = None
    stages: dict = field(default_factory=lambda: {s: StageRecord() for s in STAGES})
    artifact: Optional[Artifact] = None
    device: Optional[str] = None
    details: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    predictions: Optional[np.ndarray] = None
    bench: dict = field(default_factory=dict)
    memory_mb: dict = field(default_factory=dict)
    traceback: Optional[str] = None
    extra_artifacts: list = field(default_factory=list)  # written to --out whatever the status (a TensorRT variant's ONNX)
    eval_skipped: Optional[str] = None  # why it was timed but not evaluated (run_variant's ``evaluate_if``)

    @property
    def label(self) -> str:
        return self.variant.label

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def skip(self, stage: str, reason: str) -> None:
        self.status, self.reason, self.failed_stage = "skipped", reason, stage
        if stage in self.stages:
            self.stages[stage].status = "skipped"
        warn(f"{self.label}: skipped: {reason}")

    def fail(self, stage: str, exc: BaseException) -> None:
        user = isinstance(exc, QDeployError)
        message = str(exc) if user else internal_error(exc, self.variant, stage)
        self.status, self.reason, self.failed_stage = "failed", message, stage
        self.stages[stage].status, self.stages[stage].error = "failed", message
        if not user:  # a bug in qdeploy or a library: keep where it happened
            self.traceback = traceback.format_exc(limit=8)
            if is_debug():
                console.print(traceback.format_exc(), markup=False, highlight=False)
        warn(f"{self.label}: failed at {stage}: {message}")


def internal_error(exc: BaseException, variant: Variant, stage: str) -> str:
    """A library's (or qdeploy's) internal error as the variant's one-line reason: which package raised it, its text
    (an ``AssertionError`` often has none), and for an INT8 build what to try instead: the other placement or
    quantizer, or ``exclude`` for the layer it names. ``--debug`` prints the traceback; results.json keeps it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = "qdeploy"
    for f in reversed(frames):
        parts = Path(f.filename).parts
        if "site-packages" in parts and parts.index("site-packages") + 1 < len(parts):
            where = parts[parts.index("site-packages") + 1].removesuffix(".py")
            break
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    message = f"{type(exc).__name__} inside {where}" + (f": {text}" if text else " (no message)")
    int8 = variant.int8
    if int8 is not None and stage == "build":
        other = "onnxruntime" if int8.placement != "onnxruntime" else "tensorrt"
        tries = [f"placement: {other}"]
        if int8.quantizer == "modelopt":
            tries.append("quantizer: onnx")
        message += f"; try {' or '.join(tries)}, or exclude the layer it names; --debug shows the traceback"
    else:
        message += " (--debug shows the traceback)"
    return message


def _stage(record: VariantRecord, name: str):
    """Context manager timing one stage and recording its failure (the exception stops that variant only)."""

    class _Timed:
        def __enter__(self):
            self.t0 = time.perf_counter()
            return record.stages[name]

        def __exit__(self, exc_type, exc, tb):
            st = record.stages[name]
            st.time_s = time.perf_counter() - self.t0
            if exc is None:
                st.status = "ok"
                return False
            if isinstance(exc, VariantUnavailable):
                record.skip(name, str(exc))
                return True
            if isinstance(exc, Exception):
                record.fail(name, exc)
                return True
            return False  # KeyboardInterrupt and the like stop the run

    return _Timed()


def _reproduction(ctx: RunContext, record: VariantRecord) -> None:
    """TensorRT variants, built or skipped: the trtexec command lines and the ONNX files they use."""
    from qdeploy.engines.tensorrt_engine import reproduction

    if record.variant.engine.name != "tensorrt":
        return
    try:
        artifacts, info = reproduction(record.variant, ctx.builder, lambda a: _deployable_name(a, record.label))
    except QDeployError as e:  # the ONNX itself could not be made: say so, the variant's own status stands
        record.details["trtexec"] = {"error": str(e)}
        return
    record.extra_artifacts = artifacts
    record.details.update(info)


def build_variant(ctx: RunContext, variant: Variant) -> VariantRecord:
    """Check that this machine can run the variant, then build (or fetch from the cache) its artifact."""
    record = VariantRecord(variant)
    try:
        variant.engine.check(variant, ctx.builder.has_torch)
    except VariantUnavailable as e:
        record.skip("check", str(e))
        _reproduction(ctx, record)
        return record
    log(f"[bold]{variant.label}[/bold]: build {variant.artifact_request().kind.value}")
    with MemoryProbe() as mem, _stage(record, "build") as st:
        record.artifact = ctx.builder.build(variant.artifact_request())
        st.extra["cache_hit"] = record.artifact.cache_hit
        kill_point("build")
    if record.stages["build"].status == "ok":
        st.extra["memory_mb"] = {k: mem.result()[k] for k in ("rss_peak", "rss_delta")}
    _reproduction(ctx, record)
    return record


def run_variant(ctx: RunContext, variant: Variant, record: Optional[VariantRecord] = None,
                evaluate_if: Optional[Callable[[VariantRecord], Optional[str]]] = None) -> VariantRecord:
    """Load the built artifact in its engine, evaluate and benchmark it. Builds first when not built yet.
    ``evaluate_if``: benchmark first, then evaluate unless it returns why not (kept in ``eval_skipped``): a search
    skips the evaluation of a candidate its timing already rules out."""
    if record is None:
        record = build_variant(ctx, variant)
    if record.status != "ok" or record.artifact is None:
        return record
    cfg = ctx.cfg
    cuda = torch.cuda.is_available()
    engine = create_engine(variant, record.artifact)
    log(f"[bold]{variant.label}[/bold]: run")
    # the previous variant's freed memory back to the OS first: else this one's "model adds" (peak over the
    # process before it loaded) reuses that heap and reads near 0 (qdeploy raises glibc's trim threshold)
    release_build_memory()
    try:
        with MemoryProbe(cuda=cuda) as mem:
            with _stage(record, "load"):
                engine.load()
                record.device = engine.device
            time_first = evaluate_if is not None and "bench" in ctx.stages
            if time_first:
                _bench_stage(ctx, engine, record)
                record.eval_skipped = evaluate_if(record) if record.ok else None
            if record.ok and "eval" in ctx.stages and record.eval_skipped is None:
                with _stage(record, "eval"):
                    kill_point("eval")
                    record.metrics, record.predictions = evaluate(
                        engine, ctx.eval_batches, cfg.model.preprocess, ctx.task, cfg.data.eval.ignore_index,
                        ctx.eval_batches.class_names, desc=f"eval {variant.label}")
            if not time_first:
                _bench_stage(ctx, engine, record)
            if record.ok:
                record.details.update(engine.describe())
        if record.ok:
            record.memory_mb = mem.result()
            record.memory_mb["artifact"] = record.artifact.size_mb
            if record.details.get("engine_device_memory_bytes") is not None:  # TensorRT: activations/scratch it reserves
                record.memory_mb["engine_device"] = round(record.details["engine_device_memory_bytes"] / 2**20, 3)
    finally:
        engine.close()
    return record


def _bench_stage(ctx: RunContext, engine, record: VariantRecord) -> None:
    if record.ok and "bench" in ctx.stages:
        cfg = ctx.cfg
        with _stage(record, "bench"):
            kill_point("bench")
            record.bench = benchmark(engine, ctx.bench_inputs(), cfg.bench.batch_sizes, cfg.bench.warmup, cfg.bench.iterations,
                                     repeats=cfg.bench.repeats)


def release_build_memory() -> None:
    """Give memory freed after building (calibration statistics, exporters) back to the OS, so the next
    variants' peak RSS measures the deployed model, not what the build left in the allocator."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------------------------------------
# Assembling results, copying artifacts

def _pick_reference(cfg: RunConfig, records: list[VariantRecord]) -> Optional[str]:
    """The configured reference, else the first evaluated FP32 variant (torch preferred: it is the source model)."""
    if cfg.eval.reference:
        return cfg.eval.reference
    fp32 = [r for r in records if r.variant.precision == "fp32" and r.predictions is not None]
    ranked = [r for r in fp32 if r.variant.engine.name == "torch"] + fp32
    return ranked[0].label if ranked else None


def _deployable_name(artifact: Artifact, label: str) -> str:
    if artifact.kind in IR_KINDS:
        from qdeploy.engines.openvino_engine import ir_deploy_name

        return ir_deploy_name(artifact.kind, label)
    if artifact.kind == ArtifactKind.ONNX_FP32:
        return "model.onnx"
    if artifact.kind == ArtifactKind.ONNX_FP16:
        return "model-fp16.onnx"
    if artifact.kind == ArtifactKind.ONNX_FP16_CALIBRATED:
        return "model-fp16-calibrated.onnx"
    if artifact.kind == ArtifactKind.TRT_CALIBRATION_CACHE:
        return f"{label}.trtcache"
    if artifact.kind == ArtifactKind.QAT_CHECKPOINT:
        return f"{label}.qat-checkpoint.pt"
    if artifact.kind == ArtifactKind.TRT_ENGINE:
        return f"{label}.engine"
    return f"{label}.onnx"


def copy_artifacts(ctx: RunContext, records: list[VariantRecord], extra: Iterable[tuple[str, Artifact]] = ()) -> list[dict]:
    """Copy every deployable artifact the run built into the output folder; one entry per (variant, artifact).

    The PyTorch model is the user's input, not something qdeploy produced, so it is not copied.
    """
    placed: dict[tuple, str] = {}
    data_files: dict[tuple, list] = {}
    entries = []
    pairs = [(r.label, r.artifact) for r in records if r.artifact is not None and r.status in (*RAN_STATUSES, "failed")]
    pairs += [(r.label, a) for r in records for a in r.extra_artifacts]
    for label, art in list(pairs) + list(extra):
        for a in [art, *art.companions]:
            if a.kind == ArtifactKind.PYTORCH or a.path is None:
                continue
            key = (a.kind, a.fingerprint)
            if key not in placed:
                name = _deployable_name(a, label)
                ctx.output.path(name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(a.path, ctx.output.path(name))
                if a.kind in IR_KINDS:  # the weights travel with the IR's .xml
                    weights = str(Path(name).with_suffix(".bin"))
                    shutil.copyfile(a.path.with_suffix(".bin"), ctx.output.path(weights))
                    data_files[key] = [{"path": weights, "sha256": sha256_file(ctx.output.path(weights))}]
                elif a.kind == ArtifactKind.TRT_ENGINE:  # the portability sidecar travels with the engine
                    shutil.copyfile(a.path.with_suffix(".engine.json"), ctx.output.path(name + ".json"))
                elif a.path.suffix == ".onnx":
                    data_files[key] = _copy_external_data(a.path, ctx.output)
                placed[key] = name
            name = placed[key]
            entries.append({"variant": label, "kind": a.kind.value, "path": name, "sha256": sha256_file(ctx.output.path(name)),
                            "produced_by": a.produced_by, "inputs": list(a.inputs)})
            if data_files.get(key):  # the ONNX (or IR) loads only with these beside it
                entries[-1]["external_data"] = data_files[key]
    # a TensorRT variant's trtexec lines name its ONNX as this variant would call it; when another variant placed the same
    # artifact first, the file has that variant's name: point the lines at the file that is really in --out (likewise an
    # OpenVINO variant's deploy line)
    for r in records:
        if r.artifact is not None and isinstance(r.details.get("deploy"), str):
            provisional, final = _deployable_name(r.artifact, r.label), placed.get((r.artifact.kind, r.artifact.fingerprint))
            if final and final != provisional:
                r.details["deploy"] = r.details["deploy"].replace(repr(provisional), repr(final))
        for art in r.extra_artifacts:
            for a in [art, *art.companions]:
                provisional, final = _deployable_name(a, r.label), placed.get((a.kind, a.fingerprint))
                if final and final != provisional:
                    _rename_in_details(r.details, provisional, final)
    return entries


def _copy_external_data(path: Path, output: OutputDir) -> list[dict]:
    """The external data files of an ONNX (a model above 2 GB) copied into the output folder under the location the
    ONNX reads them by (relative to its folder); ``[{path, sha256}]``."""
    import onnx

    from qdeploy.export.onnx import external_data_files

    copied = []
    for data in external_data_files(onnx.load(str(path), load_external_data=False), path.parent):
        rel = data.relative_to(path.parent).as_posix()
        output.path(rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data, output.path(rel))
        copied.append({"path": rel, "sha256": sha256_file(output.path(rel))})
    return copied


def _rename_in_details(details: dict, old: str, new: str) -> None:
    for key in ("trtexec", "onnx"):
        section = details.get(key)
        if isinstance(section, dict):
            details[key] = {k: v.replace(f"={old}", f"={new}") if key == "trtexec" else (new if v == old else v)
                            for k, v in section.items()}


def _data_summary(batches, spec) -> dict:
    out = {"format": spec.format, "root": spec.root, "samples": batches.num_samples,
           "num_classes": getattr(batches, "num_classes", None), "class_names": batches.class_names,
           "skipped_files": list(batches.skipped)}
    boxes = getattr(getattr(batches, "dataset", None), "skipped_boxes", None)
    if boxes is not None:  # detection: boxes left out by bad_boxes: skip, one message each
        out["skipped_boxes"] = list(boxes)
    return out


def assemble_results(ctx: RunContext, records: list[VariantRecord], artifacts: list[dict]) -> dict:
    cfg = ctx.cfg
    reference = _pick_reference(cfg, records) if "eval" in ctx.stages else None
    ref_pred = next((r.predictions for r in records if r.label == reference), None)
    onnx = next((a for a in ctx.builder.built() if a.kind == ArtifactKind.ONNX_FP32), None)
    artifact_path = {(e["variant"], e["kind"]): e["path"] for e in artifacts}
    # paired statistics against the reference on the same images (evaluate.compare): with the agreement rules, they
    # decide whether an INT8 variant is degraded where there are labels; and is the reference itself above chance?
    from qdeploy.evaluate.compare import paired_changes, reference_chance

    task = cfg.model.task
    ref_record = next((r for r in records if r.label == reference), None)
    num_classes = len((ref_record.metrics or {}).get("per_class_iou") or {}) if ref_record is not None else None
    changes = paired_changes(ctx.eval_batches, task, ref_pred,
                             {r.label: r.predictions for r in records if r.predictions is not None and r.label != reference},
                             cfg.data.eval.ignore_index, num_classes) if ref_pred is not None else {}
    chance, chance_basis = reference_chance(ctx.eval_batches, ref_pred) \
        if ref_pred is not None and get_task(task).reference_chance else (None, "")
    variants = []
    for r in records:
        v = r.variant
        details = dict(r.details)
        if r.artifact is not None and (v.label, r.artifact.kind.value) in artifact_path:
            details["artifact"] = artifact_path[(v.label, r.artifact.kind.value)]
        if r.traceback:
            details["traceback"] = r.traceback
        rec = {
            "name": v.label, "engine": v.engine.name, "precision": v.precision, "status": r.status, "reason": r.reason,
            "failed_stage": r.failed_stage, "stages": {k: s.to_dict() for k, s in r.stages.items()},
            "device": r.device, "details": details, "metrics": r.metrics,
            "agreement": agreement(r.predictions, ref_pred) if r.predictions is not None and ref_pred is not None else None,
            "latency_ms": r.bench.get("latency_ms", {}), "latency_samples_ms": r.bench.get("latency_samples_ms", {}),
            "throughput_ips": r.bench.get("throughput_ips", {}), "memory_mb": r.memory_mb,
            "timings_s": {k: round(s.time_s, 4) for k, s in r.stages.items() if s.time_s is not None},
            "speed_is_deployment": v.engine.speed_is_deployment(v),
        }
        if r.label in changes:
            rec["accuracy_change"] = changes[r.label]
        note = v.engine.note(v)
        if isinstance(details.get("deploy"), str) and r.status in RAN_STATUSES:  # how to load it, in the notes
            note = (f"{note}; " if note else "") + f"load: {details['deploy']}"
        if note:
            rec["note"] = note
        if "trtexec" in details:  # TensorRT variants, built or skipped: how to build the engine by hand
            rec["trtexec"] = details["trtexec"]
        if r.artifact is not None and r.artifact.kind in (ArtifactKind.ONNX_INT8, ArtifactKind.OPENVINO_IR_INT8):
            rec["quantization"] = r.artifact.info
        if r.artifact is not None and r.artifact.kind == ArtifactKind.TRT_ENGINE:
            rec["tensorrt_engine"] = {k: r.artifact.info.get(k) for k in ("tensorrt_version", "plan", "gpu", "profiles",
                                                                          "source_onnx", "precisions", "precision_shortfall")}
        variants.append(rec)
    mark_degraded(variants, task, cfg.eval.min_agreement, cfg.report.tolerance)
    data = {"eval": _data_summary(ctx.eval_batches, cfg.data.eval)}
    if ctx.calibration is not None:
        data["calibration"] = _data_summary(ctx.calibration, cfg.data.calibration)
    results = {
        "schema": SCHEMA_VERSION,
        "qdeploy_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "stages": sorted(ctx.stages),
        "config": cfg.model_dump(mode="json"),
        "model": {
            "source": cfg.model.source, "task": cfg.model.task, "input_size": list(cfg.model.preprocess.input_size),
            "check": ctx.model_check,
            "onnx": None if onnx is None else {"path": "model.onnx", "opset": onnx.opset, "produced_by": onnx.produced_by,
                                                "size_mb": onnx.size_mb, "verify": onnx.info.get("verify"),
                                                "fingerprint": onnx.fingerprint},
        },
        "data": data,
        "environment": environment(),
        "bench": cfg.bench.model_dump(mode="json"),
        "reference": reference,
        "variants": variants,
        "artifacts": artifacts,
    }
    examples = ctx.task.examples(ctx.eval_batches, {r.label: r.predictions for r in records if r.predictions is not None},
                                 reference) if reference is not None else None
    if examples:  # detection: a few images with each variant's boxes, for the report's picture
        results["examples"] = examples
    results["recommendation"] = recommend(results, cfg.report.tolerance, cfg.report.batch_size)
    results["warnings"] = run_warnings(results, chance, chance_basis)
    return results


# ---------------------------------------------------------------------------------------------
# Entry points (run / export / quantize share open_run)

def run(
    config: Union[RunConfig, dict, str, Path],
    out_dir: Union[str, Path],
    stages: Iterable[str] = MEASURE_STAGES,
    only: Optional[Iterable[str]] = None,
    cache_dir: Optional[Path] = None,
    write: bool = True,
) -> dict:
    """Compare the config's variants; write results.json, report.md, report.html and the artifacts into ``out_dir``."""
    ctx = open_run(config, out_dir, stages, only, cache_dir)
    try:
        records = [build_variant(ctx, v) for v in ctx.variants]
        release_build_memory()
        records = [run_variant(ctx, r.variant, r) for r in records]
        artifacts = copy_artifacts(ctx, records)
        results = assemble_results(ctx, records, artifacts)
        if write:
            with open(ctx.output.path("config.yaml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(ctx.cfg.model_dump(mode="json", exclude_defaults=True), f, sort_keys=False)
            write_reports(results, ctx.output.staging)
            final = ctx.output.commit()
            print_table(results)
            log(f"wrote {final}/: results.json, report.md, report.html" + (f" and {len(artifacts)} artifact entries" if artifacts else ""))
    finally:
        ctx.output.abort()
    return results


def build(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], only: Optional[Iterable[str]] = None,
          cache_dir: Optional[Path] = None) -> dict:
    """``qdeploy build``: every variant's artifact (ONNX, Q/DQ ONNX, TensorRT engine + sidecar) into ``out_dir``, without
    evaluating or benchmarking; ``build.json`` lists each variant's status, files and, for TensorRT variants, the
    trtexec command lines (written also when TensorRT is absent and the variant is skipped)."""
    ctx = open_run(config, out_dir, stages=(), only=only, cache_dir=cache_dir)
    try:
        records, artifacts = _build_only(ctx)
        files = {}
        for a in artifacts:
            files.setdefault(a["variant"], []).append(a["path"])
        summary = {"variants": {r.label: {"status": r.status, "reason": r.reason, "failed_stage": r.failed_stage,
                                          "build": r.stages["build"].to_dict(), "files": files.get(r.label, []),
                                          **{k: r.details[k] for k in ("trtexec", "onnx", "profiles", "tensorrt") if k in r.details},
                                          **({"artifact_info": r.artifact.info} if r.artifact is not None else {})}
                            for r in records},
                   "artifacts": artifacts}
        write_json(ctx.output.path("build.json"), summary)
        final = ctx.output.commit()
        summary["out"] = str(final)
    finally:
        ctx.output.abort()
    return summary


def _build_only(ctx: RunContext) -> tuple[list[VariantRecord], list[dict]]:
    records = [build_variant(ctx, v) for v in ctx.variants]
    return records, copy_artifacts(ctx, records)


def export(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    """Export (or reuse the cached export of) the model to ONNX, verify it, copy it to ``out_dir/model.onnx``."""
    ctx = open_run(config, out_dir, stages=(), cache_dir=cache_dir, variants_filter=lambda vs: [])
    try:
        onnx = ctx.builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        shutil.copyfile(onnx.path, ctx.output.path("model.onnx"))
        summary = {"path": "model.onnx", "sha256": sha256_file(ctx.output.path("model.onnx")), "opset": onnx.opset,
                   "produced_by": onnx.produced_by, "size_mb": onnx.size_mb, "verify": onnx.info.get("verify"),
                   "fingerprint": onnx.fingerprint, "cache_hit": onnx.cache_hit}
        data = _copy_external_data(onnx.path, ctx.output)
        if data:
            summary["external_data"] = data
        write_json(ctx.output.path("export.json"), summary)
        final = ctx.output.commit()
        summary["copied_to"] = str(final / "model.onnx")
    finally:
        ctx.output.abort()
    return summary


def quantize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], only: Optional[Iterable[str]] = None,
             cache_dir: Optional[Path] = None) -> dict:
    """Build the INT8 artifacts of the config's int8 variants without evaluating or benchmarking them.

    Writes ``DIR/<variant>.onnx``, ``DIR/<variant>.trtcache`` (TensorRT calibration cache) and
    ``DIR/quantize.json`` (ranges, timings, Q/DQ structure, excluded layers, artifact list).
    """
    def int8_only(variants):
        chosen = [v for v in variants if v.precision == "int8"]
        if not chosen:
            raise QDeployError("no int8 variants to quantize: add e.g. {engine: onnxruntime, precision: int8, method: entropy}")
        return chosen

    ctx = open_run(config, out_dir, stages=(), only=only, cache_dir=cache_dir, variants_filter=int8_only)
    try:
        records, artifacts = _build_only(ctx)
        summary = {"variants": {}, "artifacts": artifacts}
        for r in records:
            entry = {"status": r.status, "reason": r.reason, "failed_stage": r.failed_stage,
                     "build": r.stages["build"].to_dict()}
            if r.artifact is not None:
                entry.update(r.artifact.info, artifact=f"{r.label}.onnx", trt_calibration_cache=f"{r.label}.trtcache")
            summary["variants"][r.label] = entry
        write_json(ctx.output.path("quantize.json"), summary)
        final = ctx.output.commit()
        summary["out"] = str(final)
    finally:
        ctx.output.abort()
    return summary


# ---------------------------------------------------------------------------------------------
# Quantization-aware training (``qdeploy qat``)

def _task_metric(batches, task: str, preprocess, ignore_index: int, predict, predictions: Optional[list] = None) -> float:
    """Top-1 (classification) or mIoU (segmentation) of ``predict`` (normalized images → logits) on ``batches``.
    ``predictions`` given: the predicted labels (classes or pixels, as uint8/int16) are appended to it."""
    task = get_task(task)
    metrics = None
    for x, y in batches:
        out = predict(normalize(x, preprocess))
        if metrics is None:
            metrics = task.make_metrics(out.shape[1], ignore_index, getattr(batches, "class_names", None), topk=(1,))
        metrics.update(out, y)
        if predictions is not None:
            predictions.append(out.argmax(1).astype(np.uint8 if out.shape[1] <= 256 else np.int32))
    r = metrics.result()
    return float(r[task.metric])


def _torch_metric(model: torch.nn.Module, batches, task: str, preprocess, device: str, ignore_index: int,
                  predictions: Optional[list] = None) -> float:
    """The task metric of a PyTorch model (the fake-quant model during QAT) on the data.eval split."""
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        value = _task_metric(batches, task, preprocess, ignore_index,
                             lambda x: model(torch.from_numpy(x).to(device)).float().cpu().numpy(), predictions)
    model.train(was_training)
    return value


def _onnx_metric(path: Path, batches, task: str, preprocess, ignore_index: int, predictions: Optional[list] = None) -> float:
    """The exported Q/DQ ONNX's metric in ONNX Runtime with exact Q/DQ semantics (how TensorRT computes it)."""
    import onnxruntime as ort

    from qdeploy.utils.ort_options import exact_qdq

    opts = exact_qdq(ort.SessionOptions())
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return _task_metric(batches, task, preprocess, ignore_index, lambda x: sess.run(None, {name: x})[0], predictions)


def _agreement(pred: list, reference: list) -> Optional[float]:
    from qdeploy.evaluate.metrics import agreement

    return agreement(np.concatenate([p.ravel() for p in pred]), np.concatenate([p.ravel() for p in reference])) \
        if pred and reference else None


def qat(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], resume: bool = False,
        cache_dir: Optional[Path] = None) -> dict:
    """``qdeploy qat``: PTQ (ModelOpt, TensorRT placement, ``qat.method``) → fine-tune → TensorRT-placement Q/DQ ONNX,
    and the ONNX Runtime-placement INT8 of the fine-tuned weights.

    Writes ``out_dir`` as a whole, like ``run`` (a staging folder swapped in at the end; an interrupted run leaves the
    previous folder as it was): ``qat.onnx`` (+ ``qat.trtcache``), ``qat-onnxruntime.onnx``, ``qat.json`` (fp32 /
    before / after on data.eval, agreement with FP32, epochs, images_per_s, artifact, the training log), ``qat.html``
    (loss and accuracy curves), and a copy of the final ``qat-checkpoint.pt`` and ``qat-log.json``. Training runs in
    ``qat_quantizer.command_folder`` (the cache, keyed by ``out_dir``; a checkpoint every epoch): ``resume`` continues
    from its checkpoint of the same model, data and QAT config.
    """
    import dataclasses

    from qdeploy.artifacts.builder import dataset_identity
    from qdeploy.config import Int8Config
    from qdeploy.errors import ConfigError
    from qdeploy.quantize.qat_quantizer import command_folder, finetune, resolve_device, train_summary
    from qdeploy.quantize.registry import QuantizeInputs
    from qdeploy.report.qat_page import write_qat_report

    t_start = time.perf_counter()
    cfg = as_config(config)
    q = cfg.qat_settings()
    task, pre = cfg.model.task, cfg.model.preprocess
    # ---- validate before anything expensive
    cfg.qat_training_data()  # ConfigError naming the missing data key
    if cfg.data.calibration is None:
        raise ConfigError("QAT starts from a PTQ calibration: add data.calibration")
    device = resolve_device(q)
    rank, world = _init_distributed(device)
    if world > 1 and device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    output = OutputDir(out_dir) if rank == 0 else None  # rank 0 alone writes; refused now, not after training
    try:
        eval_batches, calibration, builder = _qat_data_and_builder(cfg, cache_dir)
        fp32 = builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
        int8 = Int8Config(method=q.method, placement="tensorrt", quantizer="qat", residual_quantizers=q.residual_quantizers)
        inputs = QuantizeInputs(fp32_onnx=fp32.path, preprocess=pre, calibration=calibration, torch_model=builder.trainable_model,
                                check_inputs=builder.check_inputs(), opset=cfg.export.opset,
                                dynamic_batch=cfg.export.dynamic_batch, cache_dir=builder.cache_dir, memo=builder.memo)
        ignore = cfg.data.eval.ignore_index
        metric = lambda m: _torch_metric(m, eval_batches, task, pre, device, ignore)  # noqa: E731
        preds: dict[str, list] = {"fp32": [], "before": [], "after": [], "after_onnx": [], "onnxruntime": []}
        start: dict = {}

        def before_training(student, teacher) -> None:
            if rank == 0:
                start["fp32"] = _torch_metric(teacher, eval_batches, task, pre, device, ignore, preds["fp32"])
                start["before"] = _torch_metric(student, eval_batches, task, pre, device, ignore, preds["before"])
                log(f"qat: FP32 {start['fp32']:.4f}, PTQ ({q.method}) {start['before']:.4f} on data.eval; training on "
                    f"{setup.identity['count']} images, objective {q.objective}, {q.epochs:g} epoch(s), device {device}"
                    + (f", {world} processes" if world > 1 else ""))

        work = command_folder(builder.cache_dir, Path(out_dir))
        setup = dataclasses.replace(builder.qat_setup(fp32), work_dir=work, resume=resume,
                                    evaluate=metric if rank == 0 else None, before_training=before_training, device=device,
                                    rank=rank, world=world)
        t0 = time.perf_counter()
        student, info, train_log, _ = finetune(inputs, int8, setup, dataset_identity(calibration))
        if rank != 0:  # rank 0 evaluates, exports and writes; the others are done
            _finish_distributed(world)
            return {"rank": rank, "world": world}
        kill_point("eval")
        after = _torch_metric(student, eval_batches, task, pre, device, ignore, preds["after"])
        student = student.cpu().eval()
        onnx_path, result, ort_path, ort_result = _qat_artifacts(student, inputs, int8, info, output, t0)
        after_onnx = _onnx_metric(onnx_path, eval_batches, task, pre, ignore, preds["after_onnx"])
        ort_metric = _onnx_metric(ort_path, eval_batches, task, pre, ignore, preds["onnxruntime"])
        _copy_training_state(work, output)
        summary = {"fp32": start["fp32"], "before": start["before"], "after": after, "after_onnx": after_onnx,
                   "onnxruntime": {"artifact": ort_path.name, "metric": ort_metric, "method": q.method,
                                   "structure": ort_result.info.get("structure")},
                   "metric": get_task(task).metric,
                   # fraction of predictions (classes or pixels) equal to the FP32 model's, on data.eval
                   "agreement": {k: _agreement(preds[k], preds["fp32"]) for k in ("before", "after", "after_onnx", "onnxruntime")},
                   **{k: v for k, v in train_summary(train_log, work, q).items() if k in ("epochs", "images_per_s")},
                   "artifact": onnx_path.name, "trt_calibration_cache": "qat.trtcache", "objective": q.objective,
                   "method": q.method, "device": device, "train_images": setup.identity["count"], "log": train_log,
                   "qat": q.model_dump(mode="json"), "processes": world, "fingerprint": info["qat_fingerprint"],
                   "training_folder": str(work), "learned_ranges": info.get("learned_ranges"),
                   "outputs": info.get("outputs"),  # logits, or probabilities (a softmax head: losses on their log)
                   "structure": result.info.get("structure"), "lint": result.info.get("lint"),
                   "export_check": result.info.get("export_check"), "time_s": round(time.perf_counter() - t_start, 2)}
        write_json(output.path("qat.json"), summary)
        write_qat_report(summary, output.path("qat.html"), title=f"qdeploy qat: {cfg.model.source}")
        final = output.commit()
        summary["out"] = str(final)
        log(f"qat: {summary['metric']} FP32 {start['fp32']:.4f} → PTQ {start['before']:.4f} → QAT {after:.4f} (exported Q/DQ "
            f"ONNX in ONNX Runtime: {after_onnx:.4f}; ONNX Runtime placement from the fine-tuned weights: {ort_metric:.4f}); "
            f"wrote {final / onnx_path.name}, {final / ort_path.name}, {final / 'qat.json'} and {final / 'qat.html'}")
    finally:
        if output is not None:
            output.abort()
    _finish_distributed(world)
    return summary


def _qat_data_and_builder(cfg: RunConfig, cache_dir: Optional[Path]) -> tuple:
    """(eval images, calibration images, builder) of a QAT: the images decoded and checked, and a builder whose model
    can be fine-tuned (a PyTorch model, or an ONNX model onnx2torch converts; ConfigError otherwise)."""
    from qdeploy.errors import ConfigError

    task, pre = cfg.model.task, cfg.model.preprocess
    eval_batches = make_batches(cfg.data.eval, pre, task, desc="decode eval images")
    check_qat_data(cfg, eval_batches)
    calibration = make_batches(cfg.data.calibration, pre, task, desc="decode calibration images")
    builder = Builder(cfg, cache_dir, calibration,
                      check_inputs=lambda: normalize(eval_batches.first(cfg.export.verify.samples)[0], pre))
    if not builder.has_torch:
        from qdeploy.export.onnx_to_torch import onnx2torch_problem

        if onnx2torch_problem():
            raise ConfigError(f"QAT fine-tunes a PyTorch model; {cfg.model.source} is an ONNX or Keras model and "
                              f"{onnx2torch_problem()}")
    return eval_batches, calibration, builder


def _qat_artifacts(student, inputs, int8, info: dict, output: OutputDir, t0: float) -> tuple:
    """(path, result, ONNX Runtime path, its result): the fine-tuned ``student`` (on the CPU, in eval mode) exported as
    the TensorRT-placement Q/DQ ONNX ``qat.onnx``, and as ``qat-onnxruntime.onnx``, the ONNX Runtime placement's INT8
    of the same fine-tuned weights (quantizer qat, placement onnxruntime), each finished as every INT8 artifact is."""
    from qdeploy.config import Int8Config
    from qdeploy.quantize.modelopt_quantizer import export_checked
    from qdeploy.quantize.qat_quantizer import onnxruntime_artifact
    from qdeploy.quantize.registry import finish

    onnx_path = output.path("qat.onnx")
    result = finish(export_checked(student, inputs, onnx_path, dict(info, qat=True)), int8, onnx_path, "qat", t0)
    ort_cfg = Int8Config(method=int8.method, placement="onnxruntime", quantizer="qat")
    ort_path = output.path("qat-onnxruntime.onnx")
    with tempfile.TemporaryDirectory(prefix="qdeploy-qat-") as scratch:  # the float export is an intermediate
        ort_result = finish(onnxruntime_artifact(student, inputs, ort_cfg, ort_path, Path(scratch)), ort_cfg, ort_path,
                            "qat", time.perf_counter())
    return onnx_path, result, ort_path, ort_result


def _copy_training_state(work: Path, output: OutputDir) -> None:
    """The training's final state (checkpoint and log) travels with the artifacts."""
    import os

    from qdeploy.quantize.qat import CHECKPOINT, TRAIN_LOG

    for name in (CHECKPOINT, TRAIN_LOG):
        if (work / name).is_file():
            try:  # a hard link: the training folder's next checkpoint is a new file (atomic rename), this one stays
                os.link(work / name, output.path(name))
            except OSError:
                shutil.copyfile(work / name, output.path(name))


def _init_distributed(device: str) -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1): one process per GPU through NCCL, or gloo on the CPU."""
    import os

    from qdeploy.errors import ConfigError
    from qdeploy.utils.log import set_quiet

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    import torch.distributed as dist

    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if local_world > gpus:
            raise ConfigError(f"torchrun started {local_world} processes on this machine but only {gpus} GPU(s) are visible: "
                              f"use --nproc_per_node={gpus} (or qat.device: cpu)")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if rank != 0:
        set_quiet(True)
    return rank, world


def _finish_distributed(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
