"""ONNX Runtime CPU latency of several ONNX files, measured round-robin so that machine drift hits all alike.

    python bench/diagnose/ort_latency.py REFERENCE.onnx OTHER.onnx ... [--rounds 7] [--batch 1] [--threads 2] [--size 48] [--json OUT]

Each round opens a fresh session per file, runs 20 warm-up and 200 timed batches of the same seeded input, and
keeps that session's median; the reported latency is the median over rounds, and the ratio is to the first file.
On a shared 2-core machine one file timed alone moved by 2x between minutes (issue #8), while ratios taken
within one round-robin run held: that is why every file is timed in every round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def session_median_ms(path: str, x: np.ndarray, threads: int, warmup: int = 20, iters: int = 200) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level, opts.intra_op_num_threads = 3, threads
    s = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = s.get_inputs()[0].name
    for _ in range(warmup):
        s.run(None, {name: x})
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        s.run(None, {name: x})
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=48, help="square input size (3 channels)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    x = np.random.default_rng(0).normal(size=(args.batch, 3, args.size, args.size)).astype(np.float32)
    runs = {f: [] for f in args.files}
    for _ in range(args.rounds):
        for f in args.files:
            runs[f].append(session_median_ms(f, x, args.threads))
    ref = statistics.median(runs[args.files[0]])
    rows = []
    print(f"| file | p50 ms (median of {args.rounds} rounds) | min–max of rounds | ratio to {Path(args.files[0]).name} |")
    print("|---|---|---|---|")
    for f in args.files:
        med = statistics.median(runs[f])
        rows.append({"file": f, "median_ms": med, "rounds_ms": runs[f], "ratio": med / ref})
        print(f"| {f} | {med:.3f} | {min(runs[f]):.3f}–{max(runs[f]):.3f} | {med / ref:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
