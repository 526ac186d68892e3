"""Where INT8 goes: one description, read by both quantizers and the lint.

``RULES`` says, per op class and per placement, which ops get INT8 inputs (and weights), which stay float, and which
Adds get a skip-input quantizer. Readers:

- the ONNX Q/DQ placement (``quantize/qdq.py``): the op types it quantizes (``int8_op_types``) and the nodes it leaves
  float (``float_nodes``);
- the ModelOpt placement on the PyTorch model (``quantize/modelopt_torch.py``): the rule of each module class
  (``module_rule``), whose quantizers it disables where that rule is FLOAT;
- the lint (rule QD011): a compute op left float by a rule is "float, as it should be", not a defect.

Each rule names its ONNX op types, the PyTorch ``torch.nn`` class names of the same layer (strings, so that the lint
stage imports no torch), an optional node test beyond the op type, and why, with its source. Residual Adds: the rule
here says *that* they get the skip-input form for TensorRT; *which* input is the skip input is graph work
(``QdqGraph.residual_conv_input`` / ``modelopt_torch._residual_rule``, both after TensorRT's guide and ModelOpt's
``build_non_residual_input_map``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import onnx

from qdeploy.utils.onnx_graph import OnnxGraph

INT8 = "int8"              # Q/DQ on the activation input(s) and on the weight
FLOAT = "float"            # no Q/DQ of its own: computed in float from whatever its producer gives it
SKIP_INPUT = "skip-input"  # residual Add: Q/DQ on the skip input only (both inputs, one scale, where no conv path fuses)


@dataclass(frozen=True)
class OpRule:
    name: str
    roles: dict                            # placement -> INT8 | FLOAT | SKIP_INPUT (a placement not named: not covered)
    onnx_ops: tuple[str, ...]
    torch_modules: tuple[str, ...] = ()    # torch.nn class names of the same layer (ModelOpt quantizes modules)
    applies: Optional[Callable[[OnnxGraph, onnx.NodeProto], bool]] = None  # beyond the op type
    expand: Optional[Callable[[OnnxGraph, onnx.NodeProto], list]] = None   # the whole pattern an anchor node stands for
    why: str = ""

    def role(self, placement: str) -> Optional[str]:
        return self.roles.get(placement)

    def matches(self, g: OnnxGraph, node: onnx.NodeProto) -> bool:
        return node.op_type in self.onnx_ops and (self.applies is None or self.applies(g, node))


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
             "preceding GEMM; quantizing its pieces separately adds four roundings (as SiLU's did on EfficientNet, "
             "issue #8)")

RULES: list[OpRule] = [
    OpRule("conv", {"tensorrt": INT8, "onnxruntime": INT8}, ("Conv", "ConvTranspose"),
           ("Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"),
           why="TensorRT's INT8 convolution kernels (explicit quantization: Q/DQ on input and weights) and ONNX "
               "Runtime's QLinearConv"),
    OpRule("linear", {"tensorrt": INT8, "onnxruntime": INT8}, ("Gemm", "MatMul"), ("Linear",), applies=_has_weight,
           why="a Linear (Gemm, or MatMul with a weight, on 2-D or 3-D tensors): Q/DQ on input and weight, as "
               "ModelOpt's INT8_DEFAULT_CFG (every nn.Linear) and its ONNX INT8 (MatMul/Gemm) place them"),
    OpRule("attention-matmul", {"tensorrt": FLOAT, "onnxruntime": INT8}, ("MatMul",), applies=_two_activations,
           why=ATTENTION_MATMUL + ". ONNX Runtime's placement quantizes them: its QDQ format wraps every tensor its "
               "quantized neighbours (Reshape, Transpose, Mul) touch, and its graph optimizer fuses DQ → MatMul → Q into "
               "QLinearMatMul whether or not the quantizer listed the MatMul"),
    OpRule("layernorm", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("LayerNormalization",), ("LayerNorm",),
           why=_NORM_WHY),
    OpRule("softmax", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("Softmax",), ("Softmax",), why=_SOFTMAX_WHY),
    OpRule("gelu", {"tensorrt": FLOAT, "onnxruntime": FLOAT}, ("Gelu", "Erf"), ("GELU",),
           applies=lambda g, n: n.op_type == "Gelu" or bool(_gelu_nodes(g, n)),
           expand=lambda g, n: [n] if n.op_type == "Gelu" else _gelu_nodes(g, n), why=_GELU_WHY),
    OpRule("gating-mul", {"onnxruntime": FLOAT}, ("Mul",), applies=_two_activations,
           why="a Mul of two activations (squeeze-excitation's x·gate, SiLU's x·σ(x), GELU's pieces) stays float in the "
               "ONNX Runtime placement: ONNX Runtime's QLinearMul (requantizing, broadcasting the gate) costs 3.7-5x its "
               "float Mul's kernel time, batch 32, 2 threads, AVX2 (bench/ort_op_profile.py: EfficientNet-B0@48 9.5 vs "
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


# ONNX Runtime placement: which quantized convs ONNX Runtime can run in INT8 at all (measured, issue #23)
CONV_FLOAT_OUTPUT_WHY = (
    "a Conv whose output is not quantized stays float in the ONNX Runtime placement: ONNX Runtime's CPU provider runs a "
    "quantized Conv only as QLinearConv, which its QDQ transformer fuses from DequantizeLinear → Conv → QuantizeLinear "
    "with the Q as the conv's only consumer; without it (its consumer stays float: SiLU/hardswish kept whole, a float "
    "squeeze-excitation branch, an excluded layer) the Conv runs in float on input and weights dequantized at every "
    "call, outside the NCHWc layout FP32 convs get. Conv kernel time, INT8 graph vs FP32 graph, batch 32, 2 threads, "
    "AVX2 (bench/ort_op_profile.py): EfficientNet-B0@48 120.8 vs 18.8 ms, MobileNetV3@64 57.2 vs 16.1 ms, MobileViT-XXS "
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
    return [r for r in RULES if r.role(placement) is not None]


def int8_op_types(placement: str) -> list[str]:
    """ONNX op types a placement puts Q/DQ on (INT8 and skip-input roles), in RULES order."""
    out = []
    for r in rules(placement):
        if r.role(placement) in (INT8, SKIP_INPUT):
            out += [t for t in r.onnx_ops if t not in out]
    return out


def rule_for(g: OnnxGraph, node: onnx.NodeProto, placement: str = "tensorrt") -> Optional[OpRule]:
    """The first rule of ``placement`` that matches ``node`` (earlier rules win), or None."""
    return next((r for r in rules(placement) if r.matches(g, node)), None)


def float_nodes(g: OnnxGraph, placement: str = "tensorrt") -> dict[str, str]:
    """{node name: why it stays float}: every node whose first matching rule is FLOAT for ``placement``, with the rest
    of its pattern (a decomposed GELU)."""
    out: dict[str, str] = {}
    for node in g.nodes:
        r = rule_for(g, node, placement)
        if r is not None and r.role(placement) == FLOAT:
            for n in (r.expand(g, node) if r.expand else [node]):
                out.setdefault(n.name or n.output[0], r.why)
    return out


def _module_names(module_type: type) -> set[str]:
    return {c.__name__ for c in module_type.__mro__ if c.__module__.startswith("torch.nn")}


def module_rule(module_type: type, placement: str = "tensorrt") -> Optional[OpRule]:
    """The rule a PyTorch module class falls under (through its torch.nn base classes), or None."""
    names = _module_names(module_type)
    return next((r for r in rules(placement) if names & set(r.torch_modules)), None)


def attention_matmuls(g: OnnxGraph) -> list[onnx.NodeProto]:
    """MatMuls whose two inputs are both computed from the model input (no weight on either side), however the
    attention is written (timm's fused qkv + SDPA, nn.MultiheadAttention, separate q/k/v Linears)."""
    return [n for n in g.nodes if n.op_type == "MatMul" and _two_activations(g, n)]


@contextlib.contextmanager
def extra_rule(rule: OpRule, first: bool = True) -> Iterator[OpRule]:
    """Add a rule for the duration of a block (tests, experiments): first, it overrides the rules after it."""
    RULES.insert(0 if first else len(RULES), rule)
    try:
        yield rule
    finally:
        RULES.remove(rule)


__all__ = ["ATTENTION_MATMUL", "CONV_FLOAT_OUTPUT_WHY", "convs_without_int8_kernel", "FLOAT", "INT8", "OpRule", "RULES", "SKIP_INPUT", "attention_matmuls", "extra_rule",
           "float_nodes", "int8_op_types", "module_rule", "rule_for", "rules"]
