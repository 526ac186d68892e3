"""The engine interface, each engine's capability declaration, and the registry built from them.

An engine class declares, as class attributes, what the rest of qdeploy derives from it:
  ``name``          the ``engine:`` value in configs
  ``Options``       a strict pydantic model of its own options (flat keys in a variant's YAML)
  ``precisions``    precisions it can run; ``devices``: devices it can run on
  ``probe()``       rows for ``qdeploy doctor``: per device, usable here or not and why
  ``check()``       VariantUnavailable when this machine/model cannot run a variant (before anything is built)
  ``artifact()``    which artifact the build stage must make for a variant
  ``speed_is_deployment()``  False when the timing is not the deployment engine's (e.g. TensorRT Q/DQ in ORT)

An instance runs one built artifact: ``load / infer / prepare_timed / synchronize / timer / describe``.
Adding an engine = one module with a subclass decorated ``@register_engine``, imported in engines/__init__.py.
"""
from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from qdeploy.artifacts import Artifact, ArtifactRequest
from qdeploy.config import Int8Config, RunConfig, VariantSpec, format_validation_error
from qdeploy.errors import ConfigError
from qdeploy.quantize import get_quantizer

ENGINES: dict[str, type["Engine"]] = {}


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


def register_engine(cls: type["Engine"]) -> type["Engine"]:
    ENGINES[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Variant:
    """A config variant resolved against its engine: typed options, a unique label, the artifact it needs."""

    spec: VariantSpec
    label: str
    engine: type["Engine"]
    options: BaseModel
    index: int

    @property
    def precision(self) -> str:
        return self.spec.precision

    @property
    def int8(self) -> Optional[Int8Config]:
        return self.spec.int8

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def threads(self) -> Optional[int]:
        return self.spec.threads

    def artifact_request(self) -> ArtifactRequest:
        return self.engine.artifact(self)


class Engine(ABC):
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoOptions
    precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    # ---------------------------------------------------------------- capability (class level)
    @classmethod
    @abstractmethod
    def probe(cls) -> list[dict]:
        """``[{engine, device, precisions: [..], usable: bool, note}]`` for this machine."""

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        """Raise VariantUnavailable when ``variant`` cannot run here (no GPU, no provider, no PyTorch model)."""

    @classmethod
    def check_options(cls, spec, options: BaseModel, where: str) -> None:
        """Raise ConfigError when an option does not fit the variant's other keys (an option only some precisions
        take); checked when the config is read, on any machine."""

    @classmethod
    @abstractmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest: ...

    @classmethod
    def speed_is_deployment(cls, variant: Variant) -> bool:
        return True

    @classmethod
    def note(cls, variant: Variant) -> Optional[str]:
        """A caveat shown next to the variant's numbers in every table (e.g. 'simulated INT8')."""
        return None

    # ---------------------------------------------------------------- running one artifact
    def __init__(self, variant: Variant, artifact: Artifact):
        self.variant = variant
        self.artifact = artifact
        self.options = variant.options
        self.device = "cpu"

    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def infer(self, batch: np.ndarray) -> np.ndarray:
        """float32 NCHW numpy in → float32 numpy out (evaluation)."""

    @abstractmethod
    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        """Stage ``batch`` where the engine reads it; return a zero-argument callable running one inference."""

    def synchronize(self) -> None:
        pass

    def timer(self) -> Optional["CudaTimer"]:
        """A device timer when the engine runs on a GPU (None: use the host clock)."""
        return None

    @abstractmethod
    def describe(self) -> dict: ...

    def close(self) -> None:
        pass


class CudaTimer:
    """Time one call with CUDA events on the current stream, waiting for it to finish.

    Events bracket exactly the device work that the call enqueues (plus any launch gaps), and the
    synchronize makes each sample the latency of one complete inference, as a user would see it.
    """

    def __init__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def time_ms(self, fn: Callable[[], object]) -> float:
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


# ---------------------------------------------------------------------------------------------
# Resolving config variants against the table

def get_engine(name: str, where: str = "engine") -> type[Engine]:
    if name not in ENGINES:
        close = difflib.get_close_matches(name, list(ENGINES), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{where}: unknown engine '{name}'{hint}; engines: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def _option_tags(options: BaseModel) -> list[str]:
    """Label pieces for options set away from their defaults (``cl``, ``compile-max-autotune``...)."""
    parts = []
    for key, field in type(options).model_fields.items():
        value = getattr(options, key)
        if value == field.get_default(call_default_factory=True) or value is False or value is None:
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        tag = extra.get("label", key.replace("_", "-"))
        if value is True:
            parts.append(tag)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in value):
            parts.append(f"{tag}-" + "+".join(str(v).replace("ExecutionProvider", "") for v in value))
        elif isinstance(value, (list, tuple, dict)):  # structured (TensorRT profiles): a short stable digest, file-name safe
            import hashlib
            import json

            parts.append(f"{tag}-" + hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:6])
        else:
            parts.append(f"{tag}-{value}")
    return parts


def variant_label(spec: VariantSpec, engine: type[Engine], options: BaseModel) -> str:
    if spec.name:
        return spec.name
    parts = [spec.engine, spec.precision]
    if spec.int8 is not None:
        parts += spec.int8.label_parts()
    if spec.device != "auto":
        parts.append(spec.device)
    return "-".join(parts + _option_tags(options))


def resolve_variant(spec: VariantSpec, index: int) -> Variant:
    where = f"variants[{index}]"
    engine = get_engine(spec.engine, f"{where}.engine")
    known = set(engine.Options.model_fields)
    for key in spec.options:
        if key not in known:
            pool = list(known) + list(VariantSpec.model_fields) + list(Int8Config.model_fields)
            close = difflib.get_close_matches(key, pool, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}.{key}: not an option of engine '{engine.name}'{hint}; its options: "
                              f"{', '.join(sorted(known)) or 'none'}")
    try:
        options = engine.Options.model_validate(spec.options)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, f"{where} (engine {engine.name})", engine.Options)) from None
    if spec.precision not in engine.precisions:
        raise ConfigError(f"{where}.precision: engine '{engine.name}' runs {', '.join(engine.precisions)}, not {spec.precision}")
    if spec.device != "auto" and spec.device not in engine.devices:
        raise ConfigError(f"{where}.device: engine '{engine.name}' runs on {', '.join(engine.devices)}, not {spec.device}")
    engine.check_options(spec, options, where)
    if spec.int8 is not None and spec.int8.quantizer != "auto":
        get_quantizer(spec.int8.quantizer)  # unknown names fail now, naming the known ones
    return Variant(spec, variant_label(spec, engine, options), engine, options, index)


def resolve_variants(cfg: RunConfig, only: Optional[Iterable[str]] = None) -> list[Variant]:
    """Every config variant resolved and checked (unique labels, known reference), then ``only`` selected."""
    variants = [resolve_variant(spec, i) for i, spec in enumerate(cfg.variants)]
    seen: dict[str, int] = {}
    for v in variants:
        if v.label in seen:
            raise ConfigError(f"variants[{v.index}] and variants[{seen[v.label]}] would both be labelled '{v.label}': "
                              "give one a 'name'")
        seen[v.label] = v.index
    if cfg.eval.reference and cfg.eval.reference not in seen:
        raise ConfigError(f"eval.reference '{cfg.eval.reference}' is not one of the variants {list(seen)}")
    if only:
        only = list(only)
        unknown = [n for n in only if n not in seen]
        if unknown:
            raise ConfigError(f"--variant {', '.join(unknown)}: not in the config's variants {list(seen)}")
        variants = [v for v in variants if v.label in only]
    return variants


def create_engine(variant: Variant, artifact: Artifact) -> Engine:
    return variant.engine(variant, artifact)


def engine_table() -> list[dict]:
    """Every registered engine's probe rows (``qdeploy doctor``, results.json's environment)."""
    return [row for cls in ENGINES.values() for row in cls.probe()]
