"""The GPU kernels of qdeploy's saved program against the hand-written torch.compile + CUDA graph recipe it is compared
with in bench/suites/gpu_reference.py: where the time of two programs of the same recipe differs, kernel by kernel.

Each side runs in its own fresh process (as the ratio's processes do): the program loaded from --out by its own
load_model.py, the hand side the model compiled as gpu_reference.py's static recipe compiles it (``torch.compile(model,
dynamic=False)``), in the program's precision and layout. Both run their compiled forward without a CUDA graph while torch.profiler
records (the profiler does not see the kernels a graph replay launches; the graph replays these same kernels). Per
kernel name: calls per forward and device time per forward; the two sides' lists and their difference.

    python bench/suites/program_kernels.py convnext_tiny --data /tmp/rsdd --out /tmp/rsgpu --batch 128 \\
        --json docs/results/realsize/gpu_b128_b8_2026-11-30/kernels_convnext_b128.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_reference  # noqa: E402

def profile(step, forwards: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            step()
        torch.cuda.synchronize()
    kernels: dict = defaultdict(lambda: [0, 0.0])
    start, end = float("inf"), 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:160]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            start, end = min(start, e.time_range.start), max(end, e.time_range.end)
    # the span from the first kernel's start to the last one's end, per forward: the forwards are queued back to back,
    # so the span less the kernels' time is the gaps between kernels (and between forwards)
    return {"span_us_per_forward": round((end - start) / forwards, 2) if end > start else None,
            "kernels": {name: {"calls": c / forwards, "us": round(t / forwards, 2)}
                        for name, (c, t) in kernels.items()}}


def child(args) -> None:
    spec = importlib.util.spec_from_file_location("load_model", args.out / args.model / "load_model.py")
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    h, w = gpu_reference.input_hw(args.model)
    images = np.random.default_rng(0).standard_normal((args.batch, 3, h, w)).astype(np.float32)
    if args.side == "program":
        prog = loader.load(args.out / args.model)
        prog.cuda_graphs = args.graph
        step = prog.timed_step(images)
    else:
        # the program's own precision and layout, from its manifest as load_model reads them (not loaded here: its
        # compile cache would enter this process)
        manifest = json.loads((args.out / args.model / loader.MANIFEST).read_text())
        dtype = loader._DTYPES[manifest["precision"]]
        layout = torch.channels_last if manifest.get("channels_last") else torch.contiguous_format
        model = gpu_reference.build_model(args.model, args.data).cuda().to(dtype).to(memory_format=layout)
        fn = torch.compile(model, dynamic=False)
        x = torch.from_numpy(images).cuda().to(dtype).contiguous(memory_format=layout)
        if args.graph:
            step = loader.capture_cuda_graph(fn, x)[0].replay
        else:
            def step():
                with torch.inference_mode():
                    return fn(x)
    print("RESULT " + json.dumps(profile(step, args.forwards)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="gpu_reference.py's --out: the program is OUT/<model>")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--forwards", type=int, default=20)
    ap.add_argument("--graph", action="store_true",
                    help="profile the CUDA graph replays (where CUPTI reports a graph's kernels), not the forward")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--side", choices=("program", "hand"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        child(args)
        return
    sides, spans = {}, {}
    for side in ("program", "hand"):
        cmd = [sys.executable, __file__, args.model, "--data", str(args.data), "--out", str(args.out), "--batch",
               str(args.batch), "--forwards", str(args.forwards), "--side", side]
        cmd += ["--graph"] if args.graph else []
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{side}: exit {p.returncode}: {p.stderr[-2000:]}")
        got = json.loads(line[7:])
        spans[side], sides[side] = got["span_us_per_forward"], got["kernels"]
    names = set(sides["program"]) | set(sides["hand"])
    zero = {"calls": 0, "us": 0.0}
    diff = sorted(({"kernel": n, "program": sides["program"].get(n, zero), "hand": sides["hand"].get(n, zero),
                    "us_more_in_program": round(sides["program"].get(n, zero)["us"] - sides["hand"].get(n, zero)["us"],
                                                2)} for n in names), key=lambda d: -abs(d["us_more_in_program"]))
    totals = {s: round(sum(k["us"] for k in v.values()), 1) for s, v in sides.items()}
    calls = {s: round(sum(k["calls"] for k in v.values()), 1) for s, v in sides.items()}
    print(f"{args.model} b{args.batch}{' CUDA graph' if args.graph else ''}: kernel time per forward: program "
          f"{totals['program']} us ({calls['program']} kernels, span {spans['program']} us), hand {totals['hand']} us "
          f"({calls['hand']} kernels, span {spans['hand']} us)")
    for d in diff[:25]:
        print(f"  {d['us_more_in_program']:+9.2f} us  program {d['program']['calls']:5.1f}x {d['program']['us']:9.2f}  "
              f"hand {d['hand']['calls']:5.1f}x {d['hand']['us']:9.2f}  {d['kernel'][:110]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "batch": args.batch, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda_graph": args.graph, "totals_us": totals, "span_us_per_forward": spans, "kernels_per_forward": calls,
            "diff": diff, "sides": sides}, indent=1))


if __name__ == "__main__":
    main()
