"""Inductor's freezing against torch.compile's default on the same model, same process: what optimize's frozen
candidate (``optimize.freezing``, facts/inductor.py) can gain, per device.

Each model (torchvision, random weights: speed does not depend on their values; channels_last; FP32 on the CPU, FP16
on a GPU) is compiled (``dynamic=False``, as qdeploy compiles) with and without ``freezing`` set while it compiles, each
in a fresh process, the two alternating (``--repeats`` processes each): two programs of one model cannot stay compiled
side by side in one process (Dynamo hands a second instance of the model the first one's program), and a fresh process
is what a deployed program runs in. A GPU program is replayed as a CUDA graph, as qdeploy runs it. The p50 is the
median over a side's processes of each process's median; the compile time is the first call's. ``--bn-folded`` adds a
third side: each BatchNorm folded into its convolution in the model itself and compiled without freezing (what freezing
gains on a GPU, if BatchNorm is where it gains, without the saved frozen program's first-call cost). ``hf_vit_small``
and ``hf_swin_tiny`` are Hugging Face's ViT (DeiT-S's size) and Swin-T, whose separate query, key and value layers
freezing concatenates into one matmul.

    python bench/suites/inductor_freezing.py resnet50 mobilenet_v3_large efficientnet_b0 --device cpu --batch 1 \\
        --json docs/results/inductor_freezing_cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from qdeploy.artifacts.torch_program_loader import capture_cuda_graph  # noqa: E402
from qdeploy.facts.inductor import has_batchnorm  # noqa: E402


class Logits(torch.nn.Module):
    """A Hugging Face classifier called as a user's deployment calls it: pixels in, logits out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(pixel_values=x).logits


def hf_model(name: str):
    """Hugging Face's ViT at DeiT-S's size and Swin-T (random weights): attention as three Linear layers on one input,
    which freezing concatenates into one matmul (facts/inductor.concatenable_linears)."""
    import transformers

    if name == "hf_vit_small":
        cfg = transformers.ViTConfig(hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                                     intermediate_size=1536, image_size=224, patch_size=16, num_labels=1000)
        return Logits(transformers.ViTForImageClassification(cfg))
    if name == "hf_swin_tiny":
        return Logits(transformers.SwinForImageClassification(transformers.SwinConfig(num_labels=1000)))
    raise SystemExit(f"unknown model {name}: a torchvision model name, hf_vit_small or hf_swin_tiny")


def build(name: str):
    return (hf_model(name) if name.startswith("hf_") else getattr(torchvision.models, name)()).eval()


def compiled(name: str, device: str, dtype, x, freezing: bool, bn_folded: bool = False, concat_linear: bool = False):
    model = build(name)
    if bn_folded:
        # each BatchNorm folded into the convolution before it in the model itself (torch.fx's conv-BN fusion, in
        # FP32 before the cast), as Ultralytics' fuse() and TensorRT do: what freezing folds on a GPU, without
        # freezing's cost at a fresh process's first call (AOTAutograd caches no frozen graph)
        from torch.fx.experimental.optimization import fuse

        model = fuse(model)
    model = model.to(device=device, dtype=dtype, memory_format=torch.channels_last)
    fn = torch.compile(model, dynamic=False)
    # cpp.enable_concat_linear: freezing's concatenation of Linear layers on one input, which the CPU leaves off by
    # default (a GPU graph has it under freezing alone)
    with torch._inductor.config.patch({"freezing": freezing or concat_linear, "cpp.enable_concat_linear": concat_linear}), \
            torch.inference_mode():
        t0 = time.perf_counter()
        fn(x)
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
    if device != "cuda":
        def step():
            with torch.inference_mode():
                return fn(x)
        return step, compile_s
    return capture_cuda_graph(fn, x)[0].replay, compile_s  # as qdeploy's engine and load_model.py capture it


def round_median(step, device: str, iterations: int) -> float:
    times = []
    for _ in range(iterations):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def machine(device: str) -> dict:
    if device == "cuda":
        return {"gpu": torch.cuda.get_device_name()}
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    have = next((line.split(":", 1)[1].split() for line in flags.splitlines() if line.startswith("Flags")), [])
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "flags": [f for f in keep if f in have]}


def child(args) -> None:
    """One process: one model compiled one way, timed in ``--rounds`` rounds; prints its JSON."""
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    x = torch.randn(args.batch, 3, args.size, args.size, device=args.device, dtype=dtype
                    ).contiguous(memory_format=torch.channels_last)
    step, compile_s = compiled(args.child, args.device, dtype, x, args.freezing, args.bn_folded, args.concat_linear)
    for _ in range(3):
        step()
    rounds = [round_median(step, args.device, args.iterations) for _ in range(args.rounds)]
    print("RESULT " + json.dumps({"p50_ms": statistics.median(rounds), "compile_s": compile_s}), flush=True)


FORMS = {"default": [], "frozen": ["--freezing"], "bn-folded": ["--bn-folded"],
         "frozen-concat-linear": ["--concat-linear"]}


def one_process(args, name: str, form: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--device", args.device, "--batch", str(args.batch),
           "--size", str(args.size), "--rounds", str(args.rounds), "--iterations", str(args.iterations),
           "--json", "-"] + FORMS[form]
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{name} ({form}) failed: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", help="torchvision model names, or hf_vit_small / hf_swin_tiny (Hugging Face)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes a side, alternating")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds in each process")
    ap.add_argument("--iterations", type=int, default=20, help="timed calls per round")
    ap.add_argument("--json", type=str, required=True)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bn-folded", action="store_true",
                    help="also time the model with each BatchNorm folded into its convolution, compiled without "
                         "freezing (a third side of the alternation)")
    ap.add_argument("--concat-linear", action="store_true",
                    help="also time the frozen program with the CPU's cpp.enable_concat_linear on (Linear layers on one "
                         "input as one matmul; a GPU graph has it under freezing alone): a further side")
    ap.add_argument("--freezing", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    rows = []
    for name in args.models:
        # a model without a BatchNorm has nothing to fold: its third side would be its first
        forms = ["default", "frozen"] + (["bn-folded"] if args.bn_folded and has_batchnorm(build(name)) else []) \
            + (["frozen-concat-linear"] if args.concat_linear else [])
        runs = {f: [] for f in forms}
        for _ in range(args.repeats):
            for form in forms:
                runs[form].append(one_process(args, name, form))
        p50 = {k: statistics.median(r["p50_ms"] for r in v) for k, v in runs.items()}
        compile_s = {k: round(statistics.median(r["compile_s"] for r in v), 1) for k, v in runs.items()}
        row = {"model": name, "device": args.device, "dtype": "float16" if args.device == "cuda" else "float32",
               "batch": args.batch, "input_size": args.size, "p50_ms": round(p50["default"], 3),
               "frozen_p50_ms": round(p50["frozen"], 3), "speedup": round(p50["default"] / p50["frozen"], 3),
               "compile_s": compile_s["default"], "frozen_compile_s": compile_s["frozen"],
               "process_p50s_ms": {k: [round(r["p50_ms"], 3) for r in v] for k, v in runs.items()}}
        if "bn-folded" in forms:
            row.update(bn_folded_p50_ms=round(p50["bn-folded"], 3),
                       bn_folded_speedup=round(p50["default"] / p50["bn-folded"], 3),
                       bn_folded_compile_s=compile_s["bn-folded"])
        if "frozen-concat-linear" in forms:
            row.update(frozen_concat_linear_p50_ms=round(p50["frozen-concat-linear"], 3),
                       concat_linear_speedup_over_frozen=round(p50["frozen"] / p50["frozen-concat-linear"], 3),
                       frozen_concat_linear_compile_s=compile_s["frozen-concat-linear"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {"command": "python bench/suites/inductor_freezing.py " + " ".join(args.models)
           + f" --device {args.device} --batch {args.batch} --repeats {args.repeats}"
           + (" --bn-folded" if args.bn_folded else "") + (" --concat-linear" if args.concat_linear else ""),
           "torch": torch.__version__,
           "torchvision": torchvision.__version__, "machine": machine(args.device), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
