"""Quantizer ``nncf``: OpenVINO's own INT8 placement (``placement: openvino``), made by NNCF on the FP32 ONNX.

``nncf.quantize`` with its ONNX backend inserts QuantizeLinear/DequantizeLinear where OpenVINO's CPU plugin wants them
(NNCF's CPU hardware config, target_device ANY: int8 weights symmetric per output channel, activations per tensor,
unsigned after a ReLU) and calibrates the ranges itself; the Q/DQ ONNX is what engine ``openvino`` (and ONNX Runtime)
runs. Only the settings NNCF has an equivalent for are accepted: range methods mean-minmax (NNCF's default) and max,
``exclude`` and ``exclude_ops``.

``nncf`` is imported on first use only: ``import qdeploy`` stays fast and works without it (then ``check`` declines).
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from qdeploy.config import RANGE_METHODS, Int8Config
from qdeploy.errors import ConfigError, QDeployError
from qdeploy.facts.onnxruntime import nncf_overflow_fix_reason, u8s8_saturates
from qdeploy.quantize.registry import NotApplicable, QuantizeInputs, Quantizer, QuantResult, register_quantizer
from qdeploy.utils.log import log, warn


@register_quantizer
class NncfQuantizer(Quantizer):
    name = "nncf"
    description = "OpenVINO's own Q/DQ placement and ranges, made by NNCF (nncf.quantize on the ONNX; placement openvino)"

    def check(self, cfg: Int8Config, has_torch: bool) -> None:
        if importlib.util.find_spec("nncf") is None:
            raise NotApplicable("NNCF is not installed (pip install nncf)")
        if cfg.calibration_cache:
            raise NotApplicable("calibration_cache: NNCF calibrates its own ranges and cannot take them from a TensorRT "
                                "calibration cache (use placement tensorrt or onnxruntime with it)")
        if cfg.split_activations:
            raise NotApplicable("split_activations is ONNX Runtime's placement option; NNCF places the quantizers around "
                                "SiLU/hardswish by OpenVINO's own rules")
        if cfg.quantized_conv_outputs:
            raise NotApplicable("quantized_conv_outputs is ONNX Runtime's placement option; NNCF places the quantizers by "
                                "OpenVINO's own rules")
        _check_method(cfg.method)  # ConfigError: a method NNCF has no equivalent of is the user's choice, not a fallback

    def quantize(self, inputs: QuantizeInputs, cfg: Int8Config, out_path: Path) -> QuantResult:
        import onnx
        from onnxruntime.quantization.onnx_model import ONNXModel

        from qdeploy.quantize.calibrate import ranges_from_qdq
        from qdeploy.utils.atomic import atomic_path

        if inputs.calibration is None:  # before any file is read
            raise QDeployError("INT8 needs calibration images: add data.calibration to the config")
        t0 = time.perf_counter()
        nncf = _import_nncf()
        model = onnx.load(str(inputs.fp32_onnx))
        plan = NncfPlan.of(nncf, model, inputs, cfg)
        plan.log(nncf, "ONNX backend: Q/DQ ONNX")
        qmodel = plan.run(nncf, model, plan.ignored_scope(nncf), inputs.fp32_onnx)
        # NNCF inserts its Q/DQ nodes where it finds room: the ONNX spec, the checker and the engines want the nodes in
        # topological order
        ONNXModel(qmodel).topological_sort()
        onnx.checker.check_model(qmodel)
        with atomic_path(out_path) as tmp:
            onnx.save(qmodel, str(tmp))
        info = plan.info(nncf, time.perf_counter() - t0)
        log(f"quantize: NNCF done in {info['time_s']:.1f} s")
        return QuantResult(out_path, ranges_from_qdq(out_path), info)


@dataclass
class NncfPlan:
    """What qdeploy hands NNCF for one model, whichever NNCF backend runs (ONNX: a Q/DQ ONNX; OpenVINO: an INT8 IR):
    the model type, the ignored scope (the user's exclude resolved on the FP32 ONNX's node names, a detector's
    prediction head and decoding tail), the calibration images and the range estimator."""

    cfg: Int8Config
    input_name: str
    model_type: object
    attention: list
    layer_norms: list
    excluded: list
    unmatched: list
    head_convs: set
    head_tail: set
    chunk: int
    dataset_source: "_CalibrationImages"
    advanced: object
    warnings: list = field(default_factory=list)

    @classmethod
    def of(cls, nncf, model, inputs: QuantizeInputs, cfg: Int8Config) -> "NncfPlan":
        from qdeploy.lint.placement import attention_matmuls, layer_norms, nncf_schemes, prediction_head
        from qdeploy.lint.qdq_graph import QdqGraph
        from qdeploy.quantize.qdq import select_excluded
        from qdeploy.utils.onnx_graph import OnnxGraph

        if inputs.calibration is None:
            raise QDeployError("INT8 needs calibration images: add data.calibration to the config")
        graph = OnnxGraph(model)
        if len(graph.input_names) != 1:
            raise NotApplicable(f"{Path(inputs.fp32_onnx).name} has {len(graph.input_names)} inputs "
                                f"({', '.join(graph.input_names)}); quantizer nncf feeds one image input")
        input_name = graph.input_names[0]
        # NNCF's docs: model_type TRANSFORMER is for transformer models. In its source (nncf 3.4) it keeps the attention
        # output and position-encoding patterns float (MULTIHEAD_ATTENTION_OUTPUT, ROPE, SAM_PE in
        # common/graph/patterns/patterns.py), picks preset mixed (asymmetric activations, but symmetric on both inputs
        # of an activation×activation MatMul: min_max/algorithm.py) and runs SmoothQuant before the range pass
        # (post_training/pipeline.py). A LayerNorm network without attention takes it first too (a ConvNeXt collapses
        # under the default scheme, an MLP-Mixer did not): lint/placement.NNCF_TRANSFORMER_WHY.
        attention, norms = attention_matmuls(graph), layer_norms(graph)
        scheme = nncf_schemes(graph)[0].model_type if cfg.nncf_model_type == "auto" else cfg.nncf_model_type
        # qdeploy's exclude rule (module names, or regexes *searched* in node names: quantize/exclude.py) resolved here,
        # then handed to NNCF by name: NNCF's own patterns are re.match'ed (anchored), which would read "conv1" differently
        excluded, unmatched = select_excluded(model, cfg.exclude, cfg.exclude_ops)
        # a detector's prediction convs and decoding tail (lint/placement.prediction_head: the rules prediction-conv and
        # prediction-output): ignored as OpenVINO's own YOLOv8 INT8 recipe ignores the head's decoding and DFL conv
        head_convs, head_tail = prediction_head(QdqGraph(model))
        chunk = _static_batch(model, input_name)
        advanced = _advanced_parameters(cfg.method)
        if chunk > 1:
            # a static batch of N: N images per inference, statistics still per image (NNCF's batchwise statistics,
            # what it uses for any batched data loader)
            advanced.batchwise_statistics = True
        return cls(cfg, input_name, nncf.ModelType.TRANSFORMER if scheme == "transformer" else None, attention, norms,
                   excluded, unmatched, head_convs, head_tail, chunk,
                   _CalibrationImages(inputs.calibration, inputs.preprocess, chunk), advanced)

    @property
    def head(self) -> list:
        return sorted(self.head_convs | self.head_tail)

    def ignored_names(self) -> list:
        """The FP32 ONNX's node names NNCF leaves float (the user's exclude, the prediction head)."""
        return list(dict.fromkeys(self.excluded + self.head))

    def ignored_scope(self, nncf, names: Optional[list] = None):
        return nncf.IgnoredScope(names=self.ignored_names() if names is None else names,
                                 types=list(self.cfg.exclude_ops), validate=False)

    def why_transformer(self) -> str:
        """What made it a transformer model for NNCF: '2 attention matmuls, 5 LayerNorms', or the config."""
        if self.cfg.nncf_model_type != "auto":
            return "int8.nncf_model_type"
        return ", ".join(f"{len(found)} {what}" for found, what in ((self.attention, "attention matmuls"),
                                                                    (self.layer_norms, "LayerNorms")) if found)

    def log(self, nncf, backend: str) -> None:
        samples = int(self.dataset_source.batches.num_samples)
        log(f"quantize: NNCF {nncf.__version__} (OpenVINO placement, {backend}), {samples} calibration images, "
            f"method {self.cfg.method}, model_type {'transformer' if self.model_type else 'default'}"
            + (f" ({self.why_transformer()})" if self.model_type else "")
            + (f", {len(self.excluded)} nodes excluded" if self.excluded else "")
            + (f", prediction head float ({len(self.head_convs)} convs, {len(self.head_tail)} decoding nodes)"
               if self.head else "")
            + (f", {len(self.cfg.exclude_ops)} op types excluded" if self.cfg.exclude_ops else ""))

    def run(self, nncf, model, ignored, source: Path):
        """``nncf.quantize`` on ``model`` (an onnx.ModelProto or an openvino.Model: NNCF picks the backend by type)."""
        input_name = self.input_name
        with _nncf_output(nncf) as self.warnings:
            try:
                return nncf.quantize(
                    model, nncf.Dataset(self.dataset_source, lambda x: {input_name: x}),
                    # every calibration image (NNCF counts data items: one image each, or one static batch each)
                    subset_size=max(1, len(self.dataset_source)),
                    model_type=self.model_type, ignored_scope=ignored, advanced_parameters=self.advanced)
            except (nncf.ValidationError, nncf.UnsupportedModelError, nncf.UnsupportedDatasetError,
                    nncf.ParameterNotSupportedError) as e:
                raise QDeployError(f"NNCF could not quantize {Path(source).name}: {e}") from e

    def info(self, nncf, seconds: float) -> dict:
        head = self.head
        return {"method": self.cfg.method, "samples": int(self.dataset_source.batches.num_samples),
                "nncf": nncf.__version__, "model_type": "transformer" if self.model_type else None,
                "attention_matmuls": [n.name for n in self.attention],
                "layer_norms": [n.name for n in self.layer_norms],
                "ignored_scope": {"names": self.excluded, "types": list(self.cfg.exclude_ops),
                                  "patterns": list(self.cfg.exclude), **({"prediction_head": head} if head else {})},
                "excluded_by_user": self.excluded, "unmatched_patterns": self.unmatched,
                "batch_per_inference": self.chunk, "nncf_warnings": list(self.warnings), "time_s": round(seconds, 3),
                "overflow_fix": nncf_overflow_fix_reason(u8s8_saturates())}


# compute op types of an OpenVINO model (opset names), and what NNCF's OpenVINO backend puts before an INT8 one
IR_COMPUTE_TYPES = ("Convolution", "GroupConvolution", "ConvolutionBackpropData", "GroupConvolutionBackpropData", "MatMul")


def ir_names_of(onnx_names: list, ov_model) -> tuple[list, list]:
    """(the ov.Model's node names that stand for ``onnx_names``, the ONNX names with none). OpenVINO's ONNX frontend
    names each op after the ONNX node it came from, with a ``/<suffix>`` on the ops it splits a node into (a Conv with
    a bias becomes ``<name>/WithoutBiases`` and its Add ``<name>``)."""
    names = [op.get_friendly_name() for op in ov_model.get_ordered_ops()]
    found, missing = [], []
    for n in onnx_names:
        hits = [m for m in names if m == n or m.startswith(n + "/")]
        (found.extend(hits) if hits else missing.append(n))
    return list(dict.fromkeys(found)), missing


def ir_structure(ov_model) -> dict:
    """How many compute ops the IR has and how many NNCF quantized (a FakeQuantize on their activation input)."""
    compute = [op for op in ov_model.get_ordered_ops() if op.get_type_name() in IR_COMPUTE_TYPES]
    int8 = [op for op in compute if op.input_value(0).get_node().get_type_name() == "FakeQuantize"]
    fq = sum(op.get_type_name() == "FakeQuantize" for op in ov_model.get_ordered_ops())
    return {"compute_ops": len(compute), "compute_ops_int8": len(int8), "fake_quantize": fq,
            "float_compute_ops": [op.get_friendly_name() for op in compute if op not in int8]}


def quantize_openvino_ir(inputs: QuantizeInputs, cfg: Int8Config, folder: Path) -> tuple[Path, dict]:
    """(model.xml, info) of the INT8 IR NNCF's OpenVINO backend makes, in ``folder``: ``nncf.quantize`` on the
    ov.Model OpenVINO converts from the FP32 ONNX (the route whose node names qdeploy's placement plan reads), the same
    model type, ignored scope, calibration images and range estimator as quantizer nncf's Q/DQ ONNX, saved as an IR
    (FakeQuantize ops and INT8 weights, which the CPU plugin compiles to its INT8 kernels). Where OpenVINO's ONNX
    frontend cannot convert the model, the PyTorch module's conversion (export/openvino_ir.convert); the placement
    plan's names then match no op and are said so."""
    import onnx
    import openvino as ov

    from qdeploy.export.openvino_ir import convert, save_ir

    NncfQuantizer().check(cfg, inputs.has_torch)
    t0 = time.perf_counter()
    nncf = _import_nncf()
    model = onnx.load(str(inputs.fp32_onnx), load_external_data=False)
    plan = NncfPlan.of(nncf, model, inputs, cfg)
    ov_model, route = convert(inputs.fp32_onnx, inputs.torch_model, inputs.check_inputs)
    names, missing = ir_names_of(plan.ignored_names(), ov_model)
    if missing:
        warn(f"NNCF (OpenVINO backend): {len(missing)} node(s) to keep float have no op in the OpenVINO model "
             f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); they are quantized as NNCF decides")
    plan.log(nncf, "OpenVINO backend: INT8 IR")
    qmodel = plan.run(nncf, ov_model, plan.ignored_scope(nncf, names), inputs.fp32_onnx)
    xml = save_ir(qmodel, folder)
    info = {**plan.info(nncf, time.perf_counter() - t0), "backend": "openvino", "openvino": ov.__version__.split("-")[0],
            "route": route, "sample_shape": [1, *next(iter(plan.dataset_source)).shape[1:]],
            "ignored_ir_nodes": names, "ignored_without_ir_node": missing, "structure": ir_structure(qmodel),
            "quantizer": NncfQuantizer.name}
    log(f"quantize: NNCF (OpenVINO backend) done in {info['time_s']:.1f} s: {info['structure']['compute_ops_int8']} of "
        f"{info['structure']['compute_ops']} compute ops INT8")
    return xml, info


def _check_method(method: str) -> None:
    if method not in RANGE_METHODS or not RANGE_METHODS[method].nncf:
        offered = sorted((m.name for m in RANGE_METHODS.values() if m.nncf),
                         key=lambda name: name != Int8Config.model_fields["method"].default)  # the default first
        raise ConfigError(f"method {method}: quantizer nncf (placement openvino) offers {' and '.join(offered)} here "
                          f"(NNCF's own range estimators); use placement onnxruntime for {method}")


def _advanced_parameters(method: str):
    """NNCF's settings for a range method. mean-minmax is NNCF's default for per-tensor activations (the mean over the
    calibration items of each item's min and max: min_max/algorithm.py, ``RangeEstimatorParametersSet.MEAN_MINMAX``);
    max is its global min/max (``MINMAX``). NNCF's weights stay at their min/max per channel either way."""
    _check_method(method)
    nncf = _import_nncf()
    # weights in half the 8-bit range on a CPU without VNNI, where its INT8 kernels saturate (facts/onnxruntime.py)
    overflow = {"overflow_fix": nncf.OverflowFix.ENABLE} if nncf_overflow_fix_reason(u8s8_saturates()) else {}
    if method == "max":
        from nncf.quantization.range_estimator import RangeEstimatorParametersSet

        return nncf.AdvancedQuantizationParameters(activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX,
                                                   **overflow)
    return nncf.AdvancedQuantizationParameters(**overflow)  # the defaults: MEAN_MINMAX for per-tensor activations


def _import_nncf():
    """``import nncf`` without its usage telemetry: NNCF sends Google Analytics events from ``nncf.quantize`` (through
    openvino-telemetry, on unless opted out, and its import writes a client id under the home folder). Its own switch
    (NNCF_CI, read once at import) and openvino-telemetry's CI rule (CI=true) turn both off; set for the import only."""
    if "nncf" in sys.modules:
        return sys.modules["nncf"]
    saved = {k: os.environ.get(k) for k in ("NNCF_CI", "CI")}
    os.environ.update(NNCF_CI="1", CI="true")
    try:
        with _no_cuda_home_warning():
            import nncf
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nncf


class _CalibrationImages:
    """Re-iterable float32 NCHW arrays of ``chunk`` calibration images each (NNCF iterates once per pipeline step:
    SmoothQuant, then min-max + bias correction), normalised as the model expects. One image per item by default, so
    that NNCF's per-item statistics are per-image statistics whatever the data's batch size."""

    def __init__(self, batches, preprocess, chunk: int = 1):
        self.batches, self.preprocess, self.chunk = batches, preprocess, chunk

    def __len__(self) -> int:
        return -(-int(self.batches.num_samples) // self.chunk)

    def __iter__(self) -> Iterator[np.ndarray]:
        from qdeploy.data import normalize

        pending: list[np.ndarray] = []
        have = 0
        for images, _ in self.batches:
            x = normalize(images, self.preprocess)
            if self.chunk == 1:
                for i in range(len(x)):
                    yield x[i:i + 1]
                continue
            pending.append(x)
            have += len(x)
            while have >= self.chunk:
                joined = np.concatenate(pending)
                yield joined[:self.chunk]
                rest = joined[self.chunk:]
                pending, have = ([rest] if len(rest) else []), len(rest)
        # with a static batch, preflight makes the calibration count a multiple of it: nothing is left over


def _static_batch(model, input_name: str) -> int:
    """The input's fixed batch size N > 1 (calibration then feeds N images at a time), else 1."""
    for i in model.graph.input:
        if i.name == input_name:
            dims = i.type.tensor_type.shape.dim
            if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 1:
                return int(dims[0].dim_value)
    return 1


@contextlib.contextmanager
def _no_cuda_home_warning() -> Iterator[None]:
    """NNCF imports its torch backend (nncf.torch → torch.utils.cpp_extension) on first use, and torch then warns "No
    CUDA runtime is found, using CUDA_HOME=..." on a machine without a GPU: nothing qdeploy does uses it."""
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    saved = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        cpp_logger.setLevel(saved)


class _ToQdeployWarnings(logging.Handler):
    def __init__(self, collected: list):
        super().__init__(logging.WARNING)
        self.collected = collected

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.collected.append(msg)
        warn(f"NNCF: {msg}")


@contextlib.contextmanager
def _nncf_output(nncf) -> Iterator[list]:
    """While NNCF runs: its log at WARNING, its warnings as qdeploy warnings (on stderr, collected for the result), its
    rich progress bars (which print to the global console, stdout) on stderr, or nowhere with --quiet; stdout stays
    clean for machine-readable output."""
    from qdeploy.utils.log import is_quiet

    logger = nncf.nncf_logger
    saved_level, saved_handlers = logger.level, list(logger.handlers)
    collected: list[str] = []
    logger.handlers = [_ToQdeployWarnings(collected)]
    nncf.set_log_level(logging.WARNING)
    try:
        with open(os.devnull, "w") if is_quiet() else contextlib.nullcontext(sys.stderr) as sink, \
                contextlib.redirect_stdout(sink), _no_cuda_home_warning():
            yield collected
    finally:
        logger.handlers = saved_handlers
        logger.setLevel(saved_level)
