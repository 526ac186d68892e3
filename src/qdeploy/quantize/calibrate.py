"""Calibration with a cache, and the per-variant INT8 artifact (what engines load)."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from qdeploy.errors import QDeployError
from qdeploy.export.onnx import sha256_file
from qdeploy.quantize.ranges import TensorRange, compute_ranges
from qdeploy.utils.atomic import write_json
from qdeploy.utils.log import log, warn


def calibration_key(onnx_path: Path, batches, preprocess, method: str, percentile: float, num_bins: int, names=None) -> str:
    """Identity of a set of ranges: model bytes, the exact calibration images, preprocessing, method, options."""
    samples = [str(s[0]) for s in getattr(batches.dataset, "samples", [])]
    payload = {
        "onnx": sha256_file(Path(onnx_path)),
        "samples": hashlib.sha256("\n".join(samples).encode()).hexdigest(), "count": batches.num_samples,
        "preprocess": preprocess.model_dump(mode="json"),
        "method": method, "percentile": percentile if method == "percentile" else None, "num_bins": num_bins,
        "tensors": hashlib.sha256("\n".join(names).encode()).hexdigest() if names is not None else "all",
        "version": 3,  # 3: bounded histograms + strided search, entropy keeps the majority
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def calibrate(onnx_path: Path, batches, preprocess, method: str, percentile: float = 99.99,
              cache_dir: Optional[Path] = None, stats_memo: Optional[dict] = None, num_bins: int = 2048,
              names: Optional[list] = None) -> tuple[dict, dict]:
    """Ranges for the float activations ``names`` (default: all) of ``onnx_path``; returns (ranges, info).

    One ONNX Runtime pass collects statistics of every activation; ``stats_memo`` keeps them for the
    other methods of the same run. Ranges are cached on disk by ``calibration_key``.
    """
    from qdeploy.data import normalize
    from qdeploy.quantize.collect import collect_activation_stats

    key = calibration_key(onnx_path, batches, preprocess, method, percentile, num_bins, names)
    path = Path(cache_dir) / "calibration" / f"{key}.json" if cache_dir else None
    info = {"method": method, "percentile": percentile if method == "percentile" else None,
            "samples": batches.num_samples, "cache": str(path) if path else None}
    if path is not None and path.is_file():
        data = json.loads(path.read_text())
        log(f"calibrate: cache hit {path} ({method})")
        info.update(cache_hit=True, time_s=0.0)
        return {k: TensorRange(*v) for k, v in data["ranges"].items()}, info
    t0 = time.perf_counter()
    memo_key = (str(onnx_path), id(batches), num_bins)
    stats = stats_memo.get(memo_key) if stats_memo is not None else None
    if stats is None or (method != "max" and next(iter(stats.tensors.values())).hist is None):
        # histograms only when a histogram method needs them: max alone is a plain min/max pass
        stats = collect_activation_stats(onnx_path, (normalize(x, preprocess) for x, _ in batches), batches.num_samples,
                                         num_bins, histograms=method != "max")
        if stats_memo is not None:
            stats_memo[memo_key] = stats  # one histogram pass serves every method in this run
    ranges = compute_ranges(stats, method, percentile, names=set(names) if names is not None else None)
    info.update(cache_hit=False, time_s=round(time.perf_counter() - t0, 3), tensors=len(ranges))
    log(f"calibrate: {method} ranges for {len(ranges)} tensors from {batches.num_samples} images in {info['time_s']:.1f} s")
    if path is not None:
        write_json(path, {"key": key, **{k: v for k, v in info.items() if k != "cache"},
                          "ranges": {k: [r.lo, r.hi, r.amax] for k, r in ranges.items()}})
    return ranges, info


def ranges_from_trt_cache(cache_path: Path, onnx_path: Path) -> dict:
    """Ranges from an existing TensorRT calibration cache; every entry must name a tensor of the model."""
    import onnx

    from qdeploy.quantize.collect import float_activations
    from qdeploy.quantize.trt_cache import read_trt_cache

    amax = read_trt_cache(cache_path)
    names, _ = float_activations(onnx.load(str(onnx_path)))
    unknown = [n for n in amax if n not in set(names)]
    if unknown:
        raise QDeployError(
            f"TensorRT calibration cache {cache_path} does not match the model: {len(unknown)} of {len(amax)} tensors "
            f"are not in {Path(onnx_path).name} (e.g. {', '.join(unknown[:5])}); model tensors look like {', '.join(names[:3])}"
        )
    return {n: TensorRange(-a, a, a) for n, a in amax.items()}


def ort_preprocessed(fp32_path: Path) -> Path:
    """``onnxruntime.quantization.shape_inference.quant_pre_process`` of the FP32 ONNX (cached next to it)."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from qdeploy.utils.atomic import atomic_path

    out = Path(fp32_path).with_name(Path(fp32_path).stem + "-ortpre.onnx")
    if not out.is_file():
        with atomic_path(out) as tmp:
            tmp.unlink()  # quant_pre_process writes the file itself
            quant_pre_process(str(fp32_path), str(tmp), skip_symbolic_shape=False)
    return out


def check_qdq_export(qm, onnx_path: Path, inputs, min_cosine: float = 0.99) -> dict:
    """The exported Q/DQ ONNX (in ONNX Runtime) must compute what ModelOpt's fake-quantized model computes.

    Rounding at Q/DQ boundaries may differ by one step between the two, so the check is a cosine
    similarity per image rather than the tight tolerance of the FP32 export check.
    """
    import numpy as np
    import onnxruntime as ort

    x = np.ascontiguousarray(inputs, dtype=np.float32)
    with torch.inference_mode():
        ref = qm(torch.from_numpy(x)).float().numpy()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    got = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    a, b = got.reshape(len(x), -1).astype(np.float64), ref.reshape(len(x), -1).astype(np.float64)
    cos = float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-30)))
    result = {"samples": len(x), "min_cosine": cos, "max_abs_diff": float(np.max(np.abs(a - b)))}
    if not cos >= min_cosine:
        raise QDeployError(f"Q/DQ export {onnx_path} does not match ModelOpt's fake-quantized model: cosine {cos:.4f} < {min_cosine}")
    log(f"quantize: Q/DQ ONNX vs ModelOpt fake-quant model on {len(x)} real images: min cosine {cos:.5f}")
    return result


def ranges_from_qdq(onnx_path: Path) -> dict:
    """Activation ranges read back from a Q/DQ ONNX (per-tensor QuantizeLinear on non-constant inputs)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    consts = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = next(a.t for a in node.attribute if a.name == "value")
    producers = {o: n for n in model.graph.node for o in n.output}
    ranges = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in consts:
            continue
        tensor = node.input[0]
        while tensor in producers and producers[tensor].op_type in ("Cast", "Identity"):  # ModelOpt casts before Q
            tensor = producers[tensor].input[0]
        if tensor in consts:
            continue
        scale = consts.get(node.input[1])
        if scale is None:
            continue
        s = numpy_helper.to_array(scale)
        if s.size == 1:
            amax = float(s.reshape(())) * 127.0
            ranges[tensor] = TensorRange(-amax, amax, amax)
    return ranges


@dataclass
class QuantizedArtifact:
    path: Path
    input_name: str
    output_name: str
    opset: int
    exporter: str
    cached: bool = False
    verify: Optional[dict] = None
    info: dict = field(default_factory=dict)


def quantize_variant(artifacts, variant, calibration_batches, cache_dir: Path) -> QuantizedArtifact:
    """The INT8 ONNX for one variant (memoised per run by target, calibrator and exclusions)."""
    from qdeploy.quantize.qdq import quantize_onnx
    from qdeploy.quantize.structure import qdq_structure
    from qdeploy.quantize.trt_cache import write_trt_cache

    fp32 = artifacts.onnx()
    spec = artifacts.spec
    tag = hashlib.sha256(json.dumps([variant.target, variant.calibrator, variant.percentile, variant.exclude,
                                     variant.exclude_ops, variant.calibration_cache, variant.quantizer],
                                    sort_keys=True).encode()).hexdigest()[:12]

    use_modelopt = variant.target == "tensorrt" and not variant.calibration_cache and not variant.exclude_ops and (
        variant.quantizer == "modelopt" or (variant.quantizer == "auto" and artifacts.has_torch))
    if variant.quantizer == "modelopt" and not artifacts.has_torch:
        raise QDeployError(f"variant {variant.label}: quantizer modelopt needs a PyTorch model; {spec.source} is ONNX-only")

    def build_modelopt() -> tuple:
        t0 = time.perf_counter()
        if calibration_batches is None:
            raise QDeployError(f"variant {variant.label}: INT8 needs calibration images: add data.calibration to the config")
        batches = calibration_batches()
        key = calibration_key(fp32.path, batches, spec.preprocess, variant.calibrator, variant.percentile, 2048,
                              ["modelopt"] + list(variant.exclude))
        cache = Path(cache_dir) / "calibration" / f"{key}.json"
        info = {"method": variant.calibrator, "percentile": variant.percentile if variant.calibrator == "percentile" else None,
                "samples": batches.num_samples, "cache": str(cache), "quantizer": "modelopt"}
        cached = json.loads(cache.read_text())["amax"] if cache.is_file() else None
        if cached is not None:
            log(f"calibrate: cache hit {cache} ({variant.calibrator}, ModelOpt)")
        from qdeploy.data import normalize
        from qdeploy.quantize.modelopt_torch import export_qdq_onnx, quantize_torch_model

        qm, amax, details = quantize_torch_model(
            artifacts.torch_model(), (normalize(x, spec.preprocess) for x, _ in batches), batches.num_samples,
            variant.calibrator, variant.percentile, variant.exclude, amax=cached,
            stats_memo=artifacts.derived("modelopt-stats", dict))
        info.update(details, cache_hit=cached is not None, time_s=0.0 if cached is not None else round(time.perf_counter() - t0, 3))
        if cached is None:
            write_json(cache, {"key": key, "method": variant.calibrator, "amax": amax})
            log(f"calibrate: ModelOpt {variant.calibrator} ranges for {len(amax)} quantizers in {info['time_s']:.1f} s")
        out = Path(cache_dir) / "int8" / f"{fp32.path.stem}-int8-tensorrt-modelopt-{variant.calibrator}-{tag}.onnx"
        h, w = spec.preprocess.input_size
        export_qdq_onnx(qm, torch.randn(2, spec.preprocess.channels, h, w), out, artifacts.export_spec.opset, artifacts.export_spec.dynamic_batch)
        if artifacts.verify_inputs is not None:
            info["export_check"] = check_qdq_export(qm, out, artifacts.verify_inputs())
        return out, ranges_from_qdq(out), info, t0

    def build() -> QuantizedArtifact:
        if use_modelopt:
            from qdeploy.quantize.modelopt_torch import NotTraceable

            try:
                out, ranges, info, t0 = build_modelopt()
                return finish(out, ranges, info, t0)
            except NotTraceable as e:
                if variant.quantizer == "modelopt":
                    raise
                warn(f"{variant.label}: {e}; falling back to Q/DQ insertion in the ONNX graph")
        t0 = time.perf_counter()
        # ONNX Runtime's recommended pre-processing (shape inference + basic graph optimisation) for its own
        # INT8 kernels: on torchvision ResNet-18 (224², 2 threads) INT8 goes from 0.55x to 2.65x FP32 with it.
        # The TensorRT-style artifact keeps the exported graph as is.
        source = artifacts.derived("onnx-ort-preprocessed", lambda: ort_preprocessed(fp32.path)) \
            if variant.target == "onnxruntime" else fp32.path
        if variant.calibration_cache:
            ranges = ranges_from_trt_cache(Path(variant.calibration_cache), source)
            info = {"method": "tensorrt-cache", "source": variant.calibration_cache}
            log(f"quantize: ranges of {len(ranges)} tensors from TensorRT cache {variant.calibration_cache}")
        else:
            if calibration_batches is None:
                raise QDeployError(f"variant {variant.label}: INT8 needs calibration images: add data.calibration to the config")
            import onnx

            from qdeploy.quantize.qdq import tensors_to_calibrate

            names = tensors_to_calibrate(onnx.load(str(source), load_external_data=False), variant.target)
            ranges, info = calibrate(source, calibration_batches(), spec.preprocess, variant.calibrator,
                                     variant.percentile, cache_dir, artifacts.derived("calibration-stats", dict), names=names)
        out = Path(cache_dir) / "int8" / f"{fp32.path.stem}-int8-{variant.target}-{variant.calibrator}-{tag}.onnx"
        placed = quantize_onnx(source, ranges, variant.target, out, variant.exclude, variant.exclude_ops)
        info.update(placed, quantizer="onnxruntime-qdq")
        return finish(out, ranges, info, t0)

    def finish(out: Path, ranges: dict, info: dict, t0: float) -> QuantizedArtifact:
        trt_cache = write_trt_cache(out.with_suffix(".trtcache"), ranges)
        info.update(target=variant.target, trt_calibration_cache=str(trt_cache), quantize_time_s=round(time.perf_counter() - t0, 3),
                    structure=qdq_structure(out), artifact=str(out))
        s = info["structure"]
        log(f"quantize: {out.name}: {s['compute_ops_quantized']}/{s['compute_ops']} compute ops INT8, "
            f"{s['residual_adds_quantized']}/{s['residual_adds']} residual Adds quantized")
        return QuantizedArtifact(out, fp32.input_name, fp32.output_name, fp32.opset, f"{fp32.exporter}+int8-{variant.target}", info=info)

    return artifacts.derived(f"int8-{tag}", build)
