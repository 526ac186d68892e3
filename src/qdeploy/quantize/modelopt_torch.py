"""TensorRT Q/DQ ONNX from a PyTorch model through NVIDIA ModelOpt (``modelopt.torch.quantization``).

1. ``torch.fx`` traces the model, folds BatchNorm into the preceding Conv (so weight scales are
   computed on the weights TensorRT will run), and turns every ``a + b`` of two tensors into a
   ``ResidualAdd`` module. ModelOpt only quantizes modules, so a functional residual addition would
   otherwise stay float and TensorRT could not fuse Conv+Add in INT8. Conv/Linear/BN/pooling modules stay
   leaves of the trace even when they are user subclasses with their own forward (EfficientNet-Lite's
   same-padding convs), and their BN is folded too; such subclasses are registered with ModelOpt
   (_register_subclasses).
2. ``mtq.quantize`` with per-channel (axis 0) INT8 weight quantizers and per-tensor INT8 input
   quantizers (histogram calibrators) on Conv/Linear/pooling and on both inputs of each ResidualAdd; then
   ``apply_plan`` keeps on only the quantizers where the placement plan (lint/placement.py, the plan the ONNX
   quantizer inserts and the lint checks) wants a Q/DQ: skip input only on residual Adds, narrow convs, pools,
   Conv→BN/act chains, LayerNorm, squeeze-excitation branches float. A compute op the plan makes INT8 that no
   quantizer reaches (a functional F.linear or F.conv2d on a parameter, nn.MultiheadAttention's in_proj) makes the
   quantizer NotApplicable: quantizer auto then takes the ONNX quantizer, and says why. ``apply_shared_scales``
   gives act+act Add inputs one scale.
   ``algorithm=None``: ModelOpt's own finish step passes no method to histogram calibrators (and one
   to the weight max-calibrators, which reject it), so we collect statistics ourselves, then set each
   input quantizer's amax with the chosen method (ranges.py: ModelOpt's algorithms, made fast) and
   each weight quantizer's with its max calibrator.
3. ``torch.onnx.export`` (TorchScript exporter, ModelOpt's symbolic functions) writes explicit
   QuantizeLinear/DequantizeLinear nodes; a zero Pad left between a DQ and its Conv (a subclass padding in its
   forward) is folded into the Conv's pads (lint fix QD009, numerically exact).
"""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import operator
import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from torch import fx, nn

from qdeploy.errors import QDeployError
from qdeploy.quantize.registry import NotApplicable
from qdeploy.export.onnx import INPUT_NAME, OUTPUT_NAME
from qdeploy.models.loader import SelectOutput
from qdeploy.quantize.collect import TensorStats
from qdeploy.quantize.modelopt_import import import_modelopt
from qdeploy.quantize.equalize import channel_gains
from qdeploy.quantize.ranges import TensorRange, calibration_facts, calibration_warnings, compute_amax
from qdeploy.utils.atomic import atomic_path
from qdeploy.utils.log import progress, warn


# Smallest amax a quantizer gets. ModelOpt's fake quantization treats amax ≤ 2**-24 as "zero amax" and outputs
# 0, while the exported QuantizeLinear (scale = amax/127) passes such values through, so a floor at or below
# 2**-24 makes the export disagree with the calibrated model (seen on an untrained MobileNetV2 whose logits
# are ~1e-9: cosine 0). Just above ModelOpt's epsilon both agree.
AMAX_FLOOR = 2.0 ** -23


class NotTraceable(NotApplicable):
    """torch.fx cannot trace the model, so ModelOpt's residual-Add quantizers cannot be placed."""


class ResidualAdd(nn.Module):
    """``a + b`` as a module, so quantization tools can attach quantizers to both inputs."""

    def forward(self, a, b):
        return a + b


_REGISTERED = False


def _modelopt():
    """Import ModelOpt quietly and register the quantized ResidualAdd once."""
    global _REGISTERED
    mtq = import_modelopt("modelopt.torch.quantization")
    TensorQuantizer = import_modelopt("modelopt.torch.quantization.nn").TensorQuantizer
    if not _REGISTERED:
        class QuantResidualAdd(ResidualAdd):
            def _setup(self):
                self.lhs_input_quantizer = TensorQuantizer()
                self.rhs_input_quantizer = TensorQuantizer()

            def forward(self, a, b):
                return self.lhs_input_quantizer(a) + self.rhs_input_quantizer(b)

        mtq.register(original_cls=ResidualAdd, quantized_cls=QuantResidualAdd)
        _REGISTERED = True
    return mtq, TensorQuantizer


_LEAF_CLASSES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Linear,
                 nn.modules.batchnorm._BatchNorm) + tuple(
    c for c in vars(nn.modules.pooling).values() if isinstance(c, type) and issubclass(c, nn.Module) and c is not nn.Module)


def _static_pieces(node: fx.Node) -> Optional[int]:
    """How many tensors a chunk/split node returns when its arguments say it (chunk's count; split by a list of sizes);
    None otherwise (split by one size: the count depends on the input's shape)."""
    method = node.op == "call_method" and node.target in ("chunk", "split", "tensor_split")
    function = node.op == "call_function" and node.target in (torch.chunk, torch.split, torch.tensor_split)
    if not (method or function) or len(node.args) < 2:
        return None
    what = node.args[1]
    if node.target in ("chunk", torch.chunk) and isinstance(what, int):
        return what
    if isinstance(what, (list, tuple)) and all(isinstance(v, int) for v in what):
        return len(what) + (1 if node.target in ("tensor_split", torch.tensor_split) else 0)
    return None


class _PiecesProxy(fx.Proxy):
    """A Proxy with a length when it stands for a chunk/split of a known count: ``list(x.chunk(2, 1))`` (the C2f block
    of Ultralytics' YOLOv8 and of its re-implementations) asks for it before iterating (:meth:`_LeafTracer.iter`).
    ``__iter__`` stays torch.fx's own: it reads the caller's bytecode (``a, b = x.chunk(2)`` unpacks without us)."""

    def __len__(self):
        n = _static_pieces(self.node)
        return n if n is not None else super().__len__()


class _LeafTracer(fx.Tracer):
    """torch.fx's tracer, plus: every Conv/ConvTranspose/Linear/BatchNorm/pooling module is a leaf, subclasses included.

    The default tracer keeps only modules defined in torch.nn whole; it traces *through* a user subclass of
    nn.Conv2d with its own forward (EfficientNet-Lite's Conv2dStaticSamePadding: ZeroPad2d then F.conv2d), which
    leaves an F.conv2d on get_attr weights that neither Conv+BN folding nor ModelOpt (it quantizes modules) can handle.
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # onnx2torch's own op modules (an ONNX or Keras source's twin) too: each is one ONNX op, and their shape
        # checks are control flow a symbolic trace cannot follow; but not its Add/Sub/Mul/Div module, whose torch.add
        # the trace must see to make a residual Add a ResidualAdd with quantizers
        onnx_op = type(m).__module__.startswith("onnx2torch.") and type(m).__name__ != "OnnxBinaryMathOperation"
        return isinstance(m, _LEAF_CLASSES) or onnx_op or super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _PiecesProxy(node, self)

    def iter(self, obj: fx.Proxy):
        """Where torch.fx cannot iterate a Proxy (not a tuple unpacking): a chunk/split of known count iterates into
        getitem nodes; anything else fails as before ("Proxy object cannot be iterated")."""
        n = _static_pieces(obj.node)
        if n is None:
            return super().iter(obj)
        return iter([obj[i] for i in range(n)])


def _probe_input(conv: nn.Module) -> Optional[torch.Tensor]:
    nd = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}[next(c for c in type(conv).__mro__ if c in (nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    size = max((k - 1) * d + 1 for k, d in zip(conv.kernel_size, conv.dilation)) + 2 * max(conv.stride) + 3
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, conv.in_channels, *([size] * nd), generator=g, dtype=conv.weight.dtype)


def _fold_subclass_conv_bn(gm: fx.GraphModule) -> list:
    """Fold BatchNorm into a preceding conv *subclass* (fuse() folds the exact nn.Conv*d only). Returns the folded convs.

    fuse_conv_bn_eval rescales a copy of the conv's weight and bias and keeps its class, so the subclass's own
    forward (padding etc.) still runs. That is only right when the forward is linear in weight and bias the usual
    way (a weight-standardizing conv would undo the scaling), so each fold is checked on a random probe input
    and skipped (BN left as is) when the folded conv does not reproduce conv → BN.
    """
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    modules = dict(gm.named_modules())
    folded = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            continue
        bn, src = modules.get(node.target), node.args[0]
        if not isinstance(bn, _BN_MODULES) or type(bn).forward is not nn.modules.batchnorm._BatchNorm.forward:
            continue
        if not (bn.track_running_stats and bn.running_mean is not None) or not isinstance(src, fx.Node):
            continue
        if src.op != "call_module" or len(src.users) > 1:
            continue
        conv = modules.get(src.target)
        if not isinstance(conv, _CONV_MODULES) or type(conv) in _CONV_MODULES or conv.out_channels != bn.num_features:
            continue
        try:
            fused = fuse_conv_bn_eval(conv, bn)  # works on a deep copy
            x = _probe_input(conv)
            with torch.no_grad():
                ref, out = bn(conv(x)), fused(x)
            ok = ref.shape == out.shape and torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-6)
        except Exception:
            ok = False
        if not ok:
            continue
        parent, _, attr = src.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, attr, fused)
        modules[src.target] = fused
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        folded.append(src.target)
    if folded:
        gm.graph.lint()
        gm.delete_all_unused_submodules()  # the folded BNs (fuse() drops them too)
        gm.recompile()
    return folded


def _register_subclasses(model: nn.Module) -> list:
    """Register with ModelOpt every Conv/ConvTranspose/Linear subclass of ``model`` that it would leave unquantized.

    ModelOpt's QuantModuleRegistry converts a module whose class is registered, or a subclass that *shares* the
    registered class's forward; a subclass with its own forward (Conv2dStaticSamePadding) gets no quantizers. Its
    quantized class here is ModelOpt's QuantLinearConvBase with the base class's weight descriptor: the input
    quantizer runs on the module's input, then the subclass's own forward runs with the weight attribute returning
    the quantized weight (ModelOpt's dynamic attribute). The subclass's padding thus runs on the dequantized input:
    DQ → Pad → Conv in the ONNX, which export_qdq_onnx folds into the Conv's pads when the Pad is a zero pad.
    Returns the classes registered now.
    """
    quant_module = import_modelopt("modelopt.torch.quantization.nn.modules.quant_module")
    registry, base_cls = quant_module.QuantModuleRegistry, quant_module.QuantLinearConvBase
    mtq = import_modelopt("modelopt.torch.quantization")
    added = []
    for m in model.modules():
        cls = type(m)
        if not isinstance(m, _BACKBONE_MODULES) or cls in _BACKBONE_MODULES or cls in registry:
            continue
        base = next(c for c in cls.__mro__ if c in _BACKBONE_MODULES)
        desc = registry[base].default_quant_desc_weight
        quant_cls = type(f"QDeployQuant{cls.__name__}", (base_cls,), {
            "default_quant_desc_weight": desc, "__doc__": f"ModelOpt quantizers for {cls.__qualname__} (qdeploy)"})
        mtq.register(original_cls=cls, quantized_cls=quant_cls)
        added.append(cls)
    return added


def prepare_for_quantization(model: nn.Module) -> tuple[fx.GraphModule, int]:
    """FX-trace, fold Conv+BN, and make residual additions modules. Returns (graph module, #residual adds)."""
    from torch.fx.experimental.optimization import fuse

    model = copy.deepcopy(model).eval()
    try:
        tracer = _LeafTracer()
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    except Exception as e:  # data-dependent control flow etc.
        raise NotTraceable(
            f"torch.fx cannot trace the model for ModelOpt quantization ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "use quantizer: onnx for this variant"
        ) from None
    # Conv+BN folding (eval mode) of the exact torch.nn classes; no_trace: a re-trace with torch.fx's default tracer
    # would go through the conv subclasses kept as leaves above
    gm = fuse(gm, no_trace=True)
    _fold_subclass_conv_bn(gm)  # the same for conv subclasses (fuse() matches exact types only)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add) \
                and len(node.args) == 2 and not node.kwargs \
                and all(isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args):  # x + parameter: a bias
            name = f"residual_add_{count}"
            gm.add_submodule(name, ResidualAdd())
            with gm.graph.inserting_after(node):
                new = gm.graph.call_module(name, args=node.args)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            count += 1
    gm.graph.lint()
    gm.recompile()
    return gm, count


_CONV_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_DECONV_MODULES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_BACKBONE_MODULES = _CONV_MODULES + _DECONV_MODULES + (nn.Linear,)  # Conv / ConvTranspose / Gemm
_BN_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _enabled(module: nn.Module, attr: str):
    q = getattr(module, attr, None)
    return q if q is not None and getattr(q, "is_enabled", False) else None


# ---- the placement plan applied to ModelOpt's quantizers ----------------------------------------------------------
# ModelOpt puts quantizers on modules: an input quantizer on every Conv/Linear/pool/BatchNorm/LayerNorm/LeakyReLU module
# (and both inputs of each ResidualAdd), a weight quantizer on every Conv/Linear. Where a Q/DQ goes is the placement
# plan's decision (lint/placement.py), the same plan the ONNX quantizer inserts: the model is exported once with every
# input quantizer on and a marker amax of its own (quantizer i: amax i + 1, so the Q/DQ's scale names it), the Q/DQ
# pairs are taken out again (recording which node input each quantizer feeds), the plan is computed on that float
# graph, and a quantizer stays on only where the plan wants a Q/DQ. A node the plan makes INT8 that no quantizer reaches
# (a functional F.linear on a module's weight, nn.MultiheadAttention's in_proj) is reported: this route cannot place
# the plan, and quantizer auto takes the ONNX quantizer instead.

_MARKER_TOLERANCE = 1e-3


def _marker_export(qm: nn.Module, select, example: torch.Tensor, opset: int, acts: list, quantizers: dict):
    """The ONNX of ``qm`` with input quantizer i exported as a Q/DQ of scale (i + 1) / 127 and no weight quantizer."""
    import onnx

    weights = [n for n in quantizers if n.endswith("weight_quantizer")]
    for n in weights:
        quantizers[n].disable()
    for i, n in enumerate(acts):
        q = quantizers[n]
        q.amax = torch.tensor(float(i + 1))
        q.disable_calib()
        q.enable_quant()
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            torch.onnx.export(SelectOutput(qm, select).eval(), (example,), buf, dynamo=False,
                              opset_version=max(opset, 13), input_names=[INPUT_NAME], output_names=[OUTPUT_NAME],
                              do_constant_folding=True)
    except Exception as e:
        raise NotApplicable(f"the model with ModelOpt's quantizers does not export to ONNX "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use quantizer: onnx") from None
    finally:
        for n in weights:
            quantizers[n].enable()
        for n in acts:
            quantizers[n].reset_amax()
    return onnx.load_from_string(buf.getvalue())


def _strip_markers(model, acts: list) -> dict:
    """Remove the marker Q/DQ pairs from ``model`` (in place); {quantizer name: [(consumer node, input index)]}."""
    from qdeploy.facts.tensorrt import DQ_SEES_THROUGH
    from qdeploy.utils.onnx_graph import OnnxGraph

    g = OnnxGraph(model)
    g.ensure_node_names()
    g = OnnxGraph(model)
    sites: dict[str, list] = {}
    drop = set()
    # the Casts ModelOpt's quantizers export besides their Q/DQ (float to float): identities that would lengthen one
    # path to a residual Add's common ancestor and so change which input the plan calls the conv path
    for cast in (n for n in model.graph.node if n.op_type == "Cast" and "_quantizer/" in n.name):
        for c in g.consumers.get(cast.output[0], []):
            for j, i in enumerate(c.input):
                if i == cast.output[0]:
                    c.input[j] = cast.input[0]
        if all(o.name != cast.output[0] for o in model.graph.output):
            drop.add(id(cast))
    g = OnnxGraph(model)
    for dq in list(model.graph.node):
        if dq.op_type != "DequantizeLinear":
            continue
        q = g.producer.get(dq.input[0])
        scale = g.constant_value(dq.input[1])
        if q is None or q.op_type != "QuantizeLinear" or scale is None or scale.size != 1:
            continue
        marker = float(scale.reshape(-1)[0]) * 127.0
        idx = int(round(marker)) - 1
        if not (0 <= idx < len(acts)) or abs(marker - (idx + 1)) > _MARKER_TOLERANCE:
            continue
        src = q.input[0]
        frontier = [dq.output[0]]
        while frontier:  # the consumers, through the ops a DQ is seen through (a Linear's Reshape)
            t = frontier.pop()
            for c in g.consumers.get(t, []):
                # a subclass's own padding (DQ → Pad → Conv, folded into the Conv at export: QD009) included
                if c.op_type in DQ_SEES_THROUGH + ("Pad",) and c.op_type != "Cast":
                    frontier.extend(c.output)
                    continue
                sites.setdefault(acts[idx], []).extend((c.name, j) for j, i in enumerate(c.input) if i == t)
        for c in g.consumers.get(dq.output[0], []):
            for j, i in enumerate(c.input):
                if i == dq.output[0]:
                    c.input[j] = src
        for o in model.graph.output:
            if o.name == dq.output[0]:
                raise NotApplicable("a quantizer sits on the model's output; use quantizer: onnx")
        drop.update((id(q), id(dq)))
    keep = [n for n in model.graph.node if id(n) not in drop]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return sites


def _apply_plan_once(qm, select, example, opset, exclude, residual_quantizers, memo: Optional[dict], TensorQuantizer) -> dict:
    """``apply_plan``, its outcome kept in the run's memo: the methods of one run (entropy, mse, ...) quantize the same
    model with the same quantizer names, so the marker export and the plan run once, and a model the plan cannot be
    placed on is refused once, not once per method."""
    key = ("placement-plan", tuple(sorted(exclude)), residual_quantizers)
    if memo is None or key not in memo:
        enabled = lambda: {n for n, m in qm.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}  # noqa: E731
        before = enabled()
        try:
            placement = apply_plan(qm, select, example, opset, exclude, residual_quantizers)
        except NotApplicable as e:
            if memo is not None:
                memo[key] = e
            raise
        if memo is None:
            return placement
        memo[key] = (sorted(before - enabled()), placement)
    cached = memo[key]
    if isinstance(cached, NotApplicable):
        raise type(cached)(str(cached))
    disabled, placement = cached
    for name in disabled:
        qm.get_submodule(name).disable()
    return copy.deepcopy(placement)


def apply_plan(qm: nn.Module, select, example: torch.Tensor, opset: int, exclude: set, residual_quantizers: bool = True
               ) -> dict:
    """Disable every ModelOpt quantizer of ``qm`` that the TensorRT placement plan does not want (see above); returns
    what was done, plus ``"_groups"`` (quantizers that share one amax: apply_shared_scales). Raises NotApplicable when a
    node the plan makes INT8 has no quantizer of this model to carry its Q/DQ."""
    from qdeploy.lint.placement import placement_plan
    from qdeploy.quantize.exclude import module_of_node

    _, TensorQuantizer = _modelopt()
    quantizers = {n: m for n, m in qm.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}
    acts = [n for n in quantizers if not n.endswith("weight_quantizer")]
    model = _marker_export(qm, select, example, opset, acts, quantizers)
    sites = _strip_markers(model, acts)

    def owner(quantizer: str) -> str:
        return quantizer.rsplit(".", 1)[0]

    def excluded_module(m: str) -> bool:
        return any(m == e or m.startswith(e + ".") for e in exclude)

    nodes = {n.name: n for n in model.graph.node}
    user = {n: "excluded by the config" for n in nodes if excluded_module(module_of_node(n))}
    plan = placement_plan(model, "tensorrt", excluded=user)
    kept, disabled, groups = set(), {}, []
    for name in acts:
        wanted = [(c, j) for c, j in sites.get(name, []) if plan.wants(c, j)]
        is_residual = name.endswith(("lhs_input_quantizer", "rhs_input_quantizer"))
        if wanted and not (is_residual and not residual_quantizers):
            kept.add(name)
            continue
        consumers = [nodes[c] for c, _ in sites.get(name, []) if c in nodes]
        d = next((plan.decisions[c.name] for c in consumers if c.name in plan.decisions), None)
        op = consumers[0].op_type if consumers else "?"
        disabled[name] = ("residual_quantizers: false" if is_residual and not residual_quantizers
                          else f"{op}: {d.rule}" if d is not None else f"{op}: no rule makes it INT8")
    for name in quantizers:
        if name.endswith("weight_quantizer") and f"{owner(name)}.input_quantizer" not in kept:
            disabled[name] = "its module's input stays float"
    for name in disabled:
        quantizers[name].disable()
    # the plan's INT8 compute nodes, each reached by a kept input quantizer whose module quantizes the weight too
    covered = set()
    for name in kept:
        weighted = _enabled(qm.get_submodule(owner(name)), "weight_quantizer") is not None
        for c, j in sites.get(name, []):
            if weighted or nodes.get(c) is not None and nodes[c].op_type == "Add":
                covered.add(c)
    uncovered = [n for n in plan.int8_compute() if n not in covered]
    if uncovered:
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise NotApplicable(
            f"ModelOpt has no quantizer for {len(uncovered)} of the {len(plan.int8_compute())} compute op(s) the TensorRT "
            f"placement plan makes INT8: {', '.join(uncovered[:5])}{more} (a functional op on a module's weight, or a "
            "module class ModelOpt does not quantize); the ONNX quantizer places them")
    residual = {}
    for add in (n for n in plan.decisions if plan.decisions[n].rule == "residual-add"):
        qs = {q: j for q in acts for c, j in sites.get(q, []) if c == add}
        on = sorted(q for q in qs if q in kept)
        if not qs:
            continue
        module = owner(next(iter(qs)))
        side = {0: "lhs", 1: "rhs"}
        skip = "both" if len(on) == 2 else side[qs[on[0]]] if on else None
        residual[module] = {"skip": skip, "rule": plan.decisions[add].why.rsplit("(", 1)[-1].rstrip(")"),
                            "conv_path": None if skip in ("both", None) else side[1 - qs[on[0]]]}
        if add in plan.shared_scale_adds and len(on) == 2:
            groups.append((on, []))
    by = {"narrow-conv": [], "pool": [], "chain": [], "rule": {}}
    for name, why in disabled.items():
        if why.startswith("Conv: narrow-conv"):
            if name.endswith("input_quantizer"):
                by["narrow-conv"].append(owner(name))
        elif why.split(":")[0] in ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"):
            by["pool"].append(name)
        elif why.endswith("no rule makes it INT8"):
            by["chain"].append(name)
        elif not name.endswith("weight_quantizer") and why != "residual_quantizers: false":
            by["rule"][owner(name)] = why
    return {"placement_plan": plan.summary(), "residual_adds": residual, "excluded_small_channel_convs": by["narrow-conv"],
            "excluded_pool_inputs": sorted(by["pool"]), "excluded_inside_conv_chains": sorted(by["chain"]),
            "float_by_placement_rule": by["rule"], "_groups": groups,
            "_se_modules": sorted({owner(q) for q, w in disabled.items() if "squeeze-excitation" in w})}


def apply_shared_scales(quantizers: dict, groups: list) -> list:
    """Give every quantizer of a group (merged where they overlap) one amax; returns the merged groups (names).

    A group's amax: the largest amax of its deciding members (a pool's input) if it has any, else the largest of all.
    Quantizers not in ``quantizers`` (disabled, excluded) are left out.
    """
    parent = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    deciding = set()
    for names, decide in groups:
        names = [q for q in names if q in quantizers]
        deciding.update(q for q in decide if q in quantizers)
        for q in names[1:]:
            parent[find(q)] = find(names[0])
        for q in names[:1]:
            find(q)
    merged = {}
    for q in parent:
        merged.setdefault(find(q), []).append(q)
    out = []
    for members in merged.values():
        if len(members) < 2:
            continue
        decide = [q for q in members if q in deciding] or members
        value = max(float(quantizers[q].amax.max()) for q in decide)
        for q in members:
            quantizers[q].amax = torch.tensor(value)
        out.append(sorted(members))
    return sorted(out)


class _SampleExtremes:
    """Forward pre-hooks on the enabled input quantizers during the statistics pass: per image, max|x| summed over
    the images (method mean-minmax), and per channel the min/max over all images for depthwise convs' inputs."""

    def __init__(self, qm: nn.Module, quantizers: dict):
        self.sample_absmax: dict[str, float] = {}
        self.sample_absmax_sq: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self.elements: dict[str, int] = {}
        self.lo: dict[str, float] = {}
        self.hi: dict[str, float] = {}
        self.channels: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        modules = dict(qm.named_modules())
        self.handles = []
        for name, q in quantizers.items():
            if name.endswith("input_quantizer"):
                owner = name[: -len(".input_quantizer")]
                conv = modules.get(owner)
                depthwise = isinstance(conv, nn.Conv2d) and conv.groups > 1 and conv.groups == conv.in_channels == conv.out_channels
                self.handles.append(q.register_forward_pre_hook(self._hook(name, owner if depthwise else None)))

    def _hook(self, name: str, depthwise_owner: Optional[str]):
        def hook(module, args):
            x = args[0].detach()
            if x.dim() < 1 or x.shape[0] == 0:
                return
            flat = x.reshape(x.shape[0], -1).float()
            absmax = flat.abs().amax(dim=1)
            self.sample_absmax[name] = self.sample_absmax.get(name, 0.0) + float(absmax.sum())
            self.sample_absmax_sq[name] = self.sample_absmax_sq.get(name, 0.0) + float((absmax * absmax).sum())
            self.samples[name] = self.samples.get(name, 0) + int(x.shape[0])
            self.elements[name] = flat.shape[1]
            self.lo[name] = min(self.lo.get(name, float("inf")), float(flat.min()))
            self.hi[name] = max(self.hi.get(name, float("-inf")), float(flat.max()))
            if depthwise_owner is not None and x.dim() >= 2:
                per = x.transpose(0, 1).reshape(x.shape[1], -1).float()
                lo, hi = per.amin(dim=1).cpu(), per.amax(dim=1).cpu()
                old = self.channels.get(depthwise_owner)
                self.channels[depthwise_owner] = (lo, hi) if old is None else (torch.minimum(old[0], lo), torch.maximum(old[1], hi))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def activation_stats(self):
        """The input quantizers' statistics as collect.ActivationStats (for ranges.calibration_warnings)."""
        from qdeploy.quantize.collect import ActivationStats

        tensors = {n: TensorStats(n, lo=self.lo[n], hi=self.hi[n], samples=self.samples[n],
                                  sample_absmax_sum=self.sample_absmax[n], sample_absmax_sq_sum=self.sample_absmax_sq[n],
                                  elements=self.elements[n]) for n in self.samples}
        return ActivationStats(tensors, max(self.samples.values(), default=0),
                               {n: n[: -len(".input_quantizer")] for n in tensors})


def _apply_equalization(qm: nn.Module, quantizers: dict, amax: dict, scale_weight_amax: bool) -> None:
    """``dwconv(x, W) = dwconv(x·g, W/g)``: the input quantizer's ``pre_quant_scale`` (ModelOpt's SmoothQuant hook,
    exported as a Mul before the QuantizeLinear) multiplies by g, the conv's weights are divided by g."""
    modules = dict(qm.named_modules())
    for key, gain in amax.items():
        if not key.endswith(".equalize_gain"):
            continue
        owner = key[: -len(".equalize_gain")]
        conv, g = modules[owner], torch.tensor(gain, dtype=torch.float32)
        with torch.no_grad():
            conv.weight.div_(g.view(-1, *([1] * (conv.weight.dim() - 1))).to(conv.weight.device))
        quantizers[f"{owner}.input_quantizer"].pre_quant_scale = g.view(1, -1, *([1] * (conv.weight.dim() - 2)))
        if scale_weight_amax:  # per-channel (axis 0) weight amax scale exactly with the weights: same INT8 values
            wq = quantizers[f"{owner}.weight_quantizer"]
            # amax may live on the GPU (load_calib_amax after the statistics pass there)
            wq.amax = torch.clamp(wq.amax / g.view(wq.amax.shape).to(wq.amax.device), min=AMAX_FLOOR)
            amax[f"{owner}.weight_quantizer"] = wq.amax.tolist()


def _quant_config(method: str) -> dict:
    act = {"num_bits": 8, "axis": None, "calibrator": "max" if method == "max" else "histogram"}
    return {"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": act},
    ], "algorithm": None}


def quantize_torch_model(model: nn.Module, batches: Iterable[np.ndarray], total: int, method: str,
                         percentile: float = 99.99, exclude: Iterable[str] = (), amax: Optional[dict] = None,
                         stats_memo: Optional[dict] = None, residual_quantizers: bool = True,
                         example: Optional[torch.Tensor] = None, opset: int = 17):
    """ModelOpt-quantized copy of ``model`` and its quantizers' amax.

    ``exclude``: names of modules whose quantizers stay disabled (float). ``amax`` given: reuse it, no
    calibration. ``stats_memo``: a dict kept for one run, so that entropy, percentile and mse variants
    share one statistics pass (their quantizers have the same names). ``example``: an input for the placement export
    (default: two images of the first calibration batch).
    """
    mtq, TensorQuantizer = _modelopt()
    if example is None:
        batches = iter(batches)
        first = next(batches)
        batches = itertools.chain([first], batches)
        example = torch.from_numpy(np.asarray(first[:2], dtype=np.float32))
    select = model.key if isinstance(model, SelectOutput) else None
    inner = model.model if isinstance(model, SelectOutput) else model  # the output selector is not traceable
    gm, n_adds = prepare_for_quantization(inner)
    _register_subclasses(gm)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints "Inserted N quantizers"
        warnings.simplefilter("ignore")
        qm = mtq.quantize(gm, _quant_config(method), forward_loop=lambda m: None)
    # a module named is excluded with its children: onnx2torch converts a padded Conv node to Sequential(pad, conv)
    exclude = {n for n, _ in qm.named_modules() if n and any(n == e or n.startswith(e + ".") for e in (exclude or ()))}
    excluded = sorted({n.rsplit(".", 1)[0] for n, m in qm.named_modules()  # before placement, which may disable them too
                       if isinstance(m, TensorQuantizer) and m.is_enabled and n.rsplit(".", 1)[0] in exclude})
    # the placement plan (lint/placement.py) decides which quantizers stay on; NotApplicable where it cannot be placed
    placement = _apply_plan_once(qm, select, example, opset, exclude, residual_quantizers, stats_memo, TensorQuantizer)
    groups = placement.pop("_groups")
    quantizers = {n: m for n, m in qm.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}
    for name in list(quantizers):
        if name.rsplit(".", 1)[0] in excluded:
            quantizers.pop(name).disable()
    if amax is None:
        memo_key = ("histogram", tuple(sorted(exclude)), residual_quantizers)
        stats = stats_memo.get(memo_key) if stats_memo is not None and method != "max" else None
        shared = stats is not None
        if stats is None:  # one statistics pass; histogram methods of the same run share it
            stats = _collect_statistics(qm, quantizers, batches, total, method)
            if stats_memo is not None and method != "max":
                stats_memo[memo_key] = stats
        amax = _set_calibrated_amax(quantizers, stats, method, percentile)
        # the hooked quantizers are exactly the enabled (placed) ones: every tensor here carries a quantizer
        warnings_found = calibration_warnings(calibration_facts(stats["activation_stats"], method, percentile), method, percentile)
        for w in warnings_found:
            warn(f"calibrate: {w['message']}")
        amax.update(_depthwise_gains(quantizers, stats["channels"]))
        _apply_equalization(qm, quantizers, amax, scale_weight_amax=True)
    else:
        shared = False
        for name, q in quantizers.items():
            if name not in amax:
                raise QDeployError(f"cached ranges do not cover quantizer {name}; delete the calibration cache")
            q.amax = torch.clamp(torch.tensor(amax[name]), min=AMAX_FLOOR)
            q.disable_calib()
            q.enable_quant()
        _apply_equalization(qm, quantizers, amax, scale_weight_amax=False)  # cached weight amax are already scaled
        warnings_found = None  # the calibration cache keeps them (modelopt_quantizer.py)
    shared_groups = apply_shared_scales(quantizers, groups)
    gains = {k: v for k, v in amax.items() if k.endswith(".equalize_gain")}
    qm.to("cpu")  # every buffer (amax, pre_quant_scale) with the weights: the export and its check run on the CPU
    amax = {name: q.amax.tolist() for name, q in quantizers.items()}
    amax.update(gains)
    qm = SelectOutput(qm, select).eval()
    all_gains = np.concatenate([np.asarray(v) for v in gains.values()]) if gains else np.ones(1)
    equalized = {"convs": sorted(k[:-len(".equalize_gain")] for k in gains), "max_gain": round(float(all_gains.max()), 2),
                 "median_gain": round(float(np.median(all_gains)), 2)}
    return qm, amax, {"shared_statistics": shared, "residual_adds_with_quantizers": n_adds, "quantizers": len(quantizers),
                      "equalized_depthwise_inputs": equalized, "warnings": warnings_found,
                      "excluded_by_user": excluded, **placement,
                      "shared_scale_groups": shared_groups}


def _collect_statistics(qm: nn.Module, quantizers: dict, batches: Iterable[np.ndarray], total: int, method: str) -> dict:
    """One statistics pass over the calibration batches: every quantizer calibrates (quantization off), hooks keep the
    per-image extremes. Returns {"weights": {name: amax}, "inputs": {name: amax, or its histogram calibrator},
    "channels": per-channel extremes of depthwise conv inputs, "activation_stats": collect.ActivationStats}."""
    for q in quantizers.values():
        q.disable_quant()
        q.enable_calib()
    # statistics on the GPU when there is one (forward passes and histograms); export happens on the CPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    qm.to(device)
    extremes = _SampleExtremes(qm, quantizers)
    with torch.no_grad(), progress("calibrate: ModelOpt statistics", total) as advance:
        for x in batches:
            qm(torch.from_numpy(x).to(device, non_blocking=True))
            advance(len(x))
    extremes.remove()
    qm.to("cpu")
    stats = {"weights": {}, "inputs": {}, "channels": extremes.channels, "activation_stats": extremes.activation_stats()}
    for name, q in quantizers.items():
        if name.endswith("weight_quantizer") or method == "max":
            q.load_calib_amax()
            # a copy: ModelOpt's amax setter writes into this buffer in place (equalization divides it later)
            stats["weights" if name.endswith("weight_quantizer") else "inputs"][name] = q.amax.detach().float().cpu().clone()
        else:
            stats["inputs"][name] = q._calibrator
    return stats


def _set_calibrated_amax(quantizers: dict, stats: dict, method: str, percentile: float) -> dict:
    """Each quantizer's amax from ``stats`` by ``method`` (ranges.compute_amax for activations), set and switched to
    quantizing. Returns {quantizer name: amax as a list}."""
    amax = {}
    for name, q in quantizers.items():
        source = stats["weights"] if name.endswith("weight_quantizer") else stats["inputs"]
        if name not in source:
            raise QDeployError(f"quantizer {name} saw no data during calibration")
        entry = source[name]
        if method == "mean-minmax" and not name.endswith("weight_quantizer"):
            # NNCF's per-tensor default, from the per-image extremes the hooks collected (one formula: ranges.py)
            value = torch.tensor(compute_amax(stats["activation_stats"].tensors[name], "mean-minmax"))
        elif isinstance(entry, torch.Tensor):
            value = entry
        else:  # a histogram calibrator
            if entry._calib_hist is None:
                raise QDeployError(f"quantizer {name} saw no data during calibration")
            top = float(entry._calib_bin_edges[-1])
            st = TensorStats(name, lo=-top, hi=top, hist=entry, samples=1)
            value = torch.tensor(compute_amax(st, method, percentile))
        value = value.detach().float().cpu()
        if not torch.isfinite(value).all():
            raise QDeployError(f"calibration produced NaN/Inf in layer '{name.rsplit('.', 1)[0]}'")
        q.amax = torch.clamp(value, min=AMAX_FLOOR)  # all-zero channels: a floor, not a zero scale
        amax[name] = q.amax.tolist()
        q.disable_calib()
        q.enable_quant()
    return amax


def _depthwise_gains(quantizers: dict, channels: dict) -> dict:
    """{"<conv>.equalize_gain": per-channel gains} for the depthwise conv inputs whose channels gain precision from a
    gain folded into the weights (quantize/equalize.py), from their per-channel extremes ``channels``."""
    gains = {}
    for module_name, (c_lo, c_hi) in channels.items():
        q = quantizers.get(f"{module_name}.input_quantizer")
        if q is None or f"{module_name}.weight_quantizer" not in quantizers:
            continue
        a = float(q.amax)
        gain = channel_gains(TensorRange(-a, a, a, c_lo.tolist(), c_hi.tolist()), symmetric=True)
        if gain is not None and np.any(gain > 1.0 + 1e-6):
            gains[f"{module_name}.equalize_gain"] = gain.tolist()
    return gains


def snap_weights_to_grid(qm: nn.Module) -> int:
    """Replace every quantized weight by its fake-quantized value (in place; the model computes the same), so that the
    exported float weight is an exact multiple of its scale.

    Otherwise a weight whose weight/scale lies within a float rounding of a half integer is quantized one way by
    ModelOpt (x · (127/amax)) and the other way by whoever reads the ONNX (ONNX Runtime and TensorRT: x / scale). That
    is common, not rare: weights stored in FP16 sit on a coarse lattice, and one flipped weight shifts its whole output
    channel (timm DeiT-tiny from FP16 weights: 1 weight of 9,216 in the patch embedding, and the export check fell to
    cosine 0.94 on some images). On the grid, every reader gets ModelOpt's integers. Returns the tensors snapped."""
    count = 0
    with torch.no_grad():
        for m in qm.modules():
            q = _enabled(m, "weight_quantizer")
            w = getattr(m, "weight", None)
            if q is None or not isinstance(w, torch.Tensor) or getattr(q, "_disabled", False) or not q._if_quant:
                continue
            w.copy_(q(w))
            count += 1
    return count


def export_qdq_onnx(qm: nn.Module, example: torch.Tensor, path: Path, opset: int, dynamic_batch: bool = True) -> dict:
    """Export the quantized model as Q/DQ ONNX. Returns the lint fixes applied to the export ({rule: count}).

    A conv subclass that pads in its own forward (EfficientNet-Lite's same padding) exports as DQ → Pad → Conv
    (ModelOpt quantizes the module's input, before the padding): TensorRT does not fuse that Pad (lint QD009). Its
    fix folds a zero constant Pad into the Conv's pads — exactly what the Conv computes with padded input, since a
    dequantized zero is zero — so the export stays numerically identical; other pads are left as they are.
    """
    snap_weights_to_grid(qm)
    axes = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}} if dynamic_batch else {}
    with atomic_path(path) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(qm, (example,), str(tmp), dynamo=False, opset_version=max(opset, 13), input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME], dynamic_axes=axes, do_constant_folding=True)
        return _export_fixes(Path(tmp))


def _export_fixes(path: Path) -> dict:
    import onnx

    from qdeploy.lint.fixes import apply_fixes

    model = onnx.load(str(path))
    fixes = set()
    # a Pad after a DQ that pads with a value we cannot read: fold none (the fix reads unknown as zero)
    if any(n.op_type == "Pad" for n in model.graph.node) and _constant_pads_after_dq(model):
        fixes.add("QD009")
    # ModelOpt gives each consumer module its own input quantizer: a LayerNorm output feeding separate q, k and v
    # Linears gets three identical Q/DQ pairs; one shared pair (bit-identical) is what ModelOpt's ONNX path and
    # TensorRT's guide place (lint rule QD020)
    fixes.add("QD020")
    applied = apply_fixes(model, fixes)
    if applied:
        _drop_dead_nodes(model)
        onnx.checker.check_model(model)
        onnx.save(model, str(path))
    return applied


def _static_shapes(model) -> dict:
    """tensor → its dims from ONNX shape inference (None for a symbolic dim such as the batch)."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return {}
    out = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    return out


def _constant_pads_after_dq(model) -> bool:
    """Give each Pad fed by a DequantizeLinear its ``pads`` (and pad value) as initializers when they are fixed numbers.

    The TorchScript exporter writes nn.ZeroPad2d's pads as a small Constant → Reshape → Slice → Cast chain that its
    constant folding leaves, and a 'same' padding computed in forward from ``x.shape`` as Shape → Gather → arithmetic
    on the activation's shape; the Pad → Conv fold needs the values. Evaluated with onnx.reference, each Shape
    replaced by the activation's inferred shape; symbolic dims (the dynamic batch) are tried at 1, 3 and 8 and the
    values kept only when they do not change (a pad that depends on the batch, or on a dynamic image size, stays).
    Returns False when some such Pad's pad *value* stays unknown (then no Pad may be folded: the fold would read
    an unknown value as zero).
    """
    from onnx import numpy_helper

    nodes = list(model.graph.node)
    producer = {o: n for n in nodes for o in n.output if o}
    inits = {t.name: t for t in model.graph.initializer}
    cache = {}
    all_known = True
    for pad in nodes:
        src = producer.get(pad.input[0]) if pad.op_type == "Pad" else None
        if src is None or src.op_type != "DequantizeLinear":
            continue
        for index in (1, 2):
            if len(pad.input) <= index or not pad.input[index]:
                continue
            target = pad.input[index]
            if target in inits or (target in producer and producer[target].op_type == "Constant"):
                continue
            value = _evaluate_constant(model, nodes, producer, inits, target, cache)
            if value is None:
                all_known &= index != 2
                continue
            name = f"{pad.name or pad.output[0]}_{('pads', 'value')[index - 1]}"
            model.graph.initializer.append(numpy_helper.from_array(value, name))
            inits[name] = model.graph.initializer[-1]
            pad.input[index] = name
    return all_known


def _evaluate_constant(model, nodes, producer, inits, target, cache):
    """The value of tensor ``target`` if it does not depend on the input's data (see _constant_pads_after_dq), else None."""
    import onnx
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    needed, shape_nodes, used_inits, stack = set(), set(), set(), [target]
    while stack:
        t = stack.pop()
        if t in inits:
            used_inits.add(t)
        elif t in producer:
            n = producer[t]
            if id(n) in needed:
                continue
            needed.add(id(n))
            if n.op_type == "Shape" and n.input[0] not in inits:  # the shape of an activation
                if "shapes" not in cache:
                    cache["shapes"] = _static_shapes(model)
                if n.input[0] not in cache["shapes"]:
                    return None
                shape_nodes.add(id(n))
            else:
                stack.extend(i for i in n.input if i)
        else:
            return None  # a graph input (or an unknown tensor): not a constant
    values = []
    for fill in ((1, 3, 8) if shape_nodes else (1,)):
        sub_nodes = []
        for n in nodes:
            if id(n) not in needed:
                continue
            if id(n) in shape_nodes:
                attrs = {a.name: a.i for a in n.attribute}
                dims = np.array([fill if d is None else d for d in cache["shapes"][n.input[0]]], np.int64)
                dims = dims[attrs.get("start", 0):attrs.get("end", len(dims))]
                n = helper.make_node("Constant", [], [n.output[0]], value=numpy_helper.from_array(dims))
            sub_nodes.append(n)
        try:
            sub = helper.make_model(
                helper.make_graph(sub_nodes, "const", [], [helper.make_tensor_value_info(target, onnx.TensorProto.UNDEFINED, None)],
                                  [inits[t] for t in used_inits]),
                opset_imports=list(model.opset_import))
            (value,) = ReferenceEvaluator(sub).run(None, {})
        except Exception:
            return None
        values.append(np.asarray(value))
    if any(v.dtype != values[0].dtype or not np.array_equal(v, values[0]) for v in values):
        return None
    return values[0]


def _drop_dead_nodes(model) -> int:
    """Remove nodes none of whose outputs is used (ONNX nodes have no side effects), and unused initializers."""
    removed = 0
    while True:
        used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
        dead = [n for n in model.graph.node if not any(o in used for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            model.graph.node.remove(n)
        removed += len(dead)
    used = {i for n in model.graph.node for i in n.input}
    for t in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(t)
    return removed
