"""Q/DQ structure of an INT8 ONNX, read the way TensorRT will read it.

Per compute op (Conv, ConvTranspose, Gemm, MatMul): is its input INT8, are its weights INT8, and which
following ops TensorRT fuses into it (BN, the activation, a residual Add whose conv path it is). Per
residual Add: which input carries Q/DQ and whether that is the fusible form (skip input only).
ONNX Runtime's fused operators (QLinearConv, ...) count as INT8 compute.
"""
from __future__ import annotations

from qdeploy.lint.placement import compute_nodes
from qdeploy.lint.qdq_graph import GATES, QdqGraph

FUSED_INT8 = ("QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm")
FORMS = {
    "fusible": "skip input quantized, conv path float: TensorRT fuses Conv+Add in INT8",
    "conv-path-quantized": "Q/DQ on the conv path: Conv and Add run as separate kernels",
    "skip-float": "conv path INT8 but skip float: float residual, reformats",
    "float": "neither input quantized",
    "shared-scale": "activation+activation, both quantized with one scale",
    "scales-differ": "activation+activation, both quantized with different scales",
    "partly": "activation+activation, one input quantized",
}


def _fusions(g: QdqGraph, node) -> tuple[list[str], bool]:
    """Ops after ``node`` that TensorRT fuses into it, and whether a Q/DQ cuts the chain."""
    fused, tensor = [], node.output[0]
    for _ in range(4):
        nxt = g.single_consumer(tensor)
        if nxt is None:
            users = g.consumers.get(tensor, [])
            # SiLU / hardswish: x feeds both the gate and the Mul
            gates = [u for u in users if u.op_type in GATES]
            muls = [u for u in users if u.op_type == "Mul"]
            if len(users) == 2 and gates and muls and gates[0].output[0] in muls[0].input:
                fused.append("SiLU" if gates[0].op_type == "Sigmoid" else "HardSwish")
                tensor = muls[0].output[0]
                continue
            return fused, False
        if nxt.op_type == "QuantizeLinear":
            return fused, bool(g.consumers.get(nxt.output[0])) and any(
                c.op_type == "DequantizeLinear" and any(u.op_type in ("BatchNormalization", "Relu", "Sigmoid", "HardSigmoid", "Mul", "Clip")
                                                        for u in g.consumers.get(c.output[0], [])) for c in g.consumers.get(nxt.output[0], []))
        if nxt.op_type in ("BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh"):
            fused.append(nxt.op_type)
            tensor = nxt.output[0]
            continue
        if nxt.op_type == "Add" and nxt.name in g.residual_add_names:
            idx, _ = g.residual_conv_input(nxt)
            if idx is not None and nxt.input[idx] == tensor:
                fused.append("Add")
                tensor = nxt.output[0]
                continue
        return fused, False
    return fused, False


def add_form(g: QdqGraph, add) -> tuple[str, int | None, list[int]]:
    idx, _ = g.residual_conv_input(add)
    quantized = [i for i, t in enumerate(add.input[:2]) if g.dq_of(t) is not None]
    if idx is None:
        if len(quantized) == 2:
            s = [g.scale(g.dq_of(t)) for t in add.input[:2]]
            same = all(x is not None for x in s) and s[0].size == s[1].size == 1 and abs(float(s[0]) - float(s[1])) <= 1e-6 * abs(float(s[0]))
            return ("shared-scale" if same else "scales-differ"), None, quantized
        return ("partly" if quantized else "float"), None, quantized
    if idx in quantized:
        return "conv-path-quantized", idx, quantized
    if quantized:
        return "fusible", idx, quantized
    conv = g.backbone(g._through_qdq(add.input[idx]))
    return ("skip-float" if conv is not None and g.dq_of(conv.input[0]) is not None else "float"), idx, quantized


def qdq_structure(g: QdqGraph) -> dict:
    ops, int8, partly, float_ops = [], 0, [], []
    for n in compute_nodes(g):
        act_q = g.dq_of(n.input[0]) is not None
        w_q = len(n.input) > 1 and g.dq_of(n.input[1]) is not None
        fuses, cut = _fusions(g, n)
        ops.append({"name": n.name, "op": n.op_type, "int8_input": act_q, "int8_weights": w_q, "fuses": fuses,
                    "fusion_cut_by_qdq": cut})
        if act_q and w_q:
            int8 += 1
        elif act_q or w_q:
            partly.append(n.name)
        else:
            float_ops.append(n.name)
    fused = [n.name for n in g.nodes if n.op_type in FUSED_INT8]
    adds = []
    for add in g.residual_adds():
        form, idx, quantized = add_form(g, add)
        adds.append({"name": add.name, "form": form, "conv_input": idx, "quantized_inputs": quantized})
    qlinear_adds = [n.name for n in g.nodes if n.op_type == "QLinearAdd"]
    counts = {f: sum(a["form"] == f for a in adds) for f in FORMS}
    return {
        "compute_ops": len(ops) + len(fused),
        "compute_ops_int8": int8 + len(fused),
        "compute_ops_partly_quantized": partly,
        "compute_ops_float": float_ops,
        "residual_adds": len(adds) + len(qlinear_adds),
        "residual_add_forms": {k: v for k, v in counts.items() if v} | ({"qlinear": len(qlinear_adds)} if qlinear_adds else {}),
        "residual_adds_fusible": counts["fusible"],
        "quantize_nodes": sum(n.op_type == "QuantizeLinear" for n in g.nodes),
        "dequantize_nodes": sum(n.op_type == "DequantizeLinear" for n in g.nodes),
        "ops": ops,
        "adds": adds,
    }


def structure_line(st: dict) -> str:
    """One line for logs and tables: compute ops INT8, and the residual Adds by form."""
    forms = ", ".join(f"{v} {k}" for k, v in st.get("residual_add_forms", {}).items()) or "none"
    return f"{st['compute_ops_int8']}/{st['compute_ops']} compute ops INT8; residual Adds: {forms}"
