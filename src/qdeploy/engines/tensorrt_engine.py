"""TensorRT engine: runs a ``.engine`` the build stage made; skipped with the reason where
TensorRT or a CUDA GPU is missing, and then still records the trtexec command lines and writes the ONNX they use.

Runner: ``execute_async_v3`` with tensors bound by address (PyTorch CUDA tensors as the buffers, no pycuda), optional
CUDA-graph capture. Its TensorRT names are in ``TRT_NAMES_USED`` (conformance-checked against 10.3/10.16/11.4 in
tests/test_tensorrt_build.py). Nothing in this module has run against a real TensorRT yet (docs/tensorrt.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.artifacts.tensorrt import trtexec_command
from qdeploy.engines.base import CudaTimer, Engine, Variant, register_engine
from qdeploy.errors import QDeployError, VariantUnavailable
from qdeploy.facts.tensorrt import (NAMES_USED, REFERENCE_VERSIONS, SUPPORTED_MAJORS, TrtUnsupported, plan_build,
                                    tensorrt_version)

TRT_NAMES_USED = NAMES_USED["runner"]["common"]  # the runner's TensorRT names (declared with the other TensorRT facts)


class TensorRTOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workspace_mib: Optional[int] = Field(None, gt=0, description="workspace memory-pool limit (MiB)",
                                         json_schema_extra={"label": "ws"})
    optimization_level: Optional[int] = Field(None, ge=0, le=5, description="builder optimization level (TensorRT's default 3)",
                                              json_schema_extra={"label": "opt"})
    timing_cache: bool = Field(True, description="reuse a timing cache across builds (per GPU and TensorRT version)")
    profiles: Optional[list[dict]] = Field(None, description="[{input, min, opt, max}]; default: from bench.batch_sizes "
                                                             "and model.preprocess.input_size")
    int8_mode: Literal["qdq", "calibration-cache"] = Field(
        "qdq", description="qdq: the TensorRT-placement Q/DQ ONNX; calibration-cache: the plain ONNX + the TensorRT "
                           "calibration cache (TensorRT 10.x only)", json_schema_extra={"label": "int8"})
    cuda_graphs: bool = Field(False, description="capture one execute_async_v3 in a CUDA graph and replay it",
                              json_schema_extra={"label": "graphs"})

    @field_validator("profiles")
    @classmethod
    def _valid_profiles(cls, v):
        if v is not None:
            from qdeploy.artifacts.tensorrt import explicit_profiles
            from qdeploy.errors import ConfigError

            try:
                explicit_profiles(v)
            except ConfigError as e:  # pydantic reports it with the variant's key path
                raise ValueError(str(e)) from None
        return v


def source_request(variant: Variant, major: int) -> ArtifactRequest:
    """The ONNX artifact the TensorRT build parses (also written to --out when TensorRT is absent)."""
    plan = plan_build(REFERENCE_VERSIONS.get(major, f"{major}.0.0"), variant.precision, variant.options.int8_mode)
    if plan.onnx == "qdq":
        int8 = (variant.int8 or _default_int8()).model_copy(update={"placement": "tensorrt"})
        return ArtifactRequest(ArtifactKind.ONNX_INT8, int8)
    if plan.calibration_cache:
        # the cache must name the FP32 ONNX's tensors: the onnx quantizer's ranges are keyed by them (ModelOpt's
        # export renames tensors), so the legacy path's cache comes from quantizer onnx
        int8 = (variant.int8 or _default_int8()).model_copy(update={"placement": "tensorrt", "quantizer": "onnx"})
        return ArtifactRequest(ArtifactKind.ONNX_INT8, int8)
    return ArtifactRequest(ArtifactKind.ONNX_FP16_CALIBRATED if plan.onnx == "fp16" else ArtifactKind.ONNX_FP32)


def _default_int8():
    from qdeploy.config import Int8Config

    return Int8Config(placement="tensorrt")


def trtexec_lines(variant: Variant, onnx_names: dict, profiles: list, installed: Optional[str],
                  cache_names: Optional[dict] = None) -> dict:
    """{major: command} for the installed major, or for every supported major when TensorRT is absent."""
    versions = [installed] if installed else [REFERENCE_VERSIONS[m] for m in SUPPORTED_MAJORS]
    out = {}
    o = variant.options
    for version in versions:
        major = int(version.split(".")[0])
        try:
            plan = plan_build(version, variant.precision, o.int8_mode)
        except TrtUnsupported as e:
            out[f"{major}.x"] = f"not possible: {e}"
            continue
        onnx = onnx_names.get(major, "model.onnx")
        out[f"{major}.x"] = trtexec_command(plan, onnx, f"{variant.label}.engine", profiles, o.workspace_mib,
                                            o.optimization_level, "timing.cache" if o.timing_cache else None,
                                            (cache_names or {}).get(major), f"{variant.label}.layers.json")
    return out


def reproduction(variant: Variant, builder, name_of: Callable) -> tuple[list, dict]:
    """What a user needs to build the engine by hand: the source ONNX artifacts (built now, written to --out even when
    the variant is skipped) and {"trtexec": {major: command}, "onnx": {major: file}} for the installed major, or for
    every supported major without TensorRT. ``name_of(artifact)`` is the file name the run gives it in --out."""
    version = tensorrt_version()
    installed = version if version is not None and int(version.split(".")[0]) in SUPPORTED_MAJORS else None
    majors = [int(installed.split(".")[0])] if installed else list(SUPPORTED_MAJORS)
    artifacts, names, caches, problems = [], {}, {}, {}
    for major in majors:
        try:
            request = source_request(variant, major)
            plan = plan_build(REFERENCE_VERSIONS.get(major, f"{major}.0.0"), variant.precision, variant.options.int8_mode)
        except TrtUnsupported:
            continue
        try:
            art = builder.build(request)
        except QDeployError as e:  # e.g. no data.calibration for 11.x's FP16 ONNX: that major's line says so
            problems[major] = str(e)
            continue
        artifacts.append(art)
        if plan.calibration_cache:  # the FP32 ONNX is parsed; the Q/DQ artifact's TensorRT cache gives the ranges
            cache = next(c for c in art.companions if c.kind == ArtifactKind.TRT_CALIBRATION_CACHE)
            caches[major] = name_of(cache)
            art = builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
            artifacts.append(art)
        names[major] = name_of(art)
    unique = {(a.kind, a.fingerprint): a for a in artifacts}  # 10.x and 11.x often parse the same ONNX
    artifacts = list(unique.values())
    input_name = artifacts[0].input_name if artifacts else "input"
    profiles = builder.trt_profiles(input_name, variant.options.profiles)
    lines = trtexec_lines(variant, names, profiles, installed, caches)
    for major, problem in problems.items():
        lines[f"{major}.x"] = f"not possible: {problem}"
    out = {"trtexec": lines, "onnx": {f"{m}.x": n for m, n in names.items()},
           "profiles": [p.to_json() for p in profiles],
           "tensorrt": installed or "not installed: one command line per supported major version"}
    spec = getattr(builder, "spec", None)
    if getattr(spec, "decode", None):  # a detector: where its NMS runs
        nms, cut = spec.nms, ""
        if spec.decode == "onnx-nms":  # the model's own NMS node was cut off; its settings are what runs on the host
            from qdeploy.tasks.detection import graph_nms_settings

            nms = graph_nms_settings(spec)[1]
            cut = " (the model's own NMS node is not in this engine: qdeploy cut the graph before it)"
        out["postprocess"] = (f"the engine ends at the raw head output{cut}; decoding ({spec.decode}) and "
                              f"{'class-agnostic' if nms.class_agnostic else 'class-wise'} NMS "
                              f"(IoU {nms.iou_threshold:g}, score >= {nms.score_threshold:g}, {nms.max_detections} per "
                              "image) run after it on the host, as qdeploy evaluated them: no NMS plugin in the engine "
                              "(TensorRT's EfficientNMS_TRT would move NMS into it; not added, so the accuracy measured "
                              "is the engine's)")
    return artifacts, out


def deserialize_engine(path: Path, source_onnx: Optional[str], runtime=None):
    """The ``ICudaEngine`` in ``path``, or VariantUnavailable naming the file and the ONNX to rebuild it from when the
    file is missing or TensorRT cannot deserialize it (it returns None for a corrupt plan or one from another
    TensorRT version). ``runtime``: a ``trt.Runtime`` the caller keeps alive with the engine; one is made if None."""
    path = Path(path)
    rebuild = f"rebuild it from {source_onnx or 'its source ONNX'} (qdeploy build)"
    if not path.is_file():
        raise VariantUnavailable(f"TensorRT engine {path} does not exist; {rebuild}")
    import tensorrt as trt

    if runtime is None:
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    try:
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    except Exception as e:  # some bindings raise instead of returning None: the same refusal, not a crash
        raise VariantUnavailable(f"TensorRT {tensorrt_version()} could not deserialize {path} ({type(e).__name__}: {e}); "
                                 f"{rebuild}") from None
    if engine is None:
        raise VariantUnavailable(f"TensorRT {tensorrt_version()} could not deserialize {path} (corrupt, or built by "
                                 f"another TensorRT version; its log above says which); {rebuild}")
    return engine


@register_engine
class TensorRTEngine(Engine):
    name = "tensorrt"
    description = "TensorRT engine built from qdeploy's ONNX / Q/DQ ONNX (10.x: precision flags; 11.x: strongly typed)"
    Options = TensorRTOptions
    precisions = ("fp32", "fp16", "int8")
    devices = ("cuda",)

    @classmethod
    def probe(cls) -> list[dict]:
        version = tensorrt_version()
        gpu = torch.cuda.is_available()
        if version is None:
            note = ("TensorRT is not installed (pip install 'qdeploy[tensorrt]' where NVIDIA's index is reachable): tensorrt "
                    "variants are skipped, their trtexec lines and ONNX files are still written")
        elif int(version.split(".")[0]) not in SUPPORTED_MAJORS:
            note = f"TensorRT {version} is installed; qdeploy builds with 10.x and 11.x only"
        else:
            note = f"TensorRT {version}: " + ("precision by builder flags (10.x)" if version.startswith("10.") else
                                             "strongly typed networks only (11.x): FP16 = FP16 ONNX, INT8 = Q/DQ ONNX")
        usable = version is not None and gpu and int(version.split(".")[0]) in SUPPORTED_MAJORS
        if version is not None and not gpu:
            note += "; no CUDA GPU visible"
        return [{"engine": cls.name, "device": "cuda", "precisions": list(cls.precisions), "usable": usable, "note": note}]

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        version = tensorrt_version()
        if version is None:
            raise VariantUnavailable("TensorRT is not installed (pip install 'qdeploy[tensorrt]'); the trtexec command "
                                     "lines and the ONNX they use are in results.json and --out")
        if not torch.cuda.is_available():
            raise VariantUnavailable(f"TensorRT {version} is installed but no CUDA GPU is visible")
        try:
            plan_build(version, variant.precision, variant.options.int8_mode)
        except TrtUnsupported as e:
            raise VariantUnavailable(str(e)) from None

    @classmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest:
        version = tensorrt_version() or REFERENCE_VERSIONS[max(SUPPORTED_MAJORS)]
        source = source_request(variant, int(version.split(".")[0]))
        opts = variant.options.model_dump(mode="json")
        return ArtifactRequest(ArtifactKind.TRT_ENGINE, source.int8,
                               options=json.dumps({"precision": variant.precision, "source": source.kind.value, **opts},
                                                  sort_keys=True))

    @classmethod
    def note(cls, variant: Variant) -> Optional[str]:
        return None

    # ---------------------------------------------------------------- running a built engine
    def load(self) -> None:
        import tensorrt as trt

        self.device = "cuda"
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))  # kept as long as the engine
        self.engine = deserialize_engine(self.artifact.path, self.artifact.info.get("source_onnx"), self.runtime)
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.stream = torch.cuda.Stream()
        self.graph = None

    def _bind(self, x: torch.Tensor) -> torch.Tensor:
        name = self.inputs[0]
        self.context.set_input_shape(name, tuple(x.shape))
        self.context.set_tensor_address(name, x.data_ptr())
        shape = tuple(self.context.get_tensor_shape(self.outputs[0]))
        out = torch.empty(shape, dtype=torch.float32, device="cuda")
        self.context.set_tensor_address(self.outputs[0], out.data_ptr())
        return out

    def infer(self, batch: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).cuda()
        out = self._bind(x)
        with torch.cuda.stream(self.stream):
            self.context.execute_async_v3(self.stream.cuda_stream)
        self.stream.synchronize()
        return out.cpu().numpy()

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        self._x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).cuda()
        self._out = self._bind(self._x)
        ctx, stream = self.context, self.stream
        if self.options.cuda_graphs:
            ctx.execute_async_v3(stream.cuda_stream)  # one run before capture (TensorRT allocates lazily)
            stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                ctx.execute_async_v3(stream.cuda_stream)
            graph = self.graph
            return graph.replay

        def step():
            ctx.execute_async_v3(stream.cuda_stream)
        return step

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def timer(self) -> Optional[CudaTimer]:
        return CudaTimer()

    def describe(self) -> dict:
        info = self.artifact.info
        return {"device": "cuda", "tensorrt": info.get("tensorrt_version"), "plan": info.get("plan"),
                "engine_device_memory_bytes": int(self.engine.device_memory_size_v2),
                "engine_file_mb": self.artifact.size_mb, "cuda_graphs": self.options.cuda_graphs,
                "layer_precisions": {k: v for k, v in (info.get("precisions") or {}).items() if k != "layers"}}

    def close(self) -> None:
        self.graph = self.context = self.engine = self.runtime = None
