"""Build a PyTorch model from a source string, load its weights, select its output.

Sources (a small registry, in the spirit of timm's):
  ``torchvision:NAME``      torchvision.models.get_model(NAME, **kwargs)
  ``timm:NAME``             timm.create_model(NAME, pretrained=False, **kwargs)
  ``path/to/file.py:fn``    fn(**kwargs) from a Python file
  ``package.module:fn``     fn(**kwargs) from an importable module (``fn`` may be dotted: ``Class.from_name``)
  ``model.onnx``            not a PyTorch model: only ONNX-based engines can run it
  ``model.keras`` / ``.h5`` / SavedModel folder   a Keras model, converted to ONNX (export/keras.py)
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torchvision
from torch import nn

from qdeploy.config import ModelSpec, source_format
from qdeploy.errors import ModelError
from qdeploy.utils.hashing import sha256_file, sha256_json
from qdeploy.utils.inputs import check_model_file, check_weights_file

_FACTORY_SOURCES: dict[str, Callable[[str, dict], nn.Module]] = {}


def register_source(prefix: str):
    """Register a ``prefix:NAME`` model source (e.g. ``torchvision``)."""

    def deco(fn):
        _FACTORY_SOURCES[prefix] = fn
        return fn

    return deco


@register_source("torchvision")
def _torchvision(name: str, kwargs: dict) -> nn.Module:
    known = torchvision.models.list_models()
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "torchvision.models.list_models() lists them"
        raise ModelError(f"model.source torchvision:{name}: torchvision {torchvision.__version__} has no model '{name}' ({hint})")
    try:
        return torchvision.models.get_model(name, **kwargs)
    except ValueError as e:
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
    return source_format(source) == "onnx"


def is_keras_source(source: str) -> bool:
    """A Keras model (.keras, .h5, SavedModel folder): converted to ONNX by export.keras, never built in PyTorch."""
    return source_format(source) == "keras"


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
        raise ModelError(f"model source '{source}': '{attr}' is a {type(factory).__name__}, not a callable factory: "
                         "name the function or class that builds the model")
    return factory


def _import_file(path: Path):
    check_model_file(path)
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


# What a file that is not a PyTorch checkpoint usually is, by its first bytes (the usual mix-ups: an image, an
# archive, an ONNX model or a config given as model.weights).
_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"), (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"), (b"BM", "a BMP image"),
    (b"%PDF", "a PDF document"), (b"\x1f\x8b", "a gzip archive"), (b"\x89HDF", "an HDF5 (Keras) file"),
    (b"\x93NUMPY", "a NumPy array file"), (b"7z\xbc\xaf", "a 7-Zip archive"), (b"\x7fELF", "a program (ELF binary)"),
]
_FIX = "give the file that torch.save(model.state_dict(), FILE) wrote"


def _not_a_checkpoint(path: Path, what: str, fix: str = _FIX) -> ModelError:
    return ModelError(f"weights file {path} is not a PyTorch checkpoint (it is {what}): {fix}")


def _is_safetensors(head: bytes, size: int) -> bool:
    if len(head) < 10:
        return False
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= size - 8 and head[8:9] == b"{"


def _looks_like_onnx(path: Path) -> bool:
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return False
    return model.ir_version > 0 and (len(model.graph.node) > 0 or len(model.graph.input) > 0)


def _sniff_weights(path: Path) -> str:
    """'torch' (a torch.save file: ZIP with data.pkl, or a legacy pickle), 'safetensors', or a ModelError that says
    what the file is instead; checked before torch.load, whose errors for such files are pages of unpickling advice."""
    size = path.stat().st_size
    if size == 0:
        raise ModelError(f"weights file {path} is empty (0 bytes): save the state_dict again (torch.save(model.state_dict(), FILE))")
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        import zipfile

        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError):
            raise ModelError(f"weights file {path} is truncated or damaged (its ZIP archive is incomplete): copy or save "
                             "it again") from None
        if not any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            example = next((n for n in names if not n.endswith("/")), None)
            raise _not_a_checkpoint(path, "a ZIP archive that holds no PyTorch checkpoint" + (f", e.g. {example}" if example else ""),
                                    "unpack it and give the .pt/.pth file")
        return "torch"
    if head.startswith(b"\x80"):  # pickle protocol 2+: torch.save's legacy format
        return "torch"
    if _is_safetensors(head, size):
        return "safetensors"
    for magic, what in _MAGIC:
        if head.startswith(magic):
            raise _not_a_checkpoint(path, what)
    if (head[:1] == b"\x08" or path.suffix.lower() == ".onnx") and _looks_like_onnx(path):
        raise _not_a_checkpoint(path, "an ONNX model", "give it as model.source (and remove model.weights), or give the "
                                                       "PyTorch state_dict file")
    if b"\x00" not in head:
        try:
            head.decode("utf-8")
            text = True
        except UnicodeDecodeError as e:
            text = e.start >= len(head) - 4  # a multi-byte character cut by the 4 KB window
        if text:
            first = head.decode("utf-8", "replace").strip().splitlines()[:1]
            kind = "a text file" + (f" starting '{first[0][:40]}'" if first else "")
            raise _not_a_checkpoint(path, kind)
    raise _not_a_checkpoint(path, f"an unknown format, starting with bytes {head[:4].hex(' ')}")


def _torch_load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e)
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
        if found:  # pickled Python objects, e.g. torch.save(model) instead of torch.save(model.state_dict())
            raise ModelError(f"weights file {path} holds pickled Python objects ({found.group(1)}), which qdeploy does not "
                             "unpickle (it could run code): save the weights with torch.save(model.state_dict(), FILE)") from None
        if "central directory" in text or "zip archive" in text.lower():
            raise ModelError(f"weights file {path} is a truncated or damaged PyTorch checkpoint: copy or save it again") from None
        first = (text.strip().splitlines() or [""])[0]
        first = first.split(". ")[0][:200]
        raise ModelError(f"weights file {path} cannot be read as a PyTorch checkpoint ({type(e).__name__}: {first}): "
                         f"{_FIX}") from None


def _read_checkpoint(path: Path, key: str | None) -> dict[str, torch.Tensor]:
    check_weights_file(path)
    if _sniff_weights(path) == "safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ModelError(f"weights file {path} is a safetensors file: pip install safetensors to read it") from None
        try:
            ckpt = load_file(str(path), device="cpu")
        except Exception as e:
            raise ModelError(f"weights file {path} is a damaged safetensors file: {(str(e).splitlines() or [''])[0][:200]}") from None
    else:
        ckpt = _torch_load(path)
    if key is not None:
        if not isinstance(ckpt, dict) or key not in ckpt:
            keys = ", ".join(map(str, list(ckpt)[:8])) if isinstance(ckpt, dict) else ""
            raise ModelError(f"weights file {path} has no key '{key}' (model.weights_key)" +
                             (f"; its top-level keys: {keys}" if keys else "; it is not a mapping: remove model.weights_key"))
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
        raise ModelError(f"weights {path} do not match the model architecture: " + "; ".join(parts) +
                         " (check that model.source and model.kwargs, e.g. num_classes, build the network these weights "
                         "were trained for)")
    model.load_state_dict(state, strict=False)  # every key was checked above


def build_torch_model(spec: ModelSpec) -> nn.Module:
    """Build the model in eval mode on CPU in FP32, weights loaded, reduced to a single output tensor."""
    if source_format(spec.source) != "pytorch":
        kind = {"onnx": "an ONNX", "keras": "a Keras"}[source_format(spec.source)]
        raise ModelError(f"model source {spec.source} is {kind} model, not a PyTorch model")
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
    if spec.weights_file:  # None, or weights: random (the factory's initialisation, on purpose)
        load_state_dict_checked(model, spec.weights_file, spec.weights_key)
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
    if spec.weights_file:
        payload["weights_sha256"] = sha256_file(resolve_weights_path(spec.weights_file))
    elif model is not None:
        payload["state_sha256"] = state_fingerprint(model)
    module_file = spec.source.rpartition(":")[0]
    if module_file.endswith(".py") and Path(module_file).is_file():
        payload["code_sha256"] = sha256_file(Path(module_file))
    return sha256_json(payload)
