"""Range search with bounded cost: strided/prefix-sum search against the exhaustive one, qdeploy's histogram
against ModelOpt's, and the entropy guard against the degenerate zero-KL range (gates that lie away from 0)."""
import inspect
import time

import numpy as np
import pytest
import torch
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.calib.histogram import _compute_amax_entropy, _compute_amax_percentile

from qdeploy.quantize.collect import AbsHistogram, TensorStats
from qdeploy.quantize.ranges import (
    MAX_CANDIDATES, _numpy_hist, compute_amax, entropy_amax, mse_amax, mse_amax_bounded, percentile_amax, search_stride,
)

DISTRIBUTIONS = {
    "relu-gaussian": lambda rng, n: np.maximum(rng.standard_normal(n), 0),
    "laplace-squared": lambda rng, n: rng.laplace(size=n) ** 2,
    "student-t": lambda rng, n: rng.standard_t(3, n),
    # a squeeze-excitation gate: sigmoid of small logits, every value far from 0
    "sigmoid-gate": lambda rng, n: 1 / (1 + np.exp(-0.05 * rng.standard_normal(n))),
}


def _modelopt_hist(batches):
    calib = HistogramCalibrator(num_bins=2048, torch_hist=True)
    for b in batches:
        calib.collect(torch.from_numpy(np.asarray(b, np.float32)))
    return _numpy_hist(calib)


def _growing_batches(name, seed, first_scale):
    """A first batch spanning ``first_scale`` of the final range, then full batches: ModelOpt keeps the first
    batch's bin width and adds bins, so the histogram ends with ~2048 / first_scale bins."""
    rng = np.random.default_rng(seed)
    full = [DISTRIBUTIONS[name](rng, 100_000) for _ in range(3)]
    first = full[0][np.abs(full[0]) <= first_scale * np.abs(full[0]).max()][:2000]
    return [first] + full


def _kl_curve(hist, edges):
    """entropy_amax's KL for every candidate (stride 1, ModelOpt's candidates): its own source, stopped before the argmin."""
    src = inspect.getsource(entropy_amax).replace("def entropy_amax", "def _kl")
    src = src[:src.index("    best = len(kl)")] + "    return cand, kl\n"
    ns = {"np": np}
    exec(src, ns)
    return ns["_kl"](hist, edges, keep_majority=False)


def _mse_of(hist, edges, amax):
    """Exact (float64) 8-bit fake-quant squared error of the histogram's bin centres for one range."""
    centers = (edges[1:] + edges[:-1]) / 2
    scale = 127 / amax
    quant = np.clip(np.round(centers * scale), -127, 127) / scale
    return float(((quant - centers) ** 2 * hist).sum())


# ---- exact pieces: the same result as the exhaustive / ModelOpt computation ----------------------

@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_prefix_sum_mse_equals_the_exhaustive_mse(name):
    hist, edges = _modelopt_hist([DISTRIBUTIONS[name](np.random.default_rng(4), 200_000)])
    assert mse_amax_bounded(hist, edges) == pytest.approx(mse_amax(hist, edges), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_entropy_guard_changes_nothing_where_modelopt_is_sane(name):
    hist, edges = _modelopt_hist([DISTRIBUTIONS[name](np.random.default_rng(5), 200_000)])
    modelopt = float(_compute_amax_entropy(hist.copy(), edges, 8, False))
    if name != "sigmoid-gate":
        assert entropy_amax(hist, edges) == entropy_amax(hist, edges, keep_majority=False) == modelopt
    else:  # degenerate for both (see entropy_amax): ModelOpt picks the edge below the data (NaN KL), the closed form the one above
        first = int(np.flatnonzero(hist)[0])
        assert modelopt == pytest.approx(float(edges[first]))
        assert entropy_amax(hist, edges, keep_majority=False) == pytest.approx(float(edges[first + 1]))


def test_percentile_is_modelopts():
    hist, edges = _modelopt_hist([DISTRIBUTIONS["student-t"](np.random.default_rng(6), 200_000)])
    for p in (99.0, 99.9, 99.99):
        assert percentile_amax(hist, edges, p) == float(_compute_amax_percentile(hist, edges, p))


# ---- the entropy collapse: ModelOpt's KL picks a range below every value of a gate ----------------

@pytest.mark.slow
def test_entropy_does_not_clip_every_value_of_a_gate():
    values = DISTRIBUTIONS["sigmoid-gate"](np.random.default_rng(7), 200_000)
    hist, edges = _modelopt_hist([values])
    modelopt = float(_compute_amax_entropy(hist.copy(), edges, 8, False))
    # ModelOpt: keep only the first populated bin, fold everything into it: KL = 0, every value clipped
    assert np.mean(values > modelopt) > 0.999
    cand, kl = _kl_curve(hist, edges)
    assert kl[cand == np.flatnonzero(hist)[0] + 1][0] == 0.0
    ours = entropy_amax(hist, edges)
    assert np.mean(values <= ours) >= 0.5  # keeps the majority of the values unclipped
    assert ours <= values.max()


def test_compute_amax_uses_the_guarded_entropy():
    values = DISTRIBUTIONS["sigmoid-gate"](np.random.default_rng(8), 100_000).astype(np.float32)
    h = AbsHistogram(2048)
    h.collect(values)
    st = TensorStats("gate", lo=float(values.min()), hi=float(values.max()), hist=h, samples=1)
    assert np.mean(values <= compute_amax(st, "entropy")) >= 0.5


# ---- bounded cost: strided search within the stated tolerance of the exhaustive one -----------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["relu-gaussian", "laplace-squared", "student-t"])
def test_strided_search_is_within_tolerance_of_the_exhaustive_search(name):
    """The tolerance stated in ranges.search_stride, on ModelOpt histograms that grew to ~20-40k bins."""
    hist, edges = _modelopt_hist(_growing_batches(name, 9, first_scale=0.07))
    stride = search_stride(len(hist))
    assert len(hist) > 15_000 and stride > 1
    top = float(edges[-1])
    # MSE: objective within 1 % of the exhaustive minimum, range within 1 % of the tensor's max
    exhaustive = mse_amax_bounded(hist, edges)
    strided = mse_amax_bounded(hist, edges, stride=stride)
    assert _mse_of(hist, edges, strided) <= 1.01 * _mse_of(hist, edges, exhaustive)
    assert abs(strided - exhaustive) <= 0.01 * top
    # entropy: KL within 30 % of the exhaustive minimum (KL is ragged from one bin to the next)
    cand, kl = _kl_curve(hist, edges)
    strided = entropy_amax(hist, edges, stride=stride, keep_majority=False)
    assert kl[np.argmin(np.abs(edges[cand] - strided))] <= 1.3 * kl.min() + 1e-12


@pytest.mark.slow
def test_cost_does_not_grow_with_the_bin_count():
    """3.1 M bins (an EfficientNet-B0 squeeze-excitation tensor had that many): bounded by MAX_CANDIDATES."""
    rng = np.random.default_rng(10)
    n = 3_100_000
    values = np.abs(rng.standard_t(4, 2_000_000))

    def stats(bins: int) -> TensorStats:
        hist = np.histogram(values, bins=bins, range=(0, 40))[0]
        holder = type("H", (), {"_calib_hist": hist, "_calib_bin_edges": np.linspace(0, 40, bins + 1)})()
        return TensorStats("t", lo=-40.0, hi=40.0, hist=holder, samples=1)

    huge, coarse = stats(n), stats(2048)  # the 2048-bin one is searched exhaustively (below MAX_CANDIDATES)
    assert len(range(128, n + 1, search_stride(n))) <= MAX_CANDIDATES
    for method in ("entropy", "mse", "percentile"):
        t0 = time.perf_counter()
        amax = compute_amax(huge, method)
        assert time.perf_counter() - t0 < 5.0, method  # ~0.1-0.3 s on 2 cores; an O(bins x candidates) search takes hours
        reference = compute_amax(coarse, method)
        if method == "entropy":
            # KL is ragged between resolutions: only the objective is bounded (search_stride), so the range
            # is checked loosely, against the tensor's max (measured: 26.7 vs 18.8 of 40 here)
            assert abs(amax - reference) <= 0.25 * 40.0, (amax, reference)
        else:  # same data at ModelOpt's default resolution: the bounded search lands in the same place
            assert amax == pytest.approx(reference, rel=0.01), method
    assert compute_amax(huge, "percentile") == pytest.approx(np.percentile(values, 99.99), rel=0.01)


# ---- qdeploy's histogram: ModelOpt's binning, bounded -------------------------------------------------

def test_abs_histogram_bins_like_modelopt_while_it_fits():
    rng = np.random.default_rng(11)
    batches = [rng.standard_normal(50_000).astype(np.float32) * s for s in (1.0, 1.3, 1.6)]  # grows to ~3300 bins
    ref_hist, ref_edges = _modelopt_hist(batches)
    ours = AbsHistogram(2048)
    for b in batches:
        ours.collect(b)
    assert len(ours._calib_hist) == len(ref_hist) and ours._calib_hist.sum() == ref_hist.sum()
    assert np.abs(ours._calib_hist - ref_hist).sum() <= 1e-3 * ref_hist.sum()  # float rounding at bin edges only
    np.testing.assert_allclose(ours._calib_bin_edges, ref_edges, rtol=1e-5)


def test_abs_histogram_merges_bins_instead_of_growing_without_bound():
    rng = np.random.default_rng(12)
    tiny = rng.standard_normal(5000).astype(np.float32) * 1e-3
    wide = rng.standard_normal(50_000).astype(np.float32) * 5
    ref_hist, ref_edges = _modelopt_hist([tiny, wide])
    ours = AbsHistogram(2048)
    ours.collect(np.zeros(100, np.float32))  # an all-zero batch first: no width yet, its zeros land in bin 0 later
    ours.collect(tiny)
    ours.collect(wide)
    assert len(ref_hist) > 1_000_000  # ModelOpt: millions of bins
    assert 2048 <= len(ours._calib_hist) <= 4096
    assert ours._calib_hist.sum() == ref_hist.sum() + 100
    factor = round((ours._calib_bin_edges[1] - ours._calib_bin_edges[0]) / (ref_edges[1] - ref_edges[0]))
    assert factor & (factor - 1) == 0  # a power of two: every coarse edge is a fine edge
    merged = np.add.reduceat(np.asarray(ref_hist, np.int64), np.arange(0, len(ref_hist), factor))
    assert np.abs(ours._calib_hist[:len(merged)] - merged).sum() <= 100 + 1e-3 * ref_hist.sum()


def _elementwise_onnx(path, nodes, width: int):
    """An opset-17 ONNX from graph input x to output y, both (n, width) float, through ``nodes``; saved at ``path``."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_mean_minmax_averages_each_images_extremes(tmp_path):
    """NNCF's default activation estimator: mean over images of each image's min / max / max|x|, so one outlier
    image does not stretch the range (global max: 10; mean of per-image maxima: 3.25)."""
    from onnx import helper

    from qdeploy.quantize.collect import collect_activation_stats
    from qdeploy.quantize.ranges import compute_ranges

    path = _elementwise_onnx(tmp_path / "id.onnx", [helper.make_node("Identity", ["x"], ["y"], name="id")], 4)
    images = np.array([[-1, 0, 0, 1], [-1, 0, 0, 1], [-2, 0, 0, 1], [0, 0, 0, 10]], dtype=np.float32)
    stats = collect_activation_stats(path, [images[:3], images[3:]], total=4, histograms=False)  # batches of 3 and 1
    r = compute_ranges(stats, "mean-minmax")["y"]
    assert r.amax == pytest.approx((1 + 1 + 2 + 10) / 4)
    assert r.lo == pytest.approx((-1 - 1 - 2 + 0) / 4) and r.hi == pytest.approx((1 + 1 + 1 + 10) / 4)
    assert compute_ranges(stats, "max")["y"].amax == pytest.approx(10)


def test_mean_minmax_on_the_modelopt_path_averages_each_images_own_extreme():
    """ModelOpt path: the first conv's input quantizer reads the network input itself, so its mean-minmax amax must
    be the mean over the images of each image's max|x| (not the global max, which one bright image sets)."""
    import torch
    from torch import nn

    from qdeploy.config import Int8Config
    from qdeploy.quantize import candidates, get_quantizer
    from qdeploy.quantize.modelopt_torch import quantize_torch_model

    cfg = Int8Config(method="mean-minmax", placement="tensorrt")
    get_quantizer("modelopt").check(cfg, True)  # served by both quantizers now
    assert "modelopt" in [q.name for q in candidates(cfg, has_torch=True)]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3, 8, 8)).astype(np.float32)
    x[5] *= 20  # one outlier image: the global max is ~20x the typical one
    net = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3)).eval()
    _, amax, _ = quantize_torch_model(net, (x[i:i + 16] for i in range(0, 64, 16)), 64, "mean-minmax")
    first = next(k for k in amax if k.endswith("input_quantizer"))
    expected = float(np.abs(x).reshape(64, -1).max(axis=1).mean())
    assert float(np.asarray(amax[first]).reshape(-1)[0]) == pytest.approx(expected, rel=1e-5)
    assert expected < 0.5 * float(np.abs(x).max())

def test_modelopt_histograms_with_an_extra_edge_work_with_every_method():
    """ModelOpt's HistogramCalibrator grows its edges with a float32 arange: after a few batches that reach further
    it holds one edge too many (here 2,356 edges for 2,354 bins). Every method must still give a range (the mse
    broadcast crash on a ConvNeXt, issue 21)."""
    import torch

    mo_hist = pytest.importorskip("modelopt.torch.quantization.calib.histogram")
    from qdeploy.quantize.collect import TensorStats
    from qdeploy.config import RANGE_METHODS
    from qdeploy.quantize.ranges import compute_amax

    rng = np.random.default_rng(0)
    calib = None
    for _ in range(38):  # the seeded sequence that first shows the extra edge
        calib = mo_hist.HistogramCalibrator(num_bits=8, axis=None, unsigned=False, num_bins=2048)
        top = float(rng.uniform(0.01, 10))
        calib.collect(torch.tensor([0.0, top]))
        for _ in range(30):
            top *= float(rng.uniform(1.0, 1.05))
            calib.collect(torch.tensor([top]))
            if calib._calib_bin_edges.numel() != calib._calib_hist.numel() + 1:
                break
        else:
            continue
        break
    assert calib._calib_bin_edges.numel() == calib._calib_hist.numel() + 2  # the ModelOpt behaviour this guards
    stats = TensorStats("t", lo=0.0, hi=top, hist=calib, samples=1, sample_absmax_sum=top)
    for method in RANGE_METHODS:
        amax = compute_amax(stats, method)
        assert 0 < amax <= top * (1 + 1e-6), method


def test_a_batch_whose_activations_exceed_the_run_budget_is_run_in_chunks_with_the_same_statistics(tmp_path, monkeypatch):
    """Every float activation of a run comes back at once (a batch of 32 Swin-T images at 224 px: 14.9 GiB): a batch
    is run in chunks that keep one run's outputs under ACTIVATION_BYTES_PER_RUN, sized by a one-image run, and the
    statistics are those of the whole batch (extremes and per-image sums exactly; the histogram holds every value)."""
    from onnx import helper

    from qdeploy.quantize import collect
    from qdeploy.quantize.ranges import compute_ranges

    path = _elementwise_onnx(tmp_path / "two.onnx", [helper.make_node("Relu", ["x"], ["r"], name="relu"),
                                                     helper.make_node("Neg", ["r"], ["y"], name="neg")], 64)
    images = np.random.default_rng(0).normal(size=(10, 64)).astype(np.float32)
    whole = collect.collect_activation_stats(path, [images], total=10, num_bins=64)
    assert whole.images_per_run >= 10
    per_image = 3 * 64 * 4  # x, r and y of one image, float32
    monkeypatch.setattr(collect, "ACTIVATION_BYTES_PER_RUN", 3 * per_image)
    chunked = collect.collect_activation_stats(path, [images], total=10, num_bins=64)
    assert chunked.images_per_run == 3 and chunked.samples == whole.samples == 10
    for name in ("x", "r", "y"):
        a, b = whole.tensors[name], chunked.tensors[name]
        assert (a.lo, a.hi, a.samples) == (b.lo, b.hi, b.samples)
        assert a.sample_lo_sum == pytest.approx(b.sample_lo_sum) and a.sample_absmax_sum == pytest.approx(b.sample_absmax_sum)
        assert b.hist.counts.sum() == a.hist.counts.sum() == 10 * 64
    assert compute_ranges(chunked, "mean-minmax")["y"].lo == pytest.approx(compute_ranges(whole, "mean-minmax")["y"].lo)
