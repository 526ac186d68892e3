"""ONNX Runtime INT8 against its FP32 at the deployed size, format by format, with its profiler per op class.

    python bench/diagnose/ort_int8_formats.py --models resnet50 deit_small --images DIR --batch 1 --threads 16 \\
        --json runs/ort-int8/formats.json

Per model (bench/train/train_realsize.py's sources, random init, 224x224) the FP32 ONNX (torch.onnx.export, opset 17,
dynamic batch) and ``quantize_static`` of ``quant_pre_process``'s output in each format: QDQ U8S8 and S8S8 per channel,
QDQ U8S8 per tensor, QOperator U8S8 per channel (MinMax on --calib images of DIR, decoded as the ceiling harness does).
Each runs in one ONNX Runtime session (threads intra-op, one inter-op, ORT_ENABLE_ALL): p50 of --runs timed calls after
warm-up, then one profiled session whose kernel times are summed per op type (the node's ``op_name`` in the trace), so
a slower INT8 shows which kernels cost it. No qdeploy: the measurement is ONNX Runtime's own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "suites"))
from realsize_ceiling import CalibReader, cpu_info, ort_preprocessed  # noqa: E402
from realsize_ceiling_sweep import decode, export  # noqa: E402

FORMATS = {  # name → quantize_static keyword arguments
    "qdq-u8s8-per-channel": {"quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": True},
    "qdq-s8s8-per-channel": {"quant_format": "QDQ", "activation_type": "QInt8", "per_channel": True},
    "qdq-u8s8-per-tensor": {"quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": False},
    "qoperator-u8s8-per-channel": {"quant_format": "QOperator", "activation_type": "QUInt8", "per_channel": True},
}


def session(path: Path, threads: int, profile: bool = False):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = profile
    if profile:
        so.profile_file_prefix = str(path.with_suffix("")) + "-profile"
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def timed(path: Path, x: np.ndarray, threads: int, runs: int) -> float:
    s = session(path, threads)
    feed = {s.get_inputs()[0].name: x}
    for _ in range(5):
        s.run(None, feed)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        s.run(None, feed)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def profile(path: Path, x: np.ndarray, threads: int, runs: int = 10) -> dict:
    """Kernel microseconds per op type, averaged over ``runs`` calls."""
    s = session(path, threads, profile=True)
    feed = {s.get_inputs()[0].name: x}
    for _ in range(runs):
        s.run(None, feed)
    trace = json.loads(Path(s.end_profiling()).read_text())
    per = defaultdict(float)
    for ev in trace:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            per[ev["args"].get("op_name", "?")] += ev["dur"] / runs
    return {k: round(v, 1) for k, v in sorted(per.items(), key=lambda t: -t[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "deit_small"])
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    files = sorted(p for p in a.images.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    calib = decode(files[:a.calib])
    x = np.ascontiguousarray(np.take(calib, np.arange(a.batch) % len(calib), axis=0))
    doc = {"command": "python " + " ".join(sys.argv), "cpu": cpu_info(), "batch": a.batch, "threads": a.threads,
           "rows": []}
    with tempfile.TemporaryDirectory(prefix="ort-int8-") as tmp:
        for name in a.models:
            fp32 = Path(tmp) / f"{name}.onnx"
            export(name, None, fp32)
            pre, note = ort_preprocessed(fp32, Path(tmp))
            row = {"model": name, "pre_process_note": note, "p50_ms": {}, "kernel_us": {}}
            row["p50_ms"]["fp32"] = round(timed(fp32, x, a.threads, a.runs), 3)
            row["kernel_us"]["fp32"] = profile(fp32, x, a.threads)
            for fmt, kw in FORMATS.items():
                q = Path(tmp) / f"{name}-{fmt}.onnx"
                quantize_static(str(pre), str(q), CalibReader("input", calib), quant_format=getattr(QuantFormat, kw["quant_format"]),
                                activation_type=getattr(QuantType, kw["activation_type"]), weight_type=QuantType.QInt8,
                                per_channel=kw["per_channel"], calibrate_method=CalibrationMethod.MinMax)
                row["p50_ms"][fmt] = round(timed(q, x, a.threads, a.runs), 3)
                row["kernel_us"][fmt] = profile(q, x, a.threads)
                top = list(row["kernel_us"][fmt].items())[:6]
                print(f"{name} b{a.batch} t{a.threads} {fmt}: {row['p50_ms'][fmt]} ms vs fp32 {row['p50_ms']['fp32']} ms "
                      f"({row['p50_ms'][fmt] / row['p50_ms']['fp32']:.2f}x time); top kernels (us): {top}", flush=True)
            print(f"{name} fp32 top kernels (us): {list(row['kernel_us']['fp32'].items())[:6]}", flush=True)
            doc["rows"].append(row)
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
