"""Quantize stage: FP32 ONNX + calibration images → INT8 ONNX (TensorRT-style Q/DQ or ONNX Runtime-targeted).

    ranges = calibrate(onnx_artifact, calibration_batches, preprocess, method="entropy")
    quantize_onnx(fp32_path, ranges, target="tensorrt", out_path=...)

Pieces: collect.py (one ONNX Runtime pass → per-tensor min/max + histograms), ranges.py (ModelOpt's
calibrators: max / entropy / percentile / mse), qdq.py (Q/DQ placement with ONNX Runtime's quantizer),
structure.py (what got quantized), trt_cache.py (TensorRT calibration cache in/out), cache.py.
"""
from qdeploy.quantize.calibrate import QuantizedArtifact, calibrate, quantize_variant
from qdeploy.quantize.qdq import TARGETS, quantize_onnx
from qdeploy.quantize.ranges import METHODS, TensorRange, compute_ranges
from qdeploy.quantize.structure import qdq_structure
from qdeploy.quantize.trt_cache import read_trt_cache, write_trt_cache

__all__ = [
    "METHODS", "TARGETS", "QuantizedArtifact", "TensorRange", "calibrate", "compute_ranges", "qdq_structure",
    "quantize_onnx", "quantize_variant", "read_trt_cache", "write_trt_cache",
]
