"""The whole comparison: data → model artifacts → per variant (engine load → evaluate → benchmark) → report."""
from __future__ import annotations

import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from qdeploy import __version__
from qdeploy.benchmark import MemoryProbe, benchmark
from qdeploy.config import RunConfig, VariantSpec, load_config, parse_config
from qdeploy.data import make_batches, normalize
from qdeploy.engines import create_engine
from qdeploy.errors import QDeployError, VariantUnavailable
from qdeploy.evaluate import agreement, evaluate
from qdeploy.models import ModelArtifacts
from qdeploy.sysinfo import environment
from qdeploy.utils.atomic import atomic_path, ensure_writable_dir
from qdeploy.utils.log import log, warn

STAGES = ("eval", "bench")


def as_config(config: Union[RunConfig, dict, str, Path]) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return parse_config(config)
    return load_config(config)


def _select_variants(cfg: RunConfig, only: Optional[Iterable[str]]) -> list[VariantSpec]:
    if not only:
        return list(cfg.variants)
    only = list(only)
    names = [v.label for v in cfg.variants]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise QDeployError(f"--variant {', '.join(unknown)}: not in the config's variants {names}")
    return [v for v in cfg.variants if v.label in only]


def _check_reference(cfg: RunConfig, variants: list[VariantSpec]) -> None:
    if cfg.eval.reference and cfg.eval.reference not in [v.label for v in variants]:
        raise QDeployError(f"eval.reference '{cfg.eval.reference}' is not one of the variants {[v.label for v in variants]}")


def _pick_reference(cfg: RunConfig, variants: list[VariantSpec], evaluated: dict) -> Optional[str]:
    """The configured reference, else the first evaluated FP32 variant (torch preferred: it is the source model)."""
    if cfg.eval.reference:
        return cfg.eval.reference
    fp32 = [v for v in variants if v.precision == "fp32" and v.label in evaluated]
    ranked = [v for v in fp32 if v.engine == "torch"] + fp32
    return ranked[0].label if ranked else None


def _calibration_loader(cfg: RunConfig, eval_batches):
    """A memoised loader of data.calibration that refuses to calibrate on evaluation images."""
    if cfg.data.calibration is None:
        return None
    memo = {}

    def load():
        if "batches" not in memo:
            calib = make_batches(cfg.data.calibration, cfg.model.preprocess, cfg.model.task, desc="decode calibration images")
            eval_paths = {str(p) for p, _ in getattr(eval_batches.dataset, "samples", [])}
            shared = [str(p) for p, _ in getattr(calib.dataset, "samples", []) if str(p) in eval_paths]
            if shared:
                raise QDeployError(
                    f"data.calibration shares {len(shared)} images with data.eval (e.g. {shared[0]}): "
                    "calibrating on evaluation images inflates INT8 accuracy; use a disjoint folder or split"
                )
            memo["batches"] = calib
        return memo["batches"]

    return load


def _model_artifacts(cfg: RunConfig, eval_batches, cache_dir: Optional[Path]) -> ModelArtifacts:
    """The run's lazy model forms: export verification on real evaluation images, calibration on data.calibration."""
    return ModelArtifacts(
        cfg.model, cfg.export, cache_dir=cache_dir, calibration=_calibration_loader(cfg, eval_batches),
        verify_inputs=lambda: normalize(eval_batches.first(cfg.export.verify.samples)[0], cfg.model.preprocess),
    )


def run(
    config: Union[RunConfig, dict, str, Path],
    out_dir: Union[str, Path],
    stages: Iterable[str] = STAGES,
    only: Optional[Iterable[str]] = None,
    cache_dir: Optional[Path] = None,
    write: bool = True,
) -> dict:
    """Compare the config's variants; write results.json, report.md and report.html into ``out_dir``."""
    from qdeploy.report import print_table, write_reports

    cfg = as_config(config)
    stages = set(stages)
    if not cfg.eval.enabled:
        stages.discard("eval")
    if not cfg.bench.enabled:
        stages.discard("bench")
    out_dir = ensure_writable_dir(out_dir)  # fail now, not after an hour of benchmarking
    variants = _select_variants(cfg, only)
    spec = cfg.model
    task = spec.task

    batches = make_batches(cfg.data.eval, spec.preprocess, task, desc="decode eval images")
    bench_images = None

    def real_inputs(n: int) -> np.ndarray:
        return normalize(batches.first(n)[0], spec.preprocess)

    artifacts = _model_artifacts(cfg, batches, cache_dir)
    import torch

    cuda = torch.cuda.is_available()
    _check_reference(cfg, variants)
    records, predictions = [], {}
    onnx_info = None
    if any(v.engine == "onnxruntime" for v in variants):
        onnx_info = artifacts.onnx()  # export errors are user errors: fail the run loudly, not per variant

    for variant in variants:
        rec = {
            "name": variant.label, "engine": variant.engine, "precision": variant.precision, "status": "ok", "reason": None,
            "device": None, "details": {}, "metrics": {}, "agreement": None, "latency_ms": {}, "latency_samples_ms": {},
            "throughput_ips": {}, "memory_mb": {}, "timings_s": {},
        }
        records.append(rec)
        engine = create_engine(variant, artifacts)
        log(f"[bold]{variant.label}[/bold]")
        try:
            with MemoryProbe(cuda=cuda and variant.engine == "torch") as mem:
                t0 = time.perf_counter()
                engine.load()
                rec["timings_s"]["load"] = time.perf_counter() - t0
                rec["device"] = engine.device
                if "eval" in stages:
                    t0 = time.perf_counter()
                    rec["metrics"], predictions[variant.label] = evaluate(
                        engine, batches, spec.preprocess, task, cfg.data.eval.ignore_index, batches.class_names,
                        desc=f"eval {variant.label}",
                    )
                    rec["timings_s"]["eval"] = time.perf_counter() - t0
                if "bench" in stages:
                    if bench_images is None:
                        bench_images = real_inputs(max(cfg.bench.batch_sizes))
                    t0 = time.perf_counter()
                    rec.update(benchmark(engine, bench_images, cfg.bench.batch_sizes, cfg.bench.warmup, cfg.bench.iterations))
                    rec["timings_s"]["bench"] = time.perf_counter() - t0
                rec["details"] = engine.describe()
                if engine.note():
                    rec["note"] = engine.note()
                if engine.quantization():
                    rec["quantization"] = engine.quantization()
            rec["memory_mb"] = mem.result()
            path = engine.artifact_path()
            rec["memory_mb"]["artifact"] = round(Path(path).stat().st_size / 2**20, 3) if path else None
        except VariantUnavailable as e:
            rec.update(status="skipped", reason=str(e))
            warn(f"{variant.label}: skipped: {e}")
        except QDeployError:
            raise
        except Exception as e:  # one broken variant must not lose the others' results
            rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
            rec["details"]["traceback"] = traceback.format_exc(limit=8)
            warn(f"{variant.label}: failed: {type(e).__name__}: {e}")
        finally:
            engine.close()

    reference = _pick_reference(cfg, variants, predictions) if "eval" in stages else None
    ref_pred = predictions.get(reference)
    for rec in records:
        if rec["name"] in predictions and ref_pred is not None:
            rec["agreement"] = agreement(predictions[rec["name"]], ref_pred)

    results = {
        "schema": "qdeploy.results/1",
        "qdeploy_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "stages": sorted(stages),
        "config": cfg.model_dump(mode="json"),
        "model": {
            "source": spec.source, "task": task, "input_size": list(spec.preprocess.input_size),
            "onnx": onnx_info.to_dict() if onnx_info else None,
        },
        "data": {"eval": {
            "format": cfg.data.eval.format, "root": cfg.data.eval.root, "samples": batches.num_samples,
            "num_classes": getattr(batches, "num_classes", None), "class_names": batches.class_names,
        }},
        "environment": environment(),
        "bench": cfg.bench.model_dump(mode="json"),
        "reference": reference,
        "variants": records,
    }
    if write:
        if onnx_info is not None:
            with atomic_path(out_dir / "model.onnx") as tmp:  # the deployable artifact, next to its report
                tmp.write_bytes(Path(onnx_info.path).read_bytes())
        paths = write_reports(results, out_dir)
        print_table(results)
        log("wrote " + ", ".join(str(p) for p in paths.values()))
    return results


def export(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], cache_dir: Optional[Path] = None) -> dict:
    """Export (or reuse the cached export of) the model to ONNX, verify it, copy it to ``out_dir/model.onnx``."""
    from qdeploy.utils.atomic import write_json

    cfg = as_config(config)
    out_dir = ensure_writable_dir(out_dir)
    batches = make_batches(cfg.data.eval, cfg.model.preprocess, cfg.model.task, desc="decode")
    artifacts = _model_artifacts(cfg, batches, cache_dir)
    info = artifacts.onnx()
    with atomic_path(out_dir / "model.onnx") as tmp:
        tmp.write_bytes(Path(info.path).read_bytes())
    summary = info.to_dict()
    summary["copied_to"] = str(out_dir / "model.onnx")
    write_json(out_dir / "export.json", summary)
    return summary


def quantize(config: Union[RunConfig, dict, str, Path], out_dir: Union[str, Path], only: Optional[Iterable[str]] = None,
             cache_dir: Optional[Path] = None) -> dict:
    """Build the INT8 artifacts of the config's int8 variants without evaluating or benchmarking them.

    Writes ``DIR/<variant>.onnx``, ``DIR/<variant>.trtcache`` (TensorRT calibration cache) and
    ``DIR/quantize.json`` (ranges source, timings, Q/DQ structure, excluded layers).
    """
    from qdeploy.quantize import quantize_variant
    from qdeploy.export.onnx import default_cache_dir
    from qdeploy.utils.atomic import write_json

    cfg = as_config(config)
    out_dir = ensure_writable_dir(out_dir)
    variants = [v for v in _select_variants(cfg, only) if v.precision == "int8"]
    if not variants:
        raise QDeployError("no int8 variants to quantize: add e.g. {engine: onnxruntime, precision: int8, calibrator: entropy}")
    batches = make_batches(cfg.data.eval, cfg.model.preprocess, cfg.model.task, desc="decode")
    artifacts = _model_artifacts(cfg, batches, cache_dir)
    summary = {}
    for v in variants:
        art = quantize_variant(artifacts, v, artifacts.calibration, Path(cache_dir or default_cache_dir()))
        with atomic_path(out_dir / f"{v.label}.onnx") as tmp:
            tmp.write_bytes(Path(art.path).read_bytes())
        with atomic_path(out_dir / f"{v.label}.trtcache") as tmp:
            tmp.write_bytes(Path(art.info["trt_calibration_cache"]).read_bytes())
        summary[v.label] = {**art.info, "artifact": str(out_dir / f"{v.label}.onnx"), "trt_calibration_cache": str(out_dir / f"{v.label}.trtcache")}
    write_json(out_dir / "quantize.json", summary)
    return summary
