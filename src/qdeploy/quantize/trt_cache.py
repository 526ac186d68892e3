"""TensorRT calibration cache (the text format IInt8Calibrator.writeCalibrationCache produces).

Line 1: ``TRT-<version>-EntropyCalibration2`` (or another calibrator name); then one line per tensor,
``<tensor name>: <8 hex digits>``, the big-endian IEEE-754 float32 *scale* (amax / 127). TensorRT 10
can still consume it for implicit INT8; qdeploy also reads it back to place Q/DQ from existing ranges.
"""
from __future__ import annotations

import struct
from pathlib import Path

from qdeploy.errors import QDeployError
from qdeploy.utils.atomic import write_text

HEADER = "TRT-100000-EntropyCalibration2"


def write_trt_cache(path: Path, ranges: dict, header: str = HEADER) -> Path:
    lines = [header] + [f"{name}: {struct.pack('>f', r.amax / 127.0).hex()}" for name, r in ranges.items()]
    return write_text(path, "\n".join(lines) + "\n")


def read_trt_cache(path: Path) -> dict[str, float]:
    """Tensor name → amax (scale × 127)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise QDeployError(f"TensorRT calibration cache {path} cannot be read: {e.strerror or e}") from None
    if not lines or not lines[0].startswith("TRT-"):
        raise QDeployError(f"{path} is not a TensorRT calibration cache (first line should start with 'TRT-')")
    out = {}
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, hexval = line.rpartition(":")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = struct.unpack(">f", bytes.fromhex(hexval.strip()))[0] * 127.0
        except ValueError:
            raise QDeployError(f"{path}:{i}: expected '<tensor>: <8 hex digits>', got {line!r}") from None
    return out
