"""The Inductor settings a compiled PyTorch program is compiled under: one home for the engine that times it, the saved
program's compile cache and its loader (which reads them from the manifest), so all three compile the same program.

Freezing (``torch._inductor.config.freezing``) treats the weights as constants of an inference program: Inductor folds
BatchNorm into the convolution before it (conv-BN folding), concatenates the weights of Linear layers called on one
input into one matmul (a separate query, key and value), folds every computation on weights alone (casts,
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
# On a GPU freezing gains where it changes the graph, and two of its passes do: it folds a BatchNorm into the
# convolution before it (the same three models, FP16, channels_last, CUDA graph, batch 32 at 224 on an H200, ran 1.155x
# / 1.145x / 1.145x frozen: docs/results/inductor_freezing_gpu.json, while ConvNeXt-femto, whose norms are LayerNorms,
# ran 1.007x / 0.987x at batch 1 / 32 on an H100: docs/gpu.md), and it concatenates the weights of two or three Linear
# layers called on one input into one matmul (torch/_inductor/fx_passes/freezing_patterns.py, addmm_patterns_init:
# weights must be constants, so only under freezing; on the CPU only with cpp.enable_concat_linear): the separate query,
# key and value projections of Hugging Face's ViT, DeiT, Swin and BEiT and of much hand-written attention (timm's and
# torchvision's already use one qkv layer): Hugging Face's ViT (DeiT-S size) and Swin-T ran 1.016x / 1.034x frozen at
# batch 32 on the H200 (docs/results/inductor_freezing_gpu_hf.json). A GPU search spends the compile on a model with
# either; the saved frozen program's first call in a fresh process costs more (above: ResNet-50 15.8 s at batch 1
# against 5.7 s unfrozen on the H200), which the confirm run's first call records.
FREEZING_GPU_WHY = ("not tried by default on a GPU for a model with neither a BatchNorm nor Linear layers sharing an "
                    "input, or with no PyTorch model to look at (facts/inductor.freezing_default: on a GPU freezing "
                    "gains where it folds a BatchNorm into a convolution, 1.15x on three BatchNorm CNNs, ~1.0x on a "
                    "LayerNorm ConvNeXt, or concatenates such Linear layers into one matmul); optimize.freezing: true "
                    "tries it")


def has_batchnorm(model) -> bool:
    """Whether ``model`` (a torch.nn.Module) holds a BatchNorm layer, which freezing folds into the convolution before
    it: PyTorch's (and its subclasses: timm's BatchNormAct2d, SyncBatchNorm) or a frozen one, a scale and shift from
    buffers, as torchvision's, timm's and detectron2's detection backbones write it (each its own class, so known by
    name; Inductor folds its multiply and add into the convolution's weights as it does a BatchNorm's)."""
    from torch import nn

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) or type(m).__name__.startswith("FrozenBatchNorm")
               for m in model.modules())


def concatenable_linears(model, example) -> list[list[str]]:
    """The groups of ``torch.nn.Linear`` layers of ``model`` that one forward on ``example`` (a batch it takes) calls on
    the same input tensor, as freezing concatenates into one matmul: Inductor's patterns take three such layers, or
    two without a bias (addmm_patterns_init registers no pair of biased ones). Found by running the model, since which
    layers share an input is the forward's doing, not the module tree's; [] where the forward fails."""
    import torch
    from torch import nn

    names = {m: n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs: dict[int, tuple] = {}  # id of an input tensor -> (the tensor, kept alive so its id is not reused; layers)

    def record(module, args):
        if args and isinstance(args[0], torch.Tensor):
            layers = inputs.setdefault(id(args[0]), (args[0], []))[1]
            if module not in layers:  # one layer called twice on a tensor is one matmul, nothing to concatenate
                layers.append(module)

    hooks = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.inference_mode():
            model(example)
    except Exception:  # noqa: BLE001 - a model this cannot run is one the rule says nothing about
        return []
    finally:
        for h in hooks:
            h.remove()
    return [[names[m] for m in layers] for _, layers in inputs.values()
            if len(layers) >= 3 or (len(layers) == 2 and all(m.bias is None for m in layers))]


def freezing_gpu_folds(model, example=None) -> list[str]:
    """What freezing would change in ``model``'s graph on a GPU, in words (none: [])."""
    folds = []
    if has_batchnorm(model):
        folds.append("BatchNorm into the convolutions before them")
    groups = concatenable_linears(model, example) if example is not None else []
    if groups:
        folds.append(f"{len(groups)} group(s) of Linear layers on one input into one matmul each (e.g. "
                     + ", ".join(groups[0]) + ")")
    return folds


def freezing_default(device: str, model=None, example=None) -> tuple[bool, list[str]]:
    """Whether optimize tries a frozen candidate when optimize.freezing is unset, and on a GPU what freezing would fold
    there (freezing_gpu_folds): on the CPU always, on a GPU for a model (torch.nn.Module; None: not known) with a
    BatchNorm or with Linear layers that ``example`` (a batch the model takes; None: not looked for) shows sharing an
    input."""
    if device != "cuda":
        return True, []
    folds = freezing_gpu_folds(model, example) if model is not None else []
    return bool(folds), folds


def program_inductor_config(torchao: Optional[str] = None, freezing: bool = False) -> dict:
    """The Inductor settings of a program quantized with the torchao scheme ``torchao`` (None: none) and compiled with
    or without freezing ({}: Inductor's defaults)."""
    return {**torchao_inductor_config(torchao), **(FREEZING if freezing else {})}
