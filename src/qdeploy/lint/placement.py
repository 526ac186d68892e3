"""Where INT8 goes: one description (``OP_RULES``) and the one plan computed from it (``placement_plan``).

``OP_RULES`` says, per op class and per placement, which ops get INT8 inputs (and weights), which stay float, and which
Adds get a skip-input quantizer. ``placement_plan`` applies them to an ONNX graph (the exported FP32 model, or a Q/DQ
file seen through its Q/DQ): for each node the rule that decided it, its role and the inputs that carry Q/DQ. Readers:

- the ONNX Q/DQ quantizer (``quantize/qdq.py``): the nodes it leaves float and the tensors it calibrates;
- the ModelOpt quantizer on the PyTorch model (``quantize/modelopt_torch.apply_plan``): ModelOpt puts its quantizers
  on modules; a quantizer stays on only where the plan wants a Q/DQ, and a node the plan makes INT8 that no quantizer
  reaches (a functional ``F.linear`` on a module's weight) makes that route give way to the ONNX quantizer;
- the lint (rule QD011): a compute op the plan makes INT8 and the file leaves float is a finding; one a rule keeps float
  is "float, as it should be", with the rule's reason.

Each rule names its ONNX op types, an optional node test beyond the op type, and why, with its source. The compute ops
(``COMPUTE_OPS``: the ops that carry the multiply-accumulates INT8 is for) are the op types of the rules marked
``compute``. Residual Adds: the rule here says *that* they get the skip-input form for TensorRT; *which* input is the
skip input is graph work (``QdqGraph.residual_conv_input``, after TensorRT's guide and ModelOpt's
``build_non_residual_input_map``). ONNX Runtime placement: ops no rule names are left to ONNX Runtime's quantizer
(its QDQ registry), the plan lists only what the rules decide.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import onnx

from qdeploy.config import PLACEMENTS
from qdeploy.facts.tensorrt import conv_int8_supported
from qdeploy.lint.patterns import squeeze_excitation_nodes
from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.utils.onnx_graph import OnnxGraph

INT8 = "int8"              # Q/DQ on the activation input(s) and on the weight
FLOAT = "float"            # no Q/DQ of its own: computed in float from whatever its producer gives it
SKIP_INPUT = "skip-input"  # residual Add: Q/DQ on the skip input only (both inputs, one scale, where no conv path fuses)


@dataclass(frozen=True)
class OpRule:
    name: str
    roles: dict                            # placement -> INT8 | FLOAT | SKIP_INPUT (a placement not named: not covered)
    onnx_ops: tuple[str, ...]              # ANY_OP: every op type (a pattern's test decides)
    applies: Optional[Callable[[QdqGraph, onnx.NodeProto], bool]] = None  # beyond the op type
    expand: Optional[Callable[[QdqGraph, onnx.NodeProto], list]] = None   # the whole pattern an anchor node stands for
    why: str = ""
    compute: bool = False                  # its ops carry the multiply-accumulates (COMPUTE_OPS, MAC shares)

    def __post_init__(self):
        unknown = set(self.roles) - set(PLACEMENTS)
        if unknown:
            raise ValueError(f"rule {self.name}: unknown placement(s) {sorted(unknown)} (config.PLACEMENTS)")

    def role(self, placement: str) -> Optional[str]:
        return self.roles.get(placement)

    def matches(self, g: QdqGraph, node: onnx.NodeProto) -> bool:
        return (ANY_OP in self.onnx_ops or node.op_type in self.onnx_ops) and (self.applies is None or self.applies(g, node))


ANY_OP = "*"


def _has_weight(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    """One of the first two inputs is computed from constants alone (a weight, maybe through Transpose or Q/DQ)."""
    dynamic = g.from_input
    return any(i and i not in dynamic for i in node.input[:2])


def _two_activations(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    dynamic = g.from_input
    return len(node.input) == 2 and all(i in dynamic for i in node.input)


def _gelu_nodes(g: OnnxGraph, erf: onnx.NodeProto) -> list:
    """The nodes of an exported exact GELU around its Erf: x/√2 (Div or Mul by a constant) → Erf → +1 → ·x → ·0.5
    (torch.onnx's form of nn.GELU and F.gelu; the ·0.5 may come first, on x). [] when the Erf is not such a GELU."""
    pre = g.producer.get(erf.input[0])
    if pre is None or pre.op_type not in ("Div", "Mul") or not g.is_constant(pre.input[1]):
        return []
    x = pre.input[0]
    out = [pre, erf]
    add = _only_consumer(g, erf.output[0], "Add")
    if add is None or not any(g.is_constant(i) for i in add.input):
        return []
    out.append(add)
    mul = _only_consumer(g, add.output[0], "Mul")
    if mul is None:
        return []
    other = next(i for i in mul.input if i != add.output[0])
    half = g.producer.get(other)
    if other != x and (half is None or half.op_type != "Mul" or x not in half.input):
        return []
    out.append(mul)
    if other != x:
        out.append(half)  # 0.5·x first
    else:
        last = _only_consumer(g, mul.output[0], "Mul")
        if last is not None and any(g.is_constant(i) for i in last.input):
            out.append(last)
    return out


_PASS_THROUGH = ("Reshape", "Transpose", "Cast", "Identity", "Squeeze", "Unsqueeze", "Flatten")


def _feeds_softmax(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    """The node's output reaches a Softmax through data-movement ops only (an attention mask or bias Add, a scale)."""
    frontier, seen = [node.output[0]], set()
    while frontier:
        t = frontier.pop()
        for c in g.consumers.get(t, []):
            if c.op_type == "Softmax":
                return True
            if c.op_type in _PASS_THROUGH and id(c) not in seen:
                seen.add(id(c))
                frontier.extend(c.output)
    return False


def _only_consumer(g: OnnxGraph, tensor: str, op_type: str):
    users = g.consumers.get(tensor, [])
    return users[0] if len(users) == 1 and users[0].op_type == op_type else None


ATTENTION_MATMUL = (
    "a MatMul of two activations (attention's Q·Kᵀ and softmax·V) stays float: ModelOpt's ONNX INT8 matches the chain "
    "MatMul → (Add) → Softmax → MatMul as a non-quantizable partition (modelopt/onnx/quantization/partitioning.py) and "
    "its PyTorch INT8_DEFAULT_CFG puts no quantizer on these matmuls (they are not modules), and TensorRT runs attention "
    "in its fused FP16 kernels; an INT8 matmul would need both inputs quantized, softmax's output included")
_NORM_WHY = ("LayerNorm stays float: ModelOpt's ONNX INT8 matches LayerNormalization (and its ReduceMean/Sub/Pow/… "
             "decomposition) as a non-quantizable partition (modelopt/onnx/quantization/partitioning.py, "
             "find_layer_norm_partitions); TensorRT has no INT8 normalization kernel and ONNX Runtime's CPU none either, so "
             "a Q/DQ of its own only adds rounding to a statistic over the channels; PTQ4ViT/RepQ-ViT keep it float")
_SOFTMAX_WHY = ("Softmax stays float: inside ModelOpt's attention partition (MatMul → Softmax → MatMul) and in "
                "ONNX Runtime's transformer recipes; its output spans [0, 1] with most mass near 0, which a per-tensor "
                "INT8 scale resolves poorly (PTQ4ViT's twin-uniform quantization exists for it)")
_GELU_WHY = ("GELU stays whole and float: ModelOpt's ONNX INT8 matches Div → Erf → Add → Mul → Mul as a "
             "non-quantizable pattern (partitioning.py, find_hardcoded_patterns) and TensorRT fuses it into the "
             "preceding GEMM; quantizing its pieces separately adds four roundings (as SiLU's did on EfficientNet: "
             "docs/results/int8/issue8_peer_ptq_split_efficientnet_b0_48.json)")

def conv_runs_int8_in_tensorrt(g: QdqGraph, conv: onnx.NodeProto) -> Optional[bool]:
    """Whether TensorRT has an INT8 kernel for this Conv (``facts.tensorrt.conv_int8_supported``); None: shape unknown."""
    w = g.shapes.get(g._through_qdq(conv.input[1])) if len(conv.input) > 1 else None
    if not w or len(w) < 3 or any(d is None for d in w[:2]):
        return None
    kernel = g.attr(conv, "kernel_shape", None) or w[2:]
    first = g._through_qdq(conv.input[0]) in g.input_names
    return conv_int8_supported(w[0], w[1], int(g.attr(conv, "group", 1)), kernel, first)


# A detector's prediction head: what lies between its last compute ops and a graph output when the way there decodes or
# merges predictions (Sigmoid/Softmax/Exp/Tanh of scores and box offsets, the Concat of scales or of box and class
# rows) — and only data movement and elementwise arithmetic otherwise. A classifier's Gemm → (Softmax) and a segmenter's
# conv → Resize are not heads here (no Conv, or a Resize on the way), so their plans do not change.
# Clip/Min/Max: the clamp of decoded boxes to the image (torchvision's box_ops.clip_boxes_to_image, SSD's and Faster
# R-CNN's postprocess; YOLOv5's clip_boxes): without them the walk stopped at the clamp, and an SSD's anchor arithmetic
# (centre = x1 + 0.5·w of a batch-tiled anchor tensor: an Add of two activations) was taken for a residual Add and given
# one INT8 scale over pixel coordinates (torchvision SSDlite on BCCD, TensorRT placement: mAP 40.3 → 8.7).
_HEAD_DECODE_OPS = ("Concat", "Sigmoid", "Softmax", "Exp", "Tanh")
_HEAD_TAIL_OPS = _HEAD_DECODE_OPS + _PASS_THROUGH + ("Split", "Slice", "Gather", "Mul", "Add", "Sub", "Div", "Pow",
                                                     "Clip", "Min", "Max")


def prediction_head(g: OnnxGraph) -> tuple[set, set]:
    """(prediction convs, tail nodes) of ``g``'s prediction head, by name: walking back from every graph output through
    :data:`_HEAD_TAIL_OPS`, the tail is what is passed and the Convs where each path stops are the prediction convs;
    both empty unless the tail holds one of :data:`_HEAD_DECODE_OPS` and a path stops at a Conv."""
    cached = g.__dict__.get("_prediction_head")
    if cached is not None:
        return cached
    producers = {o: n for n in g.nodes for o in n.output}
    tail, convs, seen = set(), set(), set()
    frontier = [o for o in g.output_names]
    while frontier:
        t = frontier.pop()
        n = producers.get(t)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        name = n.name or n.output[0]
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            frontier.extend(n.input[:1])
        elif n.op_type in ("Conv", "ConvTranspose"):
            convs.add(name)
        elif n.op_type in _HEAD_TAIL_OPS:
            tail.add(name)
            frontier.extend(i for i in n.input if i and not g.is_constant(i))
    decodes = any(n.op_type in _HEAD_DECODE_OPS for n in g.nodes if (n.name or n.output[0]) in tail)
    out = (convs, tail) if decodes and convs else (set(), set())
    g.__dict__["_prediction_head"] = out
    return out


def _prediction_conv(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    return (node.name or node.output[0]) in prediction_head(g)[0]


def _prediction_tail(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    return (node.name or node.output[0]) in prediction_head(g)[1]


PREDICTION_CONV_WHY = (
    "a detector's prediction conv (its output reaches the model output through decoding and concatenation only) stays "
    "float: TensorRT runs a network's last convolution with FP32 output anyway, NVIDIA's YOLOv7 QAT recipe "
    "(NVIDIA-AI-IOT/yolo_deepstream, yolov7_qat: --ignore_layers model.105.m, the Detect head's output convs) keeps "
    "them float, and their outputs are box offsets and scores compared down to 0.001, where an INT8 step matters; "
    "they are a small share of the MACs")
PREDICTION_TAIL_WHY = (
    "a detector's output decoding (Sigmoid/Softmax/Exp/Tanh of scores and box offsets, the arithmetic with grids and "
    "strides, the Concat of scales or of box and class rows) stays float: OpenVINO's YOLOv8 INT8 recipe (NNCF "
    "IgnoredScope of the head's Sigmoid/Mul/Sub/Add/Concat and DFL conv) does, and one INT8 scale over a Concat of "
    "probabilities in [0, 1] and box offsets of several units rounds the scores to a few levels (FastestDet, ONNX Runtime "
    "placement: mAP 32.95 → 27.43 with its output Concat quantized)")


def _in_squeeze_excitation(g: QdqGraph, node: onnx.NodeProto) -> bool:
    nodes = g.__dict__.get("_se_nodes")
    if nodes is None:
        nodes = g.__dict__["_se_nodes"] = set(squeeze_excitation_nodes(g))
    return (node.name or node.output[0]) in nodes


NARROW_CONV_WHY = ("TensorRT has no INT8 kernel for a conv this narrow: it would run in float with reformats on both sides "
                   "(ModelOpt's find_nodes_from_convs_to_exclude, int8 mode; facts.tensorrt.conv_int8_supported)")
SQUEEZE_EXCITATION_WHY = (
    "squeeze-excitation branch kept float (NNCF's SE_BLOCK ignored pattern): the gate multiplies every channel of the "
    "block, so an error in its 1x1 convs scales a whole feature map, and the branch computes on a Cx1x1 vector, so float "
    "costs next to nothing (lint/patterns.py: CIFAR-10 EfficientNet-B0 76.5 % with the branch INT8, 80.0 % float)")

OP_RULES: list[OpRule] = [
    # pattern rules first: earlier rules win, and these take nodes the op-class rules below would make INT8
    OpRule("squeeze-excitation", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, (ANY_OP,), applies=_in_squeeze_excitation,
           why=SQUEEZE_EXCITATION_WHY),
    OpRule("prediction-conv", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("Conv", "ConvTranspose"),
           applies=_prediction_conv, compute=True, why=PREDICTION_CONV_WHY),
    OpRule("prediction-output", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, _HEAD_TAIL_OPS, applies=_prediction_tail,
           why=PREDICTION_TAIL_WHY),
    OpRule("narrow-conv", {"tensorrt": FLOAT}, ("Conv",), applies=lambda g, n: conv_runs_int8_in_tensorrt(g, n) is False,
           compute=True, why=NARROW_CONV_WHY),
    OpRule("conv", {"tensorrt": INT8, "onnxruntime": INT8}, ("Conv", "ConvTranspose"),
           compute=True, why="TensorRT's INT8 convolution kernels (explicit quantization: Q/DQ on input and weights) and ONNX "
               "Runtime's QLinearConv"),
    OpRule("linear", {"tensorrt": INT8, "onnxruntime": INT8}, ("Gemm", "MatMul"), applies=_has_weight, compute=True,
           why="a Linear (Gemm, or MatMul with a weight, on 2-D or 3-D tensors): Q/DQ on input and weight, as "
               "ModelOpt's INT8_DEFAULT_CFG (every nn.Linear) and its ONNX INT8 (MatMul/Gemm) place them"),
    OpRule("attention-matmul", {"tensorrt": FLOAT, "onnxruntime": INT8}, ("MatMul",), applies=_two_activations, compute=True,
           why=ATTENTION_MATMUL + ". ONNX Runtime's placement quantizes them: its QDQ format wraps every tensor its "
               "quantized neighbours (Reshape, Transpose, Mul) touch, and its graph optimizer fuses DQ → MatMul → Q into "
               "QLinearMatMul whether or not the quantizer listed the MatMul"),
    OpRule("softmax-input", {"tensorrt": FLOAT}, ("Add", "Sub", "Mul", "Div"), applies=_feeds_softmax,
           why="an Add/Mul between attention's Q·Kᵀ and its Softmax (a mask or position bias, a scale) stays float for "
               "TensorRT: it is inside ModelOpt's non-quantizable attention partition MatMul → (Add) → Softmax → MatMul "
               "(modelopt/onnx/quantization/partitioning.py) and TensorRT's fused attention; a mask built at run time "
               "(torchvision's shifted-window Swin) is an Add of two activations that the residual-add rule would "
               "otherwise quantize, with the -100 mask in its range: softmax output at 18 dB SQNR (bench/diagnose/ort_gap.py, "
               "docs/heldout_findings.md)"),
    OpRule("layernorm", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("LayerNormalization",),
           why=_NORM_WHY),
    OpRule("softmax", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("Softmax",), why=_SOFTMAX_WHY),
    OpRule("gelu", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("Gelu", "Erf"),
           applies=lambda g, n: n.op_type == "Gelu" or bool(_gelu_nodes(g, n)),
           expand=lambda g, n: [n] if n.op_type == "Gelu" else _gelu_nodes(g, n), why=_GELU_WHY),
    OpRule("gating-mul", {"onnxruntime": FLOAT}, ("Mul",), applies=_two_activations,
           why="a Mul of two activations (squeeze-excitation's x·gate, SiLU's x·σ(x), GELU's pieces) stays float in the "
               "ONNX Runtime placement: ONNX Runtime's QLinearMul (requantizing, broadcasting the gate) costs 3.7-5x its "
               "float Mul's kernel time, batch 32, 2 threads, AVX2 (bench/diagnose/ort_op_profile.py: EfficientNet-B0@48 9.5 vs "
               "2.5 ms, MobileNetV3@64 5.3 vs 1.4, DeiT-tiny 10.1 vs 2.0, ConvNeXt-atto 5.5 vs 1.0); with Mul float "
               "EfficientNet-B0's INT8 graph went from 1.59x to 1.13x FP32's time. Elementwise work is memory-bound: "
               "INT8 saves arithmetic, which it does not have"),
    OpRule("global-pool", {"onnxruntime": FLOAT}, ("GlobalAveragePool",),
           why="GlobalAveragePool stays float in the ONNX Runtime placement: QLinearGlobalAveragePool costs 2.5x the "
               "float kernel (EfficientNet-B0@48 1.38 vs 0.53 ms, MobileNetV3@64 0.80 vs 0.32 ms, batch 32, 2 threads, "
               "AVX2) and a mean over the map is not arithmetic-bound either"),
    OpRule("residual-add", {"tensorrt": SKIP_INPUT, "onnxruntime": INT8}, ("Add",),
           applies=lambda g, n: not any(g.is_constant(i) for i in n.input),
           why="TensorRT fuses Conv(+BN)(+act)+Add into one INT8 kernel when only the skip input is quantized (developer "
               "guide, Q/DQ layer-placement recommendations; ModelOpt's build_non_residual_input_map); ONNX Runtime runs "
               "QLinearAdd"),
]


# the op types that carry a model's multiply-accumulates: the MAC shares, the lint's compute ops, the sensitivity layers
COMPUTE_OPS: tuple[str, ...] = tuple(dict.fromkeys(t for r in OP_RULES if r.compute for t in r.onnx_ops))


# ONNX Runtime placement: which quantized convs ONNX Runtime can run in INT8 at all (bench/diagnose/ort_op_profile.py)
CONV_FLOAT_OUTPUT_WHY = (
    "a Conv whose output is not quantized stays float in the ONNX Runtime placement: ONNX Runtime's CPU provider runs a "
    "quantized Conv only as QLinearConv, which its QDQ transformer fuses from DequantizeLinear → Conv → QuantizeLinear "
    "with the Q as the conv's only consumer; without it (its consumer stays float: SiLU/hardswish kept whole, a float "
    "squeeze-excitation branch, an excluded layer) the Conv runs in float on input and weights dequantized at every "
    "call, outside the NCHWc layout FP32 convs get. Conv kernel time, INT8 graph vs FP32 graph, batch 32, 2 threads, "
    "AVX2 (bench/diagnose/ort_op_profile.py): EfficientNet-B0@48 120.8 vs 18.8 ms, MobileNetV3@64 57.2 vs 16.1 ms, MobileViT-XXS "
    "24.7 vs 7.9 ms. MatMul and Gemm keep their Q/DQ: ONNX Runtime has INT8 kernels with a float output for them "
    "(MatMulIntegerToFloat, QGemm). Int8Config.quantized_conv_outputs keeps such convs INT8 by quantizing their output "
    "instead (QLinearConv; one more rounding before the activation)")


def convs_without_int8_kernel(model: onnx.ModelProto) -> list[str]:
    """Names of the Convs of an ONNX Runtime-placement Q/DQ model that have a dequantized weight but whose output does
    not go to QuantizeLinear only (so ONNX Runtime cannot fuse them into QLinearConv: CONV_FLOAT_OUTPUT_WHY)."""
    consumers: dict[str, list] = {}
    producer = {}
    for node in model.graph.node:
        for t in node.input:
            consumers.setdefault(t, []).append(node)
        for t in node.output:
            producer[t] = node
    outputs = {o.name for o in model.graph.output}
    out = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        # a quantized weight marks a conv the placement meant to run in INT8 (a float conv may still read a DQ'd input
        # that other, quantized consumers share)
        dq_in = len(node.input) > 1 and getattr(producer.get(node.input[1]), "op_type", None) == "DequantizeLinear"
        users = consumers.get(node.output[0], [])
        fused = bool(users) and node.output[0] not in outputs and all(u.op_type == "QuantizeLinear" for u in users)
        if dq_in and not fused:
            out.append(node.name or node.output[0])
    return out


def rules(placement: str) -> list[OpRule]:
    return [r for r in OP_RULES if r.role(placement) is not None]


def int8_op_types(placement: str) -> list[str]:
    """ONNX op types a placement puts Q/DQ on (INT8 and skip-input roles), in OP_RULES order."""
    out = []
    for r in rules(placement):
        if r.role(placement) in (INT8, SKIP_INPUT):
            out += [t for t in r.onnx_ops if t not in out]
    return out


def rule_for(g: OnnxGraph, node: onnx.NodeProto, placement: str = "tensorrt") -> Optional[OpRule]:
    """The first rule of ``placement`` that matches ``node`` (earlier rules win), or None."""
    if not isinstance(g, QdqGraph):  # the rules read shapes and see through Q/DQ: one Q/DQ view per graph
        g = g.__dict__.setdefault("_qdq_view", QdqGraph(g.model))
    return next((r for r in rules(placement) if r.matches(g, node)), None)


@dataclass(frozen=True)
class Decision:
    role: str                    # INT8 | FLOAT | SKIP_INPUT
    rule: str                    # the rule's name, or "excluded" (the user's exclude)
    why: str
    quantized_inputs: tuple = () # input indices that carry Q/DQ (INT8: activation and weight; SKIP_INPUT: the skip)


@dataclass
class PlacementPlan:
    """Per node of one graph: the decision of the first rule that matched it (nodes no rule names are absent)."""
    placement: str
    decisions: dict = field(default_factory=dict)   # node name -> Decision
    shared_scale_adds: list = field(default_factory=list)  # Adds of two activations with no conv path: one scale
    compute_nodes: list = field(default_factory=list)      # names of the graph's compute nodes (COMPUTE_OPS), in order

    def float_nodes(self, rule: Optional[str] = None) -> dict[str, str]:
        """{node: why} of the nodes left float (by ``rule`` only, if given)."""
        return {n: d.why for n, d in self.decisions.items() if d.role == FLOAT and (rule is None or d.rule == rule)}

    def wants(self, node: str, index: int) -> bool:
        """Whether input ``index`` of ``node`` carries a Q/DQ in this plan."""
        d = self.decisions.get(node)
        return d is not None and d.role != FLOAT and index in d.quantized_inputs

    def int8_compute(self) -> list[str]:
        return [n for n in self.compute_nodes if self.decisions.get(n) is not None and self.decisions[n].role == INT8]

    def uncovered(self, g: QdqGraph) -> dict[str, str]:
        """{compute node: what is missing} for the compute nodes this plan (made on the Q/DQ graph ``g``) makes INT8
        and ``g`` leaves without a Q/DQ on an input the plan quantizes."""
        out = {}
        for node in g.nodes:
            name = node.name or node.output[0]
            d = self.decisions.get(name)
            if d is None or d.role != INT8 or name not in self.compute_nodes:
                continue
            missing = [i for i in d.quantized_inputs if i < len(node.input) and g.dq_of(node.input[i]) is None]
            if missing:
                out[name] = f"{node.op_type} without Q/DQ on input {', '.join(map(str, missing))} (rule {d.rule})"
        return out

    def summary(self) -> dict:
        by_rule: dict[str, dict] = {}
        for n, d in self.decisions.items():
            by_rule.setdefault(d.rule, {"role": d.role, "nodes": 0})["nodes"] += 1
        return {"placement": self.placement, "compute_nodes": len(self.compute_nodes),
                "int8_compute_nodes": len(self.int8_compute()), "by_rule": by_rule}


def placement_plan(graph, placement: str = "tensorrt", excluded: Optional[dict] = None) -> PlacementPlan:
    """The plan of ``placement`` for an ONNX model or graph (a Q/DQ graph is read through its Q/DQ). ``excluded``: {node:
    why} the user keeps float (decided before any rule)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement '{placement}' (one of {', '.join(PLACEMENTS)})")
    g = graph if isinstance(graph, QdqGraph) else QdqGraph(graph.model if isinstance(graph, OnnxGraph) else graph)
    plan = PlacementPlan(placement)
    decisions = plan.decisions
    for name, why in (excluded or {}).items():
        decisions[name] = Decision(FLOAT, "excluded", why)
    for node in g.nodes:
        name = node.name or node.output[0]
        if node.op_type in COMPUTE_OPS:
            plan.compute_nodes.append(name)
        if name in decisions:
            continue
        r = rule_for(g, node, placement)
        if r is None:
            continue
        role = r.role(placement)
        if role == FLOAT:
            for n in (r.expand(g, node) if r.expand else [node]):
                n_name = n.name or n.output[0]
                if decisions.get(n_name) is None or decisions[n_name].rule != "excluded":
                    decisions[n_name] = Decision(FLOAT, r.name, r.why)
        elif role == INT8:
            decisions[name] = Decision(INT8, r.name, r.why, tuple(range(min(2, len(node.input)))))
        else:  # SKIP_INPUT: the skip input only, or both with one scale where no conv path fuses the Add
            conv_input, how = g.residual_conv_input(node)
            if conv_input is None:
                plan.shared_scale_adds.append(name)
            decisions[name] = Decision(SKIP_INPUT, r.name, f"{r.why} ({how})",
                                       (0, 1) if conv_input is None else (1 - conv_input,))
    return plan


def float_nodes(g, placement: str = "tensorrt") -> dict[str, str]:
    """{node name: why it stays float}: every node whose first matching rule is FLOAT for ``placement``, with the rest
    of its pattern (a decomposed GELU)."""
    return placement_plan(g, placement).float_nodes()


def compute_nodes(g: OnnxGraph) -> list[onnx.NodeProto]:
    return [n for n in g.nodes if n.op_type in COMPUTE_OPS]


def attention_matmuls(g: OnnxGraph) -> list[onnx.NodeProto]:
    """MatMuls whose two inputs are both computed from the model input (no weight on either side), however the
    attention is written (timm's fused qkv + SDPA, nn.MultiheadAttention, separate q/k/v Linears)."""
    return [n for n in g.nodes if n.op_type == "MatMul" and _two_activations(g, n)]


def layer_norms(g: OnnxGraph) -> list[onnx.NodeProto]:
    """LayerNorms, exported whole (LayerNormalization, opset 17+) or decomposed (a ReduceMean whose input is also the
    first input of the Sub that its output feeds: x - mean(x), the start of the ReduceMean/Sub/Pow/… form older opsets
    and hand-written norms export)."""
    found = []
    for n in g.nodes:
        if n.op_type == "LayerNormalization":
            found.append(n)
        elif n.op_type == "ReduceMean" and any(c.op_type == "Sub" and c.input[0] == n.input[0]
                                               for c in g.consumers.get(n.output[0], [])):
            found.append(n)
    return found


# NNCF's model_type: which scheme its INT8 placement follows on the OpenVINO and ONNX backends
NNCF_TRANSFORMER_WHY = (
    "NNCF's model_type TRANSFORMER first wherever the model has attention or LayerNorm; beside it, NNCF's default (CNN) "
    "scheme on an attention model, and on a LayerNorm model without attention the default scheme with every Add float. "
    "NNCF's default scheme quantizes the tensors around a LayerNorm block (the norm's input after a depthwise conv, the "
    "residual Adds) with one symmetric per-tensor scale each, and in a network normalized by LayerNorm instead of "
    "BatchNorm those tensors can carry a few outlier channels (Bondarenko et al. 2021, 'Understanding and overcoming the "
    "challenges of efficient transformer quantization': the residual sum of LayerNorm models is where per-tensor INT8 "
    "fails); TRANSFORMER keeps Add, MVN and the normalization arithmetic float (min_max/openvino_backend.py, "
    "get_ignored_metatypes) and uses asymmetric activations. Measured with NNCF 3.4 on the OpenVINO model, agreement of "
    "the argmax with FP32, default / TRANSFORMER / default with every Add float (bench/diagnose/nncf_model_type.py, "
    "docs/results/nncf_model_type.json): ../shared's ConvNeXt-atto 15.9 / 96.9 / 96.2 %, a torchvision ConvNeXt trained "
    "on CIFAR-10 20.3 / 96.3 / 96.6 %, a timm MLP-Mixer (LayerNorm, no depthwise conv) 95.9 / 91.1 / 97.4 %; the default "
    "scheme collapsed a timm ConvNeXt-T trained at 224 to 15.0 % (docs/results/realsize_cpu_xeon.json). Without "
    "attention neither TRANSFORMER nor the default held on every model, and the default with float Adds was within 0.7 "
    "points of the better one on all three. With attention the default scheme held where measured (../shared's ViT "
    "94.9 / 97.2 / 96.2 %, its Swin 98.4 / 96.9 / 98.7 %; a Swin-T trained at 224 94.5 % against TRANSFORMER's 80 %), "
    "and which scheme runs faster depends on the batch and the CPU: a DeiT-S at 224 on a 16-core AMX Xeon ran NNCF's "
    "default IR at 0.89x TRANSFORMER's latency at batch 16 and 1.39x at batch 1 (realsize_cpu_xeon.json); so both are "
    "measured, each judged by the budget like any candidate")


@dataclass(frozen=True)
class NncfScheme:
    """One way to call NNCF: its ``model_type`` ('transformer' or 'cnn', its default) and op types kept float beside
    what that scheme leaves float itself (an IgnoredScope of types)."""
    model_type: str
    float_ops: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.model_type + "".join(f"-float-{op.lower()}" for op in self.float_ops)


def nncf_schemes(g: OnnxGraph) -> tuple[NncfScheme, ...]:
    """NNCF's schemes worth measuring on this graph, the first the one a single quantization takes:
    NNCF_TRANSFORMER_WHY."""
    if attention_matmuls(g):
        return (NncfScheme("transformer"), NncfScheme("cnn"))
    if layer_norms(g):
        return (NncfScheme("transformer"), NncfScheme("cnn", ("Add",)))
    return (NncfScheme("cnn"),)


@contextlib.contextmanager
def extra_rule(rule: OpRule, first: bool = True) -> Iterator[OpRule]:
    """Add a rule for the duration of a block (tests, experiments): first, it overrides the rules after it."""
    OP_RULES.insert(0 if first else len(OP_RULES), rule)
    try:
        yield rule
    finally:
        OP_RULES.remove(rule)


__all__ = ["ANY_OP", "ATTENTION_MATMUL", "COMPUTE_OPS", "CONV_FLOAT_OUTPUT_WHY", "Decision", "FLOAT", "INT8", "NARROW_CONV_WHY",
           "NNCF_TRANSFORMER_WHY", "NncfScheme", "OpRule", "PlacementPlan", "OP_RULES", "SKIP_INPUT", "SQUEEZE_EXCITATION_WHY",
           "attention_matmuls", "layer_norms", "nncf_schemes",
           "compute_nodes", "conv_runs_int8_in_tensorrt", "convs_without_int8_kernel", "extra_rule", "float_nodes",
           "int8_op_types", "placement_plan", "rule_for", "rules"]
