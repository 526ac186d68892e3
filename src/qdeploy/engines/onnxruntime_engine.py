"""ONNX Runtime engine: CPU execution provider, CUDA execution provider when the installed build has it."""
from __future__ import annotations

import os
from typing import Callable, Literal, Optional

import numpy as np
import onnxruntime as ort
from pydantic import BaseModel, ConfigDict, Field

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.engines.base import Engine, Variant, register_engine
from qdeploy.errors import VariantUnavailable
from qdeploy.utils.ort_options import exact_qdq

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
_ARTIFACTS = {"fp32": ArtifactKind.ONNX_FP32, "fp16": ArtifactKind.ONNX_FP16, "int8": ArtifactKind.ONNX_INT8}


class OnnxRuntimeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    providers: Optional[list[str]] = Field(None, json_schema_extra={"label": "providers"})
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field("all", json_schema_extra={"label": "opt"})


def resolve_providers(requested_device: str, precision: str, explicit: list[str] | None) -> list[str]:
    available = ort.get_available_providers()
    if explicit:
        missing = [p for p in explicit if p not in available]
        if missing:
            raise VariantUnavailable(f"ONNX Runtime providers {missing} are not in this build (available: {available})")
        providers = list(explicit)
    elif requested_device == "cuda" or (requested_device == "auto" and "CUDAExecutionProvider" in available):
        if "CUDAExecutionProvider" not in available:
            raise VariantUnavailable(f"device 'cuda' needs onnxruntime-gpu; this onnxruntime has only {available}")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    if precision == "fp16" and providers[0] == "CPUExecutionProvider":
        raise VariantUnavailable(f"FP16 in ONNX Runtime needs a GPU execution provider (CUDA); this build has {available}")
    return providers


@register_engine
class OnnxRuntimeEngine(Engine):
    name = "onnxruntime"
    description = "ONNX Runtime InferenceSession on the built ONNX (FP32, FP16 or INT8 Q/DQ)"
    Options = OnnxRuntimeOptions
    precisions = ("fp32", "fp16", "int8")
    devices = ("cpu", "cuda")

    @classmethod
    def probe(cls) -> list[dict]:
        providers = ort.get_available_providers()
        has_cuda_ep = "CUDAExecutionProvider" in providers
        return [
            {"engine": cls.name, "device": "cpu", "precisions": ["fp32", "int8"], "usable": True,
             "note": f"onnxruntime {ort.__version__}; int8: ONNX Runtime-placement Q/DQ runs INT8 kernels, "
                     "TensorRT-placement Q/DQ is simulated"},
            {"engine": cls.name, "device": "cuda", "precisions": ["fp32", "fp16", "int8"], "usable": has_cuda_ep,
             "note": "CUDAExecutionProvider" if has_cuda_ep else f"this onnxruntime build has only {providers} (install onnxruntime-gpu)"},
        ]

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        resolve_providers(variant.device, variant.precision, variant.options.providers)

    @classmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest:
        return ArtifactRequest(_ARTIFACTS[variant.precision], variant.int8)

    @classmethod
    def speed_is_deployment(cls, variant: Variant) -> bool:
        # a TensorRT-placement Q/DQ graph is meant for TensorRT; ONNX Runtime runs it mostly in float
        return not (variant.int8 is not None and variant.int8.placement == "tensorrt")

    @classmethod
    def note(cls, variant: Variant) -> Optional[str]:
        if variant.int8 is not None and variant.int8.placement == "tensorrt":
            return "TensorRT Q/DQ artifact: INT8 accuracy simulated in ONNX Runtime with exact Q/DQ semantics (TensorRT not run); speed is ONNX Runtime's, not TensorRT's"
        if variant.int8 is not None:
            return "ONNX Runtime-placement INT8 (uint8 activations, per-channel int8 weights)"
        return None

    def load(self) -> None:
        v = self.variant
        self.providers = resolve_providers(v.device, v.precision, self.options.providers)
        self.device = "cuda" if self.providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[self.options.graph_optimization])
        if v.threads:
            opts.intra_op_num_threads = v.threads
        if v.int8 is not None and v.int8.placement == "tensorrt":
            exact_qdq(opts)  # simulate TensorRT's Q/DQ semantics, not ONNX Runtime's fused int8 kernels
        self.session = ort.InferenceSession(str(self.artifact.path), opts, providers=self.providers)
        self.input_name = self.session.get_inputs()[0].name
        self.threads = v.threads or os.cpu_count()  # ORT's default: one intra-op thread per core

    def infer(self, batch: np.ndarray) -> np.ndarray:
        out = self.session.run(None, {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)})[0]
        return out.astype(np.float32, copy=False)

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        if self.device == "cuda":
            # keep input and output on the GPU so the timing covers the model, not PCIe copies
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(self.input_name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
            binding.bind_output(self.session.get_outputs()[0].name, "cuda", 0)
            session = self.session

            def step():
                session.run_with_iobinding(binding)

            return step
        session, feed = self.session, {self.input_name: x}
        return lambda: session.run(None, feed)

    def describe(self) -> dict:
        return {
            "device": self.device,
            "providers": self.session.get_providers(),
            "threads": self.threads if self.device == "cpu" else None,
            "graph_optimization": self.options.graph_optimization,
            "qdq": "exact Q/DQ (session.disable_quant_qdq)" if self.variant.int8 is not None and self.variant.int8.placement == "tensorrt" else None,
            "artifact": self.artifact.kind.value,
            "opset": self.artifact.opset,
            "onnxruntime": ort.__version__,
        }

    def close(self) -> None:
        self.session = None
