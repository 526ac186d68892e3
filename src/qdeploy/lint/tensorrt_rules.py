"""What TensorRT (explicit quantization) fuses and runs in INT8: the facts every placement and lint rule uses.

Sources (cited where each fact is used):
- TensorRT developer guide, "Working with quantized types" → "Q/DQ layer-placement recommendations"
  (figures 6, 7, 9): quantize the *skip* input of a residual Add, leave the convolution's output float, so
  Conv(+BN)(+ReLU)+Add fuses into one INT8 kernel; an extra Q/DQ on the conv path "forces the separation".
- ModelOpt ``modelopt/onnx/quantization/graph_utils.py``: ``get_fusible_backbone`` (which chains TensorRT
  fuses into a Conv), ``build_non_residual_input_map`` (which Add input is the conv path: the one on the
  longer path to the lowest common ancestor when both inputs have a backbone),
  ``find_nodes_from_convs_to_exclude`` (convs TensorRT will not run in INT8).
"""
from __future__ import annotations

from typing import Sequence

# Ops through which TensorRT's Q/DQ propagation sees the same values (no arithmetic): a Q/DQ pair can move
# across them, and scales on both sides must match or TensorRT requantizes.
SCALE_PRESERVING = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Concat", "Reshape", "Flatten",
                    "Transpose", "Squeeze", "Unsqueeze", "Slice", "Split", "Identity", "Pad", "Resize", "Upsample")
# Element-wise activations that TensorRT fuses into the producing Conv as its epilogue.
FUSIBLE_ACTIVATIONS = ("Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu",
                       "Softplus", "PRelu")
COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


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
