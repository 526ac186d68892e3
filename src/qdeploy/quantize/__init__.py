"""Quantize stage: FP32 ONNX (or the PyTorch model) + calibration images → INT8 Q/DQ ONNX.

    result = quantize(QuantizeInputs(fp32_onnx, preprocess, calibration=batches), Int8Config(method="mse"), out_path)

Settings are one object (``qdeploy.config.Int8Config``); the algorithm is a registered quantizer
(registry.py): ``onnx`` (onnx_quantizer.py: ONNX Runtime statistics pass → ranges.py → qdq.py placement)
``modelopt`` (modelopt_quantizer.py → modelopt_torch.py), ``qat`` (qat_quantizer.py: ModelOpt PTQ fine-tuned by
qat.py's trainer) and ``nncf`` (nncf_quantizer.py: placement openvino, NNCF's ``nncf.quantize`` on the ONNX; nncf is
imported on first use). Shared pieces: collect.py (statistics),
ranges.py (max / entropy / percentile / mse), calibrate.py (ranges cache, TensorRT cache input, Q/DQ
read-back), trt_cache.py (TensorRT calibration cache in/out).
"""
from qdeploy.quantize import modelopt_quantizer, nncf_quantizer, onnx_quantizer, qat_quantizer  # noqa: F401  (register the quantizers)
from qdeploy.quantize.qdq import quantize_onnx
from qdeploy.quantize.ranges import TensorRange, compute_ranges
from qdeploy.quantize.registry import (
    QUANTIZERS, NotApplicable, QuantizeInputs, Quantizer, QuantResult, candidates, get_quantizer, quantize, register_quantizer,
)
from qdeploy.quantize.trt_cache import read_trt_cache, write_trt_cache

__all__ = [
    "QUANTIZERS", "NotApplicable", "QuantResult", "QuantizeInputs", "Quantizer", "TensorRange", "candidates",
    "compute_ranges", "get_quantizer", "quantize", "quantize_onnx", "read_trt_cache", "register_quantizer",
    "write_trt_cache",
]
