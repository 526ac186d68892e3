"""Sub-graphs that post-training quantization keeps in float on purpose: accuracy rules, not speed rules.

Squeeze-excitation branches (``GlobalAveragePool|ReduceMean → Conv → act → Conv → Sigmoid|HardSigmoid → Mul``
with the pooled tensor; data-movement ops such as the Squeeze → Reshape a Keras model's SE block converts to are
seen through): NNCF's ``SE_BLOCK`` ignored pattern (``nncf/onnx/quantization/ignored_patterns.py``)
leaves them float by default. Measured on the CIFAR-10 EfficientNet-B0 (the ablation in docs/int8-accuracy.md): with
the same activation ranges as NNCF's (identical scales on the 33 tensors both quantize), quantizing the branch's two
convs was what separated qdeploy (76.5 %) from NNCF (80.0 %, FP32 80.5 %). The gate multiplies every channel
of the block, so an error in the branch's 1×1 convs scales a whole feature map; the branch computes on a
C×1×1 vector, so keeping it float costs next to nothing in ONNX Runtime or TensorRT.
"""
from __future__ import annotations

from qdeploy.lint.qdq_graph import DATA_MOVEMENT_OPS, GATES, QdqGraph

POOLS = ("GlobalAveragePool", "ReduceMean")
ACTIVATIONS = ("Relu", "Clip", "LeakyRelu", "HardSwish", "Sigmoid", "HardSigmoid", "Mul", "Add", "Div")


def _activation_input(g: QdqGraph, node) -> tuple[str | None, list[str]]:
    """The tensor an element-wise activation reads (x for SiLU's x·sigmoid(x), the data input otherwise), and
    the activation's other nodes (SiLU's sigmoid)."""
    if node.op_type == "Mul":
        swish = g.swish(node)
        return (swish[0], [swish[1].name]) if swish is not None else (None, [])
    if node.op_type in ("Add", "Div") and len(node.input) == 2:  # hardsigmoid written out: (x + 3) / 6
        acts = [i for i in node.input if g.is_activation(i)]
        return (acts[0] if len(acts) == 1 else None), []
    return (node.input[0] if node.input else None), []


def squeeze_excitation_branches(model) -> list[dict]:
    """Each SE branch: {"mul": gate Mul, "nodes": [pool, conv, activation..., conv, gate]} (node names). ``model``: an
    ONNX model or a graph view of one."""
    g = model if isinstance(model, QdqGraph) else QdqGraph(model)
    found = []
    for mul in g.nodes:
        if mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        for gate_t, x_t in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            gate = g.producer.get(gate_t)
            if gate is None or gate.op_type not in GATES or gate.input[0] == x_t:  # x·sigmoid(x) is SiLU, not SE
                continue
            nodes, convs, t = [], 0, gate.input[0]
            for _ in range(16):
                node = g.producer.get(t)
                if node is None:
                    break
                if node.op_type in DATA_MOVEMENT_OPS:  # Keras/tf2onnx: pool → Squeeze → Reshape → conv (NHWC's SE)
                    nodes.append(node.name)
                    t = node.input[0]
                elif node.op_type == "Conv":
                    convs += 1
                    nodes.append(node.name)
                    t = node.input[0]
                elif node.op_type in POOLS:
                    if convs == 2 and g.source(node.input[0]) == g.source(x_t):  # the gate itself too: its input stays float
                        found.append({"mul": mul.name, "nodes": [node.name] + nodes[::-1] + [gate.name]})
                    break
                elif node.op_type in ACTIVATIONS and convs == 1:
                    t, extra = _activation_input(g, node)
                    if t is None:
                        break
                    nodes += [node.name, *extra]
                else:
                    break
            break
    return found


def squeeze_excitation_nodes(model) -> list[str]:
    return [n for branch in squeeze_excitation_branches(model) for n in branch["nodes"]]
