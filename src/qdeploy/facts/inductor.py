"""The Inductor settings a compiled PyTorch program is compiled under: one home for the engine that times it, the saved
program's compile cache and its loader (which reads them from the manifest), so all three compile the same program.

Freezing (``torch._inductor.config.freezing``) treats the weights as constants of an inference program: Inductor folds
BatchNorm into the convolution before it (conv-BN folding), folds every computation on weights alone (casts,
transposes, concatenations) once at compile time, and on the CPU packs weights for oneDNN and fuses convolutions and
matmuls with what follows them. It is PyTorch's own inference setting (its Inductor inference benchmarks run with
``--freezing``), not torch.compile's default, so a hand-written ``torch.compile`` does not have it. It needs grad off
(qdeploy compiles under inference mode) and the weights never changing after the compile (a deployed program's).
"""
from __future__ import annotations

from typing import Optional

from qdeploy.facts.torchao import inductor_config as torchao_inductor_config

FREEZING = {"freezing": True}


def program_inductor_config(torchao: Optional[str] = None, freezing: bool = False) -> dict:
    """The Inductor settings of a program quantized with the torchao scheme ``torchao`` (None: none) and compiled with
    or without freezing ({}: Inductor's defaults)."""
    return {**torchao_inductor_config(torchao), **(FREEZING if freezing else {})}
