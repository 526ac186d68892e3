"""How to build a TensorRT engine for a precision: a plain function of the installed TensorRT version string.

TensorRT 10.x builds "weakly typed" networks: precision comes from builder flags. FP16 = ``BuilderFlag.FP16`` on the
FP32 ONNX; INT8 = ``BuilderFlag.INT8`` on the Q/DQ ONNX (explicit quantization), or, the legacy way, on the plain
ONNX with a calibrator that only reads the TensorRT calibration cache the quantize stage wrote (implicit quantization,
deprecated in 10.x but present in 10.3 and 10.16).

TensorRT 11.x removed the precision flags (``BuilderFlag.FP16/INT8/BF16/FP8``), ``IBuilderConfig.int8_calibrator``,
the ``IInt8*Calibrator`` classes and implicit quantization: networks are always strongly typed, so the ONNX decides.
FP16 = an FP16 ONNX (FP32 inputs/outputs kept); INT8 = the Q/DQ ONNX. Legacy calibration-cache INT8 is refused.

Any other major version is refused with the reason: qdeploy's TensorRT code is written against 10.x and 11.x.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from qdeploy.errors import QDeployError

Int8Mode = Literal["qdq", "calibration-cache"]
SUPPORTED_MAJORS = (10, 11)


class TrtUnsupported(QDeployError):
    """This TensorRT version cannot build the requested precision this way (the message says why and what works)."""


@dataclass(frozen=True)
class TrtPlan:
    version: str                  # the TensorRT version string it was planned for
    major: int
    precision: str                # fp32 | fp16 | int8
    onnx: str                     # which ONNX the build parses: fp32 | fp16 (FP16 weights, FP32 I/O) | qdq
    strongly_typed: bool          # NetworkDefinitionCreationFlag.STRONGLY_TYPED (11.x: always)
    builder_flags: tuple          # BuilderFlag member names to set (10.x only)
    calibration_cache: bool       # 10.x legacy INT8: a calibrator serving the .trtcache
    summary: str                  # one line for logs and reports

    def to_json(self) -> dict:
        d = asdict(self)
        d["builder_flags"] = list(self.builder_flags)
        return d


def major_of(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise TrtUnsupported(f"cannot read a major version from TensorRT version string '{version}'") from None


def plan_build(version: str, precision: str, int8_mode: Int8Mode = "qdq") -> TrtPlan:
    """The build plan for ``precision`` on TensorRT ``version`` (raises TrtUnsupported with the reason)."""
    major = major_of(version)
    if major not in SUPPORTED_MAJORS:
        raise TrtUnsupported(f"TensorRT {version}: qdeploy builds engines with TensorRT 10.x and 11.x only")
    if precision not in ("fp32", "fp16", "int8"):
        raise TrtUnsupported(f"TensorRT variants run fp32, fp16 or int8, not {precision}")
    if major == 10:
        if precision == "fp32":
            return TrtPlan(version, major, precision, "fp32", False, (), False, "FP32 ONNX, no precision flags")
        if precision == "fp16":
            return TrtPlan(version, major, precision, "fp32", False, ("FP16",), False, "FP32 ONNX + BuilderFlag.FP16")
        if int8_mode == "calibration-cache":
            return TrtPlan(version, major, precision, "fp32", False, ("INT8",), True,
                           "FP32 ONNX + BuilderFlag.INT8 + calibrator reading the TensorRT calibration cache (implicit, legacy)")
        return TrtPlan(version, major, precision, "qdq", False, ("INT8",), False,
                       "Q/DQ ONNX + BuilderFlag.INT8 (explicit quantization; float layers stay FP32)")
    # 11.x: strongly typed only
    if precision == "int8" and int8_mode == "calibration-cache":
        raise TrtUnsupported(f"TensorRT {version} removed implicit INT8 calibration (int8_calibrator, IInt8*Calibrator): "
                             "build the Q/DQ ONNX instead (int8_mode: qdq)")
    onnx = {"fp32": "fp32", "fp16": "fp16", "int8": "qdq"}[precision]
    what = {"fp32": "FP32 ONNX", "fp16": "FP16 ONNX (FP32 I/O), no flags", "int8": "Q/DQ ONNX, no flags"}[precision]
    return TrtPlan(version, major, precision, onnx, True, (), False, f"strongly typed: {what}")
