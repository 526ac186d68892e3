"""Stop glibc's allocator from returning large blocks to the OS after every op.

PyTorch's CPU allocator uses plain malloc. With glibc defaults every activation above the (dynamic)
mmap threshold is mmap'ed and munmap'ed again on each forward pass, so each inference page-faults its
activations back in: measured on a 2-core Xeon (EfficientNet-Lite0, batch 64), 52.9 ms/img with 12 s of
kernel time vs 15.2 ms/img once both thresholds are 1 GiB (M_MMAP_MAX=0 alone did not help). ONNX Runtime has its own arena and is not
affected, so without this the torch-vs-ORT comparison on CPU would mostly measure page faults.
Equivalent to starting with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ set (or preloading
jemalloc/tcmalloc, as PyTorch's CPU performance guide suggests), but works after start-up.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: bool | None = None


def tune_glibc_malloc(threshold: int = 1 << 30) -> bool:
    """Raise glibc's mmap/trim thresholds (once per process). Returns whether it applied."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
        ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, threshold) == 1
        _applied = ok_mmap and ok_trim
    except (OSError, AttributeError):
        _applied = False
    return _applied
