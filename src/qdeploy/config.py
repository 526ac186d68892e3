"""The run configuration: one strict, typed schema for YAML files and for the Python API.

Unknown keys and wrong types are rejected with the key's full path (``bench.warmpu: unknown key
(did you mean 'warmup'?)``) instead of being silently ignored: a typo in a deployment config must not
quietly change what gets measured.
"""
from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qdeploy.errors import ConfigError

Task = Literal["classification", "segmentation"]
Precision = Literal["fp32", "fp16", "bf16", "int8"]
Size = Union[int, tuple[int, int]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class Preprocess(_Strict):
    """Image → tensor. Pixels are scaled to [0, 1], then ``(x - mean) / std`` per channel.

    Geometry, in order: ``resize`` (an int resizes the shorter side, keeping aspect ratio, like
    torchvision; ``[H, W]`` resizes exactly), then a centre ``crop``. When neither is given and
    ``input_size`` is, images are resized exactly to ``input_size``.
    """

    input_size: Optional[tuple[int, int]] = Field(None, description="[H, W] the model is fed")
    resize: Optional[Size] = None
    crop: Optional[Size] = None
    mean: list[float] = Field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: list[float] = Field(default_factory=lambda: [1.0, 1.0, 1.0])
    mode: Literal["RGB", "L"] = "RGB"
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"

    @model_validator(mode="after")
    def _check(self) -> "Preprocess":
        channels = 1 if self.mode == "L" else 3
        for key in ("mean", "std"):
            values = getattr(self, key)
            if len(values) != channels:
                raise ValueError(f"{key} needs {channels} values for mode {self.mode}, got {len(values)}")
        if any(s == 0 for s in self.std):
            raise ValueError("std must not contain 0")
        if self.input_size is None:
            derived = _as_hw(self.crop) or (_as_hw(self.resize) if not isinstance(self.resize, int) else None)
            if derived is None:
                raise ValueError("input_size is required unless crop or resize [H, W] fixes it")
            self.__dict__["input_size"] = derived
        return self

    @property
    def channels(self) -> int:
        return 1 if self.mode == "L" else 3


def _as_hw(size: Optional[Size]) -> Optional[tuple[int, int]]:
    if size is None:
        return None
    if isinstance(size, int):
        return (size, size)
    return (int(size[0]), int(size[1]))


class ModelSpec(_Strict):
    """Where the model comes from and how to feed it (see ``qdeploy.models``)."""

    source: str = Field(description="torchvision:NAME | timm:NAME | file.py:factory | pkg.module:factory | model.onnx")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: Optional[str] = Field(None, description="state_dict file, or pkg:PACKAGE/path for weights shipped in a package")
    weights_key: Optional[str] = Field(None, description="take the state_dict from this key of the checkpoint")
    task: Task = "classification"
    output: Optional[Union[str, int]] = Field(None, description="key/index to take when the model returns a dict/tuple")
    preprocess: Preprocess


class DatasetSpec(_Strict):
    format: Literal["imagefolder", "segnet"] = "imagefolder"
    root: str
    classes: Optional[str] = Field(None, description="class-list file: one class per line in index order, first word = folder name")
    class_names: Optional[list[str]] = Field(None, description="names in label-index order (alternative to a classes file)")
    split: str = Field("test", description="segnet: the split folder (test → test/ + testannot/)")
    ignore_index: int = Field(255, description="segmentation label that is excluded from metrics")
    count: Optional[int] = Field(None, gt=0, description="seeded random subset of this many samples")
    seed: int = 0
    complement: bool = Field(False, description="take every sample except the seeded `count` subset (disjoint eval/calibration splits of one folder)")
    batch_size: int = Field(32, gt=0)
    workers: Optional[int] = Field(None, ge=0, description="decoding worker processes (default: min(4, CPUs))")


class DataConfig(_Strict):
    eval: DatasetSpec
    calibration: Optional[DatasetSpec] = None


class VariantSpec(_Strict):
    engine: Literal["torch", "onnxruntime"]
    precision: Precision = "fp32"
    name: Optional[str] = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: Optional[int] = Field(None, gt=0, description="CPU threads (torch.set_num_threads / ORT intra-op)")
    # torch only
    channels_last: bool = False
    cuda_graphs: bool = False
    compile: Union[bool, Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = False
    # onnxruntime only
    providers: Optional[list[str]] = None
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    # int8 only
    calibrator: Literal["max", "entropy", "percentile", "mse"] = "entropy"
    percentile: float = Field(99.99, gt=0, le=100, description="for calibrator: percentile")
    target: Literal["onnxruntime", "tensorrt"] = Field(
        "onnxruntime", description="INT8 artifact: onnxruntime = ORT-fast QDQ (uint8 act.); tensorrt = TensorRT-style symmetric Q/DQ (simulated in ORT)")
    exclude: list[str] = Field(default_factory=list, description="regexes on layer (node) names kept in float")
    exclude_ops: list[str] = Field(default_factory=list, description="op types kept in float, e.g. [Resize, Gemm]")
    calibration_cache: Optional[str] = Field(None, description="existing TensorRT calibration cache to take ranges from")
    quantizer: Literal["auto", "modelopt", "onnx"] = Field(
        "auto", description="target tensorrt: modelopt = ModelOpt on the PyTorch model (auto for PyTorch models), onnx = Q/DQ inserted into the ONNX")

    @model_validator(mode="after")
    def _engine_options(self) -> "VariantSpec":
        torch_only = {"channels_last": False, "cuda_graphs": False, "compile": False}
        ort_only = {"providers": None, "graph_optimization": "all"}
        int8_only = {"calibrator": "entropy", "percentile": 99.99, "target": "onnxruntime", "exclude": [], "exclude_ops": [],
                     "calibration_cache": None, "quantizer": "auto"}
        wrong = dict(torch_only if self.engine != "torch" else ort_only)
        if self.precision != "int8":
            wrong.update(int8_only)
        for key, default in wrong.items():
            if getattr(self, key) != default:
                why = f"engine '{self.engine}'" if key not in int8_only else f"precision '{self.precision}' (only int8)"
                raise ValueError(f"option '{key}' does not apply to {why}")
        if self.quantizer == "modelopt" and (self.target != "tensorrt" or self.calibration_cache or self.exclude_ops):
            raise ValueError("quantizer 'modelopt' produces target tensorrt from calibration (no calibration_cache / exclude_ops; use exclude)")
        if self.precision == "int8" and self.engine != "onnxruntime":
            raise ValueError(
                "precision int8 runs on engine onnxruntime (target: onnxruntime or tensorrt); "
                "PyTorch INT8 through ModelOpt is not implemented yet"
            )
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.engine, self.precision]
        if self.precision == "int8":
            parts += (["trt"] if self.target == "tensorrt" else []) + [self.calibrator if not self.calibration_cache else "trtcache"]
            if self.quantizer != "auto":
                parts.insert(-1, self.quantizer)
            if self.calibrator == "percentile" and self.percentile != 99.99:
                parts[-1] += f"{self.percentile:g}"
            if self.exclude or self.exclude_ops:
                parts.append("partial")
        if self.device != "auto":
            parts.append(self.device)
        if self.channels_last:
            parts.append("cl")
        if self.cuda_graphs:
            parts.append("cudagraph")
        if self.compile:
            parts.append("compile" if self.compile is True else f"compile-{self.compile}")
        return "-".join(parts)


class VerifySpec(_Strict):
    atol: float = Field(1e-4, ge=0)
    rtol: float = Field(1e-3, ge=0, description="relative to max |reference output|")
    min_cosine: float = Field(0.9999, ge=-1, le=1)
    samples: int = Field(8, gt=0, description="real evaluation images fed to both models")


class ExportSpec(_Strict):
    opset: int = Field(17, ge=11)
    dynamic_batch: bool = True
    dynamic_hw: bool = False
    exporter: Literal["auto", "dynamo", "torchscript"] = "auto"
    verify: VerifySpec = Field(default_factory=VerifySpec)
    cache: bool = True


class BenchSpec(_Strict):
    enabled: bool = True
    batch_sizes: list[int] = Field(default_factory=lambda: [1])
    warmup: int = Field(10, ge=0)
    iterations: int = Field(100, gt=0)

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(b <= 0 for b in v):
            raise ValueError("batch_sizes must be a non-empty list of positive integers")
        return v


class EvalSpec(_Strict):
    enabled: bool = True
    reference: Optional[str] = Field(None, description="variant name that agreement is measured against (default: first FP32 variant)")


class RunConfig(_Strict):
    model: ModelSpec
    data: DataConfig
    variants: list[VariantSpec] = Field(default_factory=lambda: [VariantSpec(engine="torch"), VariantSpec(engine="onnxruntime")])
    export: ExportSpec = Field(default_factory=ExportSpec)
    bench: BenchSpec = Field(default_factory=BenchSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)

    @model_validator(mode="after")
    def _unique_names(self) -> "RunConfig":
        seen: dict[str, int] = {}
        for i, v in enumerate(self.variants):
            if v.label in seen:
                raise ValueError(f"variants[{i}] and variants[{seen[v.label]}] are both named '{v.label}': give one a 'name'")
            seen[v.label] = i
        return self


# ---------------------------------------------------------------------------------------------
# Loading

def _format_loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names valid at ``loc`` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return []
        current = _model_in(field.annotation)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def format_validation_error(err: ValidationError, source: str, schema: type[BaseModel] = None) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p in {"function-after[_check()]"}))
        where = _format_loc(loc)
        if e["type"] == "extra_forbidden":
            hint = ""
            if schema is not None and loc:
                close = difflib.get_close_matches(str(loc[-1]), _known_keys(schema, loc), n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{where}: unknown key{hint}")
        elif e["type"] == "missing":
            lines.append(f"{where}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            got_s = f" (got {got!r})" if e["type"] not in ("value_error",) and not isinstance(got, (dict, list)) else ""
            lines.append(f"{where}: {msg}{got_s}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def parse_config(data: dict, source: str = "<dict>") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, RunConfig)) from None


def _looks_like_path(source: str) -> bool:
    return source.endswith(".onnx") or ".py:" in source or source.endswith(".py")


def _resolve_paths(data: dict, base: Path) -> dict:
    """Make relative paths in the config relative to the config file, not to the current directory."""

    def fix(p: Any) -> Any:
        if isinstance(p, str) and p and not p.startswith("pkg:") and not Path(p).expanduser().is_absolute():
            return str((base / p).resolve())
        return p

    model = data.get("model")
    if isinstance(model, dict):
        src = model.get("source")
        if isinstance(src, str) and _looks_like_path(src):
            path, sep, factory = src.rpartition(":") if ".py:" in src else (src, "", "")
            model["source"] = str(Path(fix(path)).expanduser()) + (sep + factory if sep else "")
        if isinstance(model.get("weights"), str):
            model["weights"] = fix(model["weights"])
    for variant in data.get("variants") or []:
        if isinstance(variant, dict) and isinstance(variant.get("calibration_cache"), str):
            variant["calibration_cache"] = fix(variant["calibration_cache"])
    d = data.get("data")
    if isinstance(d, dict):
        for part in d.values():
            if isinstance(part, dict):
                for key in ("root", "classes"):
                    if isinstance(part.get(key), str):
                        part[key] = fix(part[key])
    return data


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty")
    if isinstance(data, dict):
        data = _resolve_paths(data, path.resolve().parent)
    return parse_config(data, str(path))
