"""Issue 35: why qdeploy's compiled FP16 channels_last program of torchvision's ConvNeXt-femto is ~10 % slower than the
hand-written torch.compile + CUDA graph (0.274 vs 0.250 ms at batch 1, in one process; docs/results/gpu_reference.json).

One process, one model, FP16 channels_last, every way of compiling it that differs between the hand-written reference
and qdeploy, each replayed as a CUDA graph captured by hand (load_model.capture_cuda_graph), timed interleaved
(ROUNDS rounds of ITER replays per batch size, CUDA events; the lowest round median kept, every round shown), plus the
CUDA kernels one uncaptured call launches (torch.profiler) — a fixed per-call gap at both batch sizes points at extra
kernels, a proportional one at slower kernels:

  hand            torch.compile(net)                        (bench/gpu_reference.py's reference: dynamic=None)
  hand-static     torch.compile(net, dynamic=False)          (what qdeploy's engine and load_model.py pass)
  export-static   torch.export → .module() → compile(dynamic=False)
  export-saved    torch.export.save/load → constants_to_device → compile(dynamic=False)  (load_model.py's path)
  hand-freezing   torch.compile(net) with torch._inductor.config.freezing (weights folded as constants)

  python bench/gpu_compile_diag.py tv_convnext_femto [--json OUT.json]
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ROUNDS, ITER = 3, 200
# the trained weights (bench/train_heldout.py's output; the larger ones are not in the repo): --weights DIR
WEIGHTS = HERE / "heldout"


def loader_module():
    spec = importlib.util.spec_from_file_location(
        "load_model", HERE.parent / "src" / "qdeploy" / "artifacts" / "torch_program_loader.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(name: str) -> torch.nn.Module:
    import train_heldout

    fac, kw, size = train_heldout.FACTORIES[name]
    model = fac()  # the factory defaults are the trained architecture (kw: what train_heldout recorded)
    model.load_state_dict(torch.load(WEIGHTS / f"{name}.pt", weights_only=True))
    return model.eval(), size


def kernels(fn, x) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x)
            torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = {}
    for e in ev:
        names[e.name[:60]] = names.get(e.name[:60], 0) + 1
    return {"count": len(ev), "gpu_us": round(sum(e.device_time for e in ev), 1),
            "top": sorted(names.items(), key=lambda kv: -kv[1])[:8]}


def main() -> None:
    global WEIGHTS
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="tv_convnext_femto")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--build-s", type=float, default=600, help="stop building more ways after this many seconds")
    ap.add_argument("--weights", type=Path, default=HERE / "heldout", help="folder of NAME.pt (default bench/heldout)")
    args = ap.parse_args()
    WEIGHTS = args.weights
    torch.backends.cudnn.benchmark = True
    loader = loader_module()
    base, size = build(args.model)
    fp16 = base.cuda().half().to(memory_format=torch.channels_last)
    xs = {b: torch.randn(b, 3, size, size, device="cuda").half().contiguous(memory_format=torch.channels_last)
          for b in (1, 32)}

    def fresh():
        return copy.deepcopy(fp16)

    ways = {}
    ways["hand"] = lambda: torch.compile(fresh())
    ways["hand-static"] = lambda: torch.compile(fresh(), dynamic=False)

    def exported(save: bool):
        def make():
            progs = {}
            for b, x in xs.items():  # qdeploy saves one program per batch size
                ep = torch.export.export(fresh(), (x,))
                if save:
                    f = Path(tempfile.mkdtemp()) / "m.pt2"
                    torch.export.save(ep, str(f))
                    ep = torch.export.load(str(f))
                mod = loader.constants_to_device(ep.module(), "cuda")
                progs[b] = torch.compile(mod, dynamic=False)
            return lambda x: progs[x.shape[0]](x)
        return make

    ways["export-saved"] = exported(True)

    def freezing():
        import torch._inductor.config as ic

        ic.freezing = True
        try:
            m = torch.compile(fresh())
            with torch.inference_mode():
                for x in xs.values():
                    m(x)  # compile now, under the flag
        finally:
            ic.freezing = False
        return m

    ways["hand-freezing"] = freezing
    ways["export-static"] = exported(False)
    report = {"model": args.model, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ways": {}}
    graphs, keep = {}, {}
    t_start = time.perf_counter()
    for name, make in ways.items():
        if time.perf_counter() - t_start > args.build_s:
            print(f"{name}: not built (--build-s {args.build_s} s spent)", flush=True)
            continue
        torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            fn = make()
            keep[name] = fn  # a graph replays into the memory of the module it captured: keep that alive
            # (graph, static input, static output): the tensors stay referenced while the graph replays into them
            graphs[name] = {b: loader.capture_cuda_graph(fn, x) for b, x in xs.items()}
            k = {b: kernels(fn, x) for b, x in xs.items()}
        except Exception as e:  # a way that fails is a finding, not the end of the diagnosis
            report["ways"][name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            print(f"{name}: FAILED {e}", flush=True)
            continue
        report["ways"][name] = {"build_s": round(time.perf_counter() - t0, 1), "kernels": k, "rounds": {1: [], 32: []}}
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s; kernels b1 {k[1]['count']} ({k[1]['gpu_us']} us), "
              f"b32 {k[32]['count']} ({k[32]['gpu_us']} us)", flush=True)
    for _ in range(ROUNDS):
        for name, g in graphs.items():
            for b, (graph, _, _) in g.items():
                for _ in range(50):
                    graph.replay()
                ts = []
                for _ in range(ITER):
                    a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graph.replay()
                    e.record()
                    e.synchronize()
                    ts.append(a.elapsed_time(e))
                report["ways"][name]["rounds"][b].append(round(statistics.median(ts), 5))
    base_p50 = {b: min(report["ways"]["hand"]["rounds"][b]) for b in (1, 32)} if "hand" in graphs else None
    for name in graphs:
        w = report["ways"][name]
        w["p50_ms"] = {b: min(w["rounds"][b]) for b in (1, 32)}
        rel = ({b: round(w["p50_ms"][b] / base_p50[b], 3) for b in (1, 32)} if base_p50 else None)
        w["vs_hand"] = rel
        print(f"DIAG {name}: b1 {w['p50_ms'][1]:.4f} ms, b32 {w['p50_ms'][32]:.4f} ms; vs hand {rel}; rounds {w['rounds']}"
              f"; top kernels b1 {w['kernels'][1]['top']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
