"""Quantizer ``modelopt``: NVIDIA ModelOpt on the PyTorch model, exported as a TensorRT Q/DQ ONNX.

``exclude`` is a list of ONNX node-name regexes for every quantizer; here they are matched against
the FP32 ONNX's node names and translated to the PyTorch modules those nodes came from (the
TorchScript exporter names nodes by module scope: ``/layer1/layer1.0/conv1/Conv`` is module
``layer1.0.conv1``), whose quantizers then stay disabled.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from qdeploy.config import Int8Config
from qdeploy.data import normalize
from qdeploy.errors import QDeployError
from qdeploy.models.loader import SelectOutput
from qdeploy.quantize.exclude import match_nodes, module_of_node
from qdeploy.quantize.calibrate import calibration_key, check_qdq_export, ranges_from_qdq
from qdeploy.quantize.modelopt_torch import export_qdq_onnx, quantize_torch_model
from qdeploy.quantize.registry import NotApplicable, QuantizeInputs, Quantizer, QuantResult, register_quantizer
from qdeploy.utils.atomic import write_json
from qdeploy.utils.faults import kill_point
from qdeploy.utils.log import log, warn
from qdeploy.utils.onnx_graph import OnnxGraph

# SelectOutput (qdeploy.models) wraps the user's module as ``model``: its scope is not part of the user's names.


def node_to_module(model) -> Callable[[str], str]:
    """ONNX node name -> the name of the module of ``model`` it came from: an onnx2torch twin of an ONNX or Keras
    source carries its own map (export/onnx_to_torch.py); a PyTorch model's nodes carry the exporter's scopes."""
    own = getattr(model.model if isinstance(model, SelectOutput) else model, "onnx_node_modules", None)
    return (lambda node: own.get(node, "")) if own is not None else module_of_node


def modules_for_exclude(onnx_path: Path, patterns: list[str], to_module: Callable[[str], str] = module_of_node
                        ) -> tuple[set[str], list[str], list[str]]:
    """(module names to keep float, ONNX nodes matched, patterns matching no node); what an entry matches:
    quantize/exclude.py."""
    graph = OnnxGraph.load(onnx_path)
    matched_nodes, hits = match_nodes([node.name or node.output[0] for node in graph.nodes], patterns)
    modules = {m for m in (to_module(n) for n in matched_nodes) if m}
    unmatched = [p for p, n in hits.items() if n == 0]
    for p in unmatched:
        warn(f"exclude pattern '{p}' matches no node of the ONNX model")
    return modules, matched_nodes, unmatched


@register_quantizer
class ModelOptQuantizer(Quantizer):
    name = "modelopt"
    description = "NVIDIA ModelOpt on the PyTorch model (Conv+BN folded, residual-Add quantizers), exported as TensorRT Q/DQ ONNX"

    def check(self, cfg: Int8Config, has_torch: bool) -> None:
        if not has_torch:
            raise NotApplicable("quantizer modelopt needs a PyTorch model; the source is an ONNX or Keras model (use quantizer: onnx)")
        if cfg.calibration_cache:
            raise NotApplicable("quantizer modelopt calibrates itself; ranges from a TensorRT cache need quantizer: onnx")
        if cfg.exclude_ops:
            raise NotApplicable("quantizer modelopt does not take exclude_ops (ONNX op types); use exclude (node-name regexes) or quantizer: onnx")

    def quantize(self, inputs: QuantizeInputs, cfg: Int8Config, out_path: Path) -> QuantResult:
        qm, info = calibrated_model(inputs, cfg)
        return export_checked(qm, inputs, out_path, info)


def calibrated_model(inputs: QuantizeInputs, cfg: Int8Config):
    """The PTQ-calibrated ModelOpt model (TensorRT placement) and its info; what ``modelopt`` exports and QAT trains."""
    t0 = time.perf_counter()
    batches = inputs.calibration
    if batches is None:
        raise QDeployError("INT8 needs calibration images: add data.calibration to the config")
    model = inputs.torch_model()
    to_module = node_to_module(model)
    user_modules, matched_nodes, unmatched = modules_for_exclude(inputs.fp32_onnx, cfg.exclude, to_module)
    exclude_modules = set(user_modules)
    # 2: skip-input-only residual Adds, shared scales; 3: conv subclasses quantized; 4: depthwise inputs equalized;
    # 5: memo fix; 6: quantizers chosen by the placement plan (squeeze-excitation branches included)
    key = calibration_key(inputs.fp32_onnx, batches, inputs.preprocess, cfg.method, cfg.percentile, 2048,
                          ["modelopt", "trt-placement-6", *sorted(exclude_modules)] + ([] if cfg.residual_quantizers else ["no-residual-quantizers"]))
    cache = Path(inputs.cache_dir) / "calibration" / f"{key}.json" if inputs.cache_dir else None
    cached_file = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    cached = cached_file.get("amax")
    if cached is not None:
        log(f"calibrate: cache hit {cache} ({cfg.method}, ModelOpt)")
    qm, amax, details = quantize_torch_model(
        model, (normalize(x, inputs.preprocess) for x, _ in batches), batches.num_samples,
        cfg.method, cfg.percentile, exclude_modules, amax=cached, stats_memo=inputs.memo.setdefault("modelopt-statistics", {}),
        residual_quantizers=cfg.residual_quantizers, opset=inputs.opset)
    kill_point("calibration")
    details["excluded_by_user"] = [m for m in details.get("excluded_by_user", [])  # a module named, or its child
                                   if any(m == u or m.startswith(u + ".") for u in user_modules)]
    details["excluded_squeeze_excitation"] = details.pop("_se_modules", [])
    if details.get("warnings") is None:
        details["warnings"] = cached_file.get("warnings", [])
    info = {"method": cfg.method, "percentile": cfg.percentile if cfg.method == "percentile" else None,
            "samples": batches.num_samples, "cache": str(cache) if cache else None, **details,
            "excluded_nodes": matched_nodes, "unmatched_patterns": unmatched, "cache_hit": cached is not None,
            "time_s": 0.0 if cached is not None else round(time.perf_counter() - t0, 3)}
    if cached is None:
        if cache is not None:
            write_json(cache, {"key": key, "method": cfg.method, "amax": amax, "warnings": info.get("warnings", [])})
        log(f"calibrate: ModelOpt {cfg.method} ranges for {len(amax)} quantizers in {info['time_s']:.1f} s")
    return qm, info


def export_checked(qm, inputs: QuantizeInputs, out_path: Path, info: dict) -> QuantResult:
    """Export the (calibrated or fine-tuned) ModelOpt model as Q/DQ ONNX and check it against the fake-quant model."""
    h, w = inputs.preprocess.input_size
    fixes = export_qdq_onnx(qm, torch.randn(2, inputs.preprocess.channels, h, w), out_path, inputs.opset, inputs.dynamic_batch)
    if fixes:
        info["export_fixes"] = fixes  # e.g. {"QD009": n}: zero Pads of same-padding convs folded into the Conv
    if inputs.check_inputs is not None:
        info["export_check"] = check_qdq_export(qm, out_path, inputs.check_inputs)
    return QuantResult(out_path, ranges_from_qdq(out_path), info)
