"""Build a PyTorch model from a source string, load its weights, select its output.

Sources (a small registry, in the spirit of timm's):
  ``torchvision:NAME``      torchvision.models.get_model(NAME, **kwargs)
  ``timm:NAME``             timm.create_model(NAME, pretrained=False, **kwargs)
  ``path/to/file.py:fn``    fn(**kwargs) from a Python file
  ``package.module:fn``     fn(**kwargs) from an importable module (``fn`` may be dotted: ``Class.from_name``)
  ``model.onnx``            not a PyTorch model: only ONNX-based engines can run it
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torchvision
from torch import nn

from qdeploy.config import ModelSpec
from qdeploy.errors import ModelError
from qdeploy.utils.hashing import sha256_file, sha256_json

_FACTORY_SOURCES: dict[str, Callable[[str, dict], nn.Module]] = {}


def register_source(prefix: str):
    """Register a ``prefix:NAME`` model source (e.g. ``torchvision``)."""

    def deco(fn):
        _FACTORY_SOURCES[prefix] = fn
        return fn

    return deco


@register_source("torchvision")
def _torchvision(name: str, kwargs: dict) -> nn.Module:
    try:
        return torchvision.models.get_model(name, **kwargs)
    except ValueError as e:  # unknown name
        raise ModelError(f"torchvision:{name}: {e}") from None


@register_source("timm")
def _timm(name: str, kwargs: dict) -> nn.Module:
    try:
        import timm
    except ImportError:
        raise ModelError(f"timm:{name}: timm is not installed (pip install 'qdeploy[timm]')") from None
    kwargs = {"pretrained": False, **kwargs}
    try:
        return timm.create_model(name, **kwargs)
    except RuntimeError as e:
        raise ModelError(f"timm:{name}: {e}") from None


def is_onnx_source(source: str) -> bool:
    return source.lower().endswith(".onnx")


def resolve_factory(source: str) -> Callable[..., Any]:
    """Return the callable that builds the model described by ``source``."""
    prefix, sep, name = source.partition(":")
    if sep and prefix in _FACTORY_SOURCES:
        return lambda **kw: _FACTORY_SOURCES[prefix](name, kw)
    module_part, sep, attr = source.rpartition(":")
    if not sep or not attr:
        raise ModelError(
            f"model source '{source}' is not one of torchvision:NAME, timm:NAME, file.py:factory, "
            "package.module:factory or a .onnx file"
        )
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        module = _import_file(Path(module_part).expanduser())
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ModelError(f"model source '{source}': cannot import module '{module_part}': {e}") from None
    factory = module
    for part in attr.split("."):  # dotted paths reach class methods, e.g. pkg:EfficientNet.from_name
        factory = getattr(factory, part, None)
    if factory is None:
        raise ModelError(f"model source '{source}': '{module_part}' has no attribute '{attr}'")
    if not callable(factory):
        raise ModelError(f"model source '{source}': '{attr}' is a {type(factory).__name__}, not a callable factory")
    return factory


def _import_file(path: Path):
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")
    name = f"qdeploy_user_model_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelError(f"model file {path} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # user code: report where it broke, not our stack
        del sys.modules[name]
        raise ModelError(f"model file {path} failed to import: {type(e).__name__}: {e}") from None
    return module


class SelectOutput(nn.Module):
    """Reduce a model's dict/tuple output to one tensor, so every engine and the ONNX graph see one output."""

    def __init__(self, model: nn.Module, key: str | int | None):
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x):
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, dict):
            if self.key is None:
                if len(out) == 1:
                    return next(iter(out.values()))
                raise ModelError(f"the model returns a dict with keys {list(out)}: set model.output to one of them")
            if self.key not in out:
                raise ModelError(f"model.output '{self.key}' is not among the model's output keys {list(out)}")
            return out[self.key]
        if isinstance(out, (tuple, list)):
            key = 0 if self.key is None else self.key
            if not isinstance(key, int) or not -len(out) <= key < len(out):
                raise ModelError(f"model.output {self.key!r} is not a valid index into the model's {len(out)} outputs")
            return out[key]
        raise ModelError(f"the model returns {type(out).__name__}; expected a tensor, dict or tuple")


def resolve_weights_path(weights: str | Path) -> Path:
    """A filesystem path, or ``pkg:PACKAGE/relative/file`` for weights shipped inside an installed package."""
    weights = str(weights)
    if weights.startswith("pkg:"):
        package, _, rel = weights[4:].partition("/")
        try:
            return Path(str(importlib.resources.files(package) / rel))
        except ModuleNotFoundError:
            raise ModelError(f"weights {weights}: package '{package}' is not installed") from None
    return Path(weights).expanduser()


def _read_checkpoint(path: Path, key: str | None) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelError(f"weights file {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelError(f"weights file {path} cannot be read as a PyTorch state_dict: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if key is not None:
        if not isinstance(ckpt, dict) or key not in ckpt:
            raise ModelError(f"weights file {path} has no key '{key}' (model.weights_key)")
        ckpt = ckpt[key]
    elif isinstance(ckpt, dict) and not any(isinstance(v, torch.Tensor) for v in ckpt.values()):
        # common training checkpoints wrap the state_dict
        for candidate in ("state_dict", "model", "model_state_dict", "ema"):
            if isinstance(ckpt.get(candidate), dict):
                ckpt = ckpt[candidate]
                break
    if not isinstance(ckpt, dict) or not ckpt:
        raise ModelError(f"weights file {path} does not hold a state_dict (a mapping of parameter names to tensors)")
    # DataParallel / DDP checkpoints prefix every key with 'module.'
    if all(k.startswith("module.") for k in ckpt):
        ckpt = {k[len("module."):]: v for k, v in ckpt.items()}
    return ckpt


def load_state_dict_checked(model: nn.Module, path: str | Path, key: str | None = None) -> None:
    """Load weights, and if they do not fit, say exactly which keys are missing, unexpected or mis-shaped."""
    path = resolve_weights_path(path)
    state = _read_checkpoint(path, key)
    expected = model.state_dict()
    # BatchNorm's step counter is not a weight and many published checkpoints omit it
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    mis_shaped = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or mis_shaped:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mis_shaped)):
            if items:
                more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
                parts.append(f"{label}: {', '.join(items[:5])}{more}")
        raise ModelError(f"weights {path} do not match the model architecture: " + "; ".join(parts))
    model.load_state_dict(state, strict=False)  # every key was checked above


def build_torch_model(spec: ModelSpec) -> nn.Module:
    """Build the model in eval mode on CPU in FP32, weights loaded, reduced to a single output tensor."""
    if is_onnx_source(spec.source):
        raise ModelError(f"model source {spec.source} is an ONNX file, not a PyTorch model")
    factory = resolve_factory(spec.source)
    try:
        model = factory(**spec.kwargs)
    except ModelError:
        raise
    except TypeError as e:
        raise ModelError(f"model source '{spec.source}': factory rejected kwargs {spec.kwargs}: {e}") from None
    except Exception as e:
        raise ModelError(f"model source '{spec.source}': factory failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model source '{spec.source}' returned a {type(model).__name__}, not a torch.nn.Module")
    if spec.weights:
        load_state_dict_checked(model, spec.weights, spec.weights_key)
    return SelectOutput(model, spec.output).eval()


def state_fingerprint(model: nn.Module) -> str:
    """Hash of the module's parameters and buffers: catches randomly initialised models (no weights file),
    whose spec alone would map two different networks to one cached artifact."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(spec: ModelSpec, model: nn.Module | None = None) -> str:
    """Identity of the FP32 model: its spec, the weights file's bytes (else the module's state), its code file."""
    payload = {"spec": spec.model_dump(mode="json")}
    if spec.weights:
        payload["weights_sha256"] = sha256_file(resolve_weights_path(spec.weights))
    elif model is not None:
        payload["state_sha256"] = state_fingerprint(model)
    module_file = spec.source.rpartition(":")[0]
    if module_file.endswith(".py") and Path(module_file).is_file():
        payload["code_sha256"] = sha256_file(Path(module_file))
    return sha256_json(payload)
