"""What loads and how fast on the GPU machine without TensorRT (issue #22's first question): does an AOTInductor
package load there (it segfaulted in `aoti_load_package` on torch 2.11+cu130 before), and what do eager, CUDA-graph
replay, torch.compile and the AOTInductor package give on a dev model, FP16 channels_last, batch 1 and 32.

    python bench/gpu_torch_probe.py --out $OUT            # on the device machine (torch, timm preinstalled there)

Each AOTInductor package is loaded in a fresh Python process (a crash there is reported with its signal, not taken for
a result). Latency: CUDA events, median of 200 replays after 20 warm-ups. Random weights: speed does not depend on them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch


def timed(fn, x, warmup=20, iters=200) -> float:
    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cuda_graph(model, x):
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model(static)

    def run(inp):
        static.copy_(inp)
        g.replay()
        return out
    return run


LOADER = textwrap.dedent("""
    import sys, json, time, statistics, torch
    t0 = time.perf_counter()
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    load_s = time.perf_counter() - t0
    x = torch.load(sys.argv[2]).cuda()
    ref = torch.load(sys.argv[3]).cuda()
    out = runner(x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    for _ in range(20): runner(x)
    torch.cuda.synchronize(); ts = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); runner(x); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    print(json.dumps({"load_s": load_s, "rel_err_vs_eager": err, "p50_ms": statistics.median(ts)}))
""")


def aoti(model, x, path: Path, dynamic: bool) -> dict:
    from torch.export import Dim, export

    t0 = time.perf_counter()
    shapes = {"x": {0: Dim("batch", min=1, max=64)}} if dynamic else None
    ep = export(model, (x,), dynamic_shapes=shapes)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    compile_s = time.perf_counter() - t0
    with torch.no_grad():
        ref = model(x)
    torch.save(x.cpu(), path.with_suffix(".x.pt"))
    torch.save(ref.cpu(), path.with_suffix(".ref.pt"))
    loader = path.with_suffix(".loader.py")
    loader.write_text(LOADER)
    p = subprocess.run([sys.executable, str(loader), pkg, str(path.with_suffix(".x.pt")), str(path.with_suffix(".ref.pt"))],
                       capture_output=True, text=True, timeout=300)
    res = {"compile_s": round(compile_s, 1), "returncode": p.returncode, "size_mb": round(os.path.getsize(pkg) / 2**20, 2)}
    if p.returncode == 0:
        res.update(json.loads(p.stdout.strip().splitlines()[-1]))
    else:
        res["stderr_tail"] = p.stderr[-800:]
    return res


def models():
    import timm
    import torchvision

    yield "tiny-linear", torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10)), 8
    yield "convnext_atto_64", timm.create_model("convnext_atto", num_classes=10, conv_mlp=False), 64
    yield "deit_tiny_p4_32", timm.create_model("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=4), 32
    yield "efficientnet_b0_48", torchvision.models.efficientnet_b0(num_classes=10), 48


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-probe"))
    ap.add_argument("--compile", action="store_true", help="also torch.compile (default and reduce-overhead)")
    ap.add_argument("--models", default="tiny-linear,convnext_atto_64,deit_tiny_p4_32,efficientnet_b0_48")
    ap.add_argument("--work", default="/tmp/gpu-probe", help="where packages are written (not $OUT: it returns 8 files)")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    wanted = args.models.split(",")
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
            "capability": torch.cuda.get_device_capability()}
    print(json.dumps(info), flush=True)
    rows = []
    for name, model, size in models():
        if name not in wanted:
            continue
        model = model.cuda().eval().half().to(memory_format=torch.channels_last)
        for batch in (1, 32):
            x = torch.randn(batch, 3, size, size, device="cuda").half().to(memory_format=torch.channels_last)
            r = {"model": name, "batch": batch}
            with torch.no_grad():
                r["eager_ms"] = timed(model, x)
                r["cudagraph_ms"] = timed(cuda_graph(model, x), x)
                if args.compile and name != "tiny-linear":
                    for mode in ("default", "reduce-overhead"):
                        torch._dynamo.reset()
                        t0 = time.perf_counter()
                        cm = torch.compile(model, mode=mode)
                        cm(x)
                        torch.cuda.synchronize()
                        r[f"compile_{mode}_s"] = round(time.perf_counter() - t0, 1)
                        r[f"compile_{mode}_ms"] = timed(cm, x)
            try:
                r["aoti"] = aoti(model, x, work / f"{name}-b{batch}.pt2", dynamic=False)
            except Exception as e:  # noqa: BLE001 - a probe reports what broke
                r["aoti"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
            (out / "probe.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
            if name == "tiny-linear" and r["aoti"].get("returncode") not in (0, None):
                print("AOTInductor package does not load here: the larger models are timed without it", flush=True)
    (out / "probe.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    for r in rows:
        a = r["aoti"]
        print(f"{r['model']:20s} b{r['batch']:<3d} eager {r['eager_ms']:.3f}  graph {r['cudagraph_ms']:.3f}  "
              + " ".join(f"{k} {v:.3f}" for k, v in r.items() if k.startswith("compile_") and k.endswith("_ms"))
              + f"  aoti {a.get('p50_ms', float('nan')):.3f} (rc {a.get('returncode')}, err {a.get('rel_err_vs_eager', float('nan')):.1e}, "
              f"compile {a.get('compile_s')} s, load {a.get('load_s', float('nan')):.2f} s)")


if __name__ == "__main__":
    main()
