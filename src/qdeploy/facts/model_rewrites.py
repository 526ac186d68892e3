"""The source-level rewrites a compiled PyTorch candidate may take before it is compiled, one table: the option's name
(a TorchOptions flag, a ProgramSettings field, an optimize setting) to the function that rewrites a model in place and
returns the names of the modules it replaced. The engine that times a candidate and the program that saves it both
apply them from here, so what was measured is what is saved."""
from __future__ import annotations

from typing import Callable, Iterable

from torch import nn

from qdeploy.facts.depthwise_stencil import rewrite_depthwise_convolutions
from qdeploy.facts.patch_matmul import rewrite_patch_convolutions

REWRITES: dict[str, Callable[[nn.Module], list[str]]] = {
    "patch_matmul": rewrite_patch_convolutions,            # facts/patch_matmul.py
    "depthwise_stencil": rewrite_depthwise_convolutions,   # facts/depthwise_stencil.py
}


def apply_rewrites(model: nn.Module, options: Iterable[str]) -> dict[str, list[str]]:
    """Rewrite ``model`` in place with each of ``options`` (REWRITES' names, applied in REWRITES' order); returns
    {option: the modules it replaced}."""
    wanted = set(options)
    unknown = wanted - set(REWRITES)
    if unknown:
        raise ValueError(f"unknown model rewrite(s) {sorted(unknown)}; known: {sorted(REWRITES)}")
    return {name: rewrite(model) for name, rewrite in REWRITES.items() if name in wanted}
