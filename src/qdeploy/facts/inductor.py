"""The Inductor settings a compiled PyTorch program is compiled under: one home for the engine that times it, the saved
program's compile cache and its loader (which reads them from the manifest), so all three compile the same program.

Freezing (``torch._inductor.config.freezing``) treats the weights as constants of an inference program: Inductor folds
BatchNorm into the convolution before it (conv-BN folding), folds every computation on weights alone (casts,
transposes, concatenations) once at compile time, and on the CPU packs weights for oneDNN and fuses convolutions and
matmuls with what follows them. It is PyTorch's own inference setting (its Inductor inference benchmarks run with
``--freezing``), not torch.compile's default, so a hand-written ``torch.compile`` does not have it. It needs grad off
(qdeploy compiles under inference mode) and the weights never changing after the compile (a deployed program's).
A saved frozen program in the exported format pays more at its first call in a fresh process than an unfrozen one:
AOTAutograd's cache refuses a graph compiled with freezing, so the fresh process traces it and runs freezing's passes
again, and only Inductor's generated code can come from the saved cache; on the CPU not even that (weights packed for
oneDNN do not pickle: ``torch.compiler.save_cache_artifacts`` saves nothing). An AOTInductor package is compiled once,
when it is saved.
"""
from __future__ import annotations

from typing import Optional

from qdeploy.facts.torchao import inductor_config as torchao_inductor_config

FREEZING = {"freezing": True}

# Where optimize tries a frozen candidate unless optimize.freezing says otherwise. On the CPU freezing is what lets
# Inductor pack weights for oneDNN and fuse convolutions with what follows (torchvision ResNet-50 1.32x,
# MobileNetV3-Large 1.23x, EfficientNet-B0 1.14x at 224, batch 1, 2 Xeon cores: docs/results/inductor_freezing_cpu.json).
# On a GPU the gain goes with BatchNorm, what freezing folds into the convolution before it: the same three models
# (FP16, channels_last, CUDA graph, batch 32 at 224 on an H200) ran 1.155x / 1.145x / 1.145x frozen
# (docs/results/inductor_freezing_gpu.json), while ConvNeXt-femto, whose norms are LayerNorms (nothing to fold), ran
# 1.007x / 0.987x at batch 1 / 32 on an H100 (docs/gpu.md). A GPU search therefore spends the compile only on a model
# with a BatchNorm; the saved frozen program's first call in a fresh process costs more (above: ResNet-50 15.8 s at
# batch 1 against 5.7 s unfrozen on the H200), which the confirm run's first call records.
FREEZING_GPU_WHY = ("not tried by default on a GPU for a model without BatchNorm, or with no PyTorch model to look at "
                    "(facts/inductor.freezing_by_default: on a GPU the gain went with the BatchNorms freezing folds "
                    "into convolutions, 1.15x on three BatchNorm CNNs, ~1.0x on a LayerNorm ConvNeXt); "
                    "optimize.freezing: true tries it")


def has_batchnorm(model) -> bool:
    """Whether ``model`` (a torch.nn.Module) holds a BatchNorm layer, which freezing folds into the convolution before
    it: PyTorch's (and its subclasses: timm's BatchNormAct2d, SyncBatchNorm) or a frozen one, a scale and shift from
    buffers, as torchvision's, timm's and detectron2's detection backbones write it (each its own class, so known by
    name; Inductor folds its multiply and add into the convolution's weights as it does a BatchNorm's)."""
    from torch import nn

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).__name__.startswith("FrozenBatchNorm")
               for m in model.modules())


def freezing_by_default(device: str, model=None) -> bool:
    """Whether optimize tries a frozen candidate when optimize.freezing is unset: on the CPU always, on a GPU for a
    model (torch.nn.Module; None: not known) with a BatchNorm."""
    if device != "cuda":
        return True
    return model is not None and has_batchnorm(model)


def program_inductor_config(torchao: Optional[str] = None, freezing: bool = False) -> dict:
    """The Inductor settings of a program quantized with the torchao scheme ``torchao`` (None: none) and compiled with
    or without freezing ({}: Inductor's defaults)."""
    return {**torchao_inductor_config(torchao), **(FREEZING if freezing else {})}
