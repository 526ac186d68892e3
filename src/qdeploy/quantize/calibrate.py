"""Activation ranges with an on-disk cache: from one ONNX Runtime statistics pass, a TensorRT cache or a Q/DQ ONNX."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.quantization.shape_inference import quant_pre_process

from qdeploy.data import normalize
from qdeploy.errors import QDeployError
from qdeploy.utils.faults import kill_point
from qdeploy.quantize.collect import collect_activation_stats
from qdeploy.quantize.ranges import TensorRange, calibration_facts, compute_ranges
from qdeploy.quantize.trt_cache import read_trt_cache
from qdeploy.utils.atomic import atomic_path, write_json
from qdeploy.utils.compare import compare_outputs
from qdeploy.utils.ort_options import exact_qdq
from qdeploy.utils.hashing import sha256_file
from qdeploy.quantize.modelopt_import import import_modelopt
from qdeploy.utils.log import log
from qdeploy.utils.onnx_graph import OnnxGraph


def calibration_key(onnx_path: Path, batches, preprocess, method: str, percentile: float, num_bins: int, names=None,
                    channel_names=()) -> str:
    """Identity of a set of ranges: model bytes, the exact calibration images, preprocessing, method, options."""
    samples = [str(s[0]) for s in getattr(getattr(batches, "dataset", None), "samples", [])]
    digest = hashlib.sha256("\n".join(samples).encode())
    if not samples and getattr(batches, "images", None) is not None:  # in-memory batches (ArrayBatches): their pixels
        digest.update(np.ascontiguousarray(batches.images).tobytes())
    payload = {
        "onnx": sha256_file(Path(onnx_path)),
        "samples": digest.hexdigest(), "count": batches.num_samples,
        "preprocess": preprocess.model_dump(mode="json"),
        "method": method, "percentile": percentile if method == "percentile" else None, "num_bins": num_bins,
        "tensors": hashlib.sha256("\n".join(names).encode()).hexdigest() if names is not None else "all",
        "channels": hashlib.sha256("\n".join(sorted(channel_names)).encode()).hexdigest(),
        "version": 5,  # 3: bounded histograms + strided search, entropy keeps the majority; 4: per-channel extremes; 5: facts
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def calibrate(onnx_path: Path, batches, preprocess, method: str, percentile: float = 99.99,
              cache_dir: Optional[Path] = None, stats_memo: Optional[dict] = None, num_bins: int = 2048,
              names: Optional[list] = None, channel_names: Iterable[str] = ()) -> tuple[dict, dict]:
    """Ranges for the float activations ``names`` (default: all) of ``onnx_path``; returns (ranges, info).

    One ONNX Runtime pass collects statistics of every activation; ``stats_memo`` keeps them for the
    other methods of the same run. Ranges are cached on disk by ``calibration_key``.
    """
    channel_names = sorted(channel_names)
    key = calibration_key(onnx_path, batches, preprocess, method, percentile, num_bins, names, channel_names)
    path = Path(cache_dir) / "calibration" / f"{key}.json" if cache_dir else None
    info = {"method": method, "percentile": percentile if method == "percentile" else None,
            "samples": batches.num_samples, "cache": str(path) if path else None}
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        log(f"calibrate: cache hit {path} ({method})")
        info.update(cache_hit=True, time_s=0.0, calibration_facts=data.get("calibration_facts", {}))
        return {k: TensorRange(*v) for k, v in data["ranges"].items()}, info
    t0 = time.perf_counter()
    memo_key = (str(onnx_path), id(batches), num_bins, tuple(channel_names))
    stats = stats_memo.get(memo_key) if stats_memo is not None else None
    needs_hist = method not in ("max", "mean-minmax")
    if stats is None or (needs_hist and next(iter(stats.tensors.values())).hist is None):
        # histograms only when a histogram method needs them: max and mean-minmax need a plain min/max pass
        stats = collect_activation_stats(onnx_path, (normalize(x, preprocess) for x, _ in batches), batches.num_samples,
                                         num_bins, histograms=needs_hist, channel_names=channel_names)
        kill_point("calibration")
        if stats_memo is not None:
            stats_memo[memo_key] = stats  # one histogram pass serves every method in this run
    ranges = compute_ranges(stats, method, percentile, names=set(names) if names is not None else None)
    # what the calibration set could not tell; turned into warnings once the quantizer knows which tensors it quantized
    info.update(cache_hit=False, time_s=round(time.perf_counter() - t0, 3), tensors=len(ranges),
                calibration_facts=calibration_facts(stats, method, percentile))
    log(f"calibrate: {method} ranges for {len(ranges)} tensors from {batches.num_samples} images in {info['time_s']:.1f} s")
    if path is not None:
        write_json(path, {"key": key, **{k: v for k, v in info.items() if k != "cache"},
                          "ranges": {k: r.to_json() for k, r in ranges.items()}})
    return ranges, info


def ranges_from_trt_cache(cache_path: Path, onnx_path: Path) -> dict:
    """Ranges from an existing TensorRT calibration cache; every entry must name a tensor of the model."""
    amax = read_trt_cache(cache_path)
    names, _ = OnnxGraph.load(onnx_path).float_activations()
    unknown = [n for n in amax if n not in set(names)]
    if unknown:
        raise QDeployError(
            f"TensorRT calibration cache {cache_path} does not match the model: {len(unknown)} of {len(amax)} tensors "
            f"are not in {Path(onnx_path).name} (e.g. {', '.join(unknown[:5])}); model tensors look like {', '.join(names[:3])}"
        )
    return {n: TensorRange(-a, a, a) for n, a in amax.items()}


def _symbolic_shapes(model):
    """ONNX Runtime's symbolic shape inference of ``model`` (the first step of quant_pre_process), or None where it cannot
    infer every shape (attention and window reshapes, e.g. Swin). Its ``SymbolicShapeInference.infer_shapes`` then saves
    ``sym_shape_infer_temp.onnx`` and its data into the current directory before it raises, and no argument moves them:
    its steps are run here instead (the same calls, minus that save), so that nothing lands in the user's working
    directory and the process's working directory never changes under other threads."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference, get_opset

    if (get_opset(model) or 0) < 7:  # what infer_shapes refuses
        return None
    inference = SymbolicShapeInference(2**31 - 1, False, False, 0)  # quant_pre_process's int_max, auto_merge, ...
    inference._preprocess(model)
    complete = False
    while inference.run_:
        complete = inference._infer_impl()
    inference._update_output_from_vi()
    return inference.out_mp_ if complete else None


def ort_preprocessed(fp32_path: Path, cache_dir: Optional[Path] = None) -> Path:
    """``onnxruntime.quantization.shape_inference.quant_pre_process`` of the FP32 ONNX, cached by its content under
    ``cache_dir/ortpre`` (never beside the input, which may be the user's own file).

    The symbolic shape inference runs first (:func:`_symbolic_shapes`), its result saved in a scratch folder in the cache,
    then quant_pre_process without it (ONNX's own shape inference and the graph optimisation): the same steps as
    quant_pre_process's own. Where the symbolic pass cannot infer every shape, the pre-processing goes on without it:
    the quantizer needs shapes, not that pass."""
    import tempfile

    import onnx

    from qdeploy.utils.cache import default_cache_dir

    fp32_path = Path(fp32_path).resolve()
    folder = Path(cache_dir or default_cache_dir()).resolve() / "ortpre"
    out = folder / f"{sha256_file(fp32_path)[:24]}-ortpre.onnx"
    if out.is_file():
        return out
    folder.mkdir(parents=True, exist_ok=True)
    try:
        inferred = _symbolic_shapes(onnx.load(str(fp32_path)))
        why = "it cannot infer every shape"
    except Exception as e:  # noqa: BLE001 - ORT raises bare Exception/AssertionError here
        inferred, why = None, f"{type(e).__name__}: {e}".rstrip(": ")
    if inferred is None:
        log(f"quantize: ONNX Runtime's symbolic shape inference failed on {fp32_path.name} ({why.splitlines()[0][:200]}); "
            "pre-processing without it")
    with atomic_path(out) as tmp, tempfile.TemporaryDirectory(prefix=".scratch-", dir=folder) as scratch:
        source = fp32_path
        if inferred is not None:
            source = Path(scratch) / "symbolic.onnx"  # what quant_pre_process saves before optimising
            onnx.save(inferred, str(source))
            del inferred
        Path(tmp).unlink()  # quant_pre_process writes the file itself
        quant_pre_process(str(source), str(tmp), skip_symbolic_shape=True)
    return out


def check_qdq_export(qm, onnx_path: Path, inputs, min_cosine: float = 0.99, floor_margin: float = 0.005) -> dict:
    """The exported Q/DQ ONNX (exact Q/DQ semantics in ONNX Runtime) must compute what ModelOpt's
    fake-quantized model computes.

    Rounding at Q/DQ boundaries may differ by one step between the two, so the check is a cosine
    similarity per image rather than the tight tolerance of the FP32 export check: min cosine ≥ 0.99.

    Some quantized networks are ill-conditioned: a one-step rounding flip early on cascades (EfficientNet-B0
    with its depthwise convs and squeeze-excitation gates). There the fake-quantized model does not even
    agree with itself run in float64 (min cosine 0.82-0.99 on 64-256 CIFAR-10 images, against ≈ 1 - 1e-6 for
    a well-conditioned network), so no faithful export can be held to 0.99 everywhere. When the float64 rerun
    is below 0.999, the export passes when it is as close to the fake-quant model as that rerun is: mean
    cosine within ``floor_margin`` of the float64 rerun's. A real export fault (a
    wrong scale, axis or missing quantizer) moves the output far beyond that noise floor.
    """
    x = np.ascontiguousarray(inputs, dtype=np.float32)
    with torch.inference_mode():
        ref = qm(torch.from_numpy(x)).float().numpy()
    opts = exact_qdq(ort.SessionOptions())
    opts.log_severity_level = 3
    got = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    result = compare_outputs(got, ref)
    cos = result["min_cosine"]
    result["passed_by"] = "min cosine"
    if not cos >= min_cosine and result["median_cosine"] >= 1 - 1e-4 and result["mean_cosine"] >= min_cosine:
        # most images agree to 1e-4 and a few do not: a rounding tie resolved differently early on (ONNX Runtime and
        # torch round x/scale and x·(1/scale) apart within one float step) cascading in those images, not a wrong scale,
        # axis or quantizer, which moves every image
        result["passed_by"] = "median cosine (a rounding-tie cascade on a few images)"
        log(f"quantize: Q/DQ ONNX vs ModelOpt fake-quant model on {len(x)} real images: median cosine "
            f"{result['median_cosine']:.6f}, {result['samples_below_0.99']} image(s) below {min_cosine} (min {cos:.4f}): "
            "a rounding tie cascading, not an export fault")
        return result
    if not cos >= min_cosine:
        with torch.inference_mode():
            ref64 = qm.double()(torch.from_numpy(x).double()).float().numpy()
        qm.float()
        floors = {"float64": compare_outputs(ref64, ref),
                  "scales one float step apart": compare_outputs(_with_scales_one_step_apart(qm, x), ref)}
        result["float64_rerun"], result["scale_step_rerun"] = floors["float64"], floors["scales one float step apart"]
        which, floor = min(floors.items(), key=lambda kv: kv[1]["mean_cosine"])
        # a well-conditioned network reruns at cosine ≈ 1 - 1e-6; below 0.999 rounding flips cascade in it
        if not (floor["min_cosine"] < 0.999 and result["mean_cosine"] >= floor["mean_cosine"] - floor_margin):
            raise QDeployError(
                f"Q/DQ export {onnx_path.name} does not match ModelOpt's fake-quantized model: min cosine {cos:.4f} < "
                f"{min_cosine}, mean {result['mean_cosine']:.4f} on {len(x)} real images (the fake-quant model itself, "
                f"{which}: min {floor['min_cosine']:.4f}, mean {floor['mean_cosine']:.4f})")
        result["passed_by"] = f"within the fake-quant model's own noise ({which})"
        log(f"quantize: Q/DQ ONNX vs ModelOpt fake-quant model on {len(x)} real images: min cosine {cos:.4f}, mean "
            f"{result['mean_cosine']:.5f}; the fake-quant model itself, {which}: min {floor['min_cosine']:.4f}, mean "
            f"{floor['mean_cosine']:.5f} (ill-conditioned INT8 network; the export is as faithful as that)")
        return result
    log(f"quantize: Q/DQ ONNX vs ModelOpt fake-quant model on {len(x)} real images: min cosine {cos:.5f}")
    return result


def _with_scales_one_step_apart(qm, x: np.ndarray) -> np.ndarray:
    """The fake-quant model's output with every quantizer's amax two float32 steps larger. ModelOpt quantizes x·(127/amax),
    ONNX Runtime and TensorRT x/scale with scale = amax/127: the same number one or two roundings apart, so values that
    close to a half step round apart, and in an ill-conditioned INT8 network the flips cascade. This rerun has the same
    kind of flips, so it measures the noise an exact export shows (on DeiT-tiny/ConvNeXt-atto its cosine distribution
    matched the ONNX's: medians 1.1e-4 and 3.8e-4 vs 0.5e-4 and 4.4e-4 on 256 test images)."""
    import copy

    TensorQuantizer = import_modelopt("modelopt.torch.quantization.nn").TensorQuantizer
    shifted = copy.deepcopy(qm)
    with torch.no_grad():
        for m in shifted.modules():
            if isinstance(m, TensorQuantizer) and m.is_enabled and getattr(m, "amax", None) is not None:
                m.amax = m.amax * (1 + 2.0 ** -22)
        with torch.inference_mode():
            return shifted(torch.from_numpy(x)).float().numpy()


def ranges_from_qdq(onnx_path: Path) -> dict:
    """Activation ranges read back from a Q/DQ ONNX (per-tensor QuantizeLinear on non-constant inputs)."""
    graph = OnnxGraph.load(onnx_path)
    ranges = {}
    for node in graph.nodes:
        if node.op_type != "QuantizeLinear":
            continue
        tensor = graph.source(node.input[0])  # ModelOpt casts before Q
        if graph.is_constant(tensor) or graph.is_constant(node.input[0]):
            continue
        scale = graph.constant_value(node.input[1])
        if scale is not None and scale.size == 1:
            amax = float(scale.reshape(())) * 127.0
            ranges[tensor] = TensorRange(-amax, amax, amax)
    return ranges
