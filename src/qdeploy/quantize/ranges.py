"""Turn activation statistics into quantization ranges with a library calibrator.

``max`` uses the observed absolute maximum. ``entropy``, ``percentile`` and ``mse`` are ModelOpt's
``HistogramCalibrator`` algorithms, re-implemented in bulk (below), on the |x| histograms collected in
one pass (collect.AbsHistogram on the ONNX Runtime path, ModelOpt's own calibrators on the ModelOpt path).

ModelOpt ≤ 0.47's ``_compute_amax_mse`` is not used: it calls
``fake_tensor_quant(centers, amax, num_bits, unsigned)`` but the signature is
``(inputs, amax, bias, num_bits, unsigned, ...)``: num_bits lands in ``bias`` and ``unsigned`` (False)
becomes ``num_bits=0``, so every candidate quantises to zero and the smallest range wins (top-1 falls
to ~10 % on CIFAR-10). ``mse_amax`` below evaluates the same objective with the arguments in their places.

ModelOpt's ``_compute_amax_entropy`` is correct but walks every (candidate, bin) pair in Python: 1.9 s
per tensor here, 107 s for ResNet-20's 57 activations, which alone breaks the calibration-time goal
(≤ 3x ONNX Runtime MinMax). ``entropy_amax`` below computes the same objective in closed form
(~8 ms per tensor); a test checks it returns exactly ModelOpt's amax. Likewise
``mse_amax`` evaluates ModelOpt's MSE objective for all candidates in bulk (0.1 s per tensor in
ModelOpt's loop), with the arguments right; a test checks it against ModelOpt's function run with the
argument fix. Percentile is ModelOpt's ``_compute_amax_percentile`` (a single cumsum), done on the
numpy histogram so that qdeploy's own histograms (collect.AbsHistogram) and ModelOpt's calibrators both work.

Bounded cost. ModelOpt's histogram (and collect.AbsHistogram, which follows it) fixes the bin width
on the first batch and *adds* bins when a later batch reaches further: a squeeze-excitation tensor
of EfficientNet-B0 whose first batch spanned 0.004 ended with 3,097,014 bins. Every candidate range
of entropy/MSE is evaluated against the whole histogram, so their cost grew with bins x candidates
(MSE: 637 s for one model). Here each candidate costs O(2^(num_bits-1)) from prefix sums over the
bins, and ``compute_amax`` evaluates at most ``MAX_CANDIDATES`` candidates per tensor with ModelOpt's
own ``stride`` (every stride-th candidate, each evaluated exactly on the full histogram): O(bins +
MAX_CANDIDATES x 128) per tensor whatever the bin count. Histograms of up to ``MAX_CANDIDATES`` + 128
bins (ModelOpt's 2048 by default) are searched exhaustively, exactly as before. The exact functions
(stride 1) stay as the reference the tests compare against; the tolerance of the strided search is
stated in ``search_stride`` and tested in tests/test_ranges.py.

One departure from ModelOpt's entropy, ``entropy_amax(keep_majority=True)``: its KL objective is blind
to clipping, and on tensors whose values all lie away from 0 (sigmoid / hard-sigmoid gates) its minimum
is a range below every value. That collapsed EfficientNet-B0 and MobileNetV3 to chance on the ONNX
Runtime placement; see entropy_amax and docs/int8-accuracy.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from qdeploy.config import RANGE_METHODS

SCALE_FLOOR = 1e-8  # an all-zero tensor gets this tiny range instead of a zero scale (division by zero)


@dataclass
class TensorRange:
    lo: float  # observed minimum clipped to [-amax, amax]
    hi: float  # observed maximum clipped to [-amax, amax]
    amax: float  # symmetric range: scale = amax / 127
    # per-channel (axis 1) observed min/max over the calibration set, for depthwise conv inputs (equalize.py)
    channel_lo: Optional[list] = None
    channel_hi: Optional[list] = None

    def to_json(self) -> list:
        if self.channel_lo is None:
            return [self.lo, self.hi, self.amax]
        return [self.lo, self.hi, self.amax, list(self.channel_lo), list(self.channel_hi)]


MAX_CANDIDATES = 4096  # candidate ranges evaluated per tensor by entropy/mse; histograms up to 4224 bins are searched exhaustively


def search_stride(num_bins: int, start_bin: int = 128, max_candidates: int = MAX_CANDIDATES) -> int:
    """ModelOpt's ``stride`` that keeps the candidates of a ``num_bins`` histogram to ``max_candidates``.

    Tolerance of the strided search against the exhaustive one (stride 1) on the same histogram — stated,
    and asserted in tests/test_ranges.py on ModelOpt histograms of 29k-42k bins:
      mse      its exact MSE ≤ 1.01 x the exhaustive minimum and its range within 1 % of the tensor's max
               of the exhaustive range (measured on every tensor of cifar10-dev EfficientNet-B0 /
               MobileNetV3-Large whose ModelOpt histogram had > 4,224 bins, up to 400 k bins: ≤ 1.0003 x, ≤ 0.42 %);
      entropy  its KL ≤ 1.3 x the exhaustive minimum (measured ≤ 1.26 x on those up to 60 k bins). KL is
               ragged from one bin to the next, so the range itself can move further (≤ 16 % of the
               tensor's max measured) between candidates whose KL is nearly equal.
    Histograms of up to max_candidates + start_bin bins (qdeploy's own are ≤ 4096) are searched exhaustively.
    """
    return max(1, -(-(num_bins - start_bin) // max_candidates))


def compute_amax(stats, method: str, percentile: float = 99.99, max_candidates: int = MAX_CANDIDATES) -> float:
    """Symmetric range of one tensor (``stats``: collect.TensorStats); entropy/mse evaluate at most
    ``max_candidates`` candidate ranges (``search_stride``), so their cost is bounded whatever the bin count."""
    absmax = max(abs(stats.lo), abs(stats.hi))
    if method == "max" or absmax == 0:
        amax = absmax
    elif method == "mean-minmax":
        # NNCF's default for per-tensor activations (MEAN_MINMAX): each image's own max|x|, averaged over the
        # images. Unlike the global max, one outlier image cannot stretch the range for all the others.
        amax = stats.sample_absmax_sum / max(stats.samples, 1)
    elif method in ("entropy", "mse", "percentile"):
        hist, edges = _numpy_hist(stats.hist)
        if hist is None:
            amax = absmax
        elif method == "percentile":
            amax = percentile_amax(hist, edges, percentile)  # one cumsum: exact at any bin count
        else:
            stride = search_stride(len(hist), max_candidates=max_candidates)
            amax = entropy_amax(hist, edges, stride=stride) if method == "entropy" else mse_amax_bounded(hist, edges, stride=stride)
    else:
        raise ValueError(f"unknown calibrator '{method}' (one of {tuple(RANGE_METHODS)})")
    return max(min(amax, absmax) if absmax > 0 else amax, SCALE_FLOOR)


def percentile_amax(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, percentile: float) -> float:
    """ModelOpt's ``_compute_amax_percentile``: the left edge of the bin where the CDF reaches ``percentile``."""
    if not 0 <= percentile <= 100:
        raise ValueError("Invalid percentile. Must be in range 0 <= percentile <= 100.")
    hist = np.asarray(calib_hist)
    cdf = np.cumsum(hist / hist.sum())
    return float(calib_bin_edges[np.searchsorted(cdf, percentile / 100)])


def _numpy_hist(calib):
    """(counts, edges) of a histogram calibrator (ours, or ModelOpt's), with ``len(edges) == len(counts) + 1``.

    ModelOpt's HistogramCalibrator (≤ 0.47) extends its edges with ``torch.arange(0, x_max + width, width)`` in float32
    when a batch reaches further; after a few extensions the step has drifted and arange makes one edge too many
    (2,356 edges for 2,354 bins), while ``torch.histc`` bins the batch into ``num_bins`` equal bins up to the last edge.
    Every estimator here then fails on mismatched shapes (a ConvNeXt's ``mse``: "operands could not be broadcast
    together with shapes (2219,) (2220,)"). The edges histc really used are rebuilt: num_bins + 1 equal steps up to
    the last edge."""
    hist, edges = calib._calib_hist, calib._calib_bin_edges
    if hist is None:
        return None, None
    if not isinstance(hist, np.ndarray):
        hist, edges = hist.int().cpu().numpy(), edges.float().cpu().numpy()
    if len(edges) != len(hist) + 1:
        edges = np.linspace(0.0, float(edges[-1]), len(hist) + 1)
    return hist, edges


def entropy_amax(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, num_bits: int = 8, start_bin: int = 128,
                 stride: int = 1, keep_majority: bool = True) -> float:
    """ModelOpt's KL-divergence (entropy) calibration — same objective, same tie-break, closed form.

    ModelOpt, for every candidate i (bins [0, i) kept, the tail folded into bin i-1): merges the kept
    bins into 128 equal buckets, spreads each bucket's mass evenly over its non-empty bins (q), and
    takes KL(p || q). Buckets are contiguous runs of bins, so with prefix sums of bins, of non-empty
    bins and of x·log x, KL for all candidates is a few (candidates × 128) array operations:
      KL_i = [Σ_{j<i-1} b_j log b_j − B_{i-1} log T − Σ_k W_k log(mean_k / S_i)] / T + p_last log(p_last / q_last)
    (T total count, S_i = Σ_{j<i} b_j, W_k bucket mass without bin i-1). ModelOpt's first-bin tweak
    (b_0 := b_1) and last-minimum tie-break are kept; a test checks equality with ModelOpt's result.
    ``stride`` as ModelOpt's: only every stride-th candidate is evaluated (each on the whole histogram).

    ``keep_majority`` (qdeploy's one departure; False = ModelOpt exactly): only candidates that keep at
    least half of the values (b_0 := b_1 counted as ModelOpt does) are considered. Why: KL(p || q) is
    taken on the *clipped* distribution p, whose clipped tail is folded into its last bin, so clipping
    itself costs nothing. For a tensor whose values all lie away from 0 (a sigmoid gate in
    [0.49, 0.51], hardswish's hard-sigmoid gate), the candidate that keeps just the first populated
    bin folds every value into that one bin: p is a point mass, q reproduces it, KL = 0 exactly — the
    global minimum — and the range becomes the data's minimum, clipping every value to one constant.
    On the ONNX Runtime placement (which quantizes those gates, the inputs of QLinearMul) that made
    EfficientNet-B0 / MobileNetV3 fall to chance. Clipping is meant for a tail of outliers, and a tail
    is a minority of the values by definition, hence the half; on distributions that start at 0 (what
    ModelOpt assumes) entropy clips far less than half and the result is ModelOpt's to the bit.
    (ModelOpt's loop is worse still there: candidates that keep no value give KL = NaN, which its
    ``np.argmin`` returns, so it picks the edge *below* the first populated bin; this closed form gives
    those candidates inf and, unguarded, picks the zero-KL edge just above it. Both clip every value.)
    """
    bins = np.array(calib_hist, dtype=np.float64)
    bins[0] = bins[1]  # as ModelOpt: the zero bin is dominated by ReLU zeros
    nb = 1 << (num_bits - 1)
    total = bins.sum()
    nonzero = (bins != 0).astype(np.float64)
    xlogx = np.where(bins > 0, bins * np.log(np.where(bins > 0, bins, 1.0)), 0.0)
    cb, cn, cx = (np.concatenate([[0.0], np.cumsum(a)]) for a in (bins, nonzero, xlogx))
    cand = np.arange(start_bin, len(bins) + 1, stride)
    if keep_majority:
        cand = cand[cb[cand] >= total / 2]  # cb[i]: values below candidate i's range end, i.e. kept unclipped
        if len(cand) == 0:  # the majority lies in the last stride: keep the whole range
            return float(calib_bin_edges[-1])
    bounds = -(-(np.arange(nb + 1)[None, :] * cand[:, None]) // nb)  # first bin of each bucket (ceil(k·i/128))
    sums = cb[bounds[:, 1:]] - cb[bounds[:, :-1]]
    counts = cn[bounds[:, 1:]] - cn[bounds[:, :-1]]
    mean = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    kept = cb[cand]
    last = bins[cand - 1]
    weights = sums.copy()
    weights[:, -1] -= last
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.where(mean > 0, np.log(mean / kept[:, None]), 0.0)
        p_last = (last + (total - kept)) / total
        q_last = np.where(last > 0, mean[:, -1] / kept, 0.0)
        kl = (cx[cand - 1] - cb[cand - 1] * np.log(total) - (weights * log_q).sum(1)) / total
        kl += np.where(p_last > 0, p_last * np.log(p_last / q_last), 0.0)
    kl[(p_last > 0) & (q_last == 0)] = np.inf
    best = len(kl) - 1 - int(np.argmin(kl[::-1]))
    return float(calib_bin_edges[cand[best]])


def mse_amax(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, num_bits: int = 8, start_bin: int = 128,
             chunk: int = 256) -> float:
    """ModelOpt's histogram-MSE calibration (``_compute_amax_mse``, signed, narrow range) done right and in bulk.

    For each candidate amax = a bin centre (from ``start_bin`` on), fake-quantise every bin centre
    (round-half-even of x·127/amax, clipped to ±127) and weigh the squared error by the bin counts;
    the candidate with the least error wins. Evaluated a chunk of candidates at a time with numpy in
    float32 like ModelOpt's kernel, instead of ModelOpt's one-torch-call-per-candidate loop (which also
    has the argument-order bug described above).
    """
    counts = np.asarray(calib_hist, dtype=np.float32)
    edges = np.asarray(calib_bin_edges, dtype=np.float32)
    centers = (edges[1:] + edges[:-1]) / np.float32(2)
    bound = np.float32((1 << (num_bits - 1)) - 1)
    candidates = np.arange(start_bin, len(centers))
    mses = np.empty(len(candidates), dtype=np.float64)
    for lo in range(0, len(candidates), chunk):
        amax = centers[candidates[lo:lo + chunk]][:, None]
        scale = bound / amax
        quant = np.clip(np.round(centers[None, :] * scale), -bound, bound) / scale
        mses[lo:lo + chunk] = (((quant - centers[None, :]) ** 2) * counts[None, :]).mean(axis=1)
    return float(centers[candidates[int(np.argmin(mses))]])


def mse_amax_bounded(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, num_bits: int = 8, start_bin: int = 128,
                     stride: int = 1) -> float:
    """``mse_amax``'s objective from prefix sums: O(bins + candidates x 2^(num_bits-1)), not O(candidates x bins).

    For a candidate amax (step s = amax/127) the bin centres that round to level k form a contiguous run
    (centres in [(k-0.5)s, (k+0.5)s); level 127 also takes everything clipped above it), so the run's
    squared error sum c(x - ks)^2 = S2 - 2ks S1 + (ks)^2 S0 comes from prefix sums of counts, counts·x and
    counts·x^2. The histograms are of |x| from 0, so levels 0..127 suffice. ``stride`` as ModelOpt's
    (candidates = every stride-th bin centre from ``start_bin``). With stride 1 it returns ``mse_amax``'s
    range up to float rounding between near-equal candidates (float64 here, float32 there): within 1e-6
    relative on the tests' and the cifar10-dev models' histograms.
    """
    counts = np.asarray(calib_hist, dtype=np.float64)
    edges = np.asarray(calib_bin_edges, dtype=np.float64)
    n = len(counts)
    if n <= start_bin:
        return float(edges[-1])
    centers = (edges[1:] + edges[:-1]) / 2
    bound = (1 << (num_bits - 1)) - 1
    p0, p1 = (np.concatenate([[0.0], np.cumsum(a)]) for a in (counts, counts * centers))
    amax = centers[start_bin::stride]
    step = amax / bound
    # first centre at or above (k + 0.5)·step for k = 0..126, where each level's run of bins ends. The bins
    # are uniform (centre j at (j + 0.5)·w from the first edge), so it is ceil(boundary / w - 0.5): no search.
    # A centre never ties a boundary when the candidate is a centre too ((2k+1)(2i+1) is odd, 254(2j+1)
    # even), so float rounding decides nothing here.
    width = (edges[-1] - edges[0]) / n
    boundary = (np.arange(bound) + 0.5)[None, :] * step[:, None]
    u = np.clip(np.ceil((boundary - edges[0]) / width - 0.5), 0, n).astype(np.intp)
    # sum over levels k of S2 - 2 q_k S1 + q_k^2 S0 (q_k = k·step), summed by parts over the run ends u_k:
    # S2 totals to a constant; sum q_k S1_k = step (127 P1[n] - sum_k P1[u_k]);
    # sum q_k^2 S0_k = step^2 (127^2 P0[n] - sum_k (2k+1) P0[u_k])
    s1 = bound * p1[n] - p1[u].sum(axis=1)
    s0 = bound * bound * p0[n] - p0[u] @ (2 * np.arange(bound) + 1.0)
    err = step * (step * s0 - 2 * s1)  # + sum(counts · x^2), the same for every candidate
    return float(amax[int(np.argmin(err))])


def compute_ranges(stats, method: str, percentile: float = 99.99, names=None) -> dict[str, TensorRange]:
    """Ranges for ``names`` (default: every collected tensor)."""
    out = {}
    for name, st in stats.tensors.items():
        if st.samples == 0 or (names is not None and name not in names):
            continue
        amax = compute_amax(st, method, percentile)
        lo, hi = st.lo, st.hi
        if method == "mean-minmax":  # asymmetric placements use the mean per-sample min and max themselves
            lo, hi = st.sample_lo_sum / st.samples, st.sample_hi_sum / st.samples
        channels = {}
        if st.channel_lo is not None:
            channels = {"channel_lo": [float(v) for v in st.channel_lo], "channel_hi": [float(v) for v in st.channel_hi]}
        out[name] = TensorRange(lo=max(lo, -amax), hi=min(hi, amax), amax=amax, **channels)
    return out


# mean-minmax averages each image's own max|x|: with N images its standard error is std/sqrt(N). Below this
# relative standard error the range would move by more than 5 % between two calibration sets of the same size.
MEAN_MINMAX_RELATIVE_ERROR = 0.05
# The count asked for is what the median quantized tensor needs. Per-image maxima are heavy-tailed on gated
# tensors: on EfficientNet-B0 a quarter of them have a spread (std/mean) above 2, so they would ask for thousands
# of images at any size one can calibrate with (the 90th percentile asked for 4-6k on 512 images, where
# mean-minmax gives its best result, 80.1-80.4 %), while the median tensor needs 22-34 images on the
# MobileNetV3 / EfficientNet-B0 / ResNet models measured. A warning that fires on the good case is ignored.
NEEDS_QUANTILE = 0.5


def images_needed(method: str, percentile: float, samples: int, absmax_sum: float, absmax_sq_sum: float,
                  elements: int) -> int | None:
    """The fewest calibration images the estimator needs for one tensor; None when the method derives no minimum.

    mean-minmax: its range is a mean over images; N ≥ (cv / 0.05)² keeps its standard error within 5 % of the
    range (cv: the spread of the per-image max|x| over its mean, on the calibration images).
    percentile: the top (100 - p) % of a tensor's values must hold at least one value, or the percentile is
    just the maximum: N ≥ 1 / ((1 - p/100) · values per image).
    max / entropy / mse take the extreme or a histogram of all values: no minimum follows from the estimator."""
    if method == "mean-minmax":
        if samples <= 1:
            return None
        mean = absmax_sum / samples
        if mean <= 0:
            return None
        var = max(absmax_sq_sum / samples - mean * mean, 0.0) * samples / (samples - 1)
        return int(np.ceil((np.sqrt(var) / mean / MEAN_MINMAX_RELATIVE_ERROR) ** 2))
    if method == "percentile" and percentile < 100 and elements > 0:
        return int(np.ceil(1.0 / ((1 - percentile / 100) * elements)))
    return None


def calibration_facts(stats, method: str, percentile: float = 99.99) -> dict:
    """What calibration_warnings needs from collect.ActivationStats, small enough to cache with the ranges:
    images each tensor needs, tensors constant over every image, the image count and the producers."""
    needs, constants = {}, []
    for name, st in stats.tensors.items():
        if not st.samples:
            continue
        need = images_needed(method, percentile, st.samples, st.sample_absmax_sum, st.sample_absmax_sq_sum, st.elements)
        if need is not None:
            needs[name] = need
        if st.hi - st.lo <= 0:
            constants.append({"tensor": name, "value": float(st.lo)})
    return {"samples": stats.samples, "needs": needs, "constants": constants,
            "producer": {c["tensor"]: stats.producer.get(c["tensor"], "?") for c in constants}
            | {n: stats.producer.get(n, "?") for n in needs}}


def calibration_warnings(facts: dict, method: str, percentile: float = 99.99, quantized=None) -> list[dict]:
    """What a user must know about the calibration set, for the tensors that carry a quantizer (``quantized``;
    None: all): too few images for the estimator (with the number the median tensor needs), and
    activations constant or all zero over every image (they get the scale floor; the layer is named)."""
    keep = (lambda t: True) if quantized is None else (lambda t: t in quantized)
    producer, n, out = facts.get("producer", {}), facts.get("samples", 0), []
    # one warning per cause: the same constant on every block (attention's sqrt(head_dim) in each of 12 blocks) is one
    # line with a count and an example, not twelve
    groups: dict = {}
    for c in facts.get("constants", []):
        if keep(c["tensor"]):
            groups.setdefault(float(c["value"]), []).append(c["tensor"])
    for value, names in groups.items():
        name, layer = names[0], producer.get(names[0], "?")
        kind = "all-zero" if value == 0 else "constant"
        what = "0" if kind == "all-zero" else f"constant {value:g}"
        who = (f"activation '{name}' (output of layer '{layer}')" if len(names) == 1 else
               f"{len(names)} activations, e.g. '{name}' (output of layer '{layer}'),")
        out.append({"kind": kind, "tensor": name, "layer": layer, "value": value, "count": len(names),
                     "tensors": names, "layers": [producer.get(t, "?") for t in names],
                     "message": f"{who} {'is' if len(names) == 1 else 'are'} {what} on all {n} calibration images: "
                                f"{'its quantizer gets' if len(names) == 1 else 'their quantizers get'} the scale floor"
                                + (" (a dead layer, or images that never exercise it)" if kind == "all-zero" else "")})
    needs = sorted((v, t) for t, v in facts.get("needs", {}).items() if keep(t))
    if needs:
        need, tensor = needs[min(len(needs) - 1, int(np.ceil(NEEDS_QUANTILE * len(needs))) - 1)]
        if n < need:
            short = sum(1 for v, _ in needs if v > n)
            what = (f"its ranges are means of each image's max|x|, and for {short} of {len(needs)} quantized tensors they "
                    f"vary by more than {int(MEAN_MINMAX_RELATIVE_ERROR * 100)} % between calibration sets of this size"
                    if method == "mean-minmax" else
                    f"for {short} of {len(needs)} quantized tensors the top {100 - percentile:g} % of the values holds less "
                    "than one value, so the percentile is just the maximum")
            out.append({"kind": "too-few-images", "tensor": tensor, "layer": producer.get(tensor, "?"), "needed": need,
                        "message": f"{n} calibration images are too few for method {method}: {what}; use at least {need} "
                                   f"images (what the median quantized tensor needs, e.g. '{tensor}')"})
    return out
