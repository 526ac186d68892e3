"""Build a TensorRT engine from an ONNX file by a :class:`TrtPlan` (needs ``tensorrt``; nothing here has run yet).

Plain TensorRT calls rather than Polygraphy's ``CreateConfig``: the plan decides every flag, the TensorRT 11 path must
touch no removed name (``BuilderFlag.FP16/INT8``, ``int8_calibrator``), and plain calls give the complete list of
TensorRT names each path uses (``TRT_NAMES_USED``), which tests/test_tensorrt_build.py checks against the API
surfaces of TensorRT 10.3, 10.16 and 11.4 (../shared/tensorrt-api). That is a check of names and signatures only.

What ran where: the build is untested against a real TensorRT (docs/tensorrt.md keeps that list).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from qdeploy.artifacts.tensorrt.profiles import InputProfile
from qdeploy.errors import QDeployError
from qdeploy.facts.tensorrt import NAMES_USED, PATH_VERSIONS, TrtPlan
from qdeploy.lint.tensorrt_confirm import parse_engine_information
from qdeploy.utils.atomic import atomic_path


# every TensorRT name each build path touches (declared with the other TensorRT facts)
TRT_NAMES_USED = NAMES_USED["engine_build"]


class TrtBuildError(QDeployError):
    """TensorRT could not parse or build the model (the message carries the parser's errors or the builder's reason)."""


def _parser_errors(parser) -> str:
    errors = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        errors.append(f"node {e.node_name() or '?'} ({e.node_operator() or '?'}): {e.desc()}")
    return "; ".join(errors) or "no error reported"


def build_engine(onnx_path: Path, engine_path: Path, plan: TrtPlan, profiles: list[InputProfile], *,
                 workspace_mib: Optional[int] = None, optimization_level: Optional[int] = None,
                 timing_cache: Optional[Path] = None, calibration_cache: Optional[Path] = None,
                 layer_info: Optional[Path] = None) -> dict:
    """Parse, build and serialize; returns {"layers": parsed inspector layers, "device_memory_bytes", ...}."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = (1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)) if plan.strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise TrtBuildError(f"TensorRT {trt.__version__}'s ONNX parser rejected {onnx_path}: {_parser_errors(parser)}")
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
    if optimization_level is not None:
        config.builder_optimization_level = int(optimization_level)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the inspector's per-layer precisions
    for flag in plan.builder_flags:  # 10.x only: the 11.x plans carry none (BuilderFlag.FP16/INT8 are gone there)
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if plan.calibration_cache:
        if calibration_cache is None or not Path(calibration_cache).is_file():
            raise TrtBuildError(f"legacy INT8 needs the TensorRT calibration cache; {calibration_cache} does not exist")
        config.int8_calibrator = _cache_calibrator(trt, Path(calibration_cache).read_bytes())
    if profiles:
        profile = builder.create_optimization_profile()
        for p in profiles:
            profile.set_shape(p.name, p.min, p.opt, p.max)
        config.add_optimization_profile(profile)
    cache_bytes = Path(timing_cache).read_bytes() if timing_cache is not None and Path(timing_cache).is_file() else b""
    config.set_timing_cache(config.create_timing_cache(cache_bytes), False)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        hint = f" (a workspace limit of {workspace_mib} MiB may be too small)" if workspace_mib else ""
        raise TrtBuildError(f"TensorRT {trt.__version__} could not build {onnx_path} ({plan.summary}); "
                            f"its log above says why{hint}")
    with atomic_path(Path(engine_path)) as tmp:
        Path(tmp).write_bytes(bytes(serialized))
    if timing_cache is not None:  # reused by the next build (same GPU and TensorRT version)
        with atomic_path(Path(timing_cache)) as tmp:
            Path(tmp).write_bytes(bytes(config.get_timing_cache().serialize()))
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    text = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    if layer_info is not None:
        with atomic_path(Path(layer_info)) as tmp:
            Path(tmp).write_text(text)
    layers = parse_engine_information(text)
    return {"layers": layers, "precisions": layer_precisions(layers), "tensorrt_version": str(trt.__version__)}


def _cache_calibrator(trt, cache: bytes):
    """A calibrator that serves an existing calibration cache and no batches (TensorRT 10.x legacy INT8 only)."""

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):
        def __init__(self):
            super().__init__()

        def get_batch_size(self):
            return 1

        def get_batch(self, names):
            return None  # no images: the ranges come from the cache

        def read_calibration_cache(self):
            return cache

        def write_calibration_cache(self, data):
            return None

    return CacheCalibrator()


# ---------------------------------------------------------------------------------------------
# No silent precision: what the inspector says each layer computes in

COMPUTE_TYPES = ("Convolution", "CaskConvolution", "Gemm", "MatrixMultiply", "FullyConnected", "Deconvolution", "CaskGemmConvolution")


def _is_compute(layer: dict) -> bool:
    t = str(layer.get("type") or "")
    return any(c.lower() in t.lower() for c in COMPUTE_TYPES)


def layer_precisions(layers: list[dict]) -> dict:
    """Compute layers (convs, GEMMs) counted by the precision of their output: {"INT8": n, "FP16": n, "FP32": n, ...,
    "layers": {precision: [names]}}. Precision names as the report uses them."""
    rename = {"Int8": "INT8", "Half": "FP16", "Float": "FP32", "BF16": "BF16", "FP8": "FP8"}
    counts: dict = {}
    names: dict = {}
    for layer in layers:
        if not _is_compute(layer):
            continue
        prec = rename.get((layer.get("output_precisions") or ["Unknown"])[0], "other")
        counts[prec] = counts.get(prec, 0) + 1
        names.setdefault(prec, []).append(layer.get("name"))
    return {**counts, "compute_layers": sum(counts.values()), "layers": names}


def precision_shortfall(requested: str, precisions: dict, min_share: float = 0.5) -> Optional[str]:
    """A sentence when a build asked for FP16 or INT8 but most compute layers run FP32 (rf-detr #1453), else None."""
    total = precisions.get("compute_layers") or 0
    if requested not in ("fp16", "int8") or total == 0:
        return None
    wanted = {"fp16": ("FP16",), "int8": ("INT8",)}[requested]
    got = sum(precisions.get(p, 0) for p in wanted)
    fp32 = precisions.get("FP32", 0)
    if fp32 / total > min_share:
        return (f"asked for {requested.upper()} but {fp32} of {total} compute layers run in FP32 "
                f"(only {got} in {'/'.join(wanted)}): the engine is mostly FP32")
    return None


__all__ = ["TRT_NAMES_USED", "PATH_VERSIONS", "TrtBuildError", "build_engine", "layer_precisions", "precision_shortfall"]
