"""What qdeploy knows about ONNX Runtime's CPU INT8 kernels, read by the quantizers (and the report).

**U8S8 saturation on x86-64 without VNNI.** ONNX Runtime's ONNX-Runtime-placement INT8 (uint8 activations, int8
weights: "U8S8") runs on x86-64 through MLAS. Without VNNI (AVX-512 VNNI or AVX-VNNI) the kernels use VPMADDUBSW,
which adds two u8×s8 products into one *int16* and saturates when the sum does not fit. ONNX Runtime's quantization
guide ("When and why do I need to try U8U8?") says so and names the remedy: quantize the weights with 7 bits
(``reduce_range``) or use U8U8; OpenVINO's "Saturation (overflow) issue workaround" page describes the same hardware
fact and the same 7-bit-weights remedy. VNNI's VPDPBUSD accumulates in int32 and does not saturate.
Measured here (ResNet-20 on CIFAR-10, AVX2-only host, entropy ranges): 8-bit weights 90.99 % top-1 vs FP32 91.73 %;
the earlier AVX-512 VNNI host gave 91.2-91.7 % with the same artifact (docs/benchmarks.md).
"""
from __future__ import annotations

import platform
from typing import Iterable, Optional

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
