"""Where an INT8 ONNX spends its time in ONNX Runtime, next to its FP32 ONNX: kernel time per op class.

ONNX Runtime's profiler times every kernel of the *optimized* graph, where Q/DQ pairs around supported ops are already
fused (QLinearConv, QLinearMatMul, QLinearAdd ...) and float convs are rewritten to the NCHWc layout (NchwcConv,
ReorderInput/ReorderOutput). So the same layer has different kernel names in the two graphs; :func:`op_class` maps
both to the layer class (``Conv``, ``MatMul``, ``Add`` ...), Q/DQ nodes ONNX Runtime could not fuse to ``Q/DQ`` and
the NCHWc reorders to ``layout``. A class whose INT8 graph spends more time than its FP32 graph is an op class whose
INT8 form costs more than its float form on this CPU: what the report shows for an INT8 artifact, and what the
placement rules (lint/placement.py) were measured on.
"""
from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

# fused / layout-specific kernel names → the layer class they compute (onnxruntime/core/optimizer: qdq_transformer,
# nchwc_transformer, conv_activation_fusion; contrib ops: QLinear*, QGemm, FusedConv, FusedMatMul, MatMulIntegerToFloat)
_ALIASES = {
    "ConvInteger": "Conv", "FusedConv": "Conv", "NhwcFusedConv": "Conv", "QLinearConv": "Conv", "NchwcConv": "Conv",
    "MatMulInteger": "MatMul", "MatMulIntegerToFloat": "MatMul", "FusedMatMul": "MatMul", "QLinearMatMul": "MatMul",
    "QGemm": "Gemm", "DynamicQuantizeMatMul": "MatMul",
    "QuantizeLinear": "Q/DQ", "DequantizeLinear": "Q/DQ", "DynamicQuantizeLinear": "Q/DQ",
    "ReorderInput": "layout", "ReorderOutput": "layout",
    "NchwcMaxPool": "MaxPool", "NchwcAveragePool": "AveragePool", "NchwcGlobalAveragePool": "GlobalAveragePool",
    "NchwcGlobalMaxPool": "GlobalMaxPool", "NchwcUpsample": "Resize",
}


def op_class(kernel_op: str) -> str:
    """The layer class an ONNX Runtime kernel computes (``QLinearConv`` and ``NchwcConv`` are both ``Conv``)."""
    if kernel_op in _ALIASES:
        return _ALIASES[kernel_op]
    for prefix in ("QLinear", "Nchwc"):
        if kernel_op.startswith(prefix) and len(kernel_op) > len(prefix):
            return kernel_op[len(prefix):]
    return kernel_op


def profile_onnx(path: Path, x: np.ndarray, runs: int = 30, warmup: int = 5, threads: Optional[int] = None) -> dict:
    """Kernel time per node of ``path`` in ONNX Runtime's CPU provider (qdeploy's session settings: every graph
    optimization, ``threads`` intra-op threads, default all cores), averaged over ``runs`` after ``warmup``.
    Returns {"p50_ms", "runs", "threads", "op_types_us", "op_classes_us", "nodes": [{node, op, us}] (slowest first)}."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="qdeploy-profile-") as tmp:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "profile")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x}
        for _ in range(warmup):
            sess.run(None, feed)
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times.append((time.perf_counter() - t0) * 1e3)
        trace = json.loads(Path(sess.end_profiling()).read_text())
    by_node: dict = collections.Counter()
    n_runs = 0
    for ev in trace:
        if ev.get("cat") == "Session" and ev.get("name") == "model_run":
            n_runs += 1
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        by_node[(ev["name"][: -len("_kernel_time")], ev.get("args", {}).get("op_name", "?"))] += ev["dur"]
    n = max(n_runs, 1)
    by_type: dict = collections.Counter()
    by_class: dict = collections.Counter()
    for (_, op), us in by_node.items():
        by_type[op] += us / n
        by_class[op_class(op)] += us / n
    return {"p50_ms": float(np.median(times)), "runs": n, "threads": threads or os.cpu_count(),
            "op_types_us": {k: round(v, 1) for k, v in by_type.most_common()},
            "op_classes_us": {k: round(v, 1) for k, v in by_class.most_common()},
            "nodes": [{"node": k[0], "op": k[1], "us": round(v / n, 1)} for k, v in by_node.most_common()]}


# OpenVINO CPU plugin layer types (ProfilingInfo.node_type) → the same classes; FakeQuantize is what OpenVINO makes of a
# Q/DQ pair it could not fold into its neighbours, Reorder its layout conversions
_OV_ALIASES = {"Convolution": "Conv", "GroupConvolution": "Conv", "FullyConnected": "MatMul",
               "FullyConnectedQuantizedLegacy": "MatMul", "FullyConnectedQuantized": "MatMul", "MatMul": "MatMul",
               "FakeQuantize": "Q/DQ", "Reorder": "layout", "Multiply": "Mul", "Subtract": "Sub", "Divide": "Div",
               "Eltwise": "elementwise", "Subgraph": "fused elementwise", "Interpolate": "Resize"}


def profile_openvino(path: Path, x: np.ndarray, runs: int = 30, warmup: int = 5, threads: Optional[int] = None) -> dict:
    """:func:`profile_onnx`'s record from OpenVINO's CPU plugin (its per-layer performance counters, ``PERF_COUNT``):
    real time per executed layer of the compiled model, averaged over ``runs``; ``op`` is the layer type and ``exec``
    the kernel (e.g. ``jit_avx2_I8``: an INT8 kernel). The ONNX is read as engine ``openvino`` reads it (signed int8
    activations as uint8)."""
    import openvino as ov

    from qdeploy.engines.openvino_engine import core, readable_onnx

    config = {"PERF_COUNT": True, "INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    with readable_onnx(Path(path), quantized=True) as (read, _):
        compiled = core().compile_model(core().read_model(str(read)), "CPU", config)
    request = compiled.create_infer_request()
    request.set_input_tensor(ov.Tensor(np.ascontiguousarray(x, dtype=np.float32)))
    for _ in range(warmup):
        request.infer()
    times = []
    by_node: dict = collections.Counter()
    kernels: dict = {}
    for _ in range(runs):
        t0 = time.perf_counter()
        request.infer()
        times.append((time.perf_counter() - t0) * 1e3)
        for info in request.get_profiling_info():
            if info.status == ov.ProfilingInfo.Status.EXECUTED:
                by_node[(info.node_name, info.node_type)] += info.real_time.total_seconds() * 1e6
                kernels[info.node_name] = info.exec_type
    n = max(runs, 1)
    by_type: dict = collections.Counter()
    by_class: dict = collections.Counter()
    for (_, op), us in by_node.items():
        by_type[op] += us / n
        by_class[_OV_ALIASES.get(op, op)] += us / n
    return {"p50_ms": float(np.median(times)), "runs": n, "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
            "engine": "openvino", "op_types_us": {k: round(v, 1) for k, v in by_type.most_common()},
            "op_classes_us": {k: round(v, 1) for k, v in by_class.most_common()},
            "nodes": [{"node": k[0], "op": k[1], "exec": kernels.get(k[0]), "us": round(v / n, 1)}
                      for k, v in by_node.most_common()]}


# an op class counts as "costs more in INT8" when its INT8 time exceeds its FP32 time by this fraction and by
# MIN_EXTRA_US: below that, profiler jitter decides
SLOWER_FRACTION = 0.10
MIN_EXTRA_US = 20.0


def compare(fp32: dict, int8: dict) -> dict:
    """Per op class: FP32 and INT8 kernel time (µs) and their ratio; ``slower``: the classes whose INT8 form costs more
    than their float form (``Q/DQ`` and ``layout`` exist in one graph only and count by their whole time), slowest
    extra time first."""
    classes = sorted(set(fp32["op_classes_us"]) | set(int8["op_classes_us"]),
                     key=lambda k: -(int8["op_classes_us"].get(k, 0.0) + fp32["op_classes_us"].get(k, 0.0)))
    engine = int8.get("engine", "onnxruntime")
    of = (lambda op: _OV_ALIASES.get(op, op)) if engine == "openvino" else op_class
    rows = []
    for k in classes:
        f, q = fp32["op_classes_us"].get(k, 0.0), int8["op_classes_us"].get(k, 0.0)
        rows.append({"op_class": k, "fp32_us": f, "int8_us": q, "ratio": round(q / f, 3) if f > 0 else None,
                     "int8_ops": sorted({n["op"] for n in int8["nodes"] if of(n["op"]) == k}),
                     "fp32_ops": sorted({n["op"] for n in fp32["nodes"] if of(n["op"]) == k})})
    slower = [r for r in rows if r["int8_us"] - r["fp32_us"] > max(MIN_EXTRA_US, SLOWER_FRACTION * r["fp32_us"])]
    slower.sort(key=lambda r: -(r["int8_us"] - r["fp32_us"]))
    return {"fp32_p50_ms": round(fp32["p50_ms"], 4), "int8_p50_ms": round(int8["p50_ms"], 4),
            "fp32_kernel_us": round(sum(fp32["op_classes_us"].values()), 1),
            "int8_kernel_us": round(sum(int8["op_classes_us"].values()), 1),
            "threads": int8["threads"], "runs": int8["runs"], "engine": engine, "classes": rows,
            "slower": [r["op_class"] for r in slower]}


def int8_cost_by_op_class(fp32_path: Path, int8_path: Path, x: np.ndarray, runs: int = 30,
                          threads: Optional[int] = None, engine: str = "onnxruntime") -> dict:
    """:func:`compare` of the two ONNX files profiled on the same input ``x`` by ``engine`` (onnxruntime: its
    profiler; openvino: its per-layer counters), plus the batch size."""
    profile = profile_openvino if engine == "openvino" else profile_onnx
    out = compare(profile(fp32_path, x, runs, threads=threads), profile(int8_path, x, runs, threads=threads))
    out["batch_size"] = int(x.shape[0])
    return out


def summary_line(cmp: dict) -> str:
    """One sentence: which op classes cost more in INT8 than in float, with their times."""
    rows = {r["op_class"]: r for r in cmp["classes"]}
    if not cmp["slower"]:
        return (f"no op class costs more in INT8 than in FP32 (kernel time {cmp['int8_kernel_us'] / 1e3:.3f} vs "
                f"{cmp['fp32_kernel_us'] / 1e3:.3f} ms, batch {cmp['batch_size']})")
    parts = [f"{k} {rows[k]['int8_us'] / 1e3:.3f} vs {rows[k]['fp32_us'] / 1e3:.3f} ms" for k in cmp["slower"]]
    who = "OpenVINO per-layer counters" if cmp.get("engine") == "openvino" else "ONNX Runtime profiler"
    return (f"op classes slower in INT8 than in FP32 ({who}, batch {cmp['batch_size']}, "
            f"{cmp['threads']} threads): " + "; ".join(parts))


__all__ = ["compare", "int8_cost_by_op_class", "op_class", "profile_onnx", "profile_openvino", "summary_line"]
