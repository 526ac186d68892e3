"""Write an INT8 ONNX from an FP32 ONNX and per-tensor ranges, with ONNX Runtime's Q/DQ quantizer.

Two placements (``target``), same ranges:

``tensorrt``     what TensorRT ≥ 10 consumes (explicit quantization), placed by TensorRT's rules
                 (qdeploy.lint): symmetric INT8 activations, per-channel (axis 0, ConvTranspose too)
                 symmetric INT8 weights kept as float + Q/DQ, float bias; Q/DQ on the inputs of
                 Conv/ConvTranspose/Gemm/MatMul; on a residual Add only the *skip* input (the conv path
                 stays float so TensorRT fuses Conv+Add(+ReLU) into one INT8 kernel), on both inputs with
                 one shared scale where neither input is a conv output; convs too narrow for TensorRT's
                 INT8 kernels stay float. ONNX Runtime places the nodes, then lint's safe fixes (drop
                 conv-path Q/DQ, unify Concat/pool scales, fold Pads, no Q/DQ inside Conv-BN-ReLU or
                 SiLU/hardswish) bring the graph to TensorRT's form: the rules live in one place.
``onnxruntime``  what ONNX Runtime's CPU kernels run fast: ONNX Runtime's default static placement
                 (QLinearConv/QLinearAdd/... fusions), uint8 asymmetric activations, per-channel
                 int8 weights.

The ranges come from qdeploy's calibrators (ranges.py); ONNX Runtime only places the nodes.
"""
from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np

from qdeploy.config import PLACEMENTS
from qdeploy.facts.onnxruntime import reduce_range_reason, u8s8_saturates
from qdeploy.lint.fixes import apply_fixes
from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.quantize.equalize import equalize_depthwise_inputs
from qdeploy.lint.placement import COMPUTE_OPS, FLOAT, PlacementPlan, convs_without_int8_kernel, int8_op_types, placement_plan
from qdeploy.quantize.exclude import match_nodes
from qdeploy.utils.atomic import atomic_path
from qdeploy.utils.log import warn
from qdeploy.utils.onnx_graph import OnnxGraph, inline_constant_identities

# the placements this module inserts Q/DQ for (those quantizer onnx makes: config.PLACEMENTS)
QDQ_PLACEMENTS = tuple(p.name for p in PLACEMENTS.values() if "onnx" in p.quantizers)


def tensors_to_calibrate(model, target: str):
    """Activations the target's placement can quantize (None = all): TensorRT style needs only the inputs of
    compute ops and of activation+activation Adds, so range search (entropy/mse) skips the rest."""
    if target != "tensorrt":
        return None
    graph = OnnxGraph(model)
    names = set()
    for node in graph.nodes:
        if node.op_type in COMPUTE_OPS:
            names.update(i for i in node.input[:2] if i and not graph.is_constant(i))
    for node in graph.residual_adds():
        names.update(node.input)
    return sorted(names)


def select_excluded(model, exclude: Iterable[str], exclude_ops: Iterable[str]) -> tuple[list[str], list[str]]:
    """Node names left in float by the user's ``exclude`` entries (module names or regexes: quantize/exclude.py) and op
    types; also the patterns that matched nothing."""
    exclude = list(exclude or [])
    exclude_ops = set(exclude_ops or [])
    names = [node.name or node.output[0] for node in model.graph.node]
    by_pattern, hits = match_nodes(names, exclude)
    chosen = set(by_pattern)
    excluded = [name for name, node in zip(names, model.graph.node) if name in chosen or node.op_type in exclude_ops]
    unmatched = [p for p, n in hits.items() if n == 0]
    for p in unmatched:
        warn(f"exclude pattern '{p}' matches no layer of the model")
    present_ops = {n.op_type for n in model.graph.node}
    for op in exclude_ops - present_ops:
        warn(f"exclude_ops '{op}' does not occur in the model")
    return excluded, unmatched


def quantize_onnx(fp32_path: Path, ranges: dict, target: str, out_path: Path,
                  exclude: Iterable[str] = (), exclude_ops: Iterable[str] = (), split_activations: bool = False,
                  quantized_conv_outputs: bool = False) -> dict:
    """Write the INT8 ONNX to ``out_path`` (atomically). Returns what was excluded and why."""
    import onnx

    if target not in QDQ_PLACEMENTS:
        raise ValueError(f"unknown INT8 target '{target}' (one of {QDQ_PLACEMENTS})")
    model = onnx.load(str(fp32_path))
    inline_constant_identities(model)  # a tied weight is a weight (per-channel Q/DQ), not an activation
    model = onnx.shape_inference.infer_shapes(model)
    OnnxGraph(model).ensure_node_names()
    user_excluded, unmatched = select_excluded(model, exclude, exclude_ops)
    # the placement plan (lint/placement.py): every node a rule decides, with the rule; this quantizer inserts it
    plan = placement_plan(model, target, excluded={n: "excluded by the config" for n in user_excluded})
    excluded = list(user_excluded)
    se_nodes = list(plan.float_nodes("squeeze-excitation"))
    narrow = list(plan.float_nodes("narrow-conv"))
    excluded += se_nodes + narrow
    # the other rules' float ops (LayerNorm, Softmax, GELU; for TensorRT also attention's matmuls of two activations)
    rule_float = [n for n, d in plan.decisions.items()
                  if d.role == FLOAT and d.rule not in ("excluded", "squeeze-excitation", "narrow-conv")]
    if split_activations:  # asked for ONNX Runtime's own placement of SiLU/hardswish's pieces: their Mul too
        g = QdqGraph(model)
        pieces = {p.name for node in g.nodes if (pair := g.swish(node)) is not None for p in (node, pair[1])}
        rule_float = [n for n in rule_float if n not in pieces]
    excluded += rule_float
    symmetric = target == "tensorrt"
    # depthwise conv inputs: per-channel precision through a gain folded into the weights (equalize.py says why)
    ranges = dict(ranges)
    equalized = equalize_depthwise_inputs(model, ranges, symmetric, skip=set(excluded))
    excluded += equalized["mul_nodes"]
    if equalized["mul_nodes"]:
        model = onnx.shape_inference.infer_shapes(model)  # the new tensors need their types for the quantizer
    swish_nodes = []
    if target == "onnxruntime" and not split_activations:
        # activation functions stay whole, as in NNCF and TensorRT: ONNX Runtime would quantize SiLU's x, sigmoid(x)
        # and product separately (QLinearSigmoid/QLinearMul), which cost 0.9 point on EfficientNet-B0
        # (docs/results/int8/issue8_peer_ptq_split_efficientnet_b0_48.json), but
        # runs them in int8: Int8Config.split_activations chooses that speed (about 2x on MobileNetV3 / EfficientNet-B0)
        g = QdqGraph(model)
        for node in g.nodes:
            pair = g.swish(node)
            if pair is not None:
                swish_nodes += [n for n in (node.name, pair[1].name) if n not in user_excluded and n not in se_nodes]
        excluded += [n for n in swish_nodes if n not in excluded]

    def place(excluded: list[str]):
        return _place(copy.deepcopy(model), ranges, target, excluded, exclude_ops, symmetric,
                      fix_swish=bool(swish_nodes) and not quantized_conv_outputs, plan=plan)

    qmodel, fixes, op_types = place(excluded)
    float_convs: list[str] = []
    if target == "onnxruntime":
        # a conv ONNX Runtime cannot fuse into QLinearConv runs slower than in FP32: float (placement.py says why);
        # again until none is left (a conv left float can leave its producer conv with a float output)
        for _ in range(4):
            more = [n for n in convs_without_int8_kernel(qmodel) if n not in excluded]
            if not more:
                break
            float_convs += more
            excluded += more
            qmodel, fixes, op_types = place(excluded)
    # ONNX Runtime's quantizer appends its Q/DQ nodes (its own save_model_to_file sorts them): the ONNX spec, the checker
    # and TensorRT's parser want the nodes in topological order
    from onnxruntime.quantization.onnx_model import ONNXModel

    ONNXModel(qmodel).topological_sort()
    with atomic_path(out_path) as tmp:
        onnx.save(qmodel, str(tmp))
    return {"excluded_by_user": user_excluded, "unmatched_patterns": unmatched, "op_types": op_types,
            "excluded_small_channel_convs": narrow, "placement_fixes": fixes, "placement_plan": plan.summary(),
            "excluded_squeeze_excitation": se_nodes, "float_by_placement_rule": rule_float, "equalized_depthwise_inputs": equalized, "activations_kept_whole": swish_nodes,
            "float_convs_without_int8_kernel": float_convs, "quantized_conv_outputs": quantized_conv_outputs,
            "reduce_range": reduce_range_reason(target == "onnxruntime" and u8s8_saturates())}


def _place(model, ranges: dict, target: str, excluded: list[str], exclude_ops, symmetric: bool, fix_swish: bool,
           plan: PlacementPlan):
    """One run of ONNX Runtime's Q/DQ quantizer with these float nodes, then the placement's fixes: (Q/DQ model, fixes
    applied, quantized op types)."""
    import onnx
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantType

    excluded = list(excluded)
    data = {}
    for name, r in ranges.items():
        lo, hi = (-r.amax, r.amax) if symmetric else (min(r.lo, 0.0), max(r.hi, 0.0))
        data[name] = TensorData(lowest=np.float32(lo), highest=np.float32(hi))
    # Constant-node outputs (e.g. Pad values exported as Constant) are quantized by ONNX Runtime like
    # activations when they feed a quantized op: give them their own exact range.
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] not in data:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None and value.data_type == onnx.TensorProto.FLOAT:
                arr = onnx.numpy_helper.to_array(value)
                if arr.size:
                    amax = max(float(np.abs(arr).max()), 1e-8)
                    lo, hi = (-amax, amax) if symmetric else (min(float(arr.min()), 0.0), max(float(arr.max()), 1e-8))
                    data[node.output[0]] = TensorData(lowest=np.float32(lo), highest=np.float32(hi))
    tensors_range = TensorsData(CalibrationMethod.MinMax, data)
    if target == "tensorrt":
        g = OnnxGraph(model)
        adds = {n.name: n for n in g.nodes if n.name in set(plan.shared_scale_adds)}
        for a, b in (tuple(adds[n].input[:2]) for n in plan.shared_scale_adds if n in adds):  # one scale for both inputs
            if a in data and b in data:
                hi = max(float(data[a].range_value[1]), float(data[b].range_value[1]))
                data[a] = data[b] = TensorData(lowest=np.float32(-hi), highest=np.float32(hi))
        tensors_range = TensorsData(CalibrationMethod.MinMax, data)
        # only activation+activation Adds are residual joins; x + constant (bias, hardswish's +3) stay float
        excluded += [n.name for n in OnnxGraph(model).constant_adds()]
        op_types = [t for t in int8_op_types("tensorrt") if t not in set(exclude_ops or [])]
        extra = {
            "ActivationSymmetric": True, "WeightSymmetric": True, "AddQDQPairToWeight": True,
            "QuantizeBias": False, "OpTypesToExcludeOutputQuantization": op_types, "DedicatedQDQPair": False,
            # TensorRT's INT8 deconvolution wants per-channel weight scales along axis 0 (ONNX Runtime uses 1)
            "TensorQuantOverrides": {w: [{"axis": 0}] for w in convtranspose_weights(g)},
            # the bias stays float for TensorRT, so ONNX Runtime's int32-bias weight-scale adjustment must not run
            # (it also assumes the ConvTranspose weight axis is 1 and indexes out of range with axis 0)
            "QDQDisableWeightAdjustForInt32Bias": True,
        }
        act_type = QuantType.QInt8
    else:
        from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
    
        op_types = sorted((set(QLinearOpsRegistry) | set(QDQRegistry)) - set(exclude_ops or []))
        extra = {"ActivationSymmetric": False, "WeightSymmetric": True}
        act_type = QuantType.QUInt8
    # ONNX Runtime's CPU kernels saturate U8S8 sums on x86-64 without VNNI: 7-bit weights there (facts/onnxruntime.py)
    reduce_range = target == "onnxruntime" and u8s8_saturates()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer = QDQQuantizer(model, True, reduce_range, QuantType.QInt8, act_type, tensors_range, [], excluded, op_types,
                                 extra)
        quantizer.quantize_model()
    qmodel = quantizer.model.model
    fixes = {}
    if target == "tensorrt":
        fixes = apply_fixes(qmodel, PLACEMENT_FIXES)
        snap_weights_to_grid(qmodel)
    elif fix_swish:  # the Q/DQ ONNX Runtime still puts on SiLU's input (a quantized conv's output) goes too
        fixes = apply_fixes(qmodel, {"QD007"})
    return qmodel, fixes, op_types


def snap_weights_to_grid(model) -> int:
    """Store each Q/DQ weight as the value its Q/DQ pair gives (ONNX's round-half-even of w/scale, saturated), so that
    weight/scale is an exact integer: TensorRT quantizes the float weight itself at build time, and a weight within a
    float rounding of a half step could come out one step apart from what ONNX Runtime evaluated (FP16 checkpoints put
    weights there often; modelopt_torch.snap_weights_to_grid says more). Only weights read by their QuantizeLinear
    alone. Returns the tensors snapped."""
    from onnx import numpy_helper

    g = OnnxGraph(model)
    count = 0
    for q in g.nodes:
        if q.op_type != "QuantizeLinear" or q.input[0] not in g.initializers or len(g.consumers.get(q.input[0], [])) != 1:
            continue
        w = numpy_helper.to_array(g.initializers[q.input[0]])
        scale = g.constant_value(q.input[1])
        zero = g.constant_value(q.input[2]) if len(q.input) > 2 and q.input[2] else np.zeros((), np.int8)
        if w.dtype != np.float32 or scale is None or zero is None or zero.dtype not in (np.int8, np.uint8):
            continue
        axis = next((a.i for a in q.attribute if a.name == "axis"), 1)
        shape = [1] * w.ndim
        if scale.size > 1:
            shape[axis % w.ndim] = -1
        s, z = scale.astype(np.float32).reshape(shape), zero.astype(np.float32).reshape(shape)
        lo, hi = (-128, 127) if zero.dtype == np.int8 else (0, 255)
        snapped = ((np.clip(np.rint(w / s) + z, lo, hi) - z) * s).astype(np.float32)
        g.initializers[q.input[0]].CopyFrom(numpy_helper.from_array(snapped, q.input[0]))
        count += 1
    return count


# lint's safe fixes that turn ONNX Runtime's placement into TensorRT's (rule ids in qdeploy.lint.rules)
PLACEMENT_FIXES = {"QD001", "QD004", "QD005", "QD006", "QD007", "QD009"}


def convtranspose_weights(g: OnnxGraph) -> list[str]:
    """ConvTranspose weights (TensorRT wants their per-channel scales along axis 0)."""
    return [n.input[1] for n in g.nodes if n.op_type == "ConvTranspose" and len(n.input) > 1 and n.input[1] in g.initializers]
