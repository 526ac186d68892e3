"""A vision transformer's patch embedding on the GPU: the convolution whose stride equals its kernel (no padding, no
overlap: ViT/DeiT 16x16, Swin 4x4) as cuDNN runs it, against the same arithmetic written as one matmul over the
image's patches. The question it answers: the profile of DeiT-S at batch 128 (FP16, contiguous, compiled) spent
0.84 ms of 4.7 in cuDNN's generic ``implicit_convolve_sgemm`` for what is a (128 x 196) x 768 by 768 x 384 GEMM;
if the matmul form is much faster, a rewrite of such convolutions is worth a candidate of the search.

Each (shape, batch, form): FP16, random weights, the module compiled (torch.compile default) and replayed as a CUDA
graph (torchao_speed.graph_p50_ms, qdeploy's capture), p50 of the replays; the output is timm's layout, tokens x
channels (``flatten(2).transpose(1, 2)`` after the convolution). One JSON line per row appended to --json:

    python bench/suites/patch_embed_speed.py --batches 32,128 --json F
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # qdeploy's PatchMatmul, without an install

# (kernel = stride, output channels) of the patch embeddings of the real-size suite's transformers and ViT-B
SHAPES = {"deit_small": (16, 384), "vit_base": (16, 768), "swin_tiny": (4, 96)}


def conv_tokens(x, weight, bias):
    """timm's PatchEmbed: the convolution, then its (N, C, H', W') output as (N, H' x W', C) tokens."""
    k = weight.shape[-1]
    return F.conv2d(x, weight, bias, stride=k).flatten(2).transpose(1, 2)


def matmul_tokens(weight, bias):
    """The same tokens as one matmul over the patches, as qdeploy's rewrite runs it (facts/patch_matmul.PatchMatmul,
    the module the search's patch-matmul candidate puts in place of the convolution), then timm's token layout: a
    function of x."""
    from qdeploy.facts.patch_matmul import PatchMatmul

    k = weight.shape[-1]
    conv = torch.nn.Conv2d(weight.shape[1], weight.shape[0], k, k, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight)
        conv.bias.copy_(bias)
    module = PatchMatmul(conv).eval()
    return lambda x: module(x).flatten(2).transpose(1, 2)


# form -> (a function of (weight, bias) returning the function of x timed, channels_last)
FORMS = {"conv": (lambda w, b: lambda x: conv_tokens(x, w, b), False),
         "conv channels_last": (lambda w, b: lambda x: conv_tokens(x, w, b), True),
         "matmul": (matmul_tokens, False)}


def row(shape: str, batch: int, form: str, size: int = 224) -> dict:
    from torchao_speed import graph_p50_ms

    k, out_channels = SHAPES[shape]
    make, channels_last = FORMS[form]
    torch.manual_seed(0)
    weight = torch.randn(out_channels, 3, k, k, device="cuda", dtype=torch.float16) * 0.05
    bias = torch.randn(out_channels, device="cuda", dtype=torch.float16)
    x = torch.randn(batch, 3, size, size, device="cuda", dtype=torch.float16)
    if channels_last:
        x, weight = (t.contiguous(memory_format=torch.channels_last) for t in (x, weight))
    # Every row's lambda is one code object, so one Dynamo cache; each row adds two entries (the compile here and the
    # graph capture's input), and past Dynamo's recompile limit (8) later rows would run eagerly, silently
    torch.compiler.reset()
    with torch.inference_mode():
        compiled = torch.compile(make(weight, bias))
        got = compiled(x)
        want = conv_tokens(x.contiguous(), weight.contiguous(), bias)
        p50 = graph_p50_ms(compiled, x)
    return {"shape": shape, "kernel": k, "out_channels": out_channels, "batch": batch, "form": form,
            "p50_ms": round(p50, 4), "max_abs_diff_vs_conv": float((got.float() - want.float()).abs().max()),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("patch_embed_speed.py: no CUDA GPU here")
    for shape in args.shapes.split(","):
        for batch in map(int, args.batches.split(",")):
            for form in FORMS:
                r = row(shape, batch, form)
                print(json.dumps(r), flush=True)
                with args.json.open("a") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
