"""The JSON next to every ``.engine`` and the portability and integrity guard that reads it.

A serialized TensorRT engine runs only with the TensorRT version that built it and on the GPU model it was tuned for
(same compute capability; TensorRT #4259: users find out by a crash or silently wrong speed). The sidecar records
what built it and the engine file's size and sha256; ``engine_problem`` checks the file against that (a truncated or
changed engine is caught without TensorRT) and ``portability_problem`` compares the builder with the machine loading
it, and loading refuses (or rebuilds from the source ONNX when it is there) instead of deserializing a foreign or
damaged plan.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from qdeploy.errors import QDeployError
from qdeploy.utils.atomic import write_json
from qdeploy.utils.hashing import sha256_file

SIDECAR_FORMAT = "qdeploy.tensorrt-engine/2"  # /2: the engine file's sha256 and size ("engine_file")


class EngineNotPortable(QDeployError):
    """The engine file was built elsewhere (another GPU or TensorRT version), or its sidecar is missing or unreadable."""


def sidecar_path(engine_path: Path) -> Path:
    return Path(engine_path).with_suffix(".engine.json")


def write_sidecar(engine_path: Path, *, tensorrt_version: str, gpu_name: str, compute_capability: str, precision: str,
                  plan: dict, profiles: list[dict], source_onnx: str, source_sha256: str, build_options: dict,
                  layers: Optional[dict] = None) -> Path:
    """Write ``<engine>.engine.json`` beside an engine file that already exists (its size and sha256 are recorded)."""
    engine_path = Path(engine_path)
    data = {"format": SIDECAR_FORMAT, "engine": engine_path.name,
            "engine_file": {"sha256": sha256_file(engine_path), "bytes": engine_path.stat().st_size},
            "tensorrt_version": tensorrt_version,
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


def engine_problem(engine_path: Path, tensorrt_version: str, gpu_name: str, compute_capability: str) -> Optional[str]:
    """None when this machine may load ``engine_path``, else one sentence naming the file and why not: the engine or
    its sidecar is missing or unreadable, the file differs from what the sidecar recorded at build time (truncated,
    corrupt or replaced), or it was built by another TensorRT version or on another GPU. Needs no TensorRT."""
    engine_path = Path(engine_path)
    if not engine_path.is_file():
        return f"engine {engine_path} does not exist; rebuild it from its ONNX (qdeploy build)"
    try:
        sidecar = read_sidecar(engine_path)
    except EngineNotPortable as e:
        return str(e)
    source = (sidecar.get("source_onnx") or {}).get("file") or "its ONNX"
    rebuild = f"rebuild it from the source ONNX {source} (qdeploy build)"
    recorded = sidecar.get("engine_file") or {}
    if not recorded.get("sha256") or recorded.get("bytes") is None:
        return (f"engine {engine_path}: its sidecar {sidecar_path(engine_path).name} records no size and sha256, so a "
                f"corrupt file cannot be told apart; {rebuild}")
    size = engine_path.stat().st_size
    if size != recorded["bytes"]:
        how = "truncated" if size < recorded["bytes"] else "longer than built"
        return (f"engine {engine_path} is corrupt ({how}: {size} bytes, its sidecar recorded {recorded['bytes']}); "
                f"{rebuild}")
    if sha256_file(engine_path) != recorded["sha256"]:
        return (f"engine {engine_path} is corrupt or was replaced: same size ({size} bytes) but its sha256 differs from "
                f"the one its sidecar recorded at build time; {rebuild}")
    problem = portability_problem(sidecar, tensorrt_version, gpu_name, compute_capability)
    if problem is not None:
        return f"engine {engine_path} cannot be loaded here: {problem}; {rebuild}"
    return None
