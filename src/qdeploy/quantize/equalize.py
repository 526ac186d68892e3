"""Per-channel precision for depthwise-convolution inputs, on per-tensor INT8 hardware.

Why. A depthwise conv reads each input channel on its own, and the channels of its input (an expand
conv's output after BN and SiLU/ReLU6) span very different ranges: on the CIFAR-10 EfficientNet-B0 the
per-channel maxima of one tensor differ by 100x. One per-tensor scale then quantizes the narrow channels
to a few levels. NNCF quantizes these inputs per channel (its CPU hardware setup, ``q8_a_ch`` for
``DEPTHWISE_CONVOLUTION``, with each channel's global min/max). That is what separated its PTQ from ours
on EfficientNet-B0 (the ablation in docs/int8-accuracy.md): with NNCF's per-channel depthwise inputs
turned into per-tensor ones its model falls from 80.0 % to 49 %; qdeploy's went from 79.5 % to 80.3 %
with them.

How, without per-channel activation scales. TensorRT quantizes activations per tensor only, and ONNX
Runtime's QLinearConv takes one input scale. So the per-channel scale is moved out of the quantizer,
as ModelOpt's ``pre_quant_scale`` (SmoothQuant) does: ``dwconv(x, W) = dwconv(x·g, W/g)`` exactly, for a
per-channel gain g, because output channel c of a depthwise conv sees input channel c only. A ``Mul``
by g is inserted before the conv's input quantizer, and the conv's weights are divided by g. The
weights are quantized per output channel, so their INT8 values do not change (each channel's scale
divides by g_c). The activation quantizer keeps the tensor's per-tensor range [lo, hi] from the chosen
method; g_c stretches channel c's observed range [lo_c, hi_c] to fill it:
``g_c = min(hi / hi_c, lo / lo_c)``, at least 1 and at most ``MAX_GAIN``. A channel is therefore never
clipped more than with the per-tensor range alone, and gets up to ``MAX_GAIN`` x finer steps.
The Mul is an element-wise op on the producer's output: TensorRT fuses it into the pointwise epilogue
that also holds the activation and the output quantization (not confirmed on a GPU here, TensorRT
is not installed).
"""
from __future__ import annotations

import numpy as np

from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.quantize.ranges import TensorRange

# A channel 256x narrower than its tensor's range gets 8 bits more resolution than per-tensor scaling would
# give it; narrower channels are near-dead (their whole range is under 1/256 of a step). Larger gains would
# shrink the weights (W/g) towards the weight quantizers' amax floor for no measurable benefit.
MAX_GAIN = 256.0


def depthwise_convs(model) -> list:
    """Depthwise Conv nodes whose weights are initializers (group = C_in, one input channel per group)."""
    g = QdqGraph(model)
    return [n for n in g.nodes if n.op_type == "Conv" and g.is_depthwise(n) and n.input[1] in g.initializers]


def depthwise_inputs(model) -> list[str]:
    """Activation tensors read by depthwise convs: the tensors whose per-channel extremes are collected."""
    return sorted({n.input[0] for n in depthwise_convs(model)})


def channel_gains(r: TensorRange, symmetric: bool) -> np.ndarray | None:
    """Per-channel gain g_c ≥ 1 that stretches channel c's range into the tensor's quantization range."""
    if r.channel_lo is None:
        return None
    lo, hi = (-r.amax, r.amax) if symmetric else (min(r.lo, 0.0), max(r.hi, 0.0))
    c_lo, c_hi = np.asarray(r.channel_lo, np.float64), np.asarray(r.channel_hi, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(c_hi > 0, hi / c_hi, np.inf)
        down = np.where(c_lo < 0, lo / c_lo, np.inf)
    gain = np.minimum(up, down)
    gain = np.where(np.isfinite(gain), gain, MAX_GAIN)  # an all-zero channel: any gain is exact
    return np.clip(gain, 1.0, MAX_GAIN)


def equalize_depthwise_inputs(model, ranges: dict, symmetric: bool, skip=()) -> dict:
    """Insert ``Mul(x, g)`` before every depthwise conv whose input has per-channel extremes in ``ranges``
    and divide its weights by g (in place). The new tensors get the per-tensor range of x in ``ranges``.
    ``skip``: conv node names left alone (user excludes). Returns {"convs", "mul_nodes", "max_gain", "median_gain"}."""
    from onnx import helper, numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    users = {}
    for node in model.graph.node:
        for i in node.input:
            users[i] = users.get(i, 0) + 1
    convs, muls, gains_seen = [], [], []
    nodes = list(model.graph.node)
    for conv in depthwise_convs(model):
        x = conv.input[0]
        r = ranges.get(x)
        gain = channel_gains(r, symmetric) if r is not None and conv.name not in skip else None
        weight = inits[conv.input[1]]
        w = numpy_helper.to_array(weight)
        if gain is None or len(gain) != w.shape[0] or np.all(gain <= 1.0 + 1e-6):
            continue
        shape = (1, len(gain)) + (1,) * (w.ndim - 2)
        g_name, x_eq, w_name = f"{conv.name}/equalize_gain", f"{conv.name}/equalized_input", conv.input[1]
        if users.get(w_name, 0) > 1:  # a weight shared with another node: give this conv its own copy
            w_name = f"{conv.name}/equalized_weight"
        scaled = (w / gain.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
        new_w = numpy_helper.from_array(scaled, w_name)
        if w_name == conv.input[1]:
            weight.CopyFrom(new_w)
        else:
            model.graph.initializer.append(new_w)
            conv.input[1] = w_name
        model.graph.initializer.append(numpy_helper.from_array(gain.astype(np.float32).reshape(shape), g_name))
        mul = helper.make_node("Mul", [x, g_name], [x_eq], name=f"{conv.name}/equalize")
        nodes.insert(nodes.index(conv), mul)
        conv.input[0] = x_eq
        ranges[x_eq] = TensorRange(r.lo, r.hi, r.amax)
        convs.append(conv.name)
        muls.append(mul.name)
        gains_seen.append(gain)
    if muls:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    allg = np.concatenate(gains_seen) if gains_seen else np.ones(1)
    return {"convs": convs, "mul_nodes": muls, "max_gain": round(float(allg.max()), 2),
            "median_gain": round(float(np.median(allg)), 2)}
