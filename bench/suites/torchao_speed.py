"""torchao's low-precision schemes against FP16 on the GPU, the program only: the speed a torchao candidate of
`optimize --target torch-cuda` can reach, without a search around it.

Each (model, scheme, batch): timm's model with random weights (speed does not depend on their values) in FP16,
its Linear layers quantized as qdeploy quantizes them (``facts/torchao.apply_torchao``: the layers the scheme's kernel
takes), compiled (torch.compile default, under ``facts/torchao.inductor_config``) and replayed as a CUDA graph captured
by hand: qdeploy's compile + CUDA graph candidate. p50 of CUDA-event timed replays; the compile time is the first call's.
One JSON line per row is appended to --json as it is measured, so a run cut short keeps what it measured:

    python bench/suites/torchao_speed.py deit_small_patch16_224 --schemes none,int8-dynamic --batches 32,128 --json F

``--profile``: where a program's GPU time goes, per call, by kind of kernel (torch.profiler's CUDA kernel times over
calls of the compiled program without its graph: the same kernels): the matmuls, attention, the kernels that quantize
activations (Inductor names a fused kernel after the operations it fused: amax, round, clamp), and the rest. Set
beside FP16's, it says which part a scheme made faster and what it added.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from qdeploy.artifacts.torch_program_loader import capture_cuda_graph  # noqa: E402
from qdeploy.facts.torchao import SCHEMES, apply_torchao, inductor_config, quantizable, rows_per_image  # noqa: E402,E501


def graph_p50_ms(fn, x, warmup: int = 20, iterations: int = 100) -> float:
    """p50 of ``iterations`` replays of ``fn(x)`` captured as one CUDA graph as qdeploy captures it (after ``warmup``
    replays)."""
    graph = capture_cuda_graph(fn, x)[0]
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# Kernel names by kind (cuBLAS: gemm/nvjet/xmma/sm90 names; CUTLASS; Inductor's Triton matmul templates, triton_tem_*;
# cuDNN's convolutions; FlashAttention and PyTorch's fused attention). The first kind whose pattern matches a name
# takes it. Inductor's pointwise and reduction kernels (triton_poi_/triton_red_/triton_per_) are named after the
# operations fused into them, a matmul's among them when they compute its input (torchao's FP8 cast of GELU's output
# is "triton_poi_fused__scaled_mm__to_copy_clamp_div_gelu_..."), so they are never a matmul, convolution or attention.
KERNEL_KINDS = (  # attention first: PyTorch's memory-efficient attention kernels are CUTLASS's (fmha_cutlassF_*)
    ("attention", re.compile(r"flash|fmha|attention|sdpa|mem_eff", re.I)),
    ("convolution", re.compile(r"convolve|conv2d|convolution|_fprop_|dgrad|wgrad", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|triton_tem|_mm_|scaled_mm|int_mm|wgmma", re.I)),
    ("quantize", re.compile(r"amax|round|clamp|float8|fp8|int8", re.I)),
)
FUSED_ELEMENTWISE = re.compile(r"^triton_(poi|red|per)_")


def kernel_kind(name: str) -> str:
    kinds = KERNEL_KINDS[-1:] if FUSED_ELEMENTWISE.match(name) else KERNEL_KINDS
    return next((kind for kind, pattern in kinds if pattern.search(name)), "other")


def time_by_kind(kernels: list[tuple[str, float]], calls: int) -> dict:
    """(kernel name, total µs) over ``calls`` calls → ms per call by kind, and the five longest kernels."""
    kinds: dict[str, float] = {}
    for name, us in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us
    top = sorted(kernels, key=lambda k: -k[1])[:5]
    return {"ms_per_call": {k: round(v / calls / 1e3, 4) for k, v in sorted(kinds.items())},
            "longest_kernels": [{"name": n[:120], "kind": kernel_kind(n), "ms_per_call": round(us / calls / 1e3, 4)}
                                for n, us in top]}


def profile_kernels(fn, x, calls: int = 10) -> dict:
    """``time_by_kind`` of ``calls`` calls of ``fn(x)``, from torch.profiler's CUDA kernel events."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():  # the GPU's own activities: kernels, copies; not the annotations that span them
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    return time_by_kind(sorted(totals.items()), calls)


def row(model_name: str, scheme: str, batch: int, num_classes: int, size: int, profile: bool = False,
        channels_last: bool = False) -> dict:
    import timm

    torch.compiler.reset()
    model = timm.create_model(model_name, pretrained=False, num_classes=num_classes).cuda().half().eval()
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    x = torch.randn(batch, 3, size, size, device="cuda", dtype=torch.float16)
    if channels_last:  # as qdeploy's -cl candidates run: the convolutions' weights and the input in NHWC
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    quantized = 0
    if scheme != "none":
        rows = rows_per_image(model, x)
        quantized = sum(quantizable(scheme, m, rows.get(m)) for m in linear)
        apply_torchao(model, scheme, example=x)
    with torch._inductor.config.patch(inductor_config(None if scheme == "none" else scheme)), \
            torch.inference_mode():
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        compiled(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        p50 = graph_p50_ms(compiled, x)
        kernels = profile_kernels(compiled, x) if profile else None
    out = {"model": model_name, "scheme": scheme, "batch": batch, "input_size": size, "num_classes": num_classes,
           "channels_last": channels_last, "p50_ms": round(p50, 4), "compile_s": round(compile_s, 1),
           "linear_layers": len(linear), "quantized_layers": quantized}
    if kernels is not None:
        out["profile"] = kernels
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="timm model names")
    ap.add_argument("--schemes", default="none," + ",".join(SCHEMES), help="none (FP16) and facts/torchao schemes")
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--profile", action="store_true", help="add each program's GPU time by kind of kernel")
    ap.add_argument("--channels-last", action="store_true", help="model and input in channels_last (qdeploy's -cl "
                    "candidates' layout)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torchao_speed.py: no CUDA GPU here")
    schemes = args.schemes.split(",")
    unknown = [s for s in schemes if s != "none" and s not in SCHEMES]
    if unknown:
        raise SystemExit(f"--schemes: {unknown} not among none, {', '.join(SCHEMES)}")
    for name in args.models:
        for batch in (int(b) for b in args.batches.split(",")):
            for scheme in schemes:
                try:
                    r = row(name, scheme, batch, args.num_classes, args.size, args.profile, args.channels_last)
                except Exception as e:  # noqa: BLE001 - a scheme that cannot run here is a row with its reason
                    r = {"model": name, "scheme": scheme, "batch": batch, "error": f"{type(e).__name__}: "
                         f"{str(e).splitlines()[0][:300] if str(e) else ''}"}
                r["gpu"] = torch.cuda.get_device_name()
                r["torch"] = torch.__version__
                print(json.dumps(r), flush=True)
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
