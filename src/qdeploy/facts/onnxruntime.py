"""What qdeploy knows about ONNX Runtime builds: its CPU INT8 kernels, read by the quantizers (and the report), and
whether the CUDA execution provider can run here, read by the ONNX Runtime engine (``cuda_ep_problem``, below).

**U8S8 saturation on x86-64 without VNNI.** ONNX Runtime's ONNX-Runtime-placement INT8 (uint8 activations, int8
weights: "U8S8") runs on x86-64 through MLAS. Without VNNI (AVX-512 VNNI or AVX-VNNI) the kernels use VPMADDUBSW,
which adds two u8×s8 products into one *int16* and saturates when the sum does not fit. ONNX Runtime's quantization
guide ("When and why do I need to try U8U8?") says so and names the remedy: quantize the weights with 7 bits
(``reduce_range``) or use U8U8; OpenVINO's "Saturation (overflow) issue workaround" page describes the same hardware
fact and the same 7-bit-weights remedy. VNNI's VPDPBUSD accumulates in int32 and does not saturate.
Measured on an AVX2-only CPU (ResNet-20 on CIFAR-10, entropy ranges; docs/first-run.md): 8-bit weights 90.99 % top-1
vs FP32 91.73 %; an AVX-512 VNNI CPU gave 91.2-91.7 % with the same artifact.
"""
from __future__ import annotations

import functools
import platform
import re
import subprocess
from typing import Iterable, Optional, Sequence

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def u8s8_saturates(cpu_flags: Optional[Iterable[str]] = None) -> bool:
    """Whether ONNX Runtime's U8S8 CPU kernels saturate on this CPU (x86-64 without VNNI). ``cpu_flags``: the
    /proc/cpuinfo flags (default: this machine's); non-x86 CPUs (Arm's dot-product kernels accumulate in int32) never."""
    if cpu_flags is None:
        if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
            return False
        from qdeploy.sysinfo import cpu_flags as read_flags

        cpu_flags = read_flags()
        if not cpu_flags:  # flags unreadable: assume the kernels that work everywhere are needed
            return True
    flags = set(cpu_flags)
    return not (flags & set(VNNI_FLAGS))


def reduce_range_reason(saturates: bool) -> Optional[str]:
    return ("weights quantized to 7 bits (reduce_range): this CPU has no VNNI, and ONNX Runtime's U8S8 kernels "
            "saturate int16 sums without it (ONNX Runtime quantization guide)") if saturates else None


def nncf_overflow_fix_reason(saturates: bool) -> Optional[str]:
    """NNCF's remedy for the same saturation on the CPUs OpenVINO runs INT8 on: every Convolution's and MatMul's
    weights in half the 8-bit range (``nncf.OverflowFix.ENABLE``) where this CPU has no VNNI; with VNNI, NNCF's default
    (the first convolutions only). NNCF's own note (``OverflowFix``) names AVX-2 and AVX-512 without VNNI. Measured on
    an AVX2-only CPU (AMD EPYC, 2 cores): the Ultralytics YOLOv8n export's INT8 IR lost 3.73 mAP@0.5:0.95 points on
    BCCD with NNCF's default (45.17 % -> 41.44 %, the VNNI Xeons of earlier runs were within 1 point;
    tests/test_yolov8_export.py)."""
    return ("every Convolution's and MatMul's weights in half the 8-bit range (NNCF's OverflowFix.ENABLE): this CPU "
            "has no VNNI, and the CPU plugin's AVX2 / AVX-512 INT8 kernels saturate int16 sums without it (NNCF, "
            "OpenVINO's saturation (overflow) issue workaround)") if saturates else None


# ---------------------------------------------------------------------------------------------
# Can this onnxruntime run the CUDA execution provider here? (the onnxruntime-cuda target needs it)
#
# Where ONNX Runtime exposes its facts (read in onnxruntime 1.32's own package, and microsoft/onnxruntime's setup.py):
#   * ``onnxruntime.get_available_providers()``: the providers compiled into the installed build; the CPU wheel
#     ``onnxruntime`` has no 'CUDAExecutionProvider', the ``onnxruntime-gpu`` wheel has it (both install the module
#     ``onnxruntime``, so only one of them can be installed).
#   * ``onnxruntime.capi.build_and_package_info.cuda_version``: the CUDA version a GPU wheel was built with (the build's
#     ``--cuda_version``, e.g. '12.2'); absent in the CPU wheel ("cuda_version is optional. For example, cpu only
#     package does not have the attribute.", onnxruntime/capi/onnxruntime_validation.py, re-exported as
#     ``onnxruntime.cuda_version``; onnxruntime/__init__.py's CUDA DLL preloading reads it). Not seen in a real GPU
#     wheel here: when it is missing, the major check below is skipped.
# The machine's CUDA: the "CUDA Version: X.Y" that ``nvidia-smi`` prints is the newest CUDA its driver runs; NVIDIA
# drivers also run older CUDA majors, so only a build for a *newer* CUDA major than the driver's cannot work (a build
# for an older major needs that major's CUDA/cuDNN libraries, which the engine checks when the session starts:
# ``cuda_fallback_message``). Without nvidia-smi, PyTorch's CUDA (``torch.version.cuda``) when it sees a GPU.

CUDA_EP = "CUDAExecutionProvider"
CUDA_EP_DOCS = "https://onnxruntime.ai/docs/execution-providers/CUDA-ExecutionProvider.html#requirements"
_SMI_CUDA = re.compile(r"CUDA Version\s*:\s*(\d+(?:\.\d+)*)")


def cuda_major(version: Optional[str]) -> Optional[int]:
    """12 for '12.8' (None when absent or unreadable)."""
    try:
        return int(str(version).strip().split(".")[0]) if version else None
    except ValueError:
        return None


def parse_smi_cuda(text: str) -> Optional[str]:
    """The 'CUDA Version: X.Y' of ``nvidia-smi``'s header (or of ``nvidia-smi -q``), None when it has none."""
    m = _SMI_CUDA.search(text or "")
    return m.group(1) if m else None


def cuda_ep_problem_from(providers: Sequence[str], build_cuda: Optional[str], machine_cuda: Optional[str],
                         version: str, machine_source: str = "nvidia-smi") -> Optional[str]:
    """Why this onnxruntime cannot run the CUDA execution provider, in one sentence, or None when it can.

    ``providers``: ``onnxruntime.get_available_providers()``; ``build_cuda``: the CUDA version the build was made with
    (None: unknown or CPU build); ``machine_cuda``: this machine's CUDA (None: no NVIDIA GPU visible);
    ``version``: ``onnxruntime.__version__``; ``machine_source``: where ``machine_cuda`` was read."""
    if CUDA_EP not in providers:
        return (f"onnxruntime {version} is the CPU build (providers: {', '.join(providers)}), without the CUDA "
                "execution provider; onnxruntime-gpu provides the same Python module `onnxruntime` as the CPU build "
                "qdeploy depends on, so it is installed instead of it: "
                "pip uninstall -y onnxruntime && pip install onnxruntime-gpu")
    if machine_cuda is None:
        return (f"onnxruntime-gpu {version} has the CUDA execution provider, but no NVIDIA GPU is visible here "
                "(nvidia-smi lists none and PyTorch sees no CUDA device): run on a machine with an NVIDIA GPU and "
                "its driver, or use device: cpu")
    built, here = cuda_major(build_cuda), cuda_major(machine_cuda)
    if built is not None and here is not None and built > here:
        return (f"onnxruntime-gpu {version} is built for CUDA {build_cuda}, but this machine's CUDA is {machine_cuda} "
                f"({machine_source}), an older major: install an onnxruntime-gpu built for CUDA {here}.x "
                f"(pip uninstall -y onnxruntime-gpu, then the release that {CUDA_EP_DOCS} lists for CUDA {here}) "
                f"or update the NVIDIA driver to one that runs CUDA {built}")
    return None


def cuda_fallback_message(session_providers: Sequence[str], build_cuda: Optional[str], version: str,
                          cuda_graphs: bool = False) -> str:
    """The reason given when ONNX Runtime was asked for the CUDA execution provider but the session came up on
    ``session_providers`` instead: InferenceSession catches the EP's error, prints "EP Error ... Falling back to
    ['CPUExecutionProvider'] and retrying" and runs on the CPU (or the EP's library fails to load, which ONNX Runtime
    logs as "Failed to create CUDAExecutionProvider"); timings would not be the GPU's."""
    major = cuda_major(build_cuda)
    libs = f"CUDA {major}.x and cuDNN libraries" if major is not None else "the CUDA and cuDNN libraries"
    why = (f"onnxruntime-gpu {version} needs {libs} it can load (from PyTorch built for the same CUDA major, or "
           "NVIDIA's pip wheels)")
    if cuda_graphs:
        why += (", and cuda_graphs (enable_cuda_graph) needs every node on the CUDA execution provider and no "
                "If/Loop/Scan")
    return (f"ONNX Runtime could not start the CUDA execution provider and fell back to {list(session_providers)} "
            "(ONNX Runtime printed why, as 'EP Error ...' or 'Failed to create CUDAExecutionProvider ...'): "
            f"{why}")


def build_cuda_version() -> Optional[str]:
    """The CUDA version this onnxruntime was built with (GPU builds), else None."""
    try:
        from onnxruntime.capi import build_and_package_info as info
    except ImportError:
        return None
    return getattr(info, "cuda_version", None) or None


@functools.lru_cache(maxsize=1)
def machine_cuda() -> tuple[Optional[str], str]:
    """``(version, source)``: the CUDA of this machine's driver per nvidia-smi, else PyTorch's CUDA when PyTorch sees
    a GPU, else ``(None, "none")`` (no NVIDIA GPU visible)."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
        found = parse_smi_cuda(out.stdout) if out.returncode == 0 else None
        if found:
            return found, "nvidia-smi"
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        if torch.cuda.is_available() and torch.version.cuda:
            return torch.version.cuda, "torch.version.cuda"
    except ImportError:
        pass
    return None, "none"


def cuda_ep_problem() -> Optional[str]:
    """None when this onnxruntime can run the CUDA execution provider here, else one sentence: why, and what to do."""
    import onnxruntime as ort

    providers = ort.get_available_providers()
    if CUDA_EP not in providers:  # the CPU build: no need to ask the machine
        return cuda_ep_problem_from(providers, None, None, ort.__version__)
    version, source = machine_cuda()
    return cuda_ep_problem_from(providers, build_cuda_version(), version, ort.__version__, source)
