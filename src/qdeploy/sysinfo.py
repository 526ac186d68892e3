"""What this machine is and what qdeploy can use on it (for results.json and ``qdeploy doctor``)."""
from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path
from typing import Optional

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    except OSError:
        pass
    return []


def _version(module: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:
        return None


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "gpu": None,
        "cuda": None,
        "cudnn": None,
        "driver": None,
    }
    for mod in ("torch", "torchvision", "onnx", "onnxruntime", "numpy", "timm"):
        env[mod] = _version(mod)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env
