"""A convolution whose stride equals its kernel (no padding, no overlap: the patch embedding of ViT/DeiT, 16x16, and of
Swin, 4x4; ConvNeXt's stem and downsampling layers) is one matmul over the image's patches: each k x k patch is a row,
the weight flattened to (C_out, C_in x k x k) the matrix. The arithmetic is the same (sums in another order).

Why a PyTorch candidate rewrites it: on a GPU, cuDNN runs such a convolution with a generic kernel far below what the
same GEMM reaches in cuBLAS. DeiT-S's patch embedding at batch 128 (FP16, 224 px, compiled, CUDA graph, H200) ran
0.857 ms as a contiguous convolution (``implicit_convolve_sgemm``, 18 % of the whole model's 4.79 ms), 0.533 ms in
channels_last (a CUTLASS fprop kernel) and 0.099 ms as the matmul (docs/results/patch_embed_gpu.jsonl); the whole
DeiT-S, compiled with a CUDA graph in BF16, ran 1.350 / 4.537 ms at batch 32 / 128 and 1.171 / 3.848 ms rewritten
(its search on the H200, docs/gpu.md). On the CPU (2 Xeon cores, FP32, batch 1, compiled) the whole DeiT-S ran
73.9 ms and 70.5 ms rewritten (1.05x). Whether a model gains depends on the share its patch convolutions have (Swin-T's
4x4 one is ~2.5 % of its time at batch 128), so the search compiles the rewrite as a candidate of its own and times it.

A 1x1 convolution with stride 1 is left alone: it is a matmul already, and the libraries run it as one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchMatmul(nn.Module):
    """``conv`` (stride = kernel, no padding, dilation 1, one group) as a matmul over its input's patches. Input and
    output are the convolution's: (N, C, H, W) in, (N, C_out, H // kh, W // kw) out (laid out channels-last in memory,
    which is what a following ``flatten(2).transpose(1, 2)`` to tokens reads without a copy). Like the convolution it
    ignores the rows and columns past the last whole patch."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = self.stride = tuple(conv.kernel_size)
        self.weight = nn.Parameter(conv.weight.detach().reshape(conv.out_channels, -1).clone(),
                                   requires_grad=conv.weight.requires_grad)
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone(),
                                                                requires_grad=conv.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        kh, kw = self.kernel_size
        ho, wo = h // kh, w // kw
        if ho * kh != h or wo * kw != w:
            x = x[:, :, : ho * kh, : wo * kw]
        patches = x.reshape(n, c, ho, kh, wo, kw).permute(0, 2, 4, 1, 3, 5).reshape(n, ho * wo, c * kh * kw)
        return F.linear(patches, self.weight, self.bias).reshape(n, ho, wo, self.out_channels).permute(0, 3, 1, 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size} (as one matmul)"


def is_patch_convolution(m: nn.Module) -> bool:
    """Whether ``m`` is a 2-D convolution that is one matmul over non-overlapping patches."""
    if type(m) is not nn.Conv2d:  # a subclass may change forward (weight standardisation, padding-same variants)
        return False
    k = tuple(m.kernel_size)
    return (tuple(m.stride) == k and k != (1, 1) and m.groups == 1 and tuple(m.dilation) == (1, 1)
            and m.padding in ((0, 0), 0, "valid"))


def patch_convolutions(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s convolutions that the rewrite replaces."""
    return [name for name, m in model.named_modules() if name and is_patch_convolution(m)]


def patch_matmul_by_default(model=None) -> bool:
    """Whether optimize tries the rewrite when optimize.patch_matmul is unset: for a model (torch.nn.Module; None: not
    known) with a patch convolution, on either device (PATCH_MATMUL_WHY)."""
    return model is not None and bool(patch_convolutions(model))


def replace_modules(model: nn.Module, names: list[str], make) -> list[str]:
    """Replace, in place, each module of ``model`` named in ``names`` by ``make(module)``; returns ``names``."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))
    return names


def rewrite_patch_convolutions(model: nn.Module) -> list[str]:
    """Replace, in place, every patch convolution of ``model`` by its PatchMatmul; returns their names."""
    return replace_modules(model, patch_convolutions(model), PatchMatmul)
