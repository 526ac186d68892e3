"""Depthwise convolutions as fused stencils (qdeploy/facts/depthwise_stencil.py) against the library's kernels
(cuDNN's on the GPU, oneDNN's on the CPU) at the sizes users deploy, 224 px: each model compiled as the hand-written
expert recipe with and without the rewrite, in one process, timed in alternating rounds (the median over every call of
a side). GPU: torch.compile (static shapes) + a CUDA graph captured by hand, FP16, channels_last, CUDA events, with
--profile the depthwise kernels' share of a forward. CPU (--device cpu): torch.compile, FP32, channels_last,
perf_counter. Also the outputs of the two against each other and against eager FP32, and each side's first call
(the compile).

    python bench/suites/depthwise_stencil.py --models convnext_tiny,efficientnet_b0,mobilenet_v3_large \\
        --batches 32,128 --profile --json $OUT/depthwise_stencil_gpu.jsonl
    python bench/suites/depthwise_stencil.py --device cpu --models convnext_atto,mobilenet_v3_large --batches 1 \\
        --json docs/results/depthwise_stencil_cpu.jsonl

Random weights (the speed does not depend on them), kept at a scale where the outputs compared mean something
(``build``).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from qdeploy.artifacts.torch_program_loader import capture_cuda_graph  # noqa: E402
from qdeploy.facts.depthwise_stencil import rewrite_depthwise_convolutions  # noqa: E402

SOURCES = {"convnext_tiny": ("timm", "convnext_tiny"), "convnext_atto": ("timm", "convnext_atto"),
           "efficientnet_b0": ("torchvision", "efficientnet_b0"),
           "mobilenet_v3_large": ("torchvision", "mobilenet_v3_large"),
           "mobilenetv4_conv_medium": ("timm", "mobilenetv4_conv_medium")}


def build(name: str) -> torch.nn.Module:
    """The model with random weights whose activations keep their scale, so that the outputs compared are not noise:
    layer scales (timm's ``gamma``, initialised at 1e-6) at 0.5, and BatchNorm statistics gathered on three random
    batches (at their initial mean 0 / variance 1, a torchvision MobileNetV3's outputs are ~1e-10)."""
    lib, arch = SOURCES[name]
    torch.manual_seed(0)
    if lib == "timm":
        import timm
        model = timm.create_model(arch, num_classes=10)
    else:
        import torchvision
        model = getattr(torchvision.models, arch)(num_classes=10)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("gamma"):
                p.fill_(0.5)
        if any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()):
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.reset_running_stats()
                    m.momentum = None  # a cumulative average over the batches below
            model.train()
            for _ in range(3):
                model(torch.randn(8, 3, 224, 224))
    return model.eval()


def timed(replay, per_round: int, cuda: bool) -> list:
    out = []
    for _ in range(per_round):
        if not cuda:
            t0 = time.perf_counter()
            replay()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def alternating_p50(replays: dict, rounds: int, per_round: int, cuda: bool) -> dict:
    """{side: median ms} of ``replays`` ({side: a call}) timed in ``rounds`` alternating rounds (the order reversed every
    other round) of ``per_round`` calls each, after 10 warm calls a side."""
    for replay in replays.values():
        timed(replay, 10, cuda)
    samples = {side: [] for side in replays}
    for r in range(rounds):
        for side in (list(replays) if r % 2 == 0 else list(replays)[::-1]):
            samples[side] += timed(replays[side], per_round, cuda)
    return {side: statistics.median(v) for side, v in samples.items()}


def emit(row: dict, path) -> None:
    """Print ``row`` as a JSON line and append it to ``path`` (a JSON-lines file) where one is given."""
    print(json.dumps(row), flush=True)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def cpu_step(fn, x):
    """(replay, static input, static output) shaped like capture_cuda_graph's, for the CPU: a compiled call."""
    static_in, holder = x.clone(), {}

    def step():
        with torch.inference_mode():
            holder["out"] = fn(static_in)
        return holder["out"]

    step()

    class Out:  # the last call's output, read like a graph's static output
        def float(self):
            return holder["out"].float()
    return step, static_in, Out()


def eager_call(fn, x):
    with torch.inference_mode():
        return fn(x)


def profile_share(step, forwards: int = 10) -> dict:
    """Device time a forward of ``step`` (a compiled forward): all kernels, and those whose name says depthwise
    (cuDNN's grouped / c1_k1 kernels) or that are the stencil (Triton kernels fusing constant_pad_nd)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            step()
        torch.cuda.synchronize()
    total = dw = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None) or e.cuda_time_total
            total += t
            if any(s in e.name for s in ("c1_k1", "grouped", "depthwise", "dgrad", "constant_pad")):
                dw += t
    return {"kernel_us": round(total / forwards, 1), "depthwise_named_us": round(dw / forwards, 1)}


def machine(cuda: bool) -> str:
    if cuda:
        return torch.cuda.get_device_name()
    import platform

    flags, name = "", platform.processor() or platform.machine()
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
        name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), name)
        line = next(x for x in lines if x.startswith("flags"))
        flags = " ".join(f for f in line.split(":")[1].split() if f.startswith(("avx512_vnni", "avx512_bf16", "amx",
                                                                                 "avx2", "avx512f")))
    except (OSError, StopIteration):
        pass
    return f"{name}, {torch.get_num_threads()} threads; flags {flags}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="convnext_tiny,efficientnet_b0,mobilenet_v3_large")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="GPU: the depthwise kernels' share of a forward")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    torch.backends.cudnn.benchmark = True
    dtype = torch.float16 if cuda else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.models.split(","):
        base = build(name)
        sides = {"library": copy.deepcopy(base), "stencil": copy.deepcopy(base)}
        rewritten = rewrite_depthwise_convolutions(sides["stencil"])
        compiled, compile_s = {}, {}
        for side, m in sides.items():
            compiled[side] = torch.compile(m.to(args.device, dtype).to(memory_format=torch.channels_last),
                                           dynamic=False)
        for b in batches:
            x32 = torch.randn(b, 3, 224, 224, device=args.device)
            x = x32.to(dtype).contiguous(memory_format=torch.channels_last)
            graphs = {}
            for side, fn in compiled.items():
                t0 = time.perf_counter()
                if cuda:
                    graph, static_in, static_out = capture_cuda_graph(fn, x)
                    graphs[side] = (graph.replay, static_in, static_out)
                else:
                    graphs[side] = cpu_step(fn, x)
                compile_s[side] = round(time.perf_counter() - t0, 1)
            with torch.inference_mode():
                ref = base.to(args.device).float()(x32)
            outs = {}
            for side, (replay, static_in, static_out) in graphs.items():
                static_in.copy_(x)
                replay()
                outs[side] = static_out.float().clone()
            p50 = alternating_p50({side: g[0] for side, g in graphs.items()}, args.rounds, args.per_round, cuda)
            cos = torch.nn.functional.cosine_similarity
            row = {"model": name, "batch": b, "device": machine(cuda), "torch": torch.__version__,
                   "recipe": "torch.compile static + hand CUDA graph, FP16 channels_last" if cuda else
                   f"torch.compile static, FP32 channels_last, {torch.get_num_threads()} threads",
                   "depthwise_convolutions": len(rewritten),
                   "p50_ms": {s: round(v, 4) for s, v in p50.items()},
                   "stencil_over_library": round(p50["stencil"] / p50["library"], 4),
                   "first_call_s": compile_s,
                   "max_abs_diff_stencil_vs_library": float((outs["stencil"] - outs["library"]).abs().max()),
                   "cosine_vs_fp32": {s: round(float(cos(o.flatten(1), ref.flatten(1)).min()), 6)
                                      for s, o in outs.items()},
                   "argmax_agreement_stencil_vs_library": float((outs["stencil"].argmax(1)
                                                               == outs["library"].argmax(1)).float().mean())}
            if args.profile and cuda:
                # the compiled forward without its graph: the profiler may not see the kernels a graph replay launches
                row["profile"] = {side: profile_share(lambda fn=fn: eager_call(fn, x)) for side, fn in compiled.items()}
            emit(row, args.json)
            del graphs
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
