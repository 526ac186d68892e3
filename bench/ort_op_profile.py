"""Why an INT8 ONNX is slower than its FP32 in ONNX Runtime, per op (issue #23 item 1).

    python bench/ort_op_profile.py mobilevit deit convnext --batch 1 32 --out runs/op-profile

For each cifar10-modern model: qdeploy builds the FP32 ONNX and the INT8 ONNX (ONNX Runtime placement, mean-minmax,
256 calibration images), both are run in ONNX Runtime (the session options qdeploy uses, threads = all cores) with its
profiler on, and the kernel time of every node is summed by op type over 50 runs after 10 warm-ups; the fused graph is
what is profiled (ORT fuses Q/DQ pairs around supported ops into QLinear* / MatMulInteger / ConvInteger...). Prints, per
model and batch size, the op types that take the time in each graph, and writes DIR/<model>-b<N>.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_int8 import MODELS, SHARED, config  # noqa: E402


def profile(path: Path, x: np.ndarray, runs: int, warmup: int, prefix: Path) -> dict:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(prefix)
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    for _ in range(warmup):
        sess.run(None, {name: x})
    t = []
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, {name: x})
        t.append((time.perf_counter() - t0) * 1e3)
    trace = json.loads(Path(sess.end_profiling()).read_text())
    by_type: dict = collections.Counter()
    by_node: dict = collections.Counter()
    n_runs = 0
    for ev in trace:
        if ev.get("cat") == "Session" and ev.get("name") == "model_run":
            n_runs += 1
        if ev.get("cat") != "Node" or not ev.get("name", "").endswith("_kernel_time"):
            continue
        op = ev.get("args", {}).get("op_name", "?")
        by_type[op] += ev["dur"]
        by_node[(ev["name"][: -len("_kernel_time")], op)] += ev["dur"]
    n = max(n_runs, 1)
    return {"p50_ms": float(np.median(t[-runs:])), "runs_profiled": n,
            "op_types_us": {k: round(v / n, 1) for k, v in by_type.most_common()},
            "top_nodes_us": [{"node": k[0], "op": k[1], "us": round(v / n, 1)} for k, v in by_node.most_common(25)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("runs/op-profile"))
    args = ap.parse_args()
    from qdeploy import api
    from qdeploy.sysinfo import cpu_flags

    flags = [f for f in cpu_flags() if f.startswith(("avx", "amx")) or "vnni" in f]
    print(f"# {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}, flags: {' '.join(flags)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        cfg = config(name, 500, 256, "mean-minmax")
        cfg["variants"] = [{"engine": "onnxruntime"},
                           {"engine": "onnxruntime", "precision": "int8", "method": "mean-minmax", "placement": "onnxruntime"}]
        r = api.run(cfg, args.out / name, cache_dir=args.out / "cache")
        paths = {}
        for v in r["variants"]:
            onnx = next(a for a in r["artifacts"] if a["variant"] == v["name"] and a["path"].endswith(".onnx"))
            paths[v["precision"]] = args.out / name / onnx["path"]
        size = MODELS[name][3]
        for b in args.batch:
            x = np.random.default_rng(0).standard_normal((b, 3, size, size), dtype=np.float32)
            res = {p: profile(path, x, args.runs, 10, args.out / f"{name}-b{b}-{p}") for p, path in paths.items()}
            (args.out / f"{name}-b{b}.json").write_text(json.dumps(res, indent=1))
            fp, q = res["fp32"], res["int8"]
            print(f"\n## {name} batch {b}: FP32 {fp['p50_ms']:.3f} ms, INT8 {q['p50_ms']:.3f} ms "
                  f"({q['p50_ms'] / fp['p50_ms']:.2f}x FP32's time)")
            for label, d in (("FP32", fp), ("INT8", q)):
                total = sum(d["op_types_us"].values()) or 1
                print(f"{label} kernel time {total / 1e3:.3f} ms: " + ", ".join(
                    f"{k} {v / 1e3:.3f} ({100 * v / total:.0f} %)" for k, v in list(d["op_types_us"].items())[:10]))
    subprocess.run(["true"])


if __name__ == "__main__":
    main()
