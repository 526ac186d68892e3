"""ONNX → PyTorch (onnx2torch), checked exact against ONNX Runtime: the trainable twin of an ONNX or Keras source.

Quantization-aware training is PyTorch (ModelOpt's fake quantization and qdeploy's trainer); a model that arrives
as ONNX (or as Keras, converted to ONNX by export/keras.py) gets a PyTorch module built op by op from that verified
graph by onnx2torch, so QAT trains the very network the FP32 ONNX holds. Only QAT uses it: post-training quantization
of such a model keeps working on the ONNX itself (quantizer onnx), and the PyTorch engine and targets stay for
PyTorch sources.

One rewrite first, exact: a ``MatMul`` of a 2-D activation by a constant 2-D weight, with an optional constant bias
``Add`` (how tf2onnx writes a Keras ``Dense`` layer), becomes the ``Gemm`` it is, which onnx2torch turns into an
``nn.Linear``: ModelOpt quantizes modules, and a functional matmul on a parameter would stay float.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper
from torch import nn

from qdeploy.config import VerifySpec
from qdeploy.errors import ModelError
from qdeploy.utils.compare import compare_outputs
from qdeploy.utils.log import log
from qdeploy.utils.onnx_graph import OnnxGraph

ONNX2TORCH_MISSING = "onnx2torch is not installed (pip install onnx2torch)"


def onnx2torch_problem() -> Optional[str]:
    return None if importlib.util.find_spec("onnx2torch") else ONNX2TORCH_MISSING


def dense_matmuls_as_gemm(model: onnx.ModelProto) -> int:
    """Rewrite ``MatMul(x[N,K], W[K,M]) (+ b[M])`` with constant W (and b) as ``Gemm``; returns how many."""
    g = OnnxGraph(model)
    shapes = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input):
            shapes[vi.name] = len(vi.type.tensor_type.shape.dim)
    except Exception:  # noqa: BLE001 - without shapes no rewrite is proved safe: leave the graph as it is
        return 0
    rewritten = 0
    for node in list(model.graph.node):
        if node.op_type != "MatMul" or shapes.get(node.input[0]) != 2:
            continue
        weight = g.constant_value(node.input[1])
        if weight is None or weight.ndim != 2:
            continue
        users = g.consumers.get(node.output[0], [])
        bias, out, drop = None, node.output[0], []
        if len(users) == 1 and users[0].op_type == "Add":
            other = [i for i in users[0].input if i != node.output[0]]
            value = g.constant_value(other[0]) if len(other) == 1 else None
            if value is not None and value.size == weight.shape[1] and value.ndim <= 1 + (value.shape[:1] == (1,)):
                bias, out, drop = value.reshape(-1).astype(weight.dtype), users[0].output[0], [users[0]]
        inputs = [node.input[0], node.input[1]]
        if bias is not None:
            name = f"{node.name or node.output[0]}_bias"
            model.graph.initializer.append(numpy_helper.from_array(bias, name))
            inputs.append(name)
        gemm = helper.make_node("Gemm", inputs, [out], name=node.name or f"gemm_{rewritten}")
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        for d in drop:
            model.graph.node.remove(d)
        model.graph.node.insert(index, gemm)
        rewritten += 1
    return rewritten


def _onnx2torch_export_shim() -> None:
    """onnx2torch's modules that export themselves (Reshape, Shape, ... as their ONNX op) read the opset being exported
    from ``torch.onnx.symbolic_helper.GLOBALS``, which newer torch keeps in its TorchScript exporter's ``_globals`` only:
    without it a twin with such modules cannot be exported (QAT's Q/DQ export). Point the old name at the same object."""
    from torch.onnx import symbolic_helper

    if not hasattr(symbolic_helper, "GLOBALS") and not hasattr(symbolic_helper, "_export_onnx_opset_version"):
        try:
            from torch.onnx._internal.torchscript_exporter._globals import GLOBALS
        except ImportError:  # an older torch has one of the two names itself
            return
        symbolic_helper.GLOBALS = GLOBALS


def weight_matmuls_as_linear(module: nn.Module) -> int:
    """Turn each ``OnnxMatMul(x, W)`` of onnx2torch's module whose ``W`` is a stored 2-D constant into ``nn.Linear`` with
    weight Wᵀ (in place; the same function of x for any number of leading dimensions: a transformer's 3-D Linear);
    returns how many. ModelOpt quantizes modules: a matmul on a constant would stay float, against the placement plan."""
    from torch import fx
    from onnx2torch.node_converters.matmul import OnnxMatMul

    if not isinstance(module, fx.GraphModule):
        return 0

    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_module" or not isinstance(module.get_submodule(node.target), OnnxMatMul) or len(node.args) != 2:
            continue
        x, w = node.args
        if not (isinstance(w, fx.Node) and w.op == "get_attr"):
            continue
        weight = module
        for atom in w.target.split("."):
            weight = getattr(weight, atom)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.is_floating_point():
            continue
        linear = nn.Linear(weight.shape[0], weight.shape[1], bias=False)
        linear.weight = nn.Parameter(weight.detach().t().contiguous().clone())
        module.add_submodule(node.target, linear)
        node.args = (x,)
        count += 1
    if count:
        module.graph.eliminate_dead_code()
        module.delete_all_unused_submodules()
        module.recompile()
    return count


def node_modules(model: onnx.ModelProto) -> dict[str, str]:
    """{ONNX node name (its first output where unnamed): name of the module onnx2torch converts it to}: onnx2torch
    names each module after its node (domain prefix, '.' as '/', a counter for repeats); a node it converts to a
    Sequential (a Conv with explicit padding) has the quantized layer as a child of that name."""
    from onnx2torch.onnx_graph import OnnxGraph

    return {node.proto.name or node.proto.output[0]: name for name, node in OnnxGraph(model.graph).nodes.items()}


def torch_from_onnx(path: Path, check_inputs: Optional[np.ndarray], verify: VerifySpec) -> nn.Module:
    """The FP32 ONNX as an ``nn.Module`` (eval mode, CPU), equal to ONNX Runtime on ``check_inputs`` within
    ``export.verify``'s tolerances, or a ModelError that names the file."""
    problem = onnx2torch_problem()
    if problem:
        raise ModelError(f"training {path.name} needs it in PyTorch: {problem}")
    import onnx2torch

    _onnx2torch_export_shim()
    model = onnx.load(str(path))
    gemms = dense_matmuls_as_gemm(model)  # 2-D ones as Gemm first (onnx2torch makes Gemm + bias an nn.Linear)
    # onnx2torch sizes an nn.LayerNorm from the input's value_info: without inferred shapes it gets normalized_shape []
    model = onnx.shape_inference.infer_shapes(model, data_prop=True)  # data_prop: through Shape → Reshape
    try:
        module = onnx2torch.convert(model).eval()
    except Exception as e:  # an op onnx2torch has no converter for
        raise ModelError(f"onnx2torch cannot convert {path.name} to PyTorch for training ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0][:200]})") from None
    # ONNX node -> the module onnx2torch made of it (its own naming, read from its OnnxGraph so it cannot drift): the
    # quantizers keep float what a fallback or exclude names by ONNX node, and the SE convs, through this map
    module.onnx_node_modules = node_modules(model)
    gemms += weight_matmuls_as_linear(module)
    if check_inputs is not None:
        x = np.ascontiguousarray(check_inputs[: verify.samples], dtype=np.float32)
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ref = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        with torch.inference_mode():
            got = module(torch.from_numpy(x))
        got = (got[0] if isinstance(got, (tuple, list)) else got).float().numpy()
        cmp = compare_outputs(got, ref)
        limit = verify.atol + verify.rtol * cmp["max_abs_reference"]
        if not (cmp["max_abs_diff"] <= limit and cmp["min_cosine"] >= verify.min_cosine):
            raise ModelError(f"onnx2torch's PyTorch module of {path.name} differs from ONNX Runtime: max |diff| "
                             f"{cmp['max_abs_diff']:.3g} > {limit:.3g} or cosine {cmp['min_cosine']:.6f}; it cannot be "
                             "trained as this model")
        log(f"onnx2torch: {path.name} as a PyTorch module ({gemms} Dense MatMul(s) as Linear), equal to ONNX Runtime on "
            f"{len(x)} real images (max |diff| {cmp['max_abs_diff']:.3g})")
    return module
