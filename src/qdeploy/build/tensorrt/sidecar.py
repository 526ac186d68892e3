"""The JSON next to every ``.engine`` and the portability guard that reads it.

A serialized TensorRT engine runs only with the TensorRT version that built it and on the GPU model it was tuned for
(same compute capability; TensorRT #4259: users find out by a crash or silently wrong speed). The sidecar records
what built it; ``portability_problem`` compares that with the machine loading it, and loading refuses (or rebuilds
from the source ONNX when it is there) instead of deserializing a foreign plan.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from qdeploy.errors import QDeployError
from qdeploy.utils.atomic import write_json

SIDECAR_FORMAT = "qdeploy.tensorrt-engine/1"


class EngineNotPortable(QDeployError):
    """The engine file was built elsewhere (another GPU or TensorRT version), or its sidecar is missing or unreadable."""


def sidecar_path(engine_path: Path) -> Path:
    return Path(engine_path).with_suffix(".engine.json")


def write_sidecar(engine_path: Path, *, tensorrt_version: str, gpu_name: str, compute_capability: str, precision: str,
                  plan: dict, profiles: list[dict], source_onnx: str, source_sha256: str, build_options: dict,
                  layers: Optional[dict] = None) -> Path:
    data = {"format": SIDECAR_FORMAT, "engine": Path(engine_path).name, "tensorrt_version": tensorrt_version,
            "gpu": {"name": gpu_name, "compute_capability": compute_capability}, "precision": precision, "plan": plan,
            "profiles": profiles, "source_onnx": {"file": source_onnx, "sha256": source_sha256},
            "build_options": build_options, "layer_precisions": layers}
    path = sidecar_path(engine_path)
    write_json(path, data)
    return path


def read_sidecar(engine_path: Path) -> dict:
    path = sidecar_path(engine_path)
    if not path.is_file():
        raise EngineNotPortable(f"engine {engine_path}: no sidecar {path.name}, so nothing says which GPU and TensorRT version "
                                "built it; rebuild it from its ONNX (qdeploy build) instead of loading it blind")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EngineNotPortable(f"engine sidecar {path} cannot be read ({e}); rebuild the engine from its ONNX") from None
    if data.get("format") != SIDECAR_FORMAT:
        raise EngineNotPortable(f"engine sidecar {path} has format {data.get('format')!r}, expected {SIDECAR_FORMAT}")
    return data


def portability_problem(sidecar: dict, tensorrt_version: str, gpu_name: str, compute_capability: str) -> Optional[str]:
    """None when this machine may load the engine, else why not (one sentence naming both sides)."""
    built = sidecar.get("tensorrt_version")
    if built != tensorrt_version:
        return f"it was built by TensorRT {built} and this machine has TensorRT {tensorrt_version}"
    gpu = sidecar.get("gpu") or {}
    if gpu.get("compute_capability") != compute_capability:
        return (f"it was built on {gpu.get('name')} (compute capability {gpu.get('compute_capability')}) and this GPU is "
                f"{gpu_name} (compute capability {compute_capability})")
    if gpu.get("name") != gpu_name:
        return f"it was tuned on {gpu.get('name')} and this GPU is {gpu_name} (same compute capability, other kernels timed)"
    return None
