"""Everything qdeploy knows about TensorRT, in one place that the lint, both quantizers, the engine builder and the
engine runner read (an early stage: it imports nothing of qdeploy but ``errors``).

1. **Version strategies** (``plan_build``): how each supported major builds each precision.
2. **Kernel and fusion facts** (``FUSION_BACKBONE_OPS``, ``FUSIBLE_ACTIVATIONS``,
   ``conv_int8_supported``; which ops are compute ops is the placement rules' fact: ``lint.placement.COMPUTE_OPS``):
   what TensorRT's explicit quantization fuses and runs in INT8; every Q/DQ placement and lint rule uses them.
3. **API surfaces** (``NAMES_USED``, ``PATH_VERSIONS``, ``REMOVED_IN_11``): every TensorRT Python name each consumer
   touches, per version path, checked by the tests against the API dumps of TensorRT 10.3, 10.16 and 11.4
   (../shared/tensorrt-api). The consumers keep their code in their own stage and declare nothing themselves.
4. **The installed version** (``tensorrt_version``).

Sources for the kernel facts (cited where each fact is used):
- TensorRT developer guide, "Working with quantized types" → "Q/DQ layer-placement recommendations"
  (figures 6, 7, 9): quantize the *skip* input of a residual Add, leave the convolution's output float, so
  Conv(+BN)(+ReLU)+Add fuses into one INT8 kernel; an extra Q/DQ on the conv path "forces the separation".
- ModelOpt ``modelopt/onnx/quantization/graph_utils.py``: ``get_fusible_backbone`` (which chains TensorRT
  fuses into a Conv), ``build_non_residual_input_map`` (which Add input is the conv path: the one on the
  longer path to the lowest common ancestor when both inputs have a backbone),
  ``find_nodes_from_convs_to_exclude`` (convs TensorRT will not run in INT8).

Version strategies: TensorRT 10.x builds "weakly typed" networks: precision comes from builder flags. FP16 =
``BuilderFlag.FP16`` on the FP32 ONNX; INT8 = ``BuilderFlag.INT8`` on the Q/DQ ONNX (explicit quantization), or, the
legacy way, on the plain ONNX with a calibrator that only reads the TensorRT calibration cache the quantize stage wrote
(implicit quantization, deprecated in 10.x but present in 10.3 and 10.16). TensorRT 11.x removed the precision flags
(``BuilderFlag.FP16/INT8/BF16/FP8``), ``IBuilderConfig.int8_calibrator``, the ``IInt8*Calibrator`` classes and
implicit quantization: networks are always strongly typed, so the ONNX decides. FP16 = an FP16 ONNX (FP32
inputs/outputs kept); INT8 = the Q/DQ ONNX. Legacy calibration-cache INT8 is refused. Any other major version is
refused with the reason: qdeploy's TensorRT code is written against 10.x and 11.x.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, Sequence

from qdeploy.errors import QDeployError

# ---------------------------------------------------------------------------------------------------- versions

Int8Mode = Literal["qdq", "calibration-cache"]
SUPPORTED_MAJORS = (10, 11)
# the supported majors' representative versions, for the trtexec lines written when TensorRT is absent
REFERENCE_VERSIONS = {10: "10.16.1", 11: "11.4.0"}


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


def tensorrt_version() -> str | None:
    """The importable tensorrt's version string, or None (any import error counts as "not installed")."""
    try:
        import tensorrt as trt
        return str(trt.__version__)
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------- kernels
# Ops that may sit between a DequantizeLinear and the compute op it feeds without costing the op its INT8 input:
# TensorRT constant-folds a weight's DQ(W) -> Transpose/Reshape (torch.onnx writes every Linear on a 3-D tensor as
# MatMul(x, Transpose(W)), and ModelOpt's own ONNX export of a quantized Linear is W -> Q -> DQ -> Transpose -> MatMul),
# and its Q/DQ propagation moves an activation's DQ forward across data-movement ops (TensorRT developer guide,
# "Q/DQ layer placement": DQ propagates forward across commuting layers such as Reshape and Transpose).
DQ_SEES_THROUGH = ("Cast", "Identity", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose")
# Element-wise activations that TensorRT fuses into the producing Conv as its epilogue.
FUSIBLE_ACTIVATIONS = ("Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu",
                       "Softplus", "PRelu")
# Ops a Conv(+BN)(+act)+Add chain fuses into, as ModelOpt's get_fusible_backbone names them ("C": Conv, ConvTranspose and
# Gemm; a MatMul is not a backbone there): which input of a residual Add is the conv path (QdqGraph.backbone).
FUSION_BACKBONE_OPS = ("Conv", "ConvTranspose", "Gemm")


def conv_int8_supported(out_channels: int, in_channels_per_group: int, group: int,
                        kernel_shape: Sequence[int], is_first_layer: bool) -> bool:
    """Whether TensorRT runs this Conv in INT8: ModelOpt's ``find_nodes_from_convs_to_exclude`` (int8 mode).

    Input and output channels ≥ 16 are always fine. Below that, a standard conv (group 1) is supported when
    either channel count is a multiple of 8, it is the network's first layer or the other count is ≥ 16, and
    its kernel is square; a grouped conv when its output channels are a multiple of 8 and every kernel
    dimension is ≥ 3. ``in_channels_per_group`` is the weight's dim 1 (C_in / group), as ModelOpt reads it.
    """
    oc, ic = int(out_channels), int(in_channels_per_group)
    if oc >= 16 and ic >= 16:
        return True
    kernel = [int(k) for k in kernel_shape] or [1, 1]
    if group == 1:
        return (oc % 8 == 0 or ic % 8 == 0) and (is_first_layer or oc >= 16 or ic >= 16) and len(set(kernel)) == 1
    return oc % 8 == 0 and all(k >= 3 for k in kernel)


# ---------------------------------------------------------------------------------------------------- API surfaces
# Every TensorRT name each consumer touches, per version path ("common" for all of a consumer's paths). Class members
# as "Class.member". Consumers: "engine_build" (artifacts/tensorrt/engine_build.py), "runner"
# (engines/tensorrt_engine.py), "lint_confirm" (lint/tensorrt_confirm.py, through Polygraphy's loaders).
_ENGINE_BUILD_NAMES = {
    "common": ["__version__", "Logger", "Logger.WARNING", "Builder", "OnnxParser", "Runtime",
               "Builder.create_network", "Builder.create_builder_config", "Builder.create_optimization_profile",
               "Builder.build_serialized_network", "OnnxParser.parse_from_file", "OnnxParser.num_errors",
               "OnnxParser.get_error", "ParserError.desc", "ParserError.node_name", "ParserError.node_operator",
               "IBuilderConfig.set_memory_pool_limit", "MemoryPoolType.WORKSPACE", "IBuilderConfig.builder_optimization_level",
               "IBuilderConfig.profiling_verbosity", "ProfilingVerbosity.DETAILED", "IBuilderConfig.add_optimization_profile",
               "IOptimizationProfile.set_shape", "IBuilderConfig.create_timing_cache", "IBuilderConfig.set_timing_cache",
               "IBuilderConfig.get_timing_cache", "ITimingCache.serialize", "Runtime.deserialize_cuda_engine",
               "ICudaEngine.create_engine_inspector", "EngineInspector.get_engine_information", "LayerInformationFormat.JSON"],
    "10": ["IBuilderConfig.set_flag", "BuilderFlag.FP16", "BuilderFlag.INT8"],
    "10-calibration-cache": ["IBuilderConfig.int8_calibrator", "IInt8EntropyCalibrator2",
                             "IInt8EntropyCalibrator2.read_calibration_cache", "IInt8EntropyCalibrator2.get_batch",
                             "IInt8EntropyCalibrator2.get_batch_size"],
    "11": ["NetworkDefinitionCreationFlag.STRONGLY_TYPED"],
}
# The versions each path is meant for (the conformance test checks these surfaces)
PATH_VERSIONS = {"common": ["10.3.0", "10.16.1", "11.4.0"], "10": ["10.3.0", "10.16.1"],
                 "10-calibration-cache": ["10.3.0", "10.16.1"], "11": ["11.4.0"]}

_RUNNER_NAMES = ["Logger", "Logger.WARNING", "Runtime", "Runtime.deserialize_cuda_engine",
                  "ICudaEngine.create_execution_context", "ICudaEngine.num_io_tensors", "ICudaEngine.get_tensor_name",
                  "ICudaEngine.get_tensor_mode", "TensorIOMode.INPUT", "ICudaEngine.device_memory_size_v2",
                  "IExecutionContext.set_input_shape", "IExecutionContext.get_tensor_shape",
                  "IExecutionContext.set_tensor_address", "IExecutionContext.execute_async_v3"]

# Path "10": TensorRT 10.x; path "11": TensorRT 11.x. Names Polygraphy touches for us are listed too.
_LINT_CONFIRM_NAMES = {
    "10": ["__version__", "ProfilingVerbosity.DETAILED", "LayerInformationFormat.JSON",
           "ICudaEngine.create_engine_inspector", "EngineInspector.get_engine_information",
           "BuilderFlag.INT8", "BuilderFlag.FP16"],  # via CreateConfig(int8=True, fp16=True)
    "11": ["__version__", "ProfilingVerbosity.DETAILED", "LayerInformationFormat.JSON",
           "ICudaEngine.create_engine_inspector", "EngineInspector.get_engine_information",
           "NetworkDefinitionCreationFlag.STRONGLY_TYPED"],  # via NetworkFromOnnxPath(strongly_typed=True)
}
NAMES_USED = {"engine_build": _ENGINE_BUILD_NAMES, "runner": {"common": _RUNNER_NAMES}, "lint_confirm": _LINT_CONFIRM_NAMES}
# Names TensorRT 11 removed: the 11 paths must touch none of them
REMOVED_IN_11 = ("BuilderFlag.FP16", "BuilderFlag.INT8", "BuilderFlag.BF16", "BuilderFlag.FP8", "IBuilderConfig.int8_calibrator",
                 "IInt8EntropyCalibrator2")
