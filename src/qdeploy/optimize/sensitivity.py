"""Per-layer quantization sensitivity of a Q/DQ ONNX in one pass: each compute layer's output SQNR, quantized vs float.

Why this proxy: the fallback needs an order in which to try keeping layers in float, and it must be cheap (one pass over
a few dozen images) and work for any model and quantizer, PyTorch or ONNX. For every compute op (Conv, ConvTranspose,
Gemm, MatMul) whose inputs go through QuantizeLinear/DequantizeLinear, a twin op is added that reads the *float*
tensors in front of those Q/DQ pairs; both outputs are compared on the same images. The SQNR is *local*: the layer's
own input and weight quantization error, given what reaches it. A low SQNR marks a layer whose INT8 ranges fit its
data badly (outlier channels, wide activations). It says nothing about how much the network downstream amplifies that
error, which is why the fallback refines the top of this ranking by reverting each layer alone and measuring (NNCF's
way), and uses the SQNR only to choose which layers are worth that cost.

Weights stored as int8 initializers (ONNX Runtime's QDQ format) have no float twin in the graph; their layers are
measured with the dequantized weights, i.e. activation error only, and flagged ``weights_float: false``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from qdeploy.lint.placement import COMPUTE_OPS
from qdeploy.utils.onnx_graph import OnnxGraph
from qdeploy.utils.ort_options import exact_qdq

_SUFFIX = "__qdeploy_float"
SQNR_LIMIT = 200.0  # dB: beyond float32's own resolution


def _float_source(g: OnnxGraph, tensor: str) -> tuple[str, bool, bool]:
    """(the float tensor in front of a DQ(Q(x)) pair, whether there was such a pair, whether that Q clamps at zero).
    A DQ of a constant (int8 weights) has no float source: the tensor itself is returned, with False."""
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return tensor, False, False
    q = g.producer.get(dq.input[0])
    if q is None or q.op_type != "QuantizeLinear":
        return tensor, False, False
    return q.input[0], True, _clamps_at_zero(g, q)


def _float_input(g: OnnxGraph, tensor: str, consumer: str, clamp: bool = True) -> tuple[str, bool, Optional[onnx.NodeProto]]:
    """(the float tensor a layer named ``consumer`` reads instead of ``tensor``, whether ``tensor`` was a Q/DQ pair, the
    Relu node to add in front of it or None). Where the Q clamped at zero (a Relu ONNX Runtime deleted,
    ``_clamps_at_zero``) and ``clamp``, that Relu is added back for this consumer (named after it: two layers reading
    one tensor each get their own), unless the tensor is a Relu's output already."""
    src, was_q, clamps = _float_source(g, tensor)
    before = g.producer.get(src)
    if not (clamps and clamp) or (before is not None and before.op_type == "Relu"):  # NNCF keeps its Relus
        return src, was_q, None
    relu = helper.make_node("Relu", [src], [f"{src}{_SUFFIX}_relu_{consumer}"], name=f"{consumer}{_SUFFIX}_relu")
    return relu.output[0], was_q, relu


def _clamps_at_zero(g: OnnxGraph, q: onnx.NodeProto) -> bool:
    """A Q whose zero point is its type's minimum represents nothing below 0. ONNX Runtime's QDQ quantizer relies on
    that to delete a Relu in front of it (the Q does the clamp), so the float tensor before such a Q is the
    *pre*-Relu value: the float twin must clamp it too, or the SQNR counts the Relu's work as quantization error."""
    zp = g.constant_value(q.input[2]) if len(q.input) > 2 and q.input[2] else None
    if zp is None:
        return not (len(q.input) > 2 and q.input[2])  # no zero point at all: uint8 with zero point 0 (ONNX's default)
    lowest = np.iinfo(zp.dtype).min if np.issubdtype(zp.dtype, np.integer) else None
    return lowest is not None and bool(np.all(zp == lowest))


def _weight_shape(g: OnnxGraph, tensor: str) -> Optional[tuple]:
    """The weight's shape as the compute op sees it: through DQ, Q, Cast and Transpose to the initializer, with the
    Transposes applied (torch.onnx stores a Linear's weight pre-transposed, ModelOpt as W -> Q -> DQ -> Transpose)."""
    perms = []
    for _ in range(5):
        value = g.constant_value(tensor)
        if value is not None:
            shape = tuple(value.shape)
            for perm in reversed(perms):
                shape = tuple(shape[i] for i in (perm or reversed(range(len(shape)))))
            return shape
        node = g.producer.get(tensor)
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear", "Transpose", "Cast", "Identity"):
            return None
        if node.op_type == "Transpose":
            perms.append(next((list(a.ints) for a in node.attribute if a.name == "perm"), None))
        tensor = node.input[0]
    return None


def compute_layers(g: OnnxGraph) -> list[onnx.NodeProto]:
    """The compute ops in graph order (ONNX keeps nodes topologically sorted)."""
    return [n for n in g.nodes if n.op_type in COMPUTE_OPS]


def layer_names_map(fp32_onnx: Path, qdq_onnx: Path) -> Optional[dict[str, str]]:
    """{compute-op name in the Q/DQ ONNX: its name in the FP32 ONNX}, or None when they cannot be paired.

    ``exclude`` regexes are matched against the FP32 ONNX's node names (the namespace every quantizer maps from), but a
    Q/DQ ONNX exported from a traced, quantized PyTorch model names its nodes its own way (``/model/conv1_1/Conv`` for
    ``layer1.0.conv1``). Same names where they exist; otherwise the two lists of compute ops are paired in graph order,
    and only when their op types and weight shapes agree one by one, so a wrong pairing cannot pass silently.
    """
    gf, gq = OnnxGraph.load(fp32_onnx), OnnxGraph.load(qdq_onnx)
    lf, lq = compute_layers(gf), compute_layers(gq)
    names_f = {n.name for n in lf}
    if all(n.name in names_f for n in lq):
        return {n.name: n.name for n in lq}
    twin = _paired_through_onnx2torch(gf.model, names_f, [n.name for n in lq])
    if twin is not None:
        return twin
    if len(lf) != len(lq):
        return None
    for a, b in zip(lf, lq):
        if a.op_type != b.op_type or (len(a.input) > 1 and _weight_shape(gf, a.input[1]) != _weight_shape(gq, b.input[1])):
            return None
    return {b.name: a.name for a, b in zip(lf, lq)}


def with_float_activations(qdq_onnx: Path, layers: set, out: Path) -> int:
    """Write ``qdq_onnx`` with the named compute layers reading the float tensor in front of their activation
    QuantizeLinear/DequantizeLinear pairs (other consumers of those pairs keep them); weights, and whatever the
    quantizer did to them (rounding, bias correction, SmoothQuant's scales), stay as they are. Returns the inputs
    rewired. The fallback ranks layers of an NNCF model on this: NNCF re-collects its statistics for every
    ignored scope (nncf 3.4 caches statistics only for weight compression), tens of seconds per layer on a
    transformer, where this graph edit takes milliseconds; the candidates it then measures are NNCF's own builds."""
    g = OnnxGraph.load(qdq_onnx)
    rewired, added = 0, []
    for node in g.model.graph.node:
        if node.name not in layers:
            continue
        for i, tensor in enumerate(node.input):  # a weight's DQ reads a constant, not a Q: left as it is
            source, paired, relu = _float_input(g, tensor, node.name)
            if not paired:
                continue
            if relu is not None:
                added.append((node.name, relu))
            node.input[i] = source
            rewired += 1
    if added:  # each Relu just before its consumer: the node list stays in topological order
        before = {}
        for consumer, relu in added:
            before.setdefault(consumer, []).append(relu)
        nodes = [m for n in g.model.graph.node for m in [*before.get(n.name, []), n]]
        del g.model.graph.node[:]
        g.model.graph.node.extend(nodes)
    onnx.save(g.model, str(out))
    return rewired


def _paired_through_onnx2torch(fp32: onnx.ModelProto, names_f: set, names_q: list) -> Optional[dict[str, str]]:
    """QAT of an ONNX or Keras source trains onnx2torch's module of the FP32 ONNX, whose modules are named after its
    nodes; the exported Q/DQ nodes carry those names as scopes (``/model/Conv__668/Conv``, a padded conv's layer one
    level down: ``/model/Conv__648/Conv__648.1/Conv``). None unless every compute op pairs this way."""
    from qdeploy.export.onnx_to_torch import node_modules
    from qdeploy.quantize.exclude import module_of_node, scope_key

    try:
        by_module = {scope_key(m): n for n, m in node_modules(fp32).items() if n in names_f}
    except Exception:  # onnx2torch cannot read this graph: it was not a twin either
        return None
    out = {}
    for name in names_q:
        m = scope_key(module_of_node(name))
        while m not in by_module and m.rsplit(".", 1)[-1].isdigit():  # a Sequential child (pad, conv)
            m = m.rsplit(".", 1)[0]
        if m not in by_module:
            return None
        out[name] = by_module[m]
    return out


def _with_float_twins(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[dict]]:
    g = OnnxGraph(model)
    twins, outputs, layers = [], [], []
    for n in compute_layers(g):
        inputs, quantized = list(n.input), []
        pending = []
        for i in range(min(2, len(inputs))):
            src, was_q, relu = _float_input(g, inputs[i], n.name or n.output[0], clamp=i == 0)
            if relu is not None:
                pending.append(relu)
            inputs[i] = src
            quantized.append(was_q)
        w_dq = len(n.input) > 1 and g.producer.get(n.input[1]) is not None and g.producer[n.input[1]].op_type == "DequantizeLinear"
        is_quantized = quantized[0] or (len(quantized) > 1 and quantized[1]) or w_dq
        weight = _weight_shape(g, n.input[1]) if len(n.input) > 1 else None
        layer = {"name": n.name or n.output[0], "op": n.op_type, "output": n.output[0], "quantized": bool(is_quantized),
                 "input_quantized": quantized[0], "weights_float": len(quantized) > 1 and quantized[1],
                 "weight_elements": int(np.prod(weight)) if weight else None,
                 # a MatMul of two activations (attention's Q·Kᵀ and softmax·V): its MACs come from its first input's
                 # shape (the reduction length), read in the same pass
                 "reduction_input": n.input[0] if weight is None and n.op_type == "MatMul" else None}
        outputs.append(n.output[0])
        if layer["reduction_input"]:
            outputs.append(layer["reduction_input"])
        if is_quantized:
            twin = helper.make_node(n.op_type, inputs, [n.output[0] + _SUFFIX], name=(n.name or n.output[0]) + _SUFFIX,
                                    domain=n.domain)
            twin.attribute.extend(n.attribute)
            twins += pending + [twin]
            outputs.append(twin.output[0])
        layers.append(layer)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.node.extend(twins)
    existing = {o.name for o in m.graph.output}
    for name in outputs:
        if name not in existing:
            m.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return m, layers


def _macs(layer: dict, out_shape: tuple, images: int, reduction_shape: tuple = ()) -> Optional[int]:
    """Multiply-accumulates per image. With a weight: output elements x (weight elements / output channels); Conv's
    output channels are dim 1, Gemm/MatMul's the last dim. A MatMul of two activations: output elements x the reduction
    length (its first input's last dim), so attention's two batched matmuls count like every other layer (the output
    may fold heads into the batch axis: totals are divided by the images in the batch, not by dim 0). ConvTranspose is
    overestimated by its stride product (its MACs scale with the input, not the output); only shares are used."""
    if len(out_shape) < 2 or images <= 0:
        return None
    total = int(np.prod(out_shape))
    if layer["weight_elements"]:
        channels = out_shape[1] if layer["op"] in ("Conv", "ConvTranspose") else out_shape[-1]
        return int(total * (layer["weight_elements"] // max(1, channels)) // images)
    if layer.get("reduction_input") and reduction_shape:
        return int(total * reduction_shape[-1] // images)
    return None


def layer_sensitivity(qdq_onnx: Path, images: np.ndarray, batch_size: int = 8, threads: Optional[int] = None) -> list[dict]:
    """One pass of ``images`` (normalized NCHW float32) through the Q/DQ model with float twins: per compute layer
    {name, op, quantized, macs, sqnr_db (None when the layer is not quantized), input_quantized, weights_float}, the
    quantized layers lowest SQNR (most damaged) first, then the float ones."""
    model, layers = _with_float_twins(onnx.load(str(qdq_onnx)))
    if not layers:
        return []
    opts = exact_qdq(ort.SessionOptions())
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # measure the graph as written
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    input_name = sess.get_inputs()[0].name
    wanted = [x for layer in layers for x in ([layer["output"], layer["output"] + _SUFFIX] if layer["quantized"] else [layer["output"]])]
    wanted += [layer["reduction_input"] for layer in layers if layer.get("reduction_input")]
    wanted = list(dict.fromkeys(wanted))
    index = {name: i for i, name in enumerate(wanted)}
    signal = np.zeros(len(layers))
    noise = np.zeros(len(layers))
    shapes: dict[int, tuple] = {}
    reductions: dict[int, tuple] = {}
    first_batch = min(batch_size, len(images))
    for start in range(0, len(images), batch_size):
        outs = sess.run(wanted, {input_name: np.ascontiguousarray(images[start:start + batch_size], dtype=np.float32)})
        for i, layer in enumerate(layers):
            q = outs[index[layer["output"]]]
            shapes.setdefault(i, tuple(q.shape))
            if layer.get("reduction_input"):
                reductions.setdefault(i, tuple(outs[index[layer["reduction_input"]]].shape))
            if layer["quantized"]:
                f = outs[index[layer["output"] + _SUFFIX]].astype(np.float64)
                q = q.astype(np.float64)
                signal[i] += float(np.sum(f * f))
                noise[i] += float(np.sum((f - q) ** 2))
    out = []
    for i, layer in enumerate(layers):
        sqnr = None
        if layer["quantized"]:
            s_, e_ = signal[i], noise[i]
            # clamped to +-SQNR_LIMIT: no error at all (or no signal) stays a number that JSON and sorting can take
            sqnr = SQNR_LIMIT if e_ <= 0 else (10.0 * math.log10(s_ / e_) if s_ > 0 else -SQNR_LIMIT)
            sqnr = round(max(-SQNR_LIMIT, min(SQNR_LIMIT, sqnr)), 3)
        out.append({k: v for k, v in layer.items() if k not in ("output", "weight_elements", "reduction_input")}
                   | {"macs": _macs(layer, shapes.get(i, ()), first_batch, reductions.get(i, ())), "sqnr_db": sqnr})
    return sorted(out, key=lambda d: (not d["quantized"], d["sqnr_db"] if d["sqnr_db"] is not None else 0.0))


__all__ = ["COMPUTE_OPS", "compute_layers", "layer_names_map", "layer_sensitivity"]
