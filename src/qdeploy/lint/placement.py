"""Placement rules that are facts about the graph: which compute ops stay float on purpose, per target. One home, read
by the ONNX Q/DQ placement (quantize/qdq.py) and the lint (TensorRT's view: rule QD011 does not call such an op a
defect).

Each rule is a function of the graph returning the nodes it keeps float, with the sentence that says why and where
that comes from. The ModelOpt path (PyTorch) agrees by construction where noted.
"""
from __future__ import annotations

import onnx

from qdeploy.utils.onnx_graph import OnnxGraph

ATTENTION_MATMUL = (
    "a MatMul of two activations (attention's Q·Kᵀ and softmax·V) stays float: ModelOpt's ONNX INT8 matches the chain "
    "MatMul → (Add) → Softmax → MatMul as a non-quantizable partition (modelopt/onnx/quantization/partitioning.py) and "
    "its PyTorch INT8_DEFAULT_CFG puts no quantizer on these matmuls (they are not modules), and TensorRT runs attention "
    "in its fused FP16 kernels; an INT8 matmul would need both inputs quantized, softmax's output included")


def attention_matmuls(g: OnnxGraph) -> list[onnx.NodeProto]:
    """MatMuls whose two inputs are both computed from the model input (no weight on either side), however the
    attention is written (timm's fused qkv + SDPA, nn.MultiheadAttention, separate q/k/v Linears)."""
    dynamic = g.from_input
    return [n for n in g.nodes if n.op_type == "MatMul" and len(n.input) == 2 and all(i in dynamic for i in n.input)]


def float_by_rule(g: OnnxGraph, placement: str = "tensorrt") -> dict[str, str]:
    """{node name: why it stays float} for every placement rule of ``placement``.

    The attention rule is TensorRT's (and ModelOpt's). The ONNX Runtime placement quantizes these matmuls: its QDQ
    format wraps every tensor its quantized neighbours (Reshape, Transpose, Mul) touch, and its graph optimizer then
    fuses DQ → MatMul → Q into QLinearMatMul whether or not the quantizer listed the MatMul, so a float matmul there
    would take float neighbours as well; ONNX Runtime's own transformer recipes quantize MatMul."""
    if placement != "tensorrt":
        return {}
    return {(n.name or n.output[0]): ATTENTION_MATMUL for n in attention_matmuls(g)}


__all__ = ["ATTENTION_MATMUL", "attention_matmuls", "float_by_rule"]
