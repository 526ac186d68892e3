"""FP16 ONNX (FP32 inputs/outputs kept) whose float32 islands are chosen from real activations, not guessed.

TensorRT 11 builds strongly typed networks only: FP16 means an FP16 ONNX. A converter that keeps nodes in FP32 by
op type or by a guess about overflow leaves layers stranded in FP32 (Ultralytics #26223/#26171: the first convs after
a conversion calibrated on random inputs). Here the FP32 model runs on the calibration images in ONNX Runtime with
every float intermediate exposed; a node stays FP32 only when one of its outputs reaches ``FP16_MAX / margin`` on
those images (margin 4: unseen images may go further than the calibration set). Everything else converts, through
ONNX Runtime's own converter (``onnxruntime.transformers.float16.convert_float_to_float16``, its ``node_block_list``).
The kept nodes and the activation that kept each are returned for the report.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.transformers.float16 import convert_float_to_float16

from qdeploy.utils.atomic import atomic_path

FP16_MAX = 65504.0
MARGIN = 4.0


def activation_peaks(fp32_path: Path, inputs: Iterable[np.ndarray], input_name: Optional[str] = None) -> dict[str, float]:
    """max |x| of every float32 node output over ``inputs`` (preprocessed batches), from one ONNX Runtime session."""
    model = onnx.load(str(fp32_path))
    inferred = onnx.shape_inference.infer_shapes(model)
    float_outputs = {vi.name for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
                     if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    existing = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for out in node.output:
            if out in float_outputs and out not in existing:
                model.graph.output.append(onnx.helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None))
                existing.add(out)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph's own tensors, unfused
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    name = input_name or sess.get_inputs()[0].name
    names = [o.name for o in sess.get_outputs()]
    peaks: dict[str, float] = {}
    for x in inputs:
        for n, v in zip(names, sess.run(names, {name: x})):
            if isinstance(v, np.ndarray) and v.dtype == np.float32 and v.size:
                m = float(np.max(np.abs(v[np.isfinite(v)]))) if np.isfinite(v).any() else float("inf")
                peaks[n] = max(peaks.get(n, 0.0), m)
    return peaks


def convert_fp16_calibrated(fp32_path: Path, out_path: Path, inputs: Iterable[np.ndarray], margin: float = MARGIN) -> dict:
    """Write the FP16 ONNX; returns {"kept_fp32": [{"node", "op", "tensor", "peak"}], "nodes", "images"}."""
    batches = list(inputs)
    peaks = activation_peaks(fp32_path, batches)
    model = onnx.load(str(fp32_path))
    limit = FP16_MAX / margin
    kept = []
    for node in model.graph.node:
        over = [(o, peaks[o]) for o in node.output if peaks.get(o, 0.0) > limit]
        if over:
            tensor, peak = max(over, key=lambda t: t[1])
            kept.append({"node": node.name, "op": node.op_type, "tensor": tensor, "peak": peak})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = convert_float_to_float16(model, keep_io_types=True, node_block_list=[k["node"] for k in kept])
    with atomic_path(Path(out_path)) as tmp:
        onnx.save(proto, str(tmp))
    return {"kept_fp32": kept, "nodes": len(model.graph.node), "images": int(sum(len(b) for b in batches)),
            "limit": limit}
