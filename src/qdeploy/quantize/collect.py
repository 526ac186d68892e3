"""Collect activation statistics of an FP32 ONNX model with ONNX Runtime, one pass, bounded memory.

Every float activation tensor becomes an extra graph output; each calibration batch is run once and
its tensors are folded into per-tensor statistics (min, max and an ``AbsHistogram`` of |x|) straight
away, so memory stays at one run's activations (a batch, or a chunk of it: ACTIVATION_BYTES_PER_RUN). (ONNX Runtime's
own Entropy / Percentile calibrators keep every batch's intermediate outputs until the end: 1.2 GB for ResNet-20.)
One pass serves every range method (the per-sample extremes for mean-minmax are summed on the way).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from qdeploy.errors import QDeployError
from qdeploy.utils.log import progress
from qdeploy.utils.onnx_graph import OnnxGraph


# The most activation bytes one ONNX Runtime run hands back at once: every float activation of the images in it is a
# graph output, so a calibration batch of 32 Swin-T images at 224 px is 14.9 GiB of outputs (652 tensors, 466 MiB an
# image) on top of ONNX Runtime's own buffers, and the 24 GiB host killed the process (no error, no artifact). A batch
# is run in chunks of as many images as fit, sized by a one-image run first; a model whose whole batch fits runs as
# before.
ACTIVATION_BYTES_PER_RUN = 1 << 30


class NonFiniteActivation(QDeployError):
    """NaN/Inf inside the model on calibration data: ranges would be meaningless."""


class AbsHistogram:
    """ModelOpt's ``HistogramCalibrator`` (torch_hist=True) binning of |x|, in numpy and with a bounded bin count.

    As ModelOpt: the first batch sets ``num_bins`` bins over [0, max|x|]; a later batch that reaches
    further adds bins of the same width. Unlike ModelOpt, when the count would pass ``max_bins`` the
    width doubles (pairs of bins are summed, every new edge is an old edge) until it fits: a tensor
    whose first batch spans a tiny range (squeeze-excitation tensors: 0.004 of a final 5.6) otherwise
    ends with millions of bins (3.1 M in EfficientNet-B0), and histogramming a batch into them
    dominated calibration (histc, plus torch.min/max that were 50x slower than numpy's here).
    The histogram keeps ≥ num_bins bins over the range seen (ModelOpt's resolution) and ≤ max_bins,
    so ranges.py searches it exhaustively. Exposes ModelOpt's ``_calib_hist`` / ``_calib_bin_edges``.
    """

    def __init__(self, num_bins: int = 2048, max_bins: Optional[int] = None):
        self.num_bins = num_bins
        self.max_bins = max_bins or 2 * num_bins
        self.width = 0.0
        self.counts: Optional[np.ndarray] = None  # int64
        self.zeros = 0  # values seen while every batch so far was all zero (no width yet)

    @property
    def _calib_hist(self):
        return self.counts

    @property
    def _calib_bin_edges(self):
        return None if self.counts is None else np.arange(len(self.counts) + 1, dtype=np.float64) * self.width

    def collect(self, x: np.ndarray, absmax: Optional[float] = None) -> None:
        """Add the values of ``x``; ``absmax`` = max|x| when the caller already knows it."""
        a = np.abs(x.reshape(-1), dtype=np.float32)
        top = float(a.max()) if absmax is None else float(absmax)
        if top <= 0:
            if self.counts is None:
                self.zeros += a.size
            else:
                self.counts[0] += a.size
            return
        if self.counts is None:
            self.width = top / self.num_bins
            self.counts = np.zeros(self.num_bins, dtype=np.int64)
            self.counts[0] += self.zeros
        n = len(self.counts)
        if top > n * self.width:
            need = int(np.ceil(top / self.width))
            while need > self.max_bins:  # double the width: sum pairs of bins
                if len(self.counts) % 2:
                    self.counts = np.append(self.counts, 0)
                self.counts = self.counts.reshape(-1, 2).sum(axis=1)
                self.width *= 2
                need = int(np.ceil(top / self.width))
            self.counts = np.concatenate([self.counts, np.zeros(max(need - len(self.counts), 0), dtype=np.int64)])
            n = len(self.counts)
        a *= np.float32(1.0 / self.width)
        counts = np.bincount(a.astype(np.intp), minlength=n + 1)  # truncation = floor for |x| >= 0
        # |x| = the top edge (or a rounding hair above) lands in the last bin, as with histc
        counts[n - 1] += counts[n:].sum()
        self.counts += counts[:n]


@dataclass
class TensorStats:
    name: str
    lo: float = float("inf")
    hi: float = float("-inf")
    hist: Optional[AbsHistogram] = None  # |x| (or a ModelOpt HistogramCalibrator, on the ModelOpt path)
    samples: int = 0
    # sums over samples (images) of each sample's own min, max and max|x|: the mean-minmax estimator
    sample_lo_sum: float = 0.0
    sample_hi_sum: float = 0.0
    sample_absmax_sum: float = 0.0
    sample_absmax_sq_sum: float = 0.0  # for the spread of the per-sample max|x| (too-few-images check)
    elements: int = 0  # values per sample
    # per-channel (axis 1) extremes over all samples, only for tensors asked for by name (depthwise conv inputs)
    channel_lo: Optional[np.ndarray] = None
    channel_hi: Optional[np.ndarray] = None


@dataclass
class ActivationStats:
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    samples: int = 0
    producer: dict[str, str] = field(default_factory=dict)  # tensor → name of the node that makes it
    images_per_run: Optional[int] = None  # the chunk a calibration batch was run in (ACTIVATION_BYTES_PER_RUN)


def float_activations(model) -> tuple[list[str], dict[str, str]]:
    """Names of all float, non-constant tensors (graph inputs and node outputs), and their producers."""
    return OnnxGraph(model).float_activations()


def collect_activation_stats(onnx_path: Path, batches: Iterable[np.ndarray], total: Optional[int] = None,
                             num_bins: int = 2048, threads: Optional[int] = None, names: Optional[Iterable[str]] = None,
                             histograms: bool = True, channel_names: Iterable[str] = ()) -> ActivationStats:
    """Per-tensor min/max (and |x| histograms unless ``histograms=False``, enough for ``max``) of ``names``
    (default: every float activation); per-channel (axis 1) min/max too for ``channel_names``."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(onnx_path))
    all_names, producer = float_activations(model)
    wanted = set(names) if names is not None else None
    names = [n for n in all_names if wanted is None or n in wanted]
    channel_names = set(channel_names) & set(names)
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
    stats = ActivationStats({n: TensorStats(n, hist=AbsHistogram(num_bins) if histograms else None)
                             for n in names}, 0, producer)
    workers = max(1, min(len(names), threads or os.cpu_count() or 1))
    chunk = None  # images per run (ACTIVATION_BYTES_PER_RUN), from the first image's activations
    static_batch = isinstance(sess.get_inputs()[0].shape[0], int)
    with progress("calibrate: collect activation statistics", total) as advance, \
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qdeploy-stats") as pool:
        for batch in batches:
            if chunk is None and len(batch):
                if static_batch:  # a model with a fixed batch runs only at that batch: nothing to choose
                    chunk = len(batch)
                else:
                    per_image = sum(o.nbytes for o in sess.run(out_names, {input_name: batch[:1]}))
                    chunk = max(1, ACTIVATION_BYTES_PER_RUN // max(per_image, 1))
            for i in range(0, len(batch), chunk or 1):
                x = batch[i:i + chunk] if chunk < len(batch) else batch
                outs = sess.run(out_names, {input_name: x})
                # each tensor's statistics fold on a worker thread (numpy's reductions, casts and bincount release the
                # GIL): at 224 px a transformer's 478 tensors make this fold, not the model, the cost of calibration
                # when one thread does it. A tensor is folded by one task per run, so no two threads touch the same
                # statistics
                work = [(stats.tensors[name], value) for name, value in zip(out_names, outs)
                        if name in stats.tensors and value.size]
                del outs
                list(pool.map(lambda item: _fold(item[0], item[1], len(x), item[0].name in channel_names, producer),
                              work))
                del work
                stats.samples += len(x)
                advance(len(x))
    stats.images_per_run = chunk
    return stats


def _fold(st: TensorStats, value: np.ndarray, n: int, per_channel: bool, producer: dict) -> None:
    """Fold one batch's values of one tensor (``n`` samples) into its statistics."""
    if not np.isfinite(value).all():
        raise NonFiniteActivation(
            f"calibration produced NaN/Inf in tensor '{st.name}' (output of layer '{producer.get(st.name, '?')}'); "
            "check the preprocessing (mean/std) and the calibration images"
        )
    if value.ndim >= 1 and value.shape[0] == n:  # per-sample extremes (batch axis first)
        rows = value.reshape(n, -1)
        mins, maxs = rows.min(axis=1).astype(np.float64), rows.max(axis=1).astype(np.float64)
        lo, hi = float(mins.min()), float(maxs.max())
        st.sample_lo_sum += float(mins.sum())
        st.sample_hi_sum += float(maxs.sum())
        absmax = np.maximum(-mins, maxs)
        st.sample_absmax_sum += float(absmax.sum())
        st.sample_absmax_sq_sum += float((absmax * absmax).sum())
        st.elements = rows.shape[1]
    else:  # a tensor without the batch axis: the batch's extremes stand for each of its samples
        lo, hi = float(value.min()), float(value.max())
        st.sample_lo_sum += n * lo
        st.sample_hi_sum += n * hi
        st.sample_absmax_sum += n * max(-lo, hi)
        st.sample_absmax_sq_sum += n * max(-lo, hi) ** 2
        st.elements = max(int(value.size) // max(n, 1), 1)
    st.lo, st.hi = min(st.lo, lo), max(st.hi, hi)
    if per_channel and value.ndim >= 2:
        per = np.moveaxis(value, 1, 0).reshape(value.shape[1], -1)
        c_lo, c_hi = per.min(axis=1).astype(np.float64), per.max(axis=1).astype(np.float64)
        st.channel_lo = c_lo if st.channel_lo is None else np.minimum(st.channel_lo, c_lo)
        st.channel_hi = c_hi if st.channel_hi is None else np.maximum(st.channel_hi, c_hi)
    if st.hist is not None:
        st.hist.collect(value, absmax=max(-lo, hi))
    st.samples += n
