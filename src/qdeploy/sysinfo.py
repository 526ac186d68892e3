"""What this machine is and what qdeploy can use on it (for results.json and ``qdeploy doctor``)."""
from __future__ import annotations

import importlib
import os
import platform
import subprocess
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


# the ISA features that decide which CPU kernels INT8 and BF16 get (VNNI: INT8 dot products; AMX: INT8/BF16 tiles;
# AVX512-BF16: BF16 dot products), printed next to every CPU figure
CPU_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in CPU_FLAGS_SHOWN if f in flags]
    except OSError:
        pass
    return []


def dist_version(dist: str) -> Optional[str]:
    """An installed distribution's version from its metadata (the module is not imported), or None."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    for mod in ("torch", "torchvision", "onnx", "onnxruntime", "openvino", "numpy", "timm"):
        env[mod] = _version(mod)
    if env.get("openvino"):
        env["openvino"] = env["openvino"].split("-")[0]  # "2026.4.1-22982-<hash>-releases/...": the release
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env.update(nvidia_smi_facts())
    return env


_SMI_FIELDS = {"driver_version": "driver", "clocks.sm": "sm_clock_mhz", "clocks.max.sm": "sm_clock_max_mhz",
               "clocks.mem": "mem_clock_mhz", "power.limit": "power_limit_w", "temperature.gpu": "temperature_c"}


def nvidia_smi_facts(index: int = 0) -> dict:
    """Driver and clocks of a GPU as nvidia-smi reads them at this moment ({} where nvidia-smi is absent): GPU timings
    depend on them (a GPU idling at 345 MHz ramps up under load; a capped power limit lowers the top clock)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=" + ",".join(_SMI_FIELDS),
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(values) != len(_SMI_FIELDS):
        return {}
    facts = {}
    for key, value in zip(_SMI_FIELDS.values(), values):
        try:
            facts[key] = value if key == "driver" else float(value)
        except ValueError:
            facts[key] = None  # "[N/A]" where the GPU does not report it
    return facts
