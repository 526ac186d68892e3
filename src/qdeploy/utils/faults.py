"""Kill points: fixed places where a test makes qdeploy stop the way a user or the machine would.

``QDEPLOY_KILL_AT=NAME[@N][:SIGNAL]`` makes the process send itself SIGNAL (SIGKILL by default; SIGINT, SIGTERM)
the N-th time (default: the first) it reaches the kill point NAME. Unset (always, outside tests), a kill point
costs one dictionary lookup. tests/test_faults.py runs every point with SIGINT and SIGKILL and checks that
``--out`` is then the previous output or the new one, whole, and that the next run recovers and reuses the cache.

Points (the order a run reaches them):
  export        the FP32 ONNX export is done (in the cache), before its verification
  calibration   calibration statistics collected, before the ranges are computed and cached
  build         a variant's artifact built (or fetched from the cache)
  qat-epoch     a QAT epoch's checkpoint written
  eval, bench   a variant's evaluation / benchmark starts
  swap-before   the output is complete in its staging folder (file list written), nothing moved yet
  swap-between  the swap's first half done: the old folder moved aside (two-rename swap) or exchanged (atomic swap)
  swap-after    the new folder in place, the old copy not yet removed
"""
from __future__ import annotations

import os
import signal
import time

POINTS = ("export", "calibration", "build", "qat-epoch", "eval", "bench", "swap-before", "swap-between", "swap-after")
ENV = "QDEPLOY_KILL_AT"
_SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
_reached: dict[str, int] = {}


def parse(spec: str) -> tuple[str, int, signal.Signals]:
    """``"eval@2:SIGINT"`` → ("eval", 2, SIGINT)."""
    where, _, sig = spec.partition(":")
    name, _, nth = where.partition("@")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec}: unknown kill point {name!r} (one of {', '.join(POINTS)})")
    if (sig or "SIGKILL").upper() not in _SIGNALS:
        raise ValueError(f"{ENV}={spec}: signal must be one of {', '.join(_SIGNALS)}")
    return name, int(nth or 1), _SIGNALS[(sig or "SIGKILL").upper()]


def kill_point(name: str) -> None:
    """Stop here when ``QDEPLOY_KILL_AT`` names this point (a test hook; a no-op otherwise)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, nth, signum = parse(spec)
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != nth:
        return
    os.kill(os.getpid(), signum)
    # SIGINT/SIGTERM arrive asynchronously: Python runs the handler (KeyboardInterrupt) at its next check, which
    # the sleep reaches at once; a handler that only records the signal (OutputDir's swap) lets the loop run out
    for _ in range(20):
        time.sleep(0.01)
