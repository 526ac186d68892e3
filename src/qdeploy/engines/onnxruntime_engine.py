"""ONNX Runtime engine: CPU execution provider, CUDA execution provider when the installed build has it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from qdeploy.engines.base import Engine, register_engine
from qdeploy.errors import VariantUnavailable

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def resolve_providers(requested_device: str, precision: str, explicit: list[str] | None) -> list[str]:
    import onnxruntime as ort

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
    if precision in ("fp16", "bf16") and providers[0] == "CPUExecutionProvider":
        raise VariantUnavailable(
            f"{precision.upper()} in ONNX Runtime needs a GPU execution provider (CUDA); this build has {available}"
        )
    if precision == "bf16":
        raise VariantUnavailable("BF16 is not offered for ONNX Runtime (no standard BF16 conversion for its CUDA EP); use fp16")
    return providers


@register_engine("onnxruntime")
class OnnxRuntimeEngine(Engine):
    def load(self) -> None:
        import onnxruntime as ort

        v = self.variant
        self.providers = resolve_providers(v.device, v.precision, v.providers)
        self.device = "cuda" if self.providers[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        artifact = self.artifacts.onnx()
        if v.precision == "fp16":
            from qdeploy.export.onnx import convert_fp16

            artifact = self.artifacts.derived("onnx-fp16", lambda: convert_fp16(artifact))
        elif v.precision == "int8":
            from qdeploy.export.onnx import default_cache_dir
            from qdeploy.quantize import quantize_variant

            cache_dir = Path(self.artifacts.cache_dir or default_cache_dir())
            artifact = quantize_variant(self.artifacts, v, self.artifacts.calibration, cache_dir)
        self.artifact = artifact
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[v.graph_optimization])
        if v.threads:
            opts.intra_op_num_threads = v.threads
        self.session = ort.InferenceSession(str(artifact.path), opts, providers=self.providers)
        self.input_name = self.session.get_inputs()[0].name
        self.threads = v.threads or os.cpu_count()  # ORT's default: one intra-op thread per core

    def infer(self, batch: np.ndarray) -> np.ndarray:
        out = self.session.run(None, {self.input_name: np.ascontiguousarray(batch, dtype=np.float32)})[0]
        return out.astype(np.float32, copy=False)

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        if self.device == "cuda":
            import onnxruntime as ort

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
        import onnxruntime as ort

        return {
            "device": self.device,
            "providers": self.session.get_providers(),
            "threads": self.threads if self.device == "cpu" else None,
            "graph_optimization": self.variant.graph_optimization,
            "onnx": str(self.artifact.path),
            "opset": self.artifact.opset,
            "onnxruntime": ort.__version__,
        }

    def note(self):
        if self.variant.precision == "int8" and self.variant.target == "tensorrt":
            return "TensorRT Q/DQ artifact: INT8 accuracy simulated in ONNX Runtime (TensorRT not run); speed is ONNX Runtime's, not TensorRT's"
        if self.variant.precision == "int8":
            return "ONNX Runtime-targeted INT8 (uint8 activations, per-channel int8 weights)"
        return None

    def quantization(self):
        return getattr(self.artifact, "info", None) or None

    def artifact_path(self):
        return str(self.artifact.path)

    def close(self) -> None:
        self.session = None
