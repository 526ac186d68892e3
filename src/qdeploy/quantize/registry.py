"""The quantizer registry and the one entry point: ``quantize(inputs, Int8Config(...), out_path)``.

Modelled on torchao's ``quantize_(model, Int8Config(...))``: the *settings* are one config object
(:class:`qdeploy.config.Int8Config`), the *algorithm* that executes them is a registered
:class:`Quantizer` found by name. Adding a quantizer = one module with a subclass
decorated ``@register_quantizer``, imported in ``quantize/__init__.py`` (``qat`` is one: qat_quantizer.py).

Every quantizer returns a Q/DQ ONNX plus the activation ranges it used; ``quantize`` then adds what
every INT8 artifact carries: a TensorRT calibration cache and the Q/DQ structure report.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import onnx

from qdeploy.config import PLACEMENTS, Int8Config, Preprocess
from qdeploy.errors import ConfigError, QDeployError
from qdeploy.lint import lint_model, load_qdq_model, structure_line
from qdeploy.quantize.exclude import module_of_node, scope_key
from qdeploy.lint.patterns import squeeze_excitation_nodes
from qdeploy.quantize.trt_cache import write_trt_cache
from qdeploy.utils.log import log, warn


class NotApplicable(QDeployError):
    """This quantizer cannot execute these settings on this model (``auto`` then tries the next one)."""


@dataclass
class QuantizeInputs:
    """What a quantizer may use. The PyTorch model is a loader so ONNX-only runs never build one."""

    fp32_onnx: Path
    preprocess: Preprocess
    calibration: Optional[object] = None               # qdeploy.data.Batches of data.calibration
    torch_model: Optional[Callable[[], object]] = None  # () -> FP32 nn.Module (None: ONNX-only model)
    check_inputs: Optional[np.ndarray] = None          # real preprocessed images for export checks
    opset: int = 17
    dynamic_batch: bool = True
    cache_dir: Optional[Path] = None                   # ranges cache (cache_dir/calibration)
    memo: dict = field(default_factory=dict)           # statistics shared by the methods of one run
    qat: Optional[object] = None                       # qat_quantizer.QatSetup (quantizer qat only)
    calibration_identity: Optional[dict] = None        # the exact calibration images (for QAT's training fingerprint)

    @property
    def has_torch(self) -> bool:
        return self.torch_model is not None


@dataclass
class QuantResult:
    path: Path
    ranges: dict            # tensor name -> ranges.TensorRange (what the TensorRT cache holds)
    info: dict              # method, samples, cache hit, excluded layers, structure...


class Quantizer(ABC):
    name: str = ""
    description: str = ""
    automatic: bool = True  # quantizer auto may pick it (for the placements that list it: config.PLACEMENTS)

    def makes(self, placement: str) -> bool:
        """Whether this quantizer makes ``placement`` (config.PLACEMENTS[placement].quantizers)."""
        return self.name in PLACEMENTS[placement].quantizers

    def check_placement(self, cfg: Int8Config) -> None:
        """Raise NotApplicable, naming the placements this quantizer makes, when it does not make ``cfg.placement``."""
        if not self.makes(cfg.placement):
            made = " or ".join(f"{p} (for {PLACEMENTS[p].runtime})" for p in PLACEMENTS if self.makes(p))
            raise NotApplicable(f"placement {cfg.placement}: quantizer {self.name} makes placement {made} only")

    def check(self, cfg: Int8Config, has_torch: bool) -> None:
        """Raise NotApplicable when these settings cannot run with this quantizer (before any work); the placement is
        checked before, by :meth:`applicable`."""

    def applicable(self, cfg: Int8Config, has_torch: bool) -> None:
        """Raise NotApplicable when this quantizer cannot make ``cfg``: its placement, then its own :meth:`check`."""
        self.check_placement(cfg)
        self.check(cfg, has_torch)

    @abstractmethod
    def quantize(self, inputs: QuantizeInputs, cfg: Int8Config, out_path: Path) -> QuantResult: ...


QUANTIZERS: dict[str, Quantizer] = {}
AUTO = "auto"


def register_quantizer(cls: type[Quantizer]) -> type[Quantizer]:
    QUANTIZERS[cls.name] = cls()
    return cls


def get_quantizer(name: str) -> Quantizer:
    try:
        return QUANTIZERS[name]
    except KeyError:
        raise ConfigError(f"unknown quantizer '{name}' (known: {', '.join([AUTO, *sorted(QUANTIZERS)])})") from None


def candidates(cfg: Int8Config, has_torch: bool) -> list[Quantizer]:
    """Quantizers to try, in order. ``auto``: the automatic quantizers that make the placement, in the placement's
    order (config.PLACEMENTS): for TensorRT, ModelOpt on the PyTorch model (quantizes the model TensorRT users actually
    train and fine-tune), else Q/DQ inserted into the ONNX."""
    if cfg.quantizer != AUTO:
        q = get_quantizer(cfg.quantizer)
        q.applicable(cfg, has_torch)  # an explicit choice that cannot work is the user's error
        return [q]
    order = [QUANTIZERS[n] for n in PLACEMENTS[cfg.placement].quantizers if n in QUANTIZERS and QUANTIZERS[n].automatic]
    usable = []
    for q in order:
        try:
            q.applicable(cfg, has_torch)
        except NotApplicable:
            continue
        usable.append(q)
    if not usable:
        raise ConfigError(f"no registered quantizer can execute {cfg.model_dump()}")
    return usable


def quantize(inputs: QuantizeInputs, cfg: Int8Config, out_path: Path) -> QuantResult:
    """The INT8 Q/DQ ONNX of ``cfg`` at ``out_path`` (+ ``.trtcache``), with its structure report."""
    t0 = time.perf_counter()
    tried = candidates(cfg, inputs.has_torch)
    passed_over = []
    for i, quantizer in enumerate(tried):
        try:
            result = quantizer.quantize(inputs, cfg, out_path)
            break
        except NotApplicable as e:  # torch.fx cannot trace the model, the placement plan has ops ModelOpt cannot reach
            if i + 1 == len(tried):
                raise
            warn(f"quantizer {quantizer.name}: {e}; falling back to quantizer {tried[i + 1].name}")
            passed_over.append({"quantizer": quantizer.name, "reason": str(e)})
    if passed_over:  # the structure report and results.json say which quantizer gave way, and why
        result.info["quantizer_fallback"] = passed_over
    return finish(result, cfg, out_path, quantizer.name, t0)


def excluded_nodes(qdq_model: onnx.ModelProto, excluded: Optional[list]) -> list[str]:
    """Nodes of a quantized ONNX that ``excluded_by_user`` names: ONNX node names (quantizer onnx), or module names
    (ModelOpt quantizers), which the exported nodes carry as scopes (``/model/layer1/layer1.0/conv1/Conv``). An
    onnx2torch twin's module names are its ONNX node names, '/' and all: compared with '/' read as '.'."""
    if not excluded:
        return []
    names, keys = set(excluded), {scope_key(m) for m in excluded}
    return [n.name for n in qdq_model.graph.node
            if n.name in names or (m := scope_key(module_of_node(n.name))) and m in keys]


def finish(result: QuantResult, cfg: Int8Config, out_path: Path, quantizer_name: str, t0: float) -> QuantResult:
    """What every INT8 artifact gets, whoever made it (PTQ or QAT): TensorRT cache, structure report, lint."""
    trt_cache = write_trt_cache(out_path.with_suffix(".trtcache"), result.ranges)
    qdq_model = load_qdq_model(out_path)  # read once: the lint and the explanations below share it
    report = lint_model(qdq_model, out_path.name)
    structure = report.to_dict(with_ops=True)["structure"]
    placement = PLACEMENTS[cfg.placement]
    if placement.lint_rules:
        # layers left float on purpose are explained findings, not defects
        reasons = {n: "too narrow for TensorRT's INT8 kernels (left float by the placement)"
                   for n in result.info.get("excluded_small_channel_convs") or []}
        if result.info.get("excluded_squeeze_excitation"):
            reasons.update({n: "squeeze-excitation branch kept float (NNCF's SE_BLOCK rule; accuracy)"
                            for n in squeeze_excitation_nodes(qdq_model)})
        reasons.update({n: "excluded by the config" for n in excluded_nodes(qdq_model, result.info.get("excluded_by_user"))})
        report.explain(reasons)
        lint = {k: v for k, v in report.to_dict().items() if k in ("by", "verdict", "counts", "findings")}
    else:
        lint = {"skipped": f"placement {cfg.placement}: {placement.runtime}'s CPU layout, TensorRT's rules do not apply"}
    result.info.update(quantizer=quantizer_name, placement=cfg.placement, trt_calibration_cache=str(trt_cache),
                       quantize_time_s=round(time.perf_counter() - t0, 3), structure=structure, lint=lint)
    log(f"quantize: {out_path.name} ({quantizer_name}): {structure_line(structure)}"
        + (f"; lint: {lint['verdict']}" if "verdict" in lint else ""))
    return result
