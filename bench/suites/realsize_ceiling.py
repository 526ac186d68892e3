"""The CPU ceiling of one FP32 ONNX: every engine × precision that ONNX Runtime and OpenVINO offer, by a plain harness.

    python bench/suites/realsize_ceiling.py --onnx M.onnx --calib calib.npy --evals evals.npy --batch 1 --threads 16 \\
        [--transformer] [--ignored-scope NODE ...] [--variants ov-int8-f32 ort-fp32 ...] --json OUT.json

It imports no qdeploy (numpy, onnx, onnxruntime, openvino and nncf only): the number qdeploy's chosen artifact is
compared with is an independent measurement. ``calib`` and ``evals`` are float32 NCHW arrays, already preprocessed.

Variants (all built first, then timed together):

ort-fp32          onnxruntime.InferenceSession, CPUExecutionProvider, ``intra_op_num_threads`` = threads, one inter-op
                  thread, ORT_ENABLE_ALL, sequential execution.
ort-int8-s8s8     ``quantize_static`` of ``quant_pre_process``'s output (the plain file where that fails: the variant's
ort-int8-u8s8     note says so): QDQ, per channel, MinMax, weights QInt8, activations QInt8 / QUInt8, other options left
                  at their defaults; the calibration images one per batch. Timed as ort-fp32.
ov-fp32           ``ov.convert_model`` of the ONNX compiled on "CPU" with INFERENCE_PRECISION_HINT f32,
                  INFERENCE_NUM_THREADS = threads, PERFORMANCE_HINT LATENCY.
ov-bf16           the same model with the bf16 hint (only where the CPU plugin lists BF16 in OPTIMIZATION_CAPABILITIES).
ov-int8-f32       ``nncf.quantize(model, nncf.Dataset(calibration images one per item), subset_size=len(calib),
ov-int8-bf16      model_type=TRANSFORMER if --transformer, ignored_scope=IgnoredScope(names, validate=False))``,
                  compiled with the f32 / bf16 hint (bf16 as ov-bf16). The ignored names are ONNX node names; OpenVINO's
                  ONNX frontend splits a Conv or Gemm with a bias into ``NAME/WithoutBiases`` and an Add named ``NAME``,
                  so each name goes with the ops named after it (ignored_scope_match); how many matched is recorded.
nncf-default      what a user writes: ``nncf.quantize(model, nncf.Dataset(calibration images))`` with no other argument
                  (subset_size 300), compiled with threads and LATENCY only (OpenVINO's default precision: bf16 on a
                  CPU with AMX or AVX512-BF16). A quantization of its own: it is the peer, not a re-use of ov-int8-*.

OpenVINO variants record the precision hint read back from the compiled model and, per compute-layer type of its runtime
model, how many layers ran in each ``runtimePrecision`` (e.g. ``{"Convolution": {"u8": 52}}``).

Timing: the input is ``evals[:batch]`` tiled to exactly ``batch`` images. Each variant is warmed up (5 calls and 0.2 s),
which sets its n: enough calls for a round of ``min_time`` seconds, at least 3. Then ``repeats`` rounds round-robin
over the variants (each round every variant once, the order rotated by one each round, so that none always runs first
or right after the same neighbour); a variant's round is one untimed call and n calls timed one by one with
``time.perf_counter``; its p50 is the median of its round medians. OpenVINO: one infer request whose input tensor is set
once, ``infer()``. ONNX Runtime: ``session.run(None, {input: x})``. Outputs: each variant run over all of ``evals`` in
batches of ``batch`` (the last one padded with copies of its last image), the first output kept, for agreement checks.

A variant that raises (an NNCF error, an OpenVINO compile error) is ``failed`` with a one-line reason; the others go on.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

VARIANTS = ("ort-fp32", "ort-int8-s8s8", "ort-int8-u8s8", "ov-fp32", "ov-bf16", "ov-int8-f32", "ov-int8-bf16",
            "nncf-default")
# layer types of OpenVINO's runtime model whose runtimePrecision says whether INT8 / BF16 kernels ran
COMPUTE_LAYERS = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")
WARMUP_CALLS, WARMUP_S, MIN_CALLS = 5, 0.2, 3
# many short rounds rather than a few long ones: the Xeon's speed moves by tens of percent over seconds (one round of 5
# x 0.3 s each saw every variant 35 % faster at once), and one build timed against itself in 5 such rounds came out
# 0.91-1.07x of itself; short rounds spread each variant over more of those states, for the same seconds in all
ROUNDS, ROUND_MIN_TIME = 15, 0.1


class Skipped(Exception):
    """A variant this machine cannot run as asked (e.g. bf16 on a CPU without BF16)."""


class Built:
    """A variant ready to run: ``step()`` one timed call on the staged input, ``run(x)`` its first output on ``x``."""

    def __init__(self, step: Callable[[], object], run: Callable[[np.ndarray], np.ndarray], precision: str,
                 runtime_precisions: dict | None = None, note: str | None = None):
        self.step, self.run, self.precision = step, run, precision
        self.runtime_precisions, self.note = runtime_precisions, note


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """The share of rows (and positions, for outputs with more than two dimensions) whose argmax over axis 1 agrees:
    top-1 agreement of two models' logits; of equal entries where both are already argmax maps (integers)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"outputs of different shapes: {a.shape} vs {b.shape}")
    if np.issubdtype(a.dtype, np.integer) and np.issubdtype(b.dtype, np.integer):  # argmax maps (keep_argmax)
        if a.size == 0:
            raise ValueError("agreement of empty argmax maps")
        return float(np.mean(a == b))
    if a.ndim < 2 or a.shape[0] == 0:
        raise ValueError(f"agreement needs [N, C, ...] outputs with N > 0, got shape {a.shape}")
    return float(np.mean(a.argmax(axis=1) == b.argmax(axis=1)))


def one_line(ex: BaseException) -> str:
    return f"{type(ex).__name__}: {' '.join(str(ex).split())}"[:400]


# ------------------------------------------------------------------------------------------------ the machine
def cpu_info() -> dict:
    """OpenVINO's CPU capabilities, the CPU flags and model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    import openvino as ov

    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    core = ov.Core()
    return {"openvino_capabilities": [str(c) for c in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")],
            "lscpu_flags": sorted(fields.get("flags", "").split()),
            "model_name": fields.get("model name") or platform.processor(),
            "openvino_device": core.get_property("CPU", "FULL_DEVICE_NAME"), "cpus": os.cpu_count()}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("onnxruntime", "openvino", "nncf", "numpy", "onnx"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


# ------------------------------------------------------------------------------------------------ ONNX Runtime
def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_built(path: Path, threads: int, x: np.ndarray, precision: str, note: str | None = None) -> Built:
    sess = ort_session(path, threads)
    name, out0 = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    feed = {name: x}
    return Built(lambda: sess.run(None, feed), lambda b: sess.run([out0], {name: b})[0], precision, note=note)


@contextlib.contextmanager
def working_directory(path: Path):
    """quant_pre_process's symbolic shape inference saves ``sym_shape_infer_temp.onnx`` into the current directory
    when it fails: it is kept in the work folder (this harness runs one thing at a time, so the change is safe here)."""
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def ort_preprocessed(onnx_path: Path, work: Path) -> tuple[Path, str | None]:
    """``quant_pre_process`` of the FP32 ONNX (what ONNX Runtime's docs run before quantize_static); where it raises,
    the plain file, and a note that says why."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = work / "ort-preprocessed.onnx"
    try:
        with working_directory(work):
            quant_pre_process(str(onnx_path), str(out))
        return out, None
    except Exception as ex:  # noqa: BLE001 - ORT raises bare Exception / AssertionError from shape inference
        return onnx_path, f"quant_pre_process failed ({one_line(ex)[:200]}); quantized the plain FP32 ONNX"


class CalibReader:
    """ONNX Runtime's calibration data reader: the calibration images one per batch."""

    def __init__(self, name: str, calib: np.ndarray):
        self.name, self.calib, self.i = name, calib, 0

    def get_next(self):
        if self.i >= len(self.calib):
            return None
        self.i += 1
        return {self.name: self.calib[self.i - 1:self.i]}

    def rewind(self):
        self.i = 0


def activation_bytes_per_image(source: Path, x: np.ndarray) -> int:
    """Bytes of every float tensor of one image's run (what ONNX Runtime's MinMax calibrator keeps per image)."""
    import onnx
    import onnxruntime as ort

    model = onnx.shape_inference.infer_shapes(onnx.load(str(source)))
    known = {o.name for o in model.graph.output}
    # value_info may still name tensors no node produces any more (quant_pre_process's optimizer fuses nodes and
    # keeps their old entries): only a node's output can become a graph output
    produced = {name for node in model.graph.node for name in node.output}
    for vi in model.graph.value_info:  # the float tensors whose type inference knows
        if (vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and vi.name in produced
                and vi.name not in known):
            model.graph.output.append(onnx.helper.make_tensor_value_info(vi.name, onnx.TensorProto.FLOAT, None))
            known.add(vi.name)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    dim = sess.get_inputs()[0].shape[0]
    n = dim if isinstance(dim, int) and dim > 0 else 1  # a fixed batch runs only at that batch
    b = np.ascontiguousarray(np.take(x, np.arange(n) % len(x), axis=0))
    outs = sess.run(None, {sess.get_inputs()[0].name: b})
    return int(sum(np.asarray(o).nbytes for o in outs if np.asarray(o).dtype.kind == "f")) // n


def ort_calibration_images(source: Path, calib: np.ndarray) -> tuple[np.ndarray, str | None]:
    """The calibration images ONNX Runtime's quantize_static can hold: its MinMax calibrator keeps every image's
    activations until the end (its CalibMaxIntermediateOutputs option drops the outputs it clears instead of merging
    them, in onnxruntime 1.32's source), which for 320 Swin-T images at 224 px is about 146 GiB. The first images that
    fit in a quarter of the memory available, and a note saying so where that is fewer than all."""
    import psutil

    per = activation_bytes_per_image(source, calib)
    keep = int(max(1, min(len(calib), psutil.virtual_memory().available // 4 // max(per, 1))))
    if keep >= len(calib):
        return calib, None
    return calib[:keep], (f"calibrated on the first {keep} of {len(calib)} images: ONNX Runtime's MinMax calibrator "
                          f"keeps every image's activations ({per / 2**20:.0f} MiB an image) until the end")


def ort_int8(source: Path, calib: np.ndarray, out: Path, activation: str) -> Path:
    import onnx

    if "modelopt.onnx.quantization.ort_patching" in sys.modules:
        # ModelOpt's ONNX quantization patches ONNX Runtime's quantizer modules when imported; in such a process
        # quantize_static calibrates no range for the graph input ("Quantization parameters are not specified for
        # param input"), S8S8 and U8S8 alike: a plain measurement needs a process of its own
        raise RuntimeError("ONNX Runtime's quantizer is patched by ModelOpt in this process (modelopt.onnx.quantization "
                           "was imported): run the harness in a process of its own")
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    name = onnx.load(str(source), load_external_data=False).graph.input[0].name
    quantize_static(str(source), str(out), CalibReader(name, calib), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8 if activation == "s8" else QuantType.QUInt8,
                    weight_type=QuantType.QInt8, calibrate_method=CalibrationMethod.MinMax)
    return out


def qdq_note(path: Path) -> str:
    """How many Q/DQ nodes quantize_static placed (zero would mean it quantized nothing)."""
    import onnx

    ops = [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]
    return f"{ops.count('QuantizeLinear')} QuantizeLinear / {ops.count('DequantizeLinear')} DequantizeLinear nodes"


# ------------------------------------------------------------------------------------------------ OpenVINO + NNCF
def runtime_precisions(compiled) -> dict:
    """Per compute-layer type of the compiled (runtime) model, how many layers ran in each precision."""
    counts: dict[str, dict[str, int]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if "layerType" not in rt or "runtimePrecision" not in rt:
            continue
        kind = rt["layerType"].astype(str)
        if kind in COMPUTE_LAYERS:
            per = counts.setdefault(kind, {})
            p = rt["runtimePrecision"].astype(str)
            per[p] = per.get(p, 0) + 1
    return dict(sorted(counts.items()))


def ov_built(core, model, threads: int, hint: str | None, x: np.ndarray, note: str | None = None,
             config: dict | None = None) -> Built:
    """compile_model on the CPU with one latency stream of ``threads`` threads; ``hint`` None: OpenVINO's default
    inference precision. ``config``: these compile properties instead (an artifact's own deploy line)."""
    import openvino as ov

    if config is None:
        config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        if hint:
            config["INFERENCE_PRECISION_HINT"] = hint
    compiled = core.compile_model(model, "CPU", config)
    got = compiled.get_property("INFERENCE_PRECISION_HINT")
    got = got.get_type_name() if hasattr(got, "get_type_name") else str(got)
    timed = compiled.create_infer_request()
    # staged once, as benchmark_app does: passing the array per call would add Python-side dispatch to every call
    timed.set_input_tensor(ov.Tensor(x, shared_memory=True))
    plain = compiled.create_infer_request()

    def run(b: np.ndarray) -> np.ndarray:
        plain.infer({0: np.ascontiguousarray(b, dtype=np.float32)})
        return np.array(plain.get_output_tensor(0).data, dtype=np.float32, copy=True)

    if hint and got != hint:
        note = "; ".join(filter(None, [note, f"asked for {hint}, the plugin compiled {got}"]))
    return Built(timed.infer, run, got, runtime_precisions(compiled), note)


class Shared:
    """What several variants build from, made once on first use; a failure is kept and raised to each user of it."""

    def __init__(self):
        self.memo: dict[str, object] = {}

    def get(self, key: str, make: Callable[[], object]):
        if key not in self.memo:
            try:
                self.memo[key] = make()
            except Exception as ex:  # noqa: BLE001 - re-raised below, to every variant that needs it
                self.memo[key] = ex
        if isinstance(self.memo[key], Exception):
            raise self.memo[key]
        return self.memo[key]


def ignored_scope_match(model, names: list[str]) -> dict:
    """Which ops of the converted ov.Model the ONNX node ``names`` became. OpenVINO's ONNX frontend names an op after
    its node, but splits a Conv or Gemm with a bias into ``NAME/WithoutBiases`` (the Convolution / MatMul) and an Add
    that keeps ``NAME`` (or the graph output's name): ignoring ``NAME`` alone would leave the Convolution quantized. So
    each name maps to the op of that name and the ops whose names extend it by ``/``; ``matched``: the names with an op
    of exactly that name (what NNCF's own name lookup finds), ``found``: those with any op."""
    ops = [op.get_friendly_name() for op in model.get_ops()
           if op.get_type_name() not in ("Constant", "Parameter", "Result")]
    exact = set(ops)
    per = {n: [o for o in ops if o == n or o.startswith(n + "/")] for n in names}
    return {"given": len(names), "matched": [n for n in names if n in exact],
            "found": [n for n in names if per[n]], "unmatched": [n for n in names if not per[n]],
            "ov_names": sorted({o for found in per.values() for o in found})}


# ------------------------------------------------------------------------------------------------ building
REUSED = "quantized by an earlier run of the same ONNX and calibration images (reuse folder), not timed here"


def reuse_folder(root: Path, onnx_path: Path, calib: np.ndarray, transformer: bool, ignored: list[str]) -> Path:
    """Where the quantized models of one FP32 ONNX, calibration set and NNCF settings are kept, so that another row of
    the same model (another batch size or thread count) times them without quantizing again: quantization does not
    depend on either."""
    import hashlib

    h = hashlib.sha256(Path(onnx_path).read_bytes())
    h.update(np.ascontiguousarray(calib).tobytes())
    h.update(json.dumps([calib.shape, bool(transformer), sorted(ignored)]).encode())
    return Path(root) / h.hexdigest()[:20]


def _keep(src: Path, dest: Path) -> None:
    import shutil

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".partial")
    shutil.copyfile(src, tmp)
    tmp.replace(dest)  # whole or absent: a run cut mid-copy leaves no file another run would trust


def _reused_ir(core, reuse: Path | None, stem: str, quantize: Callable[[], tuple]):
    """(model, seconds) from ``quantize()``, kept as an IR under ``reuse``; (that IR read back, None) when kept."""
    import openvino as ov

    xml = reuse / f"{stem}.xml" if reuse else None
    if xml is not None and xml.is_file() and xml.with_suffix(".bin").is_file():
        return core.read_model(str(xml)), None
    q, seconds = quantize()
    if xml is not None:
        part = reuse / f"{stem}.partial"
        part.mkdir(parents=True, exist_ok=True)
        ov.save_model(q, str(part / "m.xml"))  # weights as NNCF left them (compressed to INT8 where quantized)
        (part / "m.bin").replace(xml.with_suffix(".bin"))
        (part / "m.xml").replace(xml)  # the .xml last: present means complete
    return q, seconds


def build(name: str, ctx: dict) -> Built:
    """One variant, from the FP32 ONNX (``ctx``: the arguments of measure_ceiling, the staged input x, the Shared)."""
    import nncf
    import openvino as ov

    shared: Shared = ctx["shared"]
    threads, x, work = ctx["threads"], ctx["x"], ctx["work"]
    if name == "ort-fp32":
        return ort_built(ctx["onnx_path"], threads, x, "fp32")
    reuse: Path | None = ctx.get("reuse")
    if name.startswith("ort-int8-"):
        act = name.rsplit("-", 1)[1][:2]  # "s8" or "u8"
        kept = reuse / f"{name}.onnx" if reuse else None
        if kept is not None and kept.is_file():
            return ort_built(kept, threads, x, f"int8 {act}s8 (QDQ)", f"{qdq_note(kept)}; {REUSED}")
        source, note = shared.get("ort-pre", lambda: ort_preprocessed(ctx["onnx_path"], work))
        calib, fewer = shared.get("ort-calib", lambda: ort_calibration_images(source, ctx["calib"]))
        q = ort_int8(source, calib, work / f"{name}.onnx", act)
        if kept is not None:
            _keep(q, kept)
        return ort_built(q, threads, x, f"int8 {act}s8 (QDQ)", "; ".join(filter(None, [note, fewer, qdq_note(q)])))

    core = shared.get("core", ov.Core)
    bf16 = name.endswith("bf16")
    if bf16 and "BF16" not in ctx["capabilities"]:
        raise Skipped(f"the CPU plugin lists no BF16 in OPTIMIZATION_CAPABILITIES ({', '.join(ctx['capabilities'])})")
    calib_items = [ctx["calib"][i:i + 1] for i in range(len(ctx["calib"]))]
    if name in ("ov-fp32", "ov-bf16"):
        fp32 = shared.get("ov-fp32-model", lambda: ov.convert_model(str(ctx["onnx_path"])))
        return ov_built(core, fp32, threads, "bf16" if bf16 else "f32", x)
    if name.startswith("ov-int8-"):
        names = list(ctx["ignored_scope_names"])

        def quantize():
            model = ov.convert_model(str(ctx["onnx_path"]))  # its own copy: nncf.quantize is given a model to change
            scope = ctx["ignored_scope"] = ignored_scope_match(model, names) if names else None
            ignored = sorted({*names, *scope["ov_names"]}) if scope else None
            t = time.perf_counter()
            q = nncf.quantize(model, nncf.Dataset(calib_items), subset_size=len(calib_items),
                              model_type=nncf.ModelType.TRANSFORMER if ctx["transformer"] else None,
                              ignored_scope=nncf.IgnoredScope(names=ignored, validate=False) if ignored else None)
            return q, round(time.perf_counter() - t, 2)

        q, seconds = shared.get("ov-int8-model", lambda: _reused_ir(core, reuse, "ov-int8", quantize))
        scope = ctx.get("ignored_scope")
        note = (f"nncf.quantize {seconds} s" if seconds is not None else REUSED) + \
            ", one quantized model for ov-int8-f32 and ov-int8-bf16"
        if scope:
            note += (f"; ignored scope: {len(scope['matched'])} of {scope['given']} names matched an op by name, "
                     f"{len(scope['found'])} with the ops split from them ({len(scope['ov_names'])} ops ignored)")
        return ov_built(core, q, threads, "bf16" if bf16 else "f32", x, note)
    if name == "nncf-default":
        def quantize_default():
            t = time.perf_counter()
            q = nncf.quantize(ov.convert_model(str(ctx["onnx_path"])), nncf.Dataset(calib_items))
            return q, round(time.perf_counter() - t, 2)

        q, seconds = _reused_ir(core, reuse, "nncf-default", quantize_default)
        return ov_built(core, q, threads, None, x, f"nncf.quantize {seconds} s" if seconds is not None else REUSED)
    raise ValueError(f"unknown variant {name!r}")


# The batch each variant's outputs over the eval images are computed at, where the model's batch is dynamic: a row at
# batch 1 evaluating 1,000 images one at a time spent most of a device call's harness there (DeiT-S: 20-35 s a
# variant on 16 threads), and a prediction does not depend on the batch it was computed in beyond float summation order
EVAL_BATCH = 16


def evaluation_batch(onnx_path: Path, batch: int) -> int:
    """The row's ``batch`` where the ONNX's batch dimension is fixed, else at least EVAL_BATCH."""
    import onnx

    dims = onnx.load(str(onnx_path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    static = bool(dims) and dims[0].HasField("dim_value") and dims[0].dim_value > 0
    return batch if static else max(batch, EVAL_BATCH)


def outputs_of(built: Built, evals: np.ndarray, batch: int, keep_argmax: bool = False) -> np.ndarray:
    """The first output over all of ``evals`` in batches of ``batch``; the last batch padded with copies of its last
    image (so that a model with a fixed batch runs too), the padding's rows dropped. ``keep_argmax``: only its argmax
    over axis 1, as uint16 (a segmenter's logits over a test set are gigabytes a variant; its class map is not)."""
    parts = []
    for i in range(0, len(evals), batch):
        b = evals[i:i + batch]
        n = len(b)
        if n < batch:
            b = np.concatenate([b, np.repeat(b[-1:], batch - n, axis=0)])
        out = np.asarray(built.run(np.ascontiguousarray(b)))[:n]
        parts.append(out.argmax(axis=1).astype(np.uint16) if keep_argmax else out)
    return np.concatenate(parts)


def outputs_key(evals: np.ndarray, keep_argmax: bool) -> str:
    """The eval images' fingerprint that names a variant's kept outputs (hashed once a harness run: at 224 px 1,000
    images are 600 MB)."""
    import hashlib

    h = hashlib.sha256(np.ascontiguousarray(evals).tobytes())
    h.update(json.dumps([evals.shape, bool(keep_argmax)]).encode())
    return h.hexdigest()[:16]


def kept_outputs(reuse: Path | None, name: str, key: str) -> np.ndarray | None:
    """A library variant's outputs over the eval images ``key`` names from an earlier row of the same model (reuse
    folder), or None. Its model file is the same one (kept in the same folder); another batch size or thread count
    changes only the order of float sums, not its predictions beyond noise, and evaluating 1,000 images at batch 1 on
    4 threads cost more than a device call's harness had (ResNet-50: ONNX Runtime S8S8 alone about 80 ms an image)."""
    if reuse is None:
        return None
    f = Path(reuse) / f"outputs-{name}-{key}.npy"
    return np.load(f) if f.is_file() else None


def keep_outputs(reuse: Path, name: str, key: str, outputs: np.ndarray) -> None:
    f = Path(reuse) / f"outputs-{name}-{key}.npy"
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".partial.npy")
    np.save(tmp, outputs)
    tmp.replace(f)  # whole or absent


# ------------------------------------------------------------------------------------------------ timing
def warm(step: Callable[[], object]) -> float:
    """At least WARMUP_CALLS calls and WARMUP_S seconds; the median of those calls (ms)."""
    ts, t_end = [], time.perf_counter() + WARMUP_S
    while len(ts) < WARMUP_CALLS or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def time_round_robin(steps: dict[str, Callable[[], object]], repeats: int, min_time: float,
                     log=print) -> tuple[dict, dict]:
    """Each variant warmed up, then ``repeats`` rounds, each variant once per round, the order rotated every round.
    Returns ({name: timing}, {name: failure reason}); a variant whose call raises leaves the rounds."""
    timings, failed, calls = {}, {}, {}
    for name, step in steps.items():
        try:
            calls[name] = max(MIN_CALLS, math.ceil(min_time * 1e3 / max(warm(step), 1e-6)))
        except Exception as ex:  # noqa: BLE001 - this variant fails, the others are timed
            failed[name] = f"timing: {one_line(ex)}"
    order = [n for n in steps if n in calls]
    medians: dict[str, list[float]] = {n: [] for n in order}
    for r in range(repeats):
        k = r % len(order) if order else 0
        for name in order[k:] + order[:k]:  # none always first, or always right after the same neighbour
            if name in failed:
                continue
            step = steps[name]
            try:
                step()  # untimed: the previous variant may have pushed this one's weights out of the caches
                ts = []
                for _ in range(calls[name]):
                    t0 = time.perf_counter()
                    step()
                    ts.append((time.perf_counter() - t0) * 1e3)
            except Exception as ex:  # noqa: BLE001
                failed[name] = f"timing: {one_line(ex)}"
                continue
            medians[name].append(statistics.median(ts))
        log(f"ceiling: round {r + 1}/{repeats}: " + ", ".join(f"{n} {medians[n][-1]:.3f}" for n in order
                                                               if n not in failed and medians[n]))
    for name in order:
        if name not in failed:
            m = medians[name]
            timings[name] = {"p50_ms": round(statistics.median(m), 4), "repeat_medians_ms": [round(t, 4) for t in m],
                             "calls_per_repeat": calls[name]}
    return timings, failed


# ------------------------------------------------------------------------------------------------ the measurement
def _images(a, what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.ndim != 4 or len(a) == 0:
        raise ValueError(f"{what}: a float32 NCHW array of at least one image is needed, got shape {a.shape}")
    return a


def check_onnx(path: Path) -> None:
    """A readable ONNX with one input: what every variant needs (otherwise each would fail with the same error)."""
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as ex:  # protobuf's DecodeError and friends
        raise ValueError(f"{path} is not a readable ONNX model: {one_line(ex)}") from ex
    inputs = [i.name for i in graph.input if i.name not in {t.name for t in graph.initializer}]
    if len(inputs) != 1:
        raise ValueError(f"{path}: one input is needed, the graph has {len(inputs)} ({', '.join(inputs)})")


def _result(status: str, reason: str | None = None, build_s: float | None = None, built: Built | None = None) -> dict:
    return {"status": status, "reason": reason, "p50_ms": None, "repeat_medians_ms": [], "build_s": build_s,
            "outputs": None, "note": built.note if built else None, "precision": built.precision if built else None,
            "runtime_precisions": built.runtime_precisions if built else None}


def measure_ceiling(onnx_path: Path, calib: np.ndarray, evals: np.ndarray, batch: int, threads: int, transformer: bool,
                    work: Path, ignored_scope_names: list[str] = (), variants: list[str] | None = None,
                    repeats: int = ROUNDS, min_time: float = ROUND_MIN_TIME, log=print,
                    extra: dict[str, Callable[[np.ndarray], Built]] | None = None, keep_argmax: bool = False,
                    reuse: Path | None = None) -> dict:
    """Build every variant (a failure is that variant's result), run each over ``evals`` (at ``batch`` where the ONNX's
    batch is fixed, else at least EVAL_BATCH), time them round-robin at ``batch``.
    ``extra``: more variants timed in the same rounds, {name: make(x) → Built} (e.g. an artifact under test, loaded
    as its user deploys it). ``keep_argmax``: each variant's outputs kept as their argmax over axis 1 (segmenters).
    ``reuse``: a folder where the quantized models are kept and found again (reuse_folder: per ONNX, calibration
    images and NNCF settings), for another row of the same model; their build_s is then the reload's, and the library
    variants' outputs over the same eval images are read back from there too (``outputs_reused``; ``extra`` variants
    are always run).
    Returns {"variants": {name: result}, "cpu", "versions", "batch", "threads", "fastest", "best_fp32", ...}; each
    result's "outputs" is an ndarray (the first model output over all of ``evals``), not JSON."""
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise FileNotFoundError(f"no ONNX model at {onnx_path}")
    unknown = [v for v in (variants or ()) if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if batch < 1 or threads < 1 or repeats < 1:
        raise ValueError(f"batch, threads and repeats must be at least 1 (got {batch}, {threads}, {repeats})")
    check_onnx(onnx_path)
    calib, evals = _images(calib, "calib"), _images(evals, "evals")
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    # imported before any variant, so that no build_s counts an import
    import onnxruntime  # noqa: F401
    import openvino  # noqa: F401
    if any(v.startswith(("ov-int8", "nncf")) for v in (variants or VARIANTS)):
        import nncf  # noqa: F401
    cpu = cpu_info()
    x = np.ascontiguousarray(np.take(evals, np.arange(batch) % len(evals), axis=0))
    ctx = {"onnx_path": onnx_path.resolve(), "calib": calib, "threads": threads, "transformer": transformer,
           "work": work, "ignored_scope_names": list(ignored_scope_names), "x": x, "shared": Shared(),
           "reuse": reuse_folder(reuse, onnx_path, calib, transformer, list(ignored_scope_names)) if reuse else None,
           "capabilities": cpu["openvino_capabilities"]}
    results, built = {}, {}
    key = outputs_key(evals, keep_argmax) if ctx["reuse"] is not None else None
    makers = {**{v: (lambda v=v: build(v, ctx)) for v in VARIANTS if variants is None or v in variants},
              **{n: (lambda make=make: make(x)) for n, make in (extra or {}).items()}}
    eval_batch = evaluation_batch(onnx_path, batch)
    for name, make in makers.items():
        log(f"ceiling: building {name}")
        t0 = time.perf_counter()
        eval_s = None
        try:
            b = make()
            seconds = round(time.perf_counter() - t0, 2)
            results[name] = _result("ok", build_s=seconds, built=b)
            kept = kept_outputs(ctx["reuse"], name, key) if name in VARIANTS else None
            if kept is None:
                t1 = time.perf_counter()
                kept = outputs_of(b, evals, eval_batch, keep_argmax)
                eval_s = results[name]["eval_s"] = round(time.perf_counter() - t1, 2)
                if ctx["reuse"] is not None and name in VARIANTS:
                    keep_outputs(ctx["reuse"], name, key, kept)
            else:
                results[name]["outputs_reused"] = True
            results[name]["outputs"] = kept
            built[name] = b
        except Skipped as ex:
            results[name] = _result("skipped", str(ex))
        except Exception as ex:  # noqa: BLE001 - this variant failed; the others still run
            results[name] = {**results.get(name, _result("failed")), "status": "failed", "reason": one_line(ex),
                             "build_s": round(time.perf_counter() - t0, 2)}
        r = results[name]
        how = ""
        if r["status"] == "ok":
            built_how = f"built in {r['build_s']} s" + (", model reused" if REUSED in (r.get("note") or "") else "")
            evaluated = ("outputs reused" if r.get("outputs_reused")
                         else f"{len(evals)} images evaluated at batch {eval_batch} in {eval_s} s")
            how = f" ({built_how}; {evaluated})"
        log(f"ceiling: {name}: {r['status']}" + (f" ({r['reason']})" if r["reason"] else how))
    timings, failed = time_round_robin({n: b.step for n, b in built.items()}, repeats, min_time, log)
    for name, t in timings.items():
        results[name].update(t)
    for name, why in failed.items():
        results[name].update(status="failed", reason=why)
    # the ceiling is the libraries' own variants: an extra (the artifact under test) is timed beside them, not among them
    ok = {n: r["p50_ms"] for n, r in results.items() if r["status"] == "ok" and n in VARIANTS}
    fp32 = [ok[n] for n in ("ort-fp32", "ov-fp32") if n in ok]
    return {"variants": results, "cpu": cpu, "versions": versions(), "batch": batch, "threads": threads,
            "transformer": transformer, "onnx": str(onnx_path), "calib_images": len(calib), "eval_images": len(evals),
            "ignored_scope": ctx.get("ignored_scope"), "fastest": min(ok, key=ok.get) if ok else None,
            "best_fp32": min(fp32) if fp32 else None}


# ------------------------------------------------------------------------------------------------ the command
def to_json(doc: dict) -> dict:
    """The measurement without the outputs, each variant with its top-1 agreement with the FP32 reference (ort-fp32,
    else ov-fp32) where both ran."""
    res = doc["variants"]
    ref = next((n for n in ("ort-fp32", "ov-fp32") if res.get(n, {}).get("outputs") is not None), None)
    out = {**doc, "agreement_reference": ref, "variants": {}}
    for name, r in res.items():
        row = {k: v for k, v in r.items() if k != "outputs"}
        if ref and r.get("outputs") is not None:
            try:
                row["agreement_with_fp32"] = round(agreement(r["outputs"], res[ref]["outputs"]), 4)
            except ValueError as ex:
                row["agreement_with_fp32"] = None
                row["note"] = "; ".join(filter(None, [row.get("note"), f"agreement: {ex}"]))
        out["variants"][name] = row
    return out


def table(doc: dict) -> str:
    best = doc.get("best_fp32")
    lines = [f"{'variant':15s} {'status':8s} {'p50 ms':>9s} {'x fp32':>7s} {'agree':>6s} {'build s':>8s}  precision"]
    for name, r in doc["variants"].items():
        p50, agree = r.get("p50_ms"), r.get("agreement_with_fp32")
        speed = f"{best / p50:7.2f}" if p50 and best else f"{'':7s}"
        rp = r.get("runtime_precisions")
        lines.append(f"{name:15s} {r['status']:8s} {p50 if p50 is not None else float('nan'):9.3f} {speed} "
                     f"{'' if agree is None else f'{agree:6.3f}':>6s} {r.get('build_s') or 0:8.1f}  "
                     f"{r.get('precision') or ''}{' ' + json.dumps(rp) if rp else ''}"
                     + (f"  [{r['reason']}]" if r.get("reason") else ""))
    lines.append(f"fastest: {doc.get('fastest')}   best fp32: {best} ms   "
                 f"batch {doc['batch']}, threads {doc['threads']}")
    return "\n".join(lines)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--onnx", type=Path, required=True, help="the FP32 ONNX (one input, dynamic batch)")
    ap.add_argument("--calib", type=Path, required=True, help=".npy: float32 NCHW calibration images, preprocessed")
    ap.add_argument("--evals", type=Path, required=True, help=".npy: float32 NCHW eval images, preprocessed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--transformer", action="store_true", help="NNCF's model_type TRANSFORMER for ov-int8-*")
    ap.add_argument("--ignored-scope", nargs="*", default=[], help="ONNX node names NNCF leaves float (ov-int8-*)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, help="only these (default: all)")
    ap.add_argument("--repeats", type=int, default=ROUNDS)
    ap.add_argument("--min-time", type=float, default=ROUND_MIN_TIME,
                    help=f"seconds: a round's shortest timing (default {ROUND_MIN_TIME})")
    ap.add_argument("--work", type=Path, help="where the quantized ONNX files go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    calib, evals = np.load(a.calib), np.load(a.evals)
    with tempfile.TemporaryDirectory(prefix="ceiling-") as tmp:
        t0 = time.perf_counter()
        doc = measure_ceiling(a.onnx, calib, evals, a.batch, a.threads, a.transformer, a.work or Path(tmp),
                              a.ignored_scope, a.variants, a.repeats, a.min_time,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    doc = {"schema": "realsize_ceiling/1", "command": "python " + " ".join(sys.argv),
           "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "wall_s": round(time.perf_counter() - t0, 1), **to_json(doc)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
