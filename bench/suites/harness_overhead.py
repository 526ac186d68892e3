"""Is the qdeploy harness the bottleneck? ResNet-50 FP16 + CUDA graphs through qdeploy vs a bare replay loop.

Both are measured in the same process on the same GPU with the same settings (torchvision ResNet-50,
random weights — latency does not depend on weight values — FP16, eval, cuDNN benchmark on), once with
contiguous (NCHW) and once with channels_last (NHWC) tensors:

  bare (pipelined):  events around N back-to-back graph replays, divided by N — the floor
  bare (per-iter):   events around each replay + synchronize — what a latency measurement costs
  qdeploy:           TorchEngine(precision=fp16, cuda_graphs=True) timed by qdeploy.benchmark

Goal: qdeploy's mean within 5% of the bare pipelined loop at batch 1 and 32.
Optionally (--compile) also times torch.compile(mode="max-autotune", channels_last) through qdeploy.

Run on the GPU machine:  PYTHONPATH=src python bench/suites/harness_overhead.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torchvision

from qdeploy.benchmark import benchmark
from qdeploy.artifacts import Builder
from qdeploy.config import RunConfig, VariantSpec
from qdeploy.engines import create_engine, resolve_variant


def bare_loop(model, bs: int, iters: int, warmup: int, channels_last: bool) -> dict:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.inference_mode():
        model(x)
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    pipelined = start.elapsed_time(end) / iters
    per_iter = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        per_iter.append(start.elapsed_time(end))
    return {"pipelined_mean_ms": pipelined, "per_iter_mean_ms": float(np.mean(per_iter)), "per_iter_p50_ms": float(np.median(per_iter))}


def qdeploy_variant(variant: VariantSpec, bs_list, iters, warmup) -> dict:
    cfg = RunConfig.model_validate({"model": {"source": "torchvision:resnet50", "kwargs": {"weights": None}, "weights": "random",
                                              "preprocess": {"input_size": [224, 224]}}, "data": {"eval": {"root": "."}}})
    resolved = resolve_variant(variant, 0)
    engine = create_engine(resolved, Builder(cfg).build(resolved.artifact_request()))
    t0 = time.perf_counter()
    engine.load()
    images = np.random.default_rng(0).standard_normal((max(bs_list), 3, 224, 224)).astype(np.float32)
    out = benchmark(engine, images, bs_list, warmup, iters)
    out["total_s"] = time.perf_counter() - t0
    out["details"] = engine.describe()
    out.pop("latency_samples_ms")
    engine.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=2, help="measure everything this many times (spread = noise)")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile max-autotune (slow to compile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    bs_list = [int(b) for b in args.batch_sizes.split(",")]
    torch.backends.cudnn.benchmark = True
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
              "iterations": args.iterations, "warmup": args.warmup, "runs": []}
    for channels_last in (False, True):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        model = torchvision.models.resnet50(weights=None).eval().cuda().half().to(memory_format=fmt)
        for rep in range(args.repeats):
            run = {"channels_last": channels_last, "repeat": rep, "bare": {}, "qdeploy": None}
            for bs in bs_list:
                run["bare"][str(bs)] = bare_loop(model, bs, args.iterations, args.warmup, channels_last)
            variant = VariantSpec(engine="torch", precision="fp16", cuda_graphs=True, channels_last=channels_last)
            run["qdeploy"] = qdeploy_variant(variant, bs_list, args.iterations, args.warmup)
            report["runs"].append(run)
        del model
    if args.compile:
        report["compile_max_autotune"] = qdeploy_variant(
            VariantSpec(engine="torch", precision="fp16", channels_last=True, compile="max-autotune"), bs_list, args.iterations, args.warmup)
    print(f"{report['gpu']}  torch {report['torch']}")
    print(f"{'layout':>14} {'run':>3} {'bs':>3} {'bare pipelined':>15} {'bare per-iter':>14} {'qdeploy mean':>13} {'qdeploy p50':>12} {'overhead vs pipelined':>22}")
    for run in report["runs"]:
        layout = "channels_last" if run["channels_last"] else "contiguous"
        for bs in bs_list:
            b = run["bare"][str(bs)]
            q = run["qdeploy"]["latency_ms"][str(bs)]
            over = 100 * (q["mean"] / b["pipelined_mean_ms"] - 1)
            print(f"{layout:>14} {run['repeat']:>3} {bs:>3} {b['pipelined_mean_ms']:>12.3f} ms {b['per_iter_mean_ms']:>11.3f} ms {q['mean']:>10.3f} ms {q['p50']:>9.3f} ms {over:>20.1f} %")
    if "compile_max_autotune" in report:
        c = report["compile_max_autotune"]
        print("torch.compile max-autotune through qdeploy: " + ", ".join(
            f"bs {bs}: mean {c['latency_ms'][str(bs)]['mean']:.3f} ms" for bs in bs_list) + f" (compile+bench {c['total_s']:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
