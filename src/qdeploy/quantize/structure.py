"""Q/DQ structure of an INT8 ONNX: what decides whether TensorRT can run the graph in INT8.

For each compute op (Conv, ConvTranspose, Gemm, MatMul): is its activation input produced by a
DequantizeLinear, and is its weight? For each Add of two activations (a residual join): are both
inputs dequantized? Compute ops whose inputs are not quantized are listed by name. Fused ONNX Runtime
ops (QLinearConv, ConvInteger, QLinearMatMul, QLinearAdd...) count as quantized.
"""
from __future__ import annotations

from pathlib import Path

COMPUTE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FUSED_INT8 = ("QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm")


def qdq_structure(onnx_path: Path) -> dict:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    consts = {t.name for t in model.graph.initializer} | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}

    def dequantized(tensor: str) -> bool:
        node = producer.get(tensor)
        return node is not None and node.op_type == "DequantizeLinear"

    def is_activation(tensor: str) -> bool:
        # a weight reaches its consumer through DequantizeLinear(initializer) — still a constant
        node = producer.get(tensor)
        if tensor in consts:
            return False
        if node is not None and node.op_type == "DequantizeLinear":
            return node.input[0] not in consts and producer.get(node.input[0], None) is not None and producer[node.input[0]].op_type != "Constant"
        return True

    compute = [n for n in model.graph.node if n.op_type in COMPUTE_OPS]
    fused = [n for n in model.graph.node if n.op_type in FUSED_INT8]
    full, act_only, float_ops = [], [], []
    for n in compute:
        act_q = dequantized(n.input[0])
        w_q = len(n.input) > 1 and dequantized(n.input[1])
        (full if act_q and w_q else act_only if act_q or w_q else float_ops).append(n.name)
    adds = [n for n in model.graph.node if n.op_type == "Add" and len(n.input) == 2 and all(is_activation(i) for i in n.input)]
    adds_q = [n.name for n in adds if all(dequantized(i) for i in n.input)]
    qlinear_add = [n.name for n in model.graph.node if n.op_type == "QLinearAdd"]
    total = len(compute) + len(fused)
    return {
        "compute_ops": total,
        "compute_ops_quantized": len(full) + len(fused),
        "compute_ops_partly_quantized": act_only,
        "compute_ops_float": float_ops,
        "residual_adds": len(adds) + len(qlinear_add),
        "residual_adds_quantized": len(adds_q) + len(qlinear_add),
        "residual_adds_float": [n.name for n in adds if n.name not in adds_q],
        "quantize_nodes": sum(n.op_type == "QuantizeLinear" for n in model.graph.node),
        "dequantize_nodes": sum(n.op_type == "DequantizeLinear" for n in model.graph.node),
    }
