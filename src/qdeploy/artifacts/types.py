"""Typed artifacts: what the build stage produces and engines load.

An artifact is identified by its kind and a fingerprint of everything it was made from (model
weights and code, export options, quantization settings, calibration images, library versions),
so a cache entry is reused only when nothing that shapes it has changed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from qdeploy.config import Int8Config


class ArtifactKind(str, Enum):
    PYTORCH = "pytorch"                 # the FP32 nn.Module (its weights file, if any, is the deployable)
    ONNX_FP32 = "onnx-fp32"
    ONNX_FP16 = "onnx-fp16"             # FP16 weights/compute, FP32 inputs and outputs kept
    ONNX_FP16_CALIBRATED = "onnx-fp16-calibrated"  # FP16, FP32 only where calibration activations overflow (TensorRT 11)
    ONNX_INT8 = "onnx-int8"             # Q/DQ ONNX by a named quantizer, in a named placement style
    TRT_CALIBRATION_CACHE = "tensorrt-calibration-cache"  # companion of every ONNX_INT8
    TRT_ENGINE = "tensorrt-engine"      # a serialized TensorRT engine (+ .engine.json sidecar) for one GPU and TensorRT version
    QAT_CHECKPOINT = "qat-checkpoint"   # companion of a QAT ONNX_INT8: fine-tuned weights + optimizer + training log
    OPENVINO_IR = "openvino-ir"         # OpenVINO IR (model.xml + model.bin) of the FP32 model, FP32 weights
    OPENVINO_IR_INT8 = "openvino-ir-int8"  # OpenVINO IR quantized by NNCF's OpenVINO backend (placement openvino)


IR_KINDS = (ArtifactKind.OPENVINO_IR, ArtifactKind.OPENVINO_IR_INT8)


@dataclass(frozen=True)
class ArtifactRequest:
    """What a variant needs built: a kind, plus the INT8 settings for ONNX_INT8."""

    kind: ArtifactKind
    int8: Optional[Int8Config] = None
    options: Optional[str] = None       # TRT_ENGINE: the build options as sorted JSON

    def key(self) -> str:
        return self.kind.value + ("" if self.int8 is None else ":" + self.int8.model_dump_json()) + \
            ("" if self.options is None else ":" + self.options)


@dataclass
class Artifact:
    kind: ArtifactKind
    fingerprint: str
    produced_by: str                            # e.g. "export (torchscript)", "quantizer modelopt (entropy)"
    inputs: list[str] = field(default_factory=list)   # what it was built from: "<kind>:<fingerprint[:12]>", data sets
    path: Optional[Path] = None                 # the file (in the cache); None for an in-memory model without weights file
    module: Any = None                          # PYTORCH: the nn.Module
    input_name: str = "input"
    output_name: str = "output"
    opset: Optional[int] = None
    info: dict = field(default_factory=dict)    # export verification, quantization details and structure
    companions: list["Artifact"] = field(default_factory=list)  # e.g. the TensorRT calibration cache
    cache_hit: bool = False

    @property
    def ref(self) -> str:
        return f"{self.kind.value}:{self.fingerprint[:12]}"

    @property
    def files(self) -> list[Path]:
        """The files the artifact consists of: its path, and an OpenVINO IR's .bin beside its .xml."""
        if self.path is None:
            return []
        return [self.path, self.path.with_suffix(".bin")] if self.kind in IR_KINDS else [self.path]

    @property
    def size_mb(self) -> Optional[float]:
        files = [f for f in self.files if f.is_file()]
        return round(sum(f.stat().st_size for f in files) / 2**20, 3) if files else None
