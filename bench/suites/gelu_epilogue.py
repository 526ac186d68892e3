"""A Linear's GELU in the matmul's epilogue (qdeploy/facts/gelu_epilogue.py) against Inductor's separate GELU kernel,
on the GPU at the sizes users deploy (224 px): each model's exported program (qdeploy's export_dynamic_batch, as the
torch engine and the saved program export it) compiled with and without the rewrite as the hand-written expert recipe
(torch.compile static shapes + a CUDA graph captured by hand, FP16, channels_last), timed in alternating rounds in one
process with CUDA events (the median over every call of a side); with --profile the GELU and matmul kernels' time in a
forward. Also the outputs of the two against each other and against eager FP32, and each side's first call.

    python bench/suites/gelu_epilogue.py --models convnext_tiny,swin_tiny,deit_small --batches 32,128 --profile \\
        --json $OUT/gelu_epilogue_gpu.jsonl

Random weights (the speed does not depend on them); timm's layer scales at 0.5 so the outputs compared keep their
scale.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from depthwise_stencil import alternating_p50, eager_call, emit, machine  # noqa: E402
from qdeploy.artifacts.torch_program import ProgramSettings, export_dynamic_batch  # noqa: E402
from qdeploy.artifacts.torch_program_loader import capture_cuda_graph  # noqa: E402

SOURCES = {"convnext_tiny": "convnext_tiny", "swin_tiny": "swin_tiny_patch4_window7_224",
           "deit_small": "deit_small_patch16_224", "vit_base": "vit_base_patch16_224"}


def build(name: str) -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(SOURCES[name], num_classes=10)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("gamma"):
                p.fill_(0.5)
    return model.eval()


def profile_kinds(step, forwards: int = 10) -> dict:
    """Device time of a forward of ``step`` by kernel kind: GELU (Inductor's Triton kernels named for it), matmul
    (cuBLAS / cuBLASLt: nvjet, gemm, sm90 xmma) and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            step()
        torch.cuda.synchronize()
    kinds = {"gelu": 0.0, "matmul": 0.0, "other": 0.0}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None) or e.cuda_time_total
            name = e.name.lower()
            kind = "gelu" if "gelu" in name and "triton" in name else \
                "matmul" if any(s in name for s in ("nvjet", "gemm", "xmma", "cutlass")) else "other"
            kinds[kind] += t
    return {k: round(v / forwards, 1) for k, v in kinds.items()}


def main() -> None:
    from qdeploy.facts.gelu_epilogue import rewrite

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="convnext_tiny,swin_tiny,deit_small")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=40)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.models.split(","):
        model = build(name).to("cuda", torch.float16).to(memory_format=torch.channels_last)
        settings = ProgramSettings(device="cuda", precision="fp16", channels_last=True, input_shape=(3, 224, 224))
        t0 = time.perf_counter()
        program = export_dynamic_batch(model, settings)
        export_s = time.perf_counter() - t0
        example = (torch.randn(2, 3, 224, 224, device="cuda", dtype=torch.float16)
                   .contiguous(memory_format=torch.channels_last),)
        t0 = time.perf_counter()
        fused, pairs = rewrite(program, example, ({0: torch.export.Dim("batch", min=1)},))
        rewrite_s = time.perf_counter() - t0
        compiled = {"separate": torch.compile(program.module(), dynamic=False),
                    "epilogue": torch.compile(fused.module(), dynamic=False)}
        for b in batches:
            x32 = torch.randn(b, 3, 224, 224, device="cuda")
            x = x32.half().contiguous(memory_format=torch.channels_last)
            graphs, first_s = {}, {}
            for side, fn in compiled.items():
                t0 = time.perf_counter()
                graphs[side] = capture_cuda_graph(fn, x)
                first_s[side] = round(time.perf_counter() - t0, 1)
            outs = {}
            for side, (graph, static_in, static_out) in graphs.items():
                static_in.copy_(x)
                graph.replay()
                outs[side] = static_out.float().clone()
            p50 = alternating_p50({side: g[0].replay for side, g in graphs.items()}, args.rounds, args.per_round, True)
            cos = torch.nn.functional.cosine_similarity
            fp32 = build(name).cuda()
            with torch.inference_mode():
                ref = fp32(x32)
            del fp32
            row = {"model": name, "batch": b, "device": machine(True), "torch": torch.__version__,
                   "recipe": "exported program, torch.compile static + hand CUDA graph, FP16 channels_last",
                   "linear_gelu_pairs": pairs, "export_s": round(export_s, 1), "rewrite_s": round(rewrite_s, 1),
                   "p50_ms": {s: round(v, 4) for s, v in p50.items()},
                   "epilogue_over_separate": round(p50["epilogue"] / p50["separate"], 4),
                   "first_call_s": first_s,
                   "max_abs_diff": float((outs["epilogue"] - outs["separate"]).abs().max()),
                   "cosine_vs_fp32": {s: round(float(cos(o.flatten(1), ref.flatten(1)).min()), 6)
                                      for s, o in outs.items()},
                   "argmax_agreement": float((outs["epilogue"].argmax(1) == outs["separate"].argmax(1))
                                             .float().mean())}
            if args.profile:
                row["profile_us"] = {side: profile_kinds(lambda fn=fn: eager_call(fn, x))
                                     for side, fn in compiled.items()}
            emit(row, args.json)
            del graphs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
