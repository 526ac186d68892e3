"""Import NVIDIA ModelOpt quietly, and turn a missing dependency of ModelOpt into a message naming it.

ModelOpt's package init imports optional packages (``huggingface_hub`` through its plugins, for one);
qdeploy declares the ones it knows of, but a ModelOpt release may add another. Then the user must
see which package to install, not a ModuleNotFoundError deep inside ModelOpt.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import warnings

from qdeploy.errors import QDeployError


class MissingDependency(QDeployError):
    """A package that a feature needs is not installed."""


def import_modelopt(module: str):
    """``importlib.import_module(module)`` for a ``modelopt.*`` module, without its CUDA/JIT notices on CPU boxes."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = e.name or str(e)
        if missing.split(".")[0] == "modelopt":
            raise MissingDependency("NVIDIA ModelOpt is not installed: pip install nvidia-modelopt") from None
        raise MissingDependency(
            f"NVIDIA ModelOpt needs the package '{missing}', which is not installed "
            f"(pip install {missing.split('.')[0].replace('_', '-')})"
        ) from None
