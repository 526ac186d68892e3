"""Collect activation statistics of an FP32 ONNX model with ONNX Runtime, one pass, bounded memory.

Every float activation tensor becomes an extra graph output; each calibration batch is run once and
its tensors are folded into per-tensor statistics (min, max and a ModelOpt ``HistogramCalibrator``
over |x|) straight away, so memory stays at one batch of activations. (ONNX Runtime's own Entropy /
Percentile calibrators keep every batch's intermediate outputs until the end: 1.2 GB for ResNet-20.)
One pass serves all four range methods.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from qdeploy.errors import QDeployError
from qdeploy.quantize.modelopt_import import import_modelopt
from qdeploy.utils.log import progress
from qdeploy.utils.onnx_graph import OnnxGraph


class NonFiniteActivation(QDeployError):
    """NaN/Inf inside the model on calibration data: ranges would be meaningless."""


def modelopt_histogram_calibrator():
    """ModelOpt's HistogramCalibrator, imported quietly (a ~4 s import that logs CUDA/JIT notices on CPU boxes)."""
    return import_modelopt("modelopt.torch.quantization.calib").HistogramCalibrator


@dataclass
class TensorStats:
    name: str
    lo: float = float("inf")
    hi: float = float("-inf")
    hist: object = None  # modelopt HistogramCalibrator (abs values)
    samples: int = 0


@dataclass
class ActivationStats:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    samples: int = 0
    producer: dict[str, str] = field(default_factory=dict)  # tensor → name of the node that makes it


def float_activations(model) -> tuple[list[str], dict[str, str]]:
    """Names of all float, non-constant tensors (graph inputs and node outputs), and their producers."""
    return OnnxGraph(model).float_activations()


def collect_activation_stats(onnx_path: Path, batches: Iterable[np.ndarray], total: Optional[int] = None,
                             num_bins: int = 2048, threads: Optional[int] = None, names: Optional[Iterable[str]] = None,
                             histograms: bool = True) -> ActivationStats:
    """Per-tensor min/max (and |x| histograms unless ``histograms=False``, enough for ``max``) of ``names``
    (default: every float activation)."""
    import onnx
    import onnxruntime as ort
    import torch

    if histograms:
        HistogramCalibrator = modelopt_histogram_calibrator()

    model = onnx.load(str(onnx_path))
    all_names, producer = float_activations(model)
    wanted = set(names) if names is not None else None
    names = [n for n in all_names if wanted is None or n in wanted]
    existing = {o.name for o in model.graph.output}
    for name in names:
        if name not in existing:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # basic level only (constant folding, no Conv+activation fusions): requested tensors stay as in the FP32 graph
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if threads:
        opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    input_name = sess.get_inputs()[0].name
    out_names = [o.name for o in sess.get_outputs()]
    stats = ActivationStats({n: TensorStats(n, hist=HistogramCalibrator(num_bins=num_bins, torch_hist=True) if histograms else None)
                             for n in names}, 0, producer)
    with progress("calibrate: collect activation statistics", total) as advance:
        for x in batches:
            outs = sess.run(out_names, {input_name: x})
            for name, value in zip(out_names, outs):
                st = stats.tensors.get(name)
                if st is None or value.size == 0:
                    continue
                if not np.isfinite(value).all():
                    raise NonFiniteActivation(
                        f"calibration produced NaN/Inf in tensor '{name}' (output of layer '{producer.get(name, '?')}'); "
                        "check the preprocessing (mean/std) and the calibration images"
                    )
                st.lo = min(st.lo, float(value.min()))
                st.hi = max(st.hi, float(value.max()))
                if st.hist is not None:
                    st.hist.collect(torch.from_numpy(value))
                st.samples += len(x)
            stats.samples += len(x)
            advance(len(x))
    return stats
