"""The safe fixes behind ``qdeploy lint --fix``, keyed by rule id; each edits the ModelProto in place.

Safe means: the graph computes the same function up to Q/DQ rounding, and TensorRT's fusion gets
better. Numerically neutral: folding a zero Pad into a Conv. Close but not identical: dropping a Q/DQ
pair (one rounding step fewer) and unifying scales (one tensor quantized a little coarser); the tests
check both in ONNX Runtime on real images.

The ONNX TensorRT placement (quantize/qdq.py) applies the same fixers after ONNX Runtime has placed
its Q/DQ nodes, so that the placement rules live in one place.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.lint.rules import POOL_OPS, run_rules

FIXERS: dict[str, Callable[[onnx.ModelProto, QdqGraph, "object"], bool]] = {}


def fixer(rule_id: str):
    def register(fn):
        FIXERS[rule_id] = fn
        return fn
    return register


def _node(g: QdqGraph, name: str):
    return next((n for n in g.nodes if (n.name or n.output[0]) == name), None)


def _bypass(g: QdqGraph, consumer, tensor: str) -> bool:
    """Point ``consumer``'s input ``tensor`` (a DQ output) at the float tensor that was quantized."""
    dq = g.producer.get(tensor)  # only a DQ feeding the consumer directly: never skip a Flatten/Reshape
    src = g.float_input_of(dq) if dq is not None and dq.op_type == "DequantizeLinear" else None
    if src is None:
        return False
    for i, name in enumerate(consumer.input):
        if name == tensor:
            consumer.input[i] = src
    return True


def _set_scale(model: onnx.ModelProto, g: QdqGraph, node, value: float) -> None:
    """Give a Q or DQ node (and its partner) a new scalar scale of its own (scale initializers may be shared)."""
    dtype = g.initializers[node.input[1]].data_type if node.input[1] in g.initializers else onnx.TensorProto.FLOAT
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    name = f"{node.name or node.output[0]}_scale_unified"
    k = 0
    while name in g.initializers:
        k += 1
        name = f"{node.name or node.output[0]}_scale_unified{k}"
    model.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np_type), name))
    g.initializers[name] = model.graph.initializer[-1]
    node.input[1] = name


def _set_pair_scale(model, g: QdqGraph, q, value: float) -> None:
    _set_scale(model, g, q, value)
    for dq in g.consumers.get(q.output[0], []):
        if dq.op_type == "DequantizeLinear":
            dq.input[1] = q.input[1]


@fixer("QD001")
def drop_conv_path_qdq(model, g: QdqGraph, finding) -> bool:
    add = _node(g, finding.nodes[0])
    if add is None:
        return False
    idx, _ = g.residual_conv_input(add)
    return idx is not None and _bypass(g, add, add.input[idx])


@fixer("QD004")
def unify_concat_scales(model, g: QdqGraph, finding) -> bool:
    concat = _node(g, finding.nodes[0])
    if concat is None:
        return False
    in_qs = []
    for t in concat.input:
        dq = g.dq_of(t)
        q = g.q_of(dq) if dq is not None else None
        if q is not None and g.scale(q) is not None and g.scale(q).size == 1:
            in_qs.append(q)
    out_qs = [c for c in g.consumers.get(concat.output[0], []) if c.op_type == "QuantizeLinear" and g.scale(c) is not None]
    pairs = in_qs + out_qs
    if len(pairs) < 2:
        return False
    # the largest scale: no input is clipped by the shared range
    value = max(float(g.scale(q).reshape(-1)[0]) for q in pairs)
    for q in pairs:
        _set_pair_scale(model, g, q, value)
    return True


@fixer("QD005")
def unify_pool_scales(model, g: QdqGraph, finding) -> bool:
    pool, q = _node(g, finding.nodes[0]), _node(g, finding.nodes[1])
    if pool is None or q is None or pool.op_type not in POOL_OPS:
        return False
    dq_in = g.dq_of(pool.input[0])
    s_in = g.scale(dq_in) if dq_in is not None else None
    if s_in is None or s_in.size != 1:
        return False
    # a pool's output lies within its input's range, so the input's scale represents it without clipping
    _set_pair_scale(model, g, q, float(s_in.reshape(-1)[0]))
    return True


@fixer("QD006")
def remove_qdq_inside_conv_bn_relu(model, g: QdqGraph, finding) -> bool:
    consumer = _node(g, finding.nodes[1])
    return consumer is not None and _bypass(g, consumer, consumer.input[0])


@fixer("QD007")
def remove_qdq_inside_swish(model, g: QdqGraph, finding) -> bool:
    gate, mul = _node(g, finding.nodes[1]), _node(g, finding.nodes[2])
    changed = False
    for node in (gate, mul):
        if node is None:
            continue
        for t in list(node.input):
            if g.dq_of(t) is not None and not g.is_weight_dq(g.dq_of(t)):
                changed |= _bypass(g, node, t)
    return changed


@fixer("QD009")
def fold_pad_into_conv(model, g: QdqGraph, finding) -> bool:
    pad = _node(g, finding.nodes[0])
    if pad is None:
        return False
    mode = g.attr(pad, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        return False
    pads = g.constant_value(pad.input[1]) if len(pad.input) > 1 and pad.input[1] else g.attr(pad, "pads", None)
    has_value_input = len(pad.input) > 2 and bool(pad.input[2])
    value = g.constant_value(pad.input[2]) if has_value_input else g.attr(pad, "value", 0.0)
    if pads is None or (len(pad.input) > 3 and pad.input[3]) or value is None or np.any(np.asarray(value) != 0):
        return False  # axes input / a pad value that is non-zero or computed at run time: not expressible as Conv pads
    pads = [int(p) for p in np.asarray(pads).reshape(-1)]
    rank = len(pads) // 2
    begin, end = pads[:rank], pads[rank:]
    if rank < 3 or any(begin[:2]) or any(end[:2]) or any(p < 0 for p in pads):
        return False  # only spatial, non-negative padding folds into a Conv
    convs = [c for c in g.consumers.get(pad.output[0], []) if c.op_type == "Conv"]
    if not convs or len(convs) != len(g.consumers.get(pad.output[0], [])) or pad.output[0] in g.output_names:
        return False
    for conv in convs:
        auto = g.attr(conv, "auto_pad", b"NOTSET")
        if (auto.decode() if isinstance(auto, bytes) else auto) not in ("NOTSET", ""):
            return False
    spatial_b, spatial_e = begin[2:], end[2:]
    for conv in convs:
        old = list(g.attr(conv, "pads", None) or [0] * (2 * len(spatial_b)))
        n = len(spatial_b)
        new = [old[i] + spatial_b[i] for i in range(n)] + [old[n + i] + spatial_e[i] for i in range(n)]
        for a in list(conv.attribute):
            if a.name == "pads":
                conv.attribute.remove(a)
        conv.attribute.append(helper.make_attribute("pads", new))
        conv.input[0] = pad.input[0]
    return True


@fixer("QD020")
def merge_duplicate_qdq(model, g: QdqGraph, finding) -> bool:
    """Identical Q/DQ pairs on one tensor → one: every consumer of a duplicate DQ reads the earliest DQ instead (the
    earliest in graph order precedes every other DQ, hence every consumer: the graph stays topologically sorted). Only
    pairs whose Q and DQ compute exactly the same thing are merged, so the outputs are bit-identical."""
    qs = [_node(g, n) for n in finding.nodes]
    if len(qs) < 2 or any(q is None or q.op_type != "QuantizeLinear" for q in qs):
        return False
    key = g.qdq_params(qs[0])
    if key is None or len({g.source(q.input[0]) for q in qs}) != 1 or any(g.qdq_params(q) != key for q in qs):
        return False
    order = {id(n): i for i, n in enumerate(g.nodes)}
    dqs = sorted((dq for q in qs for dq in g.consumers.get(q.output[0], [])
                  if dq.op_type == "DequantizeLinear" and g.qdq_params(dq) == key), key=lambda n: order[id(n)])
    if len(dqs) < 2:
        return False
    keep, changed = dqs[0].output[0], False
    for dq in dqs[1:]:
        if dq.output[0] in g.output_names:
            continue
        for user in g.consumers.get(dq.output[0], []):
            for i, name in enumerate(user.input):
                if name == dq.output[0]:
                    user.input[i] = keep
                    changed = True
    return changed


@fixer("QD021")
def drop_qdq_inside_reshape_chain(model, g: QdqGraph, finding) -> bool:
    """Drop the inner Q/DQ pair of a data-movement chain: its consumers read the Q's float input, which the first DQ
    reaches through the chain (exact when both pairs share one scale)."""
    q, dq = _node(g, finding.nodes[0]), _node(g, finding.nodes[1])
    if q is None or dq is None or q.op_type != "QuantizeLinear" or dq.op_type != "DequantizeLinear" \
            or dq.input[0] != q.output[0] or dq.output[0] in g.output_names:
        return False
    users = g.consumers.get(dq.output[0], [])
    for user in users:
        for i, name in enumerate(user.input):
            if name == dq.output[0]:
                user.input[i] = q.input[0]
    return bool(users)


def prune(model: onnx.ModelProto) -> int:
    """Drop Q/DQ/Pad nodes (and initializers) that no longer feed anything. Returns how many nodes went."""
    removed = 0
    while True:
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [n for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear", "Pad", "Cast")
                and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            model.graph.node.remove(n)
        removed += len(dead)
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    for init in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(init)
    return removed


def apply_fixes(model: onnx.ModelProto, rules: set[str] | None = None, max_passes: int = 4) -> dict[str, int]:
    """Apply the safe fixes (all, or ``rules``) until no finding they fix remains. Returns fixes per rule."""
    wanted = set(FIXERS) if rules is None else set(rules) & set(FIXERS)
    applied: dict[str, int] = {}
    for _ in range(max_passes):
        g = QdqGraph(model)
        changed = False
        for finding in run_rules(g, only=wanted):
            if FIXERS[finding.rule](model, g, finding):
                applied[finding.rule] = applied.get(finding.rule, 0) + 1
                changed = True
        prune(model)
        if not changed:
            break
    return applied
