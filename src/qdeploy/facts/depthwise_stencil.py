"""A depthwise convolution (one group per channel, one filter a group: MobileNet's, EfficientNet's 3x3 / 5x5, ConvNeXt's
7x7) written as a stencil: the sum, over the kernel's kh x kw taps, of the padded input shifted by the tap times that
tap's per-channel weight. The arithmetic is the same, summed in FP32 (each tap is cast up and the sum cast back once,
so a half-precision model does not accumulate 49 terms in half precision).

Why a compiled PyTorch candidate rewrites it: Inductor passes a convolution to cuDNN as an external kernel, and cuDNN's
depthwise kernels are far from what the operation needs. A 7x7 depthwise convolution reads its input and writes its
output once for 49 multiply-adds an element. ConvNeXt-T's 18 of them at batch 128 (FP16, channels_last, 224 px) are
13.5 G multiply-adds (0.40 ms at an H100's or H200's 67 FP32 TFLOPS) and move about 1.1 GB (0.23 ms at the H200's
4.8 TB/s), yet cuDNN's ``conv2d_c1_k1_nhwc_specialized`` took 2,252 us on the H200, 30 % of the model's 7,398 us a
forward (docs/results/realsize/gpu_b128_b8_2026-11-30/kernels_convnext_b128.json). Written as a stencil, the taps are
pointwise operations on views of one tensor, which Inductor fuses into one Triton kernel (the padding becomes masked
loads) and can fuse further with the normalization or activation that follows. PyTorch's own depthwise conv1d Triton
template reports the same gap against cuDNN in channels-last (pytorch/pytorch#175280). Measured, Inductor's fused
stencil is slower still (on an H100 ConvNeXt-T's 7x7 stencils took 4.7x cuDNN's kernel time at batch 32), so the
rewrite is an opt-in candidate the search compiles and times like any other (DEPTHWISE_STENCIL_DEFAULT_WHY);
uncompiled (eager) it is slower again (kh x kw kernel launches), so only compiled candidates take it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qdeploy.facts.patch_matmul import replace_modules


class DepthwiseStencil(nn.Module):
    """``conv`` (groups = in_channels = out_channels, zero padding) as the sum of its kh x kw shifted taps. Input and
    output are the convolution's, in the input's dtype."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.channels = conv.in_channels
        self.kernel_size, self.stride = tuple(conv.kernel_size), tuple(conv.stride)
        self.dilation, self.padding = tuple(conv.dilation), _explicit_padding(conv)
        # (kh, kw, C): one tap's per-channel weights a row, broadcast over (N, C, H, W) as (C, 1, 1)
        self.weight = nn.Parameter(conv.weight.detach()[:, 0].permute(1, 2, 0).clone(),
                                   requires_grad=conv.weight.requires_grad)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone(),
                                                                requires_grad=conv.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        top, bottom, left, right = self.padding
        n, c, h, w = x.shape
        ho = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
        wo = (w + left + right - dw * (kw - 1) - 1) // sw + 1
        # padded in the input's dtype, each tap cast up: where Inductor keeps the padded input as a buffer (read by
        # every tap), it is the input's size, not twice it in FP32
        xp = F.pad(x, (left, right, top, bottom))
        wt = self.weight.float()
        out = None
        for i in range(kh):
            for j in range(kw):
                tap = xp[:, :, i * dh: i * dh + sh * (ho - 1) + 1: sh, j * dw: j * dw + sw * (wo - 1) + 1: sw]
                term = tap.float() * wt[i, j].view(1, c, 1, 1)
                out = term if out is None else out + term
        if self.bias is not None:
            out = out + self.bias.float().view(1, c, 1, 1)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, stride={self.stride} "
                f"(depthwise, as {self.kernel_size[0] * self.kernel_size[1]} fused taps)")


def _explicit_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) zeros of ``conv``'s padding, "same" and "valid" included ("same": the extra row or
    column of an even total at the bottom / right, as PyTorch pads)."""
    if conv.padding == "valid":
        return 0, 0, 0, 0
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return total[0] // 2, total[0] - total[0] // 2, total[1] // 2, total[1] - total[1] // 2
    ph, pw = conv.padding
    return ph, ph, pw, pw


def is_depthwise_convolution(m: nn.Module) -> bool:
    """Whether ``m`` is a 2-D depthwise convolution (one channel in and one out a group) with zero padding and a
    kernel larger than 1x1 (a 1x1 one is a per-channel scale, already fused by Inductor)."""
    if type(m) is not nn.Conv2d:  # a subclass may change forward (weight standardisation, padding-same variants)
        return False
    return (m.groups == m.in_channels == m.out_channels and m.groups > 1 and tuple(m.kernel_size) != (1, 1)
            and m.padding_mode == "zeros")


def depthwise_convolutions(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s convolutions that the rewrite replaces."""
    return [name for name, m in model.named_modules() if name and is_depthwise_convolution(m)]


DEPTHWISE_STENCIL_DEFAULT_WHY = (
    "not tried unless optimize.depthwise_stencil is true: the stencils ran slower than the libraries' depthwise "
    "kernels wherever measured: on an H100 (FP16 channels_last, compiled + CUDA graph, batch 32, 224 px) ConvNeXt-T "
    "2.13x, EfficientNet-B0 1.63x, MobileNetV3-L 1.21x cuDNN's time (ConvNeXt-T's 18 7x7 convolutions: 3.23 ms of "
    "Triton stencil kernels against 0.69 ms of cuDNN's), on 2 CPU cores (FP32, batch 1) MobileNetV3-L 1.25x and "
    "ConvNeXt-atto 1.22x oneDNN's, and their compiles took 2-17x as long (docs/results/depthwise_stencil_gpu.jsonl, "
    "depthwise_stencil_cpu.jsonl)")


def depthwise_stencil_by_default(model=None, device: str = "cuda") -> bool:
    """Whether optimize tries the rewrite when optimize.depthwise_stencil is unset (DEPTHWISE_STENCIL_DEFAULT_WHY)."""
    return False


def rewrite_depthwise_convolutions(model: nn.Module) -> list[str]:
    """Replace, in place, every depthwise convolution of ``model`` by its DepthwiseStencil; returns their names."""
    return replace_modules(model, depthwise_convolutions(model), DepthwiseStencil)
