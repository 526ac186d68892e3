"""Peak memory of one variant: process RSS high-water mark on the CPU, allocator peaks on the GPU.

The RSS peak (VmHWM) is process-wide and only grows, so before each variant we reset it by writing
``5`` to /proc/self/clear_refs (Linux ≥ 4.0). Where that is not allowed, a sampling thread records
the peak instead (coarser: it can miss short spikes).

``rss_peak`` is the whole process (Python, torch, ONNX Runtime, the decoded data: ~1.2 GB before any model);
``rss_delta`` is what the probed work added over ``rss_baseline``, the process's RSS when the probe began: for a
variant, what loading, evaluating and benchmarking the model adds.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import psutil
import torch

_MB = 2**20


def _vm_hwm_mb() -> Optional[float]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / _MB
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """``with MemoryProbe(cuda=...) as m: ...`` then ``m.result()``."""

    def __init__(self, cuda: bool = False, interval_s: float = 0.005):
        self.cuda = cuda
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._sampled_peak = 0.0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.baseline = self._proc.memory_info().rss / _MB
        self._hwm = _reset_hwm() and _vm_hwm_mb() is not None
        if not self._hwm:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._gpu_base = torch.cuda.memory_allocated() / _MB
        return self

    def _sample(self):
        while not self._stop.is_set():
            self._sampled_peak = max(self._sampled_peak, self._proc.memory_info().rss / _MB)
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()
        self.peak = (_vm_hwm_mb() if self._hwm else self._sampled_peak) or 0.0
        if self.cuda:
            torch.cuda.synchronize()
            self.gpu_allocated_peak = torch.cuda.max_memory_allocated() / _MB
            self.gpu_reserved_peak = torch.cuda.max_memory_reserved() / _MB
        return False

    def result(self) -> dict:
        return {
            "rss_peak": round(self.peak, 2),  # the whole process (interpreter, libraries, data) at its peak
            "rss_baseline": round(self.baseline, 2),  # the process before the probed work began
            "rss_delta": round(max(0.0, self.peak - self.baseline), 2),  # what the probed work added: "model adds"
            "rss_method": "VmHWM" if self._hwm else "sampled",
            "gpu_allocated_peak": round(self.gpu_allocated_peak, 2) if self.cuda else None,
            "gpu_reserved_peak": round(self.gpu_reserved_peak, 2) if self.cuda else None,
        }
