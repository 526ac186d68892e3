"""TensorRT Q/DQ ONNX from a PyTorch model through NVIDIA ModelOpt (``modelopt.torch.quantization``).

1. ``torch.fx`` traces the model, folds BatchNorm into the preceding Conv (so weight scales are
   computed on the weights TensorRT will run), and turns every ``a + b`` of two tensors into a
   ``ResidualAdd`` module. ModelOpt only quantizes modules, so a functional residual addition would
   otherwise stay float and TensorRT could not fuse Conv+Add in INT8.
2. ``mtq.quantize`` with per-channel (axis 0) INT8 weight quantizers and per-tensor INT8 input
   quantizers (histogram calibrators) on Conv/Linear/pooling and on both inputs of each ResidualAdd.
   ``algorithm=None``: ModelOpt's own finish step passes no method to histogram calibrators (and one
   to the weight max-calibrators, which reject it), so we collect statistics ourselves, then set each
   input quantizer's amax with the chosen method (ranges.py: ModelOpt's algorithms, made fast) and
   each weight quantizer's with its max calibrator.
3. ``torch.onnx.export`` (TorchScript exporter, ModelOpt's symbolic functions) writes explicit
   QuantizeLinear/DequantizeLinear nodes.
"""
from __future__ import annotations

import contextlib
import copy
import io
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
from qdeploy.quantize.ranges import compute_amax
from qdeploy.utils.atomic import atomic_path
from qdeploy.utils.log import progress


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


def prepare_for_quantization(model: nn.Module) -> tuple[fx.GraphModule, int]:
    """FX-trace, fold Conv+BN, and make residual additions modules. Returns (graph module, #residual adds)."""
    from torch.fx.experimental.optimization import fuse

    model = copy.deepcopy(model).eval()
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # data-dependent control flow etc.
        raise NotTraceable(
            f"torch.fx cannot trace the model for ModelOpt quantization ({type(e).__name__}: {str(e).splitlines()[0]}); "
            "use quantizer: onnx for this variant"
        ) from None
    gm = fuse(gm)  # Conv+BN folding (eval mode)
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in (operator.add, operator.iadd, torch.add) \
                and len(node.args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args):
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


def _quant_config(method: str) -> dict:
    act = {"num_bits": 8, "axis": None, "calibrator": "max" if method == "max" else "histogram"}
    return {"quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0}},
        {"quantizer_name": "*input_quantizer", "cfg": act},
    ], "algorithm": None}


def quantize_torch_model(model: nn.Module, batches: Iterable[np.ndarray], total: int, method: str,
                         percentile: float = 99.99, exclude: Iterable[str] = (), amax: Optional[dict] = None,
                         stats_memo: Optional[dict] = None):
    """ModelOpt-quantized copy of ``model`` and its quantizers' amax.

    ``exclude``: names of modules whose quantizers stay disabled (float). ``amax`` given: reuse it, no
    calibration. ``stats_memo``: a dict kept for one run, so that entropy, percentile and mse variants
    share one statistics pass (their quantizers have the same names).
    """
    mtq, TensorQuantizer = _modelopt()
    select = model.key if isinstance(model, SelectOutput) else None
    inner = model.model if isinstance(model, SelectOutput) else model  # the output selector is not traceable
    gm, n_adds = prepare_for_quantization(inner)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints "Inserted N quantizers"
        warnings.simplefilter("ignore")
        qm = mtq.quantize(gm, _quant_config(method), forward_loop=lambda m: None)
    quantizers = {n: m for n, m in qm.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled}
    exclude = set(exclude or ())
    excluded = sorted({n.rsplit(".", 1)[0] for n in quantizers if n.rsplit(".", 1)[0] in exclude})
    for name in list(quantizers):
        if name.rsplit(".", 1)[0] in excluded:
            quantizers.pop(name).disable()
    if amax is None:
        memo_key = ("histogram", tuple(sorted(exclude)))
        stats = stats_memo.get(memo_key) if stats_memo is not None and method != "max" else None
        shared = stats is not None
        if stats is None:  # one statistics pass; histogram methods of the same run share it
            for q in quantizers.values():
                q.disable_quant()
                q.enable_calib()
            # statistics on the GPU when there is one (forward passes and histograms); export happens on the CPU
            device = "cuda" if torch.cuda.is_available() else "cpu"
            qm.to(device)
            with torch.no_grad(), progress("calibrate: ModelOpt statistics", total) as advance:
                for x in batches:
                    qm(torch.from_numpy(x).to(device, non_blocking=True))
                    advance(len(x))
            qm.to("cpu")
            stats = {"weights": {}, "inputs": {}}
            for name, q in quantizers.items():
                if name.endswith("weight_quantizer") or method == "max":
                    q.load_calib_amax()
                    stats["weights" if name.endswith("weight_quantizer") else "inputs"][name] = q.amax.detach().float().cpu()
                else:
                    stats["inputs"][name] = q._calibrator
            if stats_memo is not None and method != "max":
                stats_memo[memo_key] = stats
        amax = {}
        for name, q in quantizers.items():
            source = stats["weights"] if name.endswith("weight_quantizer") else stats["inputs"]
            if name not in source:
                raise QDeployError(f"quantizer {name} saw no data during calibration")
            entry = source[name]
            if isinstance(entry, torch.Tensor):
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
            q.amax = torch.clamp(value, min=1e-8)  # all-zero channels: a floor, not a zero scale
            amax[name] = q.amax.tolist()
            q.disable_calib()
            q.enable_quant()
    else:
        shared = False
        for name, q in quantizers.items():
            if name not in amax:
                raise QDeployError(f"cached ranges do not cover quantizer {name}; delete the calibration cache")
            q.amax = torch.tensor(amax[name])
            q.disable_calib()
            q.enable_quant()
    qm = SelectOutput(qm, select).eval()
    return qm, amax, {"shared_statistics": shared, "residual_adds_with_quantizers": n_adds, "quantizers": len(quantizers), "excluded_by_user": excluded}


def export_qdq_onnx(qm: nn.Module, example: torch.Tensor, path: Path, opset: int, dynamic_batch: bool = True) -> None:
    axes = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}} if dynamic_batch else {}
    with atomic_path(path) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(qm, (example,), str(tmp), dynamo=False, opset_version=max(opset, 13), input_names=[INPUT_NAME],
                          output_names=[OUTPUT_NAME], dynamic_axes=axes, do_constant_folding=True)
