"""Q/DQ structure of an INT8 ONNX: what decides whether TensorRT can run the graph in INT8.

For each compute op (Conv, ConvTranspose, Gemm, MatMul): is its activation input produced by a
DequantizeLinear, and is its weight? For each Add of two activations (a residual join): are both
inputs dequantized? Compute ops whose inputs are not quantized are listed by name. Fused ONNX Runtime
ops (QLinearConv, ConvInteger, QLinearMatMul, QLinearAdd...) count as quantized.
"""
from __future__ import annotations

from pathlib import Path

from qdeploy.utils.onnx_graph import OnnxGraph

COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FUSED_INT8 = ("QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm")


def qdq_structure(onnx_path: Path) -> dict:
    graph = OnnxGraph.load(onnx_path)
    compute = [n for n in graph.nodes if n.op_type in COMPUTE_OPS]
    fused = [n for n in graph.nodes if n.op_type in FUSED_INT8]
    full, act_only, float_ops = [], [], []
    for n in compute:
        act_q = graph.is_dequantized(n.input[0])
        w_q = len(n.input) > 1 and graph.is_dequantized(n.input[1])
        (full if act_q and w_q else act_only if act_q or w_q else float_ops).append(n.name)
    adds = graph.residual_adds()
    adds_q = [n.name for n in adds if all(graph.is_dequantized(i) for i in n.input)]
    qlinear_add = [n.name for n in graph.nodes if n.op_type == "QLinearAdd"]
    total = len(compute) + len(fused)
    return {
        "compute_ops": total,
        "compute_ops_quantized": len(full) + len(fused),
        "compute_ops_partly_quantized": act_only,
        "compute_ops_float": float_ops,
        "residual_adds": len(adds) + len(qlinear_add),
        "residual_adds_quantized": len(adds_q) + len(qlinear_add),
        "residual_adds_float": [n.name for n in adds if n.name not in adds_q],
        "quantize_nodes": sum(n.op_type == "QuantizeLinear" for n in graph.nodes),
        "dequantize_nodes": sum(n.op_type == "DequantizeLinear" for n in graph.nodes),
    }
