"""Lint rules: each one a function over a :class:`QdqGraph` that yields findings.

A rule is registered with :func:`rule` (id, name, severity, whether its fix is safe); add a rule by
writing one more decorated function here, and, when it has a safe fix, a fixer in fixes.py keyed by the
same rule id. Severities:

``blocks-int8``     TensorRT will not run the named layer in INT8 (or will reject the graph);
``costs-reformat``  it runs, but a Q/DQ placement splits a fusion or forces a requantize/reformat kernel;
``fine``            worth knowing, no speed cost to expect (e.g. a conv left float that TensorRT would not
                    run in INT8 anyway).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import numpy as np
import onnx

from qdeploy.lint.placement import FLOAT, COMPUTE_OPS, compute_nodes, conv_runs_int8_in_tensorrt, placement_plan
from qdeploy.lint.qdq_graph import DATA_MOVEMENT_OPS, QdqGraph
from qdeploy.facts.tensorrt import conv_int8_supported  # noqa: F401 (one home: tests check the lint reads it from facts)

SEVERITIES = ("blocks-int8", "costs-reformat", "fine")
POOL_OPS = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
SMALLEST_NORMAL_F32 = float(np.finfo(np.float32).tiny)


@dataclass
class Finding:
    rule: str                 # stable id, e.g. QD001
    name: str                 # short slug, e.g. residual-add-conv-path-qdq
    severity: str
    nodes: list[str]
    message: str              # one sentence: what TensorRT will do
    fix: str                  # what to change
    fixable: bool = False     # `qdeploy lint --fix` applies it
    confirmed: str | None = None   # "confirmed by TensorRT X.Y" details, when an engine was inspected

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Rule:
    id: str
    name: str
    severity: str
    safe_fix: bool
    check: Callable[[QdqGraph], Iterator[Finding]]
    summary: str = ""


RULES: dict[str, Rule] = {}


def rule(id: str, name: str, severity: str, safe_fix: bool = False):
    assert severity in SEVERITIES, severity

    def register(fn):
        RULES[id] = Rule(id, name, severity, safe_fix, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return register


def _finding(id: str, nodes, message: str, fix: str, severity: str | None = None) -> Finding:
    r = RULES[id]
    return Finding(id, r.name, severity or r.severity, [n for n in nodes if n], message, fix, r.safe_fix)


def _name(node) -> str:
    return node.name or node.output[0]


# ---------------------------------------------------------------- residual Adds
@rule("QD001", "residual-add-conv-path-qdq", "costs-reformat", safe_fix=True)
def residual_add_conv_path_qdq(g: QdqGraph):
    """A residual Add has Q/DQ on its conv-path input, which keeps TensorRT from fusing the Conv and the Add."""
    for add in g.residual_adds():
        idx, why = g.residual_conv_input(add)
        if idx is None or g.dq_of(add.input[idx]) is None:
            continue
        conv = g.backbone(g._through_qdq(add.input[idx]))
        yield _finding("QD001", [_name(add), _name(conv) if conv is not None else ""],
                       f"Q/DQ on the output of {_name(conv) if conv is not None else 'the convolution'} forces TensorRT to run "
                       "the Conv and the Add as separate kernels (an INT8 requantize in between) instead of one "
                       "Conv+Add(+ReLU) INT8 kernel",
                       f"remove the Q/DQ on input {idx} of the Add ({why}); keep the one on the skip input")


@rule("QD002", "residual-add-skip-float", "costs-reformat")
def residual_add_skip_float(g: QdqGraph):
    """A residual Add's skip input is float while its conv path is INT8: the fused kernel cannot take an INT8 residual."""
    for add in g.residual_adds():
        idx, why = g.residual_conv_input(add)
        if idx is None:
            continue
        skip = add.input[1 - idx]
        conv = g.backbone(g._through_qdq(add.input[idx]))
        if g.dq_of(skip) is not None or conv is None or g.dq_of(conv.input[0]) is None:
            continue
        yield _finding("QD002", [_name(add)],
                       "the skip input is float, so TensorRT runs the Add (or the fused Conv+Add) with a float residual "
                       "and reformats the INT8 tensors around it",
                       "put Q/DQ on the skip input (qdeploy's TensorRT placement does)")


@rule("QD003", "add-scales-differ", "costs-reformat")
def add_scales_differ(g: QdqGraph):
    """Both inputs of an activation+activation Add are quantized with different scales."""
    for add in g.residual_adds():
        idx, _ = g.residual_conv_input(add)
        if idx is not None:
            continue
        dqs = [g.dq_of(i) for i in add.input[:2]]
        if any(d is None for d in dqs):
            continue
        s = [g.scale(d) for d in dqs]
        if any(x is None or x.size != 1 for x in s) or np.isclose(s[0], s[1], rtol=1e-6).all():
            continue
        yield _finding("QD003", [_name(add)],
                       f"the two inputs carry scales {float(s[0]):.4g} and {float(s[1]):.4g}; TensorRT rescales one of "
                       "them before adding",
                       "quantize both inputs with one shared scale (the larger)")


# ---------------------------------------------------------------- shared scales
def _scale_of_tensor(g: QdqGraph, tensor: str):
    dq = g.dq_of(tensor)
    if dq is None:
        return None, None
    s = g.scale(dq)
    return dq, (float(s.reshape(-1)[0]) if s is not None and s.size == 1 else None)


@rule("QD004", "concat-scales-differ", "costs-reformat", safe_fix=True)
def concat_scales_differ(g: QdqGraph):
    """The quantized inputs of a Concat (or its output's Q) do not share one scale."""
    for node in g.nodes:
        if node.op_type != "Concat":
            continue
        scales = [_scale_of_tensor(g, i)[1] for i in node.input if g.is_activation(i)]
        outs = [q for c in g.consumers.get(node.output[0], []) if c.op_type == "QuantizeLinear" for q in [c]]
        out_scales = [float(g.scale(q).reshape(-1)[0]) for q in outs if g.scale(q) is not None and g.scale(q).size == 1]
        known = [s for s in scales if s is not None] + out_scales
        if len(known) < 2 or np.allclose(known, known[0], rtol=1e-6):
            continue
        yield _finding("QD004", [_name(node)],
                       f"{len(known)} different scales meet at the Concat ({min(known):.4g}…{max(known):.4g}); TensorRT "
                       "cannot concatenate INT8 in place and inserts requantize/reformat kernels",
                       "give the Concat's inputs and output one shared scale (the largest)")


@rule("QD005", "pool-scales-differ", "costs-reformat", safe_fix=True)
def pool_scales_differ(g: QdqGraph):
    """The Q/DQ on both sides of a pooling op have different scales."""
    for node in g.nodes:
        if node.op_type not in POOL_OPS:
            continue
        _, s_in = _scale_of_tensor(g, node.input[0])
        if s_in is None:
            continue
        for q in g.consumers.get(node.output[0], []):
            if q.op_type != "QuantizeLinear":
                continue
            s = g.scale(q)
            if s is not None and s.size == 1 and not np.isclose(float(s.reshape(-1)[0]), s_in, rtol=1e-6):
                yield _finding("QD005", [_name(node), _name(q)],
                               f"the pool's input scale {s_in:.4g} and output scale {float(s.reshape(-1)[0]):.4g} differ, so "
                               "TensorRT cannot move the Q/DQ across the pool and requantizes after it",
                               "use the input's scale for the Q/DQ after the pool")


# ---------------------------------------------------------------- fusions
def _qdq_pair_output(g: QdqGraph, tensor: str):
    """(Q, DQ) when ``tensor`` flows directly into a Q whose DQ output is used, else None."""
    for q in g.consumers.get(tensor, []):
        if q.op_type == "QuantizeLinear":
            for dq in g.consumers.get(q.output[0], []):
                if dq.op_type == "DequantizeLinear":
                    return q, dq
    return None


@rule("QD006", "qdq-inside-conv-bn-relu", "costs-reformat", safe_fix=True)
def qdq_inside_conv_bn_relu(g: QdqGraph):
    """A Q/DQ pair sits between a Conv and its BatchNormalization or activation."""
    for node in g.nodes:
        if node.op_type not in ("BatchNormalization", "Relu", "LeakyRelu", "Clip"):
            continue
        dq = g.dq_of(node.input[0])
        if dq is None:
            continue
        src = g.float_input_of(dq)
        prod = g.producer.get(src) if src else None
        if prod is None or prod.op_type not in ("Conv", "ConvTranspose", "BatchNormalization"):
            continue
        yield _finding("QD006", [_name(prod), _name(node)],
                       f"the Q/DQ between {prod.op_type} '{_name(prod)}' and {node.op_type} '{_name(node)}' splits what "
                       "TensorRT would run as one fused kernel",
                       "remove the Q/DQ pair; quantize after the activation instead")


@rule("QD007", "activation-fusion-broken", "costs-reformat", safe_fix=True)
def activation_fusion_broken(g: QdqGraph):
    """A Q/DQ pair breaks Conv→Sigmoid→Mul (SiLU) or Conv→HardSigmoid→Mul (hardswish)."""
    for mul in g.nodes:
        swish = g.swish(mul)
        if swish is None:
            continue
        x_t, gate = swish
        conv = g.backbone(g._through_qdq(x_t))
        quantized = [t for t in (x_t, gate.input[0], gate.output[0]) if g.dq_of(t) is not None]
        if conv is None or not quantized:
            continue
        kind = "SiLU" if gate.op_type == "Sigmoid" else "hardswish"
        yield _finding("QD007", [_name(conv), _name(gate), _name(mul)],
                       f"Q/DQ inside the {kind} after '{_name(conv)}' keeps TensorRT from fusing the activation into the "
                       "convolution's INT8 kernel",
                       f"remove the Q/DQ inside the {kind}; quantize its output (the next layer's input) instead")


@rule("QD008", "convtranspose-weight-axis", "blocks-int8")
def convtranspose_weight_axis(g: QdqGraph):
    """ConvTranspose weights are quantized per channel along an axis other than 0."""
    for node in g.nodes:
        if node.op_type != "ConvTranspose" or len(node.input) < 2:
            continue
        dq = g.dq_of(node.input[1])
        if dq is None:
            continue
        axis = g.axis(dq)
        if axis is not None and axis != 0:
            yield _finding("QD008", [_name(node)],
                           f"the weight scales run along axis {axis}; TensorRT's INT8 deconvolution takes per-channel "
                           "weight scales along axis 0 only and falls back to float",
                           "re-quantize the ConvTranspose weights per channel along axis 0")


@rule("QD009", "pad-between-dq-and-conv", "costs-reformat", safe_fix=True)
def pad_between_dq_and_conv(g: QdqGraph):
    """A Pad sits between a DequantizeLinear and the Conv it feeds."""
    for pad in g.nodes:
        if pad.op_type != "Pad" or g.dq_of(pad.input[0]) is None:
            continue
        convs = [c for c in g.consumers.get(pad.output[0], []) if c.op_type == "Conv"]
        if convs:
            yield _finding("QD009", [_name(pad)] + [_name(c) for c in convs],
                           "TensorRT does not fuse a Pad between the DQ and the Conv: the Conv's INT8 input pattern is "
                           "broken and the Pad runs as its own kernel",
                           "fold the zero Pad into the Conv's pads (or move the Q/DQ after the Pad)")


@rule("QD010", "small-channel-conv-quantized", "costs-reformat")
def small_channel_conv_quantized(g: QdqGraph):
    """A quantized Conv has too few channels for TensorRT's INT8 kernels (ModelOpt's rule)."""
    for conv in g.nodes:
        if conv.op_type != "Conv" or g.dq_of(conv.input[0]) is None or len(conv.input) < 2 or g.dq_of(conv.input[1]) is None:
            continue  # a float-weight conv reading a DQ shared with another consumer is QD011's (partly quantized)
        if conv_runs_int8_in_tensorrt(g, conv) is False:
            w = g.shapes.get(g._through_qdq(conv.input[1]))
            yield _finding("QD010", [_name(conv)],
                           f"with weight shape {w} TensorRT has no INT8 kernel for this Conv: it runs in float with "
                           "reformats on both sides, so its Q/DQ only costs time",
                           "leave this Conv float (qdeploy's TensorRT placement excludes it)")


@rule("QD011", "compute-op-float", "blocks-int8")
def compute_op_float(g: QdqGraph):
    """A Conv/ConvTranspose/Gemm/MatMul the TensorRT placement plan makes INT8 has no Q/DQ on its input or its weights;
    one a rule of the plan keeps float (lint/placement.py: narrow convs, squeeze-excitation branches, attention's
    matmuls, a rule added) is "float, as it should be", with the rule's reason."""
    plan = placement_plan(g, "tensorrt")
    for node in compute_nodes(g):
        weight_idx = 1  # MatMul of two activations (attention) needs both quantized too
        act_q = g.dq_of(node.input[0]) is not None
        w_q = len(node.input) > weight_idx and g.dq_of(node.input[weight_idx]) is not None
        if act_q and w_q:
            continue
        if one_side_quantized(g, node) is not None:
            continue  # a matmul of two activations with one of them quantized: QD019 reports it
        if _is_head(g, node) and not act_q and not w_q:
            continue  # QD014 reports it
        decision = plan.decisions.get(_name(node))
        if decision is not None and decision.role == FLOAT and not act_q and not w_q:
            yield _finding("QD011", [_name(node)], f"float, as it should be: {decision.why}", "nothing to do",
                           severity="fine")
            continue
        part = "input and weights" if not act_q and not w_q else "weights" if act_q else "input"
        rule = f" (the placement plan makes it INT8: rule {decision.rule})" if decision is not None else ""
        yield _finding("QD011", [_name(node)],
                       f"no Q/DQ on its {part}{rule}: TensorRT runs this {node.op_type} in FP16/FP32 and reformats the "
                       "tensors around it",
                       "quantize it, or keep it float on purpose (an exclude) and accept the cost")


@rule("QD012", "resize-between-quantized", "costs-reformat")
def resize_between_quantized(g: QdqGraph):
    """A Resize/Upsample sits between quantized ops without Q/DQ of its own."""
    for node in g.nodes:
        if node.op_type not in ("Resize", "Upsample"):
            continue
        src_q = _reaches_dq_upstream(g, node.input[0])
        dst_q = _reaches_q_downstream(g, node.output[0])
        if not (src_q and dst_q):
            continue
        if g.dq_of(node.input[0]) is not None:
            continue  # quantized input: TensorRT can run nearest Resize in INT8
        mode = g.attr(node, "mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        shape = g.shapes.get(node.input[0])
        broadcast = bool(shape) and len(shape) >= 3 and all(d == 1 for d in shape[2:])
        yield _finding("QD012", [_name(node)],
                       f"a float {mode} Resize between INT8 layers: TensorRT dequantizes before it and quantizes after it "
                       "(two reformats)" + (" — here it upsamples a 1×1 map (ASPP-style image pooling), so the cost is "
                                            "one quantize of its output" if broadcast else ""),
                       "quantize the Resize's input with the scale its output uses" + (" (nearest mode is INT8-capable)" if mode == "nearest" else ""))


def _reaches_dq_upstream(g: QdqGraph, tensor: str, depth: int = 4) -> bool:
    for _ in range(depth):
        node = g.producer.get(tensor)
        if node is None:
            return False
        if node.op_type == "DequantizeLinear" or node.op_type in COMPUTE_OPS and g.dq_of(node.input[0]) is not None:
            return True
        if not node.input:
            return False
        tensor = node.input[0]
    return False


def _reaches_q_downstream(g: QdqGraph, tensor: str, depth: int = 4) -> bool:
    frontier = [tensor]
    for _ in range(depth):
        nxt = []
        for t in frontier:
            for c in g.consumers.get(t, []):
                if c.op_type == "QuantizeLinear":
                    return True
                nxt.extend(c.output)
        frontier = nxt
    return False


def _is_head(g: QdqGraph, node) -> bool:
    """A Gemm/MatMul whose output reaches a graph output through shape/softmax ops only."""
    if node.op_type not in ("Gemm", "MatMul"):
        return False
    tensor = node.output[0]
    for _ in range(4):
        if tensor in g.output_names:
            return True
        users = g.consumers.get(tensor, [])
        if len(users) != 1 or users[0].op_type not in ("Add", "Softmax", "LogSoftmax", "Reshape", "Flatten", "Identity", "Squeeze", "Cast"):
            return False
        tensor = users[0].output[0]
    return tensor in g.output_names


@rule("QD013", "float-classifier-head", "costs-reformat")
def float_classifier_head(g: QdqGraph):
    """The classifier head (last Gemm/MatMul) is float."""
    if not any(g.dq_of(n.input[0]) is not None for n in compute_nodes(g)):
        return
    for node in compute_nodes(g):
        if _is_head(g, node) and g.dq_of(node.input[0]) is None and (len(node.input) < 2 or g.dq_of(node.input[1]) is None):
            yield _finding("QD013", [_name(node)],
                           "the classifier head runs in float: TensorRT dequantizes its input and runs the GEMM in "
                           "FP16/FP32 (usually small; it mattered in Ultralytics #26159 where the head was large)",
                           "quantize the head too, unless it was kept float for accuracy on purpose")


@rule("QD014", "depthwise-conv-then-swish", "fine")
def depthwise_conv_then_swish(g: QdqGraph):
    """A depthwise Conv is followed by Sigmoid/Mul (SiLU) or HardSigmoid/Mul."""
    for mul in g.nodes:
        swish = g.swish(mul)
        if swish is None:
            continue
        conv = g.backbone(g._through_qdq(swish[0]))
        if conv is not None and conv.op_type == "Conv" and g.is_depthwise(conv) and g.dq_of(conv.input[0]) is not None:
            yield _finding("QD014", [_name(conv), _name(mul)],
                           "TensorRT fuses the activation into the depthwise INT8 conv only through a pointwise "
                           "epilogue; on some GPUs it runs the swish as a separate kernel",
                           "nothing required; confirm with the engine inspector")


@rule("QD015", "bad-scale", "blocks-int8")
def bad_scale(g: QdqGraph):
    """A Q/DQ scale is zero, negative, subnormal, NaN or Inf."""
    for node in g.qdq_nodes():
        s = g.scale(node)
        if s is None:
            continue
        bad = ~np.isfinite(s) | (s <= 0) | ((s > 0) & (s < SMALLEST_NORMAL_F32))
        if bad.any():
            example = float(s.reshape(-1)[np.argmax(bad.reshape(-1))])
            yield _finding("QD015", [_name(node)],
                           f"{int(bad.sum())} of {s.size} scale value(s) are unusable (e.g. {example!r}): TensorRT rejects "
                           "the layer or produces Inf/NaN",
                           "recalibrate; a channel or tensor that is all zero needs a floor scale, not 0")


def _expected_weight_axis(g: QdqGraph, node) -> int | None:
    if node.op_type in ("Conv", "ConvTranspose"):
        return 0
    if node.op_type == "Gemm":
        return 0 if int(g.attr(node, "transB", 0)) else 1
    if node.op_type == "MatMul":
        w = g.shapes.get(g._through_qdq(node.input[1]))
        return (len(w) - 1) if w else None
    return None


def _through_transposes(g: QdqGraph, tensor: str, dq, axis: int, shape):
    """The DQ's per-channel axis and the weight's shape as the compute op sees them: a Linear exported as
    W -> Q -> DQ -> Transpose -> MatMul (ModelOpt) has its per-output-channel axis 0 moved to 1 by the Transpose, which
    TensorRT folds into the weights."""
    chain, t = [], tensor
    while (n := g.producer.get(t)) is not None and n is not dq:
        chain.append(n)
        t = n.input[0]
    for n in reversed(chain):
        if n.op_type == "Transpose" and shape:
            perm = list(g.attr(n, "perm", None) or reversed(range(len(shape))))
            if 0 <= axis < len(perm):
                axis = perm.index(axis)
            shape = [shape[i] for i in perm]
    return axis, shape


@rule("QD016", "weight-axis-mismatch", "blocks-int8")
def weight_axis_mismatch(g: QdqGraph):
    """Per-channel weight scales do not run along the weight's output-channel axis, or do not fit it."""
    for node in compute_nodes(g):
        if len(node.input) < 2:
            continue
        dq = g.dq_of(node.input[1])
        if dq is None or not g.is_weight_dq(dq):
            continue
        scale = g.scale(dq)
        axis = g.axis(dq)
        if axis is None:
            continue
        w = g.shapes.get(g._through_qdq(node.input[1])) or g.shapes.get(dq.input[0])
        expected = _expected_weight_axis(g, node)
        if node.op_type == "ConvTranspose":
            expected = 0  # QD008's subject; the size check below still applies
        ax = axis if axis >= 0 or not w else axis + len(w)
        ax, w = _through_transposes(g, node.input[1], dq, ax, w)
        wrong_axis = expected is not None and ax != expected and node.op_type != "ConvTranspose"
        wrong_size = w is not None and 0 <= ax < len(w) and w[ax] is not None and w[ax] != scale.size
        if wrong_axis or wrong_size:
            yield _finding("QD016", [_name(node), _name(dq)],
                           f"weight {w} has {scale.size} per-channel scales along axis {axis}; TensorRT expects one per output "
                           f"channel (axis {expected}) and will refuse or mis-scale the layer",
                           f"re-quantize the weights per channel along axis {expected}")


@rule("QD017", "not-symmetric-int8", "blocks-int8")
def not_symmetric_int8(g: QdqGraph):
    """Q/DQ is not symmetric INT8 (uint8, or a non-zero zero point): TensorRT supports INT8 with zero point 0 only."""
    offenders = []
    for node in g.qdq_nodes():
        zp_type = g.zero_point_type(node)
        zp = g.zero_point(node)
        if zp_type not in (onnx.TensorProto.INT8, None) and zp_type not in (onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.INT4) \
                or zp is not None and np.any(np.asarray(zp) != 0):
            offenders.append(_name(node))
    if offenders:
        yield _finding("QD017", offenders[:20] + ([f"... {len(offenders) - 20} more"] if len(offenders) > 20 else []),
                       f"{len(offenders)} Q/DQ node(s) use uint8 or a non-zero zero point (ONNX Runtime's asymmetric CPU "
                       "placement): TensorRT's explicit quantization rejects them",
                       "quantize for TensorRT (placement: tensorrt): symmetric INT8 activations and weights")


@rule("QD018", "dynamic-scale", "blocks-int8")
def dynamic_scale(g: QdqGraph):
    """A Q/DQ scale is computed at run time instead of being a constant."""
    for node in g.qdq_nodes():
        if len(node.input) >= 2 and node.input[1] and g.scale(node) is None:
            yield _finding("QD018", [_name(node)],
                           "the scale is not a constant: TensorRT needs build-time scales for explicit quantization",
                           "fold the scale computation into a constant (onnx constant folding / onnxsim)")


# ---------------------------------------------------------------- transformers
def one_side_quantized(g: QdqGraph, node) -> int | None:
    """For a MatMul/Gemm whose two inputs are both activations (computed from the model input: no weight on either
    side) and exactly one of them quantized (seen through ``DQ_SEES_THROUGH``, as ``dq_of``): the index of the float
    input. None otherwise: a Linear's weight is a constant, not an activation (QD011 covers a float weight or input)."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
        return None
    a, b = node.input[0], node.input[1]
    if a not in g.from_input or b not in g.from_input:
        return None
    qa, qb = g.dq_of(a) is not None, g.dq_of(b) is not None
    if qa == qb:
        return None
    return 1 if qa else 0


@rule("QD019", "matmul-one-input-quantized", "costs-reformat")
def matmul_one_input_quantized(g: QdqGraph):
    """A MatMul/Gemm of two activations has Q/DQ on one input only: TensorRT runs it in float and the Q/DQ only costs time.

    Sources: TensorRT developer guide, "Explicit Quantization" → "Processing of Q/DQ networks" (TensorRT expects a
    Q/DQ pair on each input of a quantizable layer and fuses them into the layer only then) and "Q/DQ layer-placement
    recommendations" ("quantize all inputs of weighted operations"); ModelOpt's ONNX INT8
    (modelopt/onnx/quantization/partitioning.py ``find_mha_partitions``: MatMul → (Add) → Softmax → MatMul is a
    non-quantizable partition, no Q/DQ on either input; graph_utils.py ``classify_partially_quantized_weighted_ops``:
    a linear op that is not quantized gets no Q/DQ on any input). Severity costs-reformat, not blocks-int8: a matmul of
    two activations is attention's Q·Kᵀ or softmax·V, which TensorRT's placement keeps float on purpose
    (lint/placement.py), so the layer loses nothing; what the lone Q/DQ costs is its quantize/dequantize kernels.
    """
    for node in g.nodes:
        f = one_side_quantized(g, node)
        if f is None:
            continue
        q = 1 - f
        dq = g.dq_of(node.input[q])
        yield _finding("QD019", [_name(node), _name(dq)],
                       f"input {q} is INT8 (through '{_name(dq)}') but input {f} is float: TensorRT runs a "
                       f"{node.op_type} in INT8 only with both inputs quantized, so it runs this one in FP16/FP32 and the "
                       f"Q/DQ on input {q} only adds a quantize and a dequantize (reformat) kernel",
                       f"remove the Q/DQ on input {q} (a matmul of two activations, attention's, stays float for "
                       f"TensorRT: ModelOpt puts no Q/DQ on either input), or quantize input {f} too if it is meant to run INT8")


def _qs_by_tensor(g: QdqGraph) -> dict[str, list]:
    """Float activation → the QuantizeLinear nodes that read it (through Cast/Identity), in graph order."""
    out: dict[str, list] = {}
    for node in g.nodes:
        if node.op_type == "QuantizeLinear":
            src = g.source(node.input[0])
            if src in g.from_input:
                out.setdefault(src, []).append(node)
    return out


@rule("QD020", "tensor-quantized-per-consumer", "costs-reformat", safe_fix=True)
def tensor_quantized_per_consumer(g: QdqGraph):
    """One activation is quantized by several QuantizeLinear nodes (one per consumer) instead of one shared Q/DQ.

    Sources: ModelOpt's ONNX INT8 quantizes each tensor once and shares the Q/DQ among its consumers
    (modelopt/onnx/quantization/ort_utils.py ``configure_ort``: ``"DedicatedQDQPair": False``; graph_utils.py
    ``remove_partial_input_qdq`` relies on it: "a shared Q/DQ pair may feed multiple consumers");
    TensorRT developer guide, "Explicit Quantization" → "Q/DQ layer-placement recommendations" (be conservative
    adding Q/DQ: TensorRT cannot fuse every extra one) and "Q/DQ limitations" (TensorRT's Q/DQ rewrites compare
    scales and apply only where they are equal). Severity: costs-reformat where the scales differ (one quantize per distinct scale: the producer
    can fuse one output quantize, the others run as kernels of their own); fine where they are identical, because
    TensorRT's builder removes a Q that duplicates another on the same tensor (its verbose build log: "Running:
    HorizontalMergeQNodes on <Q>" / "Eliminating <Q'> which duplicates (Q) <Q>", as quoted from a trtexec log in a
    third-party 2024 write-up; not stated in the guide, not confirmed here: no TensorRT on this machine). The safe fix
    merges identical pairs into one (the ONNX computes bit-identical outputs).
    """
    for src, qs in _qs_by_tensor(g).items():
        if len(qs) < 2:
            continue
        params = [g.qdq_params(q) for q in qs]
        users = [_name(c) for q in qs for dq in g.consumers.get(q.output[0], []) if dq.op_type == "DequantizeLinear"
                 for c in g.consumers.get(dq.output[0], [])]
        identical = None not in params and len(set(params)) == 1
        if identical:
            f = _finding("QD020", [_name(q) for q in qs],
                         f"'{src}' is quantized {len(qs)} times with the same scale, once for each consumer "
                         f"({', '.join(users[:6])}{', …' if len(users) > 6 else ''}): TensorRT merges identical "
                         "QuantizeLinear nodes itself, other runtimes run one quantize per copy",
                         "share one Q/DQ pair among the consumers (the safe fix merges them; exact)", severity="fine")
        else:
            scales = sorted({float(g.scale(q).reshape(-1)[0]) for q in qs if g.scale(q) is not None and g.scale(q).size == 1})
            shown = ", ".join(f"{s:.4g}" for s in scales) if scales else "per-channel or computed scales"
            f = _finding("QD020", [_name(q) for q in qs],
                         f"'{src}' is quantized {len(qs)} times with different scales ({shown}), once for each consumer "
                         f"({', '.join(users[:6])}{', …' if len(users) > 6 else ''}): TensorRT cannot merge quantizes of "
                         "different scales, so each one runs on its own (at most one fuses into the producer)",
                         "quantize the tensor once, with one scale (the largest: nothing clips), and share that Q/DQ pair "
                         "among the consumers")
            f.fixable = False
        yield f


def _int8_before_movement(g: QdqGraph, tensor: str):
    """(DequantizeLinear, data-movement nodes) when ``tensor`` is an activation dequantized from INT8 and then only
    moved (Reshape/Transpose/Flatten/Squeeze/Unsqueeze, at least one); None otherwise."""
    chain = []
    node = g.producer.get(tensor)
    while node is not None and node.op_type in DATA_MOVEMENT_OPS:
        chain.append(node)
        node = g.producer.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or not any(n.op_type != "Identity" for n in chain):
        return None
    if g.is_weight_dq(node):
        return None  # a weight's DQ -> Transpose (ModelOpt's Linear) is QD016's business, and TensorRT folds it
    return node, chain


@rule("QD021", "qdq-inside-reshape-chain", "costs-reformat", safe_fix=True)
def qdq_inside_reshape_chain(g: QdqGraph):
    """A Q/DQ pair re-quantizes an INT8 tensor in the middle of a Reshape/Transpose chain (DQ → Reshape → Q → DQ → ...).

    Sources: TensorRT developer guide, "Explicit Quantization" → "Processing of Q/DQ networks": TensorRT propagates DQ
    forward and Q backward across layers that commute with them (data movement such as Reshape and Transpose), so the
    first DQ would reach the consumer (a MatMul, a Conv) and fuse into it; a second Q/DQ pair inside the chain stops
    that propagation and leaves a requantize (DQ → Q) between two copies; "Q/DQ layer-placement recommendations":
    extra Q/DQ placements cause sub-optimal fusions. ModelOpt's ONNX INT8 puts no Q/DQ of their own on copy ops
    (modelopt/onnx/op_types.py ``get_copy_ops``: Reshape, Transpose, Flatten, Squeeze, ...; the op types
    modelopt/onnx/quantization/int8.py quantizes are Add, pools, BatchNormalization, Clip, Conv(Transpose), Gemm,
    MatMul, Mul).
    The safe fix drops the inner pair: exact when its scale equals the first one's, else one requantization fewer.
    """
    for q in g.nodes:
        if q.op_type != "QuantizeLinear":
            continue
        up = _int8_before_movement(g, q.input[0])
        if up is None:
            continue
        dq_a, chain = up
        for dq in g.consumers.get(q.output[0], []):
            if dq.op_type != "DequantizeLinear" or dq.output[0] in g.output_names:
                continue
            users = g.consumers.get(dq.output[0], [])
            if not users or not all(u.op_type in DATA_MOVEMENT_OPS + COMPUTE_OPS for u in users):
                continue  # e.g. a Concat or an Add that wants its own scale: QD003/QD004's business
            same = g.qdq_params(q) is not None and g.qdq_params(q) == g.qdq_params(dq_a)
            moves = " → ".join(n.op_type for n in reversed(chain))
            after = ", ".join(f"{u.op_type} '{_name(u)}'" for u in users[:4])
            yield _finding("QD021", [_name(q), _name(dq), _name(dq_a)] + [_name(n) for n in reversed(chain)] + [_name(u) for u in users],
                           f"'{q.input[0]}' is already INT8 (DequantizeLinear '{_name(dq_a)}' → {moves}) and is quantized "
                           f"again before {after}: the pair keeps TensorRT from moving the first DQ forward into the "
                           "consumer and leaves a requantize between the data-movement layers"
                           + (" (same scale: the pair is redundant)" if same else " (a different scale)"),
                           f"remove the Q/DQ pair '{_name(q)}'/'{_name(dq)}'; TensorRT carries the first DQ through the "
                           f"chain to the consumer")


def run_rules(g: QdqGraph, only: set[str] | None = None) -> list[Finding]:
    findings = []
    for r in RULES.values():
        if only is None or r.id in only:
            findings.extend(r.check(g))
    return findings
