"""OpenVINO engine (CPU plugin) on OpenVINO IR, as OpenVINO's users deploy it: the FP32 IR (``openvino.convert_model``;
export/openvino_ir.py) compiled with the precision hint the variant names (f32, f16, bf16: read back from the compiled
model), the INT8 IR that NNCF's OpenVINO backend makes from it (placement openvino; quantize/nncf_quantizer.py), and
the INT8 Q/DQ ONNX of qdeploy's other placements through OpenVINO's ONNX frontend (where it compiles; otherwise the
variant says why). An IR compiles with a compile cache (CACHE_DIR beside it), so a reload does not recompile.

API used (checked against the installed openvino package, openvino/_ov_api.py, and docs.openvino.ai's "CPU Device"
and "Model Caching" pages): ``Core().read_model(onnx_path)``, ``Core.compile_model(model_or_path, "CPU", config)`` with
the properties INFERENCE_PRECISION_HINT, INFERENCE_NUM_THREADS, PERFORMANCE_HINT and CACHE_DIR,
``Core.get_property("CPU", ...)`` for OPTIMIZATION_CAPABILITIES and FULL_DEVICE_NAME, ``CompiledModel.get_property`` to
read the settings back, ``CompiledModel.create_infer_request``, ``InferRequest.infer`` / ``get_output_tensor`` /
``set_input_tensor`` (``openvino.Tensor(array, shared_memory=True)``), and ``CompiledModel.get_runtime_model`` (each
executed layer's ``runtimePrecision``).
"""
from __future__ import annotations

import contextlib
import tempfile
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.artifacts.types import IR_KINDS
from qdeploy.engines.base import Engine, Variant, register_engine
from qdeploy.errors import ConfigError, VariantUnavailable

try:
    import openvino as ov
except ImportError:  # a base dependency, but an image may lack it (the GPU machine does): the engine reports itself
    ov = None        # unusable (doctor, a variant asking for it) instead of breaking `import qdeploy` for every engine

# fp16 and bf16 compile the FP32 IR with that precision hint: OpenVINO converts the weights and compute internally
# (bf16: AMX-BF16 tile or AVX512-BF16 dot-product kernels; what the CPU plugin runs by default where the CPU has them)
_FLOAT_ARTIFACT = ArtifactKind.OPENVINO_IR
# the compile cache's folder, beside an IR's model.xml (OpenVINO keys each blob by the model and the compile config)
COMPILE_CACHE = "compile-cache"
# INFERENCE_PRECISION_HINT per precision. fp32 and int8 say f32 explicitly: on CPUs with AMX or AVX512_BF16 the CPU
# plugin's default hint is bf16, so an unset hint would silently run the float layers in bfloat16.
_PRECISION_HINT = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "int8": "f32"}
# the OPTIMIZATION_CAPABILITIES entry that says the CPU runs a reduced float natively: without it OpenVINO would emulate
# it or quietly keep FP32, and a "BF16" candidate would be a number about neither
_NATIVE = {"fp16": "FP16", "bf16": "BF16"}
_PERFORMANCE_HINT = {"latency": "LATENCY", "throughput": "THROUGHPUT"}
# layer types of the runtime model whose runtimePrecision says whether INT8 kernels ran
_COMPUTE_LAYERS = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")


class OpenVinoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    performance_hint: Literal["latency", "throughput"] = Field(
        "latency", json_schema_extra={"label": "hint"},
        description="OpenVINO's PERFORMANCE_HINT: latency = one stream using the cores for one request; throughput = "
                    "the cores split into several streams for parallel requests (qdeploy's benchmark runs one request "
                    "at a time, so it measures one stream's latency)")
    float_precision: Literal["f32", "bf16"] = Field(
        "f32", json_schema_extra={"label": "float"},
        description="precision int8 only: the inference-precision hint for the layers an INT8 model leaves float "
                    "(attention, Softmax, LayerNorm, GELU, the prediction head, the first conv). f32: exact float "
                    "layers. bf16: BF16 there, as the CPU plugin does by default on CPUs with AMX-BF16 or "
                    "AVX512-BF16 (OPTIMIZATION_CAPABILITIES lists BF16); refused on a CPU without")


@lru_cache(maxsize=1)
def core() -> ov.Core:
    """One OpenVINO Core per process (it holds the loaded device plugins)."""
    if ov is None:
        raise VariantUnavailable("openvino is not installed (a dependency of qdeploy: pip install 'openvino>=2026.4')")
    return ov.Core()


def cpu_capabilities() -> list[str]:
    """The CPU plugin's OPTIMIZATION_CAPABILITIES on this machine (e.g. FP32, INT8, BIN, EXPORT_IMPORT; FP16, BF16
    where the CPU runs them natively)."""
    return [str(c) for c in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def precision_problem(precision: str) -> Optional[str]:
    """Why OpenVINO's CPU plugin cannot run ``precision`` here (None: it can). FP16 and BF16 only where the CPU runs
    them natively (OPTIMIZATION_CAPABILITIES: FP16 on AVX512-FP16/AMX-FP16 CPUs, BF16 on AVX512-BF16/AMX-BF16 ones)."""
    if precision not in _NATIVE:
        return None
    caps = cpu_capabilities()
    if _NATIVE[precision] in caps:
        return None
    return (f"{precision.upper()} in OpenVINO needs a CPU whose OPTIMIZATION_CAPABILITIES list {_NATIVE[precision]}, "
            f"and this CPU's are {', '.join(caps)} (a {_PRECISION_HINT[precision]} precision hint would run FP32)")


def hint_of(precision: str, float_precision: str = "f32") -> str:
    """The INFERENCE_PRECISION_HINT a variant compiles with: its precision's, or for INT8 the float layers' choice."""
    return float_precision if precision == "int8" else _PRECISION_HINT[precision]


def float_precision_problem(variant) -> Optional[str]:
    """Why an INT8 variant's ``float_precision: bf16`` cannot run here (None: it can, or it is f32)."""
    if variant.precision != "int8" or variant.options.float_precision == "f32":
        return None
    problem = precision_problem("bf16")
    return f"float_precision bf16: {problem}" if problem else None


def ir_deploy_name(kind: ArtifactKind, label: str) -> str:
    """Where an IR goes in --out: the FP32 IR (shared by the float variants) in openvino-ir/, an INT8 IR in a folder
    named after its variant."""
    return f"{'openvino-ir' if kind == ArtifactKind.OPENVINO_IR else label}/model.xml"


def compile_config(precision: str, threads: Optional[int] = None, float_precision: str = "f32",
                   performance_hint: str = "latency", cache_dir: Optional[str] = None) -> dict:
    """The CPU plugin's compile properties for a variant: its precision hint (fp32 and int8 say f32 explicitly: the
    plugin's default is bf16 on BF16-capable CPUs; an INT8 variant with float_precision bf16 says bf16), its thread
    count (unset: every core), and the compile cache: a folder under ``cache_dir`` per setting.

    Why a folder per setting: OpenVINO 2026.4.1's cache key leaves INFERENCE_PRECISION_HINT out. An INT8 IR compiled
    with an f32 hint and then with a bf16 hint into one CACHE_DIR wrote one blob, and the second compile loaded it and
    died with SIGSEGV (NNCF's INT8 IR of DeiT-S on the AMX Xeon; either hint alone, or two folders, ran)."""
    hint = hint_of(precision, float_precision)
    config = {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": _PERFORMANCE_HINT[performance_hint]}
    if threads:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    if cache_dir:
        setting = f"{hint}-{performance_hint}-{int(threads) if threads else 'all'}-threads"
        config["CACHE_DIR"] = f"{Path(cache_dir).as_posix()}/{setting}"
    return config


def deploy_line(artifact: str, precision: str, threads: Optional[int] = None, float_precision: str = "f32") -> str:
    """How a user runs ``artifact`` as this variant did: one line of openvino code, the compile call with the variant's
    settings (and, for an IR, a compile cache beside it, so that a reload does not recompile)."""
    cache = str(Path(artifact).parent / COMPILE_CACHE) if str(artifact).endswith(".xml") else None
    return f"openvino.Core().compile_model({artifact!r}, 'CPU', {compile_config(precision, threads, float_precision, cache_dir=cache)!r})"


def signed_activations_as_uint8(model) -> int:
    """Rewrite, in place, every activation QuantizeLinear with an int8 zero point (and the DequantizeLinear nodes that
    read it) to uint8 with the zero point + 128; returns how many Q nodes changed.

    Why: OpenVINO's CPU plugin (2026.4.1 on an AVX2 host) runs Q/DQ ONNX whose activations are signed int8 with wrong
    results: NNCF's ONNX PTQ of MobileViT-XXS (symmetric int8 activations) scored 26.4 % top-1 in OpenVINO vs 84.6 % in
    ONNX Runtime on the same 500 CIFAR-10 images; the first conv fed by an int8 activation already differs by 42 %
    (relative max), while the same model with uint8 activations scored 82.6 % (ONNX Runtime placement's uint8 Q/DQ runs
    right too). The rewrite is exact: QuantizeLinear rounds x / scale, adds the zero point and saturates, so
    clamp(round(x/s) + z + 128, 0, 255) = clamp(round(x/s) + z, -128, 127) + 128 and DequantizeLinear subtracts the
    same shifted zero point: one grid, the same dequantized values. Weights (DequantizeLinear of an int8 initializer)
    stay int8, which OpenVINO reads right."""
    import onnx
    from onnx import numpy_helper

    init = {t.name: t for t in model.graph.initializer}
    shifted: dict[str, str] = {}  # int8 zero-point initializer → its uint8 twin

    def uint8_twin(name: str) -> str:
        if name not in shifted:
            z = numpy_helper.to_array(init[name]).astype(np.int16) + 128
            twin = numpy_helper.from_array(z.astype(np.uint8), f"{name}__uint8")
            model.graph.initializer.append(twin)
            shifted[name] = twin.name
        return shifted[name]

    readers: dict[str, list] = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear":
            readers.setdefault(n.input[0], []).append(n)
    changed = 0
    outputs = set()
    for n in model.graph.node:
        if (n.op_type != "QuantizeLinear" or n.input[0] in init or len(n.input) < 3 or n.input[2] not in init
                or init[n.input[2]].data_type != onnx.TensorProto.INT8):
            continue
        dqs = readers.get(n.output[0], [])
        if any(len(d.input) < 3 or d.input[2] not in init or init[d.input[2]].data_type != onnx.TensorProto.INT8
               for d in dqs):
            continue  # a reader without an int8 zero point: leave the pair as it is
        n.input[2] = uint8_twin(n.input[2])
        for d in dqs:
            d.input[2] = uint8_twin(d.input[2])
        outputs.add(n.output[0])
        changed += 1
    if changed:  # the Q outputs' declared int8 types, if any, are now wrong
        keep = [v for v in model.graph.value_info if v.name not in outputs]
        del model.graph.value_info[:]
        model.graph.value_info.extend(keep)
        used = {i for n in model.graph.node for i in n.input}
        unused = [t for t in model.graph.initializer if t.name in shifted and t.name not in used]
        for t in unused:
            model.graph.initializer.remove(t)
    return changed


# Elementwise ops whose constant operand OpenVINO's low-precision transformations cannot take as a DequantizeLinear
ELEMENTWISE_WITH_CONSTANT = frozenset({"Add", "Sub", "Mul", "Div"})


def constant_dequantize_folded(model) -> int:
    """Replace, in place, every DequantizeLinear of a constant that only elementwise ops (``ELEMENTWISE_WITH_CONSTANT``)
    read by the float constant it computes; returns how many were folded. A constant: an int8/uint8 initializer, or a
    QuantizeLinear of a float initializer / Constant node (what ONNX Runtime 1.30's quantizer writes; 1.32 writes the
    quantized initializer).

    Why: ONNX Runtime's Q/DQ quantizer (its placement) quantizes both inputs of an Add/Mul so that they fuse into
    QLinearAdd/QLinearMul, the constant one included (LeViT's and EfficientFormer's attention scale ``q @ k * 0.25``, a
    reparameterized branch's ``+ bias``, NF-RegNet's ``* gamma``). OpenVINO 2026.4.1's low-precision transformations
    (MultiplyPartialTransformation, AddTransformation) throw "Check 'index < m_inputs.size()' failed ... index '0' out
    of range" on ``Mul(DQ(Q(x)), DQ(Q(constant)))``: the files ONNX Runtime 1.30 writes for 18 of the zoo's
    architectures, on an Intel Xeon and an AMD EPYC alike, with or without Snippets and AMX (bench/diagnose/ov_probe.py);
    1.32's quantized-initializer form compiles, and is folded too. The fold is exact: the DequantizeLinear of a constant is a
    constant, computed here as ONNX does (round half to even, saturate, subtract the zero point, times the scale, in
    float32). OpenVINO then sees an elementwise op with one quantized input and a float constant, which it runs.
    Weights of Conv/MatMul/Gemm keep their DequantizeLinear (those run in INT8)."""
    from onnx import numpy_helper

    init = {t.name: t for t in model.graph.initializer}
    consts = {n.output[0]: next((a.t for a in n.attribute if a.name == "value"), None)
              for n in model.graph.node if n.op_type == "Constant"}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in model.graph.output}

    shape_only = _shape_only_values(model, readers, producer)

    def value(name: str):
        t = init.get(name) if name in init else consts.get(name)
        return numpy_helper.to_array(t) if t is not None else shape_only.get(name)

    def per_axis(x: np.ndarray, rank: int, axis: int) -> np.ndarray:
        if x.ndim == 1 and rank > 0:
            shape = [1] * rank
            shape[axis % rank] = -1
            return x.reshape(shape)
        return x

    def qparams(node, rank: int):
        scale = value(node.input[1])
        zero = value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is None or (len(node.input) > 2 and node.input[2] and zero is None):
            return None
        if zero is None:
            zero = np.zeros((), np.uint8)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        return per_axis(scale.astype(np.float32), rank, axis), per_axis(zero, rank, axis)

    folded, dropped_q = [], []
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or n.output[0] in graph_outputs:
            continue
        if not all(r.op_type in ELEMENTWISE_WITH_CONSTANT for r in readers.get(n.output[0], [])):
            continue
        q = value(n.input[0])
        quantize = producer.get(n.input[0])
        if q is None and quantize is not None and quantize.op_type == "QuantizeLinear":
            x = value(quantize.input[0])
            if x is None or len(readers.get(n.input[0], [])) != 1 or n.input[0] in graph_outputs:
                continue
            qp = qparams(quantize, x.ndim)
            if qp is None:
                continue
            scale, zero = qp
            info = np.iinfo(zero.dtype)
            q = np.clip(np.rint(x.astype(np.float32) / scale) + zero.astype(np.int32), info.min, info.max).astype(zero.dtype)
            dropped_q.append(quantize)
        elif q is None:
            continue
        qp = qparams(n, q.ndim)
        if qp is None:
            continue
        scale, zero = qp
        out = (q.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale
        model.graph.initializer.append(numpy_helper.from_array(out.astype(np.float32), n.output[0]))
        folded.append(n)
    for n in folded + dropped_q:
        model.graph.node.remove(n)
    if folded:
        used = {i for n in model.graph.node for i in n.input} | graph_outputs
        for t in [t for t in model.graph.initializer if t.name not in used]:
            model.graph.initializer.remove(t)
        for n in [n for n in model.graph.node if n.op_type == "Constant" and n.output[0] not in used]:
            model.graph.node.remove(n)
        names = {n.output[0] for n in folded + dropped_q}
        keep = [v for v in model.graph.value_info if v.name not in names]
        del model.graph.value_info[:]
        model.graph.value_info.extend(keep)
    return len(folded)


def _shape_only_values(model, readers: dict, producer: dict) -> dict:
    """{tensor: value} for the inputs of QuantizeLinear nodes (read only by elementwise ops through their
    DequantizeLinear) that do not depend on the input's values, only on constants and on the input's shape (torchvision
    Swin's shifted-window mask is built in forward from zeros, slices and ScatterND). Structure decides which tensors
    qualify (no path from the graph input except through Shape/Size); ONNX Runtime, optimizations off, computes them at
    batch 1 and 2 with different input values, and a tensor is kept only if both give the same value (one that follows
    the batch size is not a constant)."""
    graph = model.graph
    if len(graph.input) != 1:
        return {}
    data = {graph.input[0].name}
    for n in graph.node:  # topological order (ONNX requires it)
        if n.op_type not in ("Shape", "Size") and any(i in data for i in n.input):
            data.update(n.output)
    wanted = []
    for n in graph.node:
        if n.op_type != "QuantizeLinear" or n.input[0] in data or n.input[0] not in producer:
            continue
        if producer[n.input[0]].op_type == "Constant":
            continue  # read directly
        dqs = readers.get(n.output[0], [])
        if dqs and all(d.op_type == "DequantizeLinear" and all(r.op_type in ELEMENTWISE_WITH_CONSTANT
                                                               for r in readers.get(d.output[0], [])) for d in dqs):
            wanted.append(n.input[0])
    if not wanted:
        return {}
    import onnx
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in wanted)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
        x = sess.get_inputs()[0]
        if any(not isinstance(d, int) for d in x.shape[1:]):
            return {}  # a dynamic height/width: the shape-built tensor follows the image size
        rng = np.random.default_rng(0)
        runs = [sess.run(None, {x.name: rng.normal(size=(b, *x.shape[1:])).astype(np.float32)}) for b in (1, 2)]
    except Exception:  # noqa: BLE001 - not computable here: those operands keep their Q/DQ
        return {}
    return {name: a for name, a, b in zip(wanted, *runs) if a.shape == b.shape and np.array_equal(a, b)}


@contextlib.contextmanager
def readable_onnx(path: Path, quantized: bool) -> Iterator[tuple[Path, dict]]:
    """(the file OpenVINO should read, the rewrites made: ``{"int8_activations_read_as_uint8": n,
    "constant_dequantize_folded": m}``): ``path`` itself, or for a Q/DQ ONNX that needs them a copy rewritten by
    ``signed_activations_as_uint8`` and ``constant_dequantize_folded`` (in a temporary folder, gone when the block
    ends: compile inside it; the artifact is untouched). Read by the engine and benchmark/op_profile."""
    none = {"int8_activations_read_as_uint8": 0, "constant_dequantize_folded": 0}
    if not quantized or Path(path).suffix != ".onnx":  # an IR (NNCF's FakeQuantize ops) is read as it is
        yield path, none
        return
    import onnx

    model = onnx.load(str(path))
    rewrites = {"int8_activations_read_as_uint8": signed_activations_as_uint8(model),
                "constant_dequantize_folded": constant_dequantize_folded(model)}
    if not any(rewrites.values()):
        yield path, rewrites
        return
    with tempfile.TemporaryDirectory(prefix="qdeploy-ov-") as tmp:
        copy = Path(tmp) / Path(path).name
        onnx.save(model, str(copy))
        yield copy, rewrites


# A child process that reads, compiles and runs the model once (batch 1 where the batch is dynamic); exit 0 = fine
# A child process that reads, compiles and runs the model once on zeros of the shape given (else batch 1 where only the
# batch is dynamic; a model whose height or width is dynamic too is compiled only: a made-up size may not be one it
# takes, e.g. a YOLO export whose anchors follow the image size); exit 0 = fine
_PROBE = """
import json, sys
import numpy as np, openvino as ov
core = ov.Core()
model = core.read_model(sys.argv[1])
compiled = core.compile_model(model, "CPU", json.loads(sys.argv[2]))
shape = json.loads(sys.argv[3])
dims = model.inputs[0].get_partial_shape()
if shape is None and not any(d.is_dynamic for d in list(dims)[1:]):
    shape = [1 if d.is_dynamic else d.get_length() for d in dims]
if shape is not None:
    compiled(np.zeros(shape, np.float32))
"""
_PROBE_TIMEOUT_S = 600
_probed: dict = {}


def compile_crash(path: Path, config: dict, key=None, shape: Optional[list] = None) -> Optional[str]:
    """How OpenVINO's CPU plugin dies on ``path`` (None: it compiles and runs), tried in a child process first.

    Why: a native crash cannot be caught, and it would end the whole qdeploy process (an ``optimize`` loses every
    candidate measured so far). OpenVINO 2026.4.1 segfaults in compile_model on the ONNX Runtime-placement Q/DQ ONNX of
    timm's Swin (cifar10-modern swin_mini, every range method; DeiT's and the CNNs' compile). Once per ``key`` per
    process (default: the path and config)."""
    import json
    import signal
    import subprocess
    import sys

    key = (key or str(path), json.dumps(config, sort_keys=True))
    if key not in _probed:
        try:
            r = subprocess.run([sys.executable, "-c", _PROBE, str(path), json.dumps(config), json.dumps(shape)],
                               capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _probed[key] = f"did not finish within {_PROBE_TIMEOUT_S} s"
        else:
            if r.returncode < 0:
                _probed[key] = f"crashed ({signal.Signals(-r.returncode).name})"
            elif r.returncode != 0:
                last = (r.stderr.strip().splitlines() or ["exit status %d" % r.returncode])[-1]
                _probed[key] = f"failed ({last[:300]})"
            else:
                _probed[key] = None
    return _probed[key]


def _type_name(value) -> str:
    return value.get_type_name() if isinstance(value, ov.Type) else str(value)


@register_engine
class OpenVinoEngine(Engine):
    name = "openvino"
    description = ("OpenVINO CPU plugin on OpenVINO IR (FP32 pinned f32, FP16 or BF16 precision hints, INT8 by NNCF on "
                   "the OpenVINO model) or another placement's INT8 Q/DQ ONNX")
    Options = OpenVinoOptions
    precisions = ("fp32", "fp16", "bf16", "int8")
    devices = ("cpu",)

    @classmethod
    def probe(cls) -> list[dict]:
        if ov is None:
            return [{"engine": cls.name, "device": "cpu", "precisions": [], "usable": False,
                     "note": "openvino is not installed (pip install 'openvino>=2026.4')"}]
        try:
            caps = cpu_capabilities()
        except Exception as e:  # a broken install: doctor says so rather than failing
            return [{"engine": cls.name, "device": "cpu", "precisions": [], "usable": False,
                     "note": f"openvino {ov.__version__}: CPU plugin unavailable ({type(e).__name__}: {e})"}]
        runs = ["fp32"] + [p for p, cap in _NATIVE.items() if cap in caps] + ["int8"]
        return [{"engine": cls.name, "device": "cpu", "precisions": runs, "usable": True,
                 "note": f"openvino {ov.__version__.split('-')[0]}; CPU optimization capabilities: {', '.join(caps)}"}]

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        problem = precision_problem(variant.precision) or float_precision_problem(variant)
        if problem:
            raise VariantUnavailable(problem)
        if variant.int8 is not None and variant.int8.placement == "tensorrt":
            # TensorRT's placement is Q/DQ where TensorRT fuses; its accuracy is evaluated in ONNX Runtime with exact
            # Q/DQ semantics. In OpenVINO it measures neither engine. (It first lost 11.6 points of top-1 on
            # MobileViT-XXS in OpenVINO; that was OpenVINO's signed-int8-activation bug, see
            # signed_activations_as_uint8: read as uint8 it scores 82.2 % vs 83.2 % in ONNX Runtime, 500 images.)
            raise VariantUnavailable("placement tensorrt is TensorRT's Q/DQ, placed for TensorRT's fusions: in OpenVINO "
                                     "it is a number about neither engine; use placement onnxruntime or openvino "
                                     "(NNCF's) with engine openvino")

    @classmethod
    def check_options(cls, spec, options: OpenVinoOptions, where: str) -> None:
        if options.float_precision != "f32" and spec.precision != "int8":
            raise ConfigError(f"{where}.float_precision: only for precision int8 (the precision hint of the layers an "
                              f"INT8 model leaves float); a {spec.precision} variant's hint is its precision")

    @classmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest:
        """The FP32 IR for the float precisions; for INT8 the IR NNCF's OpenVINO backend makes (placement openvino) or
        the Q/DQ ONNX of another placement."""
        if variant.int8 is None:
            return ArtifactRequest(_FLOAT_ARTIFACT)
        if variant.int8.placement == "openvino":
            return ArtifactRequest(ArtifactKind.OPENVINO_IR_INT8, variant.int8)
        return ArtifactRequest(ArtifactKind.ONNX_INT8, variant.int8)

    @classmethod
    def note(cls, variant: Variant) -> Optional[str]:
        bf16 = (", float layers in BF16 (bf16 precision hint)"
                if variant.int8 is not None and variant.options.float_precision == "bf16" else "")
        if variant.int8 is not None and variant.int8.placement == "openvino":
            return "INT8 IR made by NNCF on the OpenVINO model (OpenVINO's own placement)" + bf16
        if variant.int8 is not None:
            return "ONNX Runtime-placement Q/DQ run by OpenVINO's CPU plugin (its own INT8 kernels)" + bf16
        if variant.precision in _NATIVE:
            return f"FP32 IR compiled with OpenVINO's {_PRECISION_HINT[variant.precision]} inference-precision hint"
        return None

    def load(self) -> None:
        v = self.variant
        problem = precision_problem(v.precision) or float_precision_problem(v)
        if problem:
            raise VariantUnavailable(problem)
        self.precision_hint = hint_of(v.precision, self.options.float_precision)
        ir = self.artifact.kind in IR_KINDS
        self.cache_dir = self.artifact.path.parent / COMPILE_CACHE if ir else None
        config = compile_config(v.precision, v.threads, self.options.float_precision, self.options.performance_hint,
                                self.cache_dir)
        self.compile_cache = config.get("CACHE_DIR")
        quantized = self.artifact.kind in (ArtifactKind.ONNX_INT8, ArtifactKind.OPENVINO_IR_INT8)
        with readable_onnx(self.artifact.path, quantized) as (path, self.rewrites):
            if quantized:
                crash = compile_crash(path, config, key=(str(self.artifact.path), tuple(self.rewrites.values())),
                                      shape=self.artifact.info.get("sample_shape"))
                if crash:
                    raise VariantUnavailable(f"OpenVINO {ov.__version__.split('-')[0]} {crash} compiling and running "
                                             f"{self.artifact.path.name} on the CPU (tried in a child process); this "
                                             "INT8 graph is not runnable in OpenVINO here: use engine onnxruntime")
            # an IR compiles from its file (what the compile cache keys on); a Q/DQ ONNX from the rewritten copy
            self.compiled = core().compile_model(str(path), "CPU", config)
        self.input_name = self.compiled.inputs[0].get_any_name()
        self.input_shape = str(self.compiled.inputs[0].get_partial_shape())  # a static batch is handled upstream
        got = _type_name(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        if got != self.precision_hint:  # the plugin overrode the hint: the variant would not run what it says
            raise VariantUnavailable(f"OpenVINO compiled this {v.precision.upper()} variant with inference precision "
                                     f"{got}, not the {self.precision_hint} asked for")
        reduced = self._reduced_float_layers() if self.precision_hint == "f32" else {}
        if reduced:  # the hint read back f32, but the executed layers say otherwise
            raise VariantUnavailable(f"OpenVINO ran compute layers of this {v.precision.upper()} variant in a reduced "
                                     f"float precision despite the f32 hint: {reduced}")
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))
        self.request = self.compiled.create_infer_request()

    def _reduced_float_layers(self) -> dict:
        """Compute layers of the runtime model that ran in bf16 or f16 (an f32-hinted model must have none)."""
        return {kind: {p: n for p, n in counts.items() if p in ("bf16", "f16")}
                for kind, counts in self._compute_precisions().items()
                if any(p in ("bf16", "f16") for p in counts)}

    def infer(self, batch: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        self.request.infer({0: x}, share_inputs=True, share_outputs=True)
        return np.array(self.request.get_output_tensor(0).data, dtype=np.float32, copy=True)

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        request = self.request
        # staged once, as OpenVINO's benchmark_app does: each step runs the request on the input tensor it holds
        # (passing the array per call adds Python-side dispatch, about 35 us per call on this 2-core host)
        request.set_input_tensor(ov.Tensor(x, shared_memory=True))

        def step():
            request.infer(share_outputs=True)
            return x  # keeps the shared input array alive as long as the step

        return step

    def _compute_precisions(self) -> dict:
        """Per compute-layer type of the compiled (runtime) model, how many layers ran in each precision (e.g.
        ``{"Convolution": {"u8": 2, "f32": 1}}``): shows whether OpenVINO ran a Q/DQ layer in INT8."""
        counts: dict[str, Counter] = {}
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            rt = op.get_rt_info()
            if "layerType" not in rt or "runtimePrecision" not in rt:
                continue
            kind = rt["layerType"].astype(str)
            if kind in _COMPUTE_LAYERS:
                counts.setdefault(kind, Counter())[rt["runtimePrecision"].astype(str)] += 1
        return {k: dict(c) for k, c in sorted(counts.items())}

    def describe(self) -> dict:
        return {
            "device": "cpu",
            "device_name": core().get_property("CPU", "FULL_DEVICE_NAME"),
            "precision_hint": _type_name(self.compiled.get_property("INFERENCE_PRECISION_HINT")),
            "threads": self.threads,
            "performance_hint": str(self.compiled.get_property("PERFORMANCE_HINT")).split(".")[-1].lower(),
            "streams": int(self.compiled.get_property("NUM_STREAMS")),
            "input_shape": self.input_shape,
            "compute_layer_precisions": self._compute_precisions(),
            # activation Q/DQ pairs read as uint8 (signed_activations_as_uint8: OpenVINO runs int8 ones wrong) and
            # constant operands of Add/Mul dequantized ahead (constant_dequantize_folded: OpenVINO's LPT throws on them)
            **self.rewrites,
            **({"ir_route": self.artifact.info.get("route")} if self.artifact.kind == ArtifactKind.OPENVINO_IR else {}),
            "compile_cache": self.compile_cache,
            "deploy": deploy_line(ir_deploy_name(self.artifact.kind, self.variant.label) if self.cache_dir
                                  else self.artifact.path.name,
                                  self.variant.precision, self.threads, self.options.float_precision),
            "artifact": self.artifact.kind.value,
            "opset": self.artifact.opset,
            "openvino": ov.__version__,
        }

    def close(self) -> None:
        self.request = None
        self.compiled = None
