"""OpenVINO IR (``model.xml`` + ``model.bin``): the FP32 model as OpenVINO's users deploy it, converted once by
``openvino.convert_model`` and compiled from the file by engine ``openvino``.

Two routes for a PyTorch source: the verified FP32 ONNX (``ov.convert_model(path)``, OpenVINO's ONNX frontend) and the
module itself (``ov.convert_model(module, example_input=..., input=...)``, its PyTorch frontend). Both are converted,
compiled with an f32 precision hint and timed on the run's real images; the faster one is kept if its outputs match the
other's, and the artifact says which and by how much. An ONNX or Keras source has the ONNX route only.

API used (openvino 2026.4, openvino/_ov_api.py and openvino/tools/ovc/convert.py): ``convert_model(input_model,
example_input=, input=)``, ``save_model(model, path, compress_to_fp16=)`` (its default compresses float weights to
FP16 in the .bin: an FP32 artifact says False), ``Core.compile_model``, ``CompiledModel.create_infer_request``.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from qdeploy.errors import ExportError

XML_NAME = "model.xml"
# outputs of the two routes closer than this (relative to the output's largest magnitude) are the same model: both are
# FP32 graphs of one network, differing only by the frontends' op decompositions and the kernels' summation order
ROUTE_TOLERANCE = 1e-3
# the PyTorch route is kept only if it is this much faster: the same network compiled twice times within the run-to-run
# noise of a CPU, and the ONNX route's node names are the ones qdeploy's placement plan (exclude, prediction head) reads
ROUTE_MIN_GAIN = 0.05
# the two routes are timed side by side, alternating, each round's median kept: a shared CPU's speed moves by tens of
# percent over seconds (the real-size suite's rounds on the Xeon), so two timings one after the other can differ by
# more than the gain asked for while both routes compile to the same graph
_ROUTE_ROUNDS = 5
_CALLS_PER_ROUND = 6


def save_ir(model, folder: Path, compress_to_fp16: bool = False) -> Path:
    """Write ``model`` as ``folder/model.xml`` + ``model.bin``, atomically: the folder appears complete or not at all.
    ``compress_to_fp16`` False keeps FP32 weights FP32 (openvino.save_model's default would round them to FP16)."""
    import openvino as ov

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        ov.save_model(model, str(staging / XML_NAME), compress_to_fp16=compress_to_fp16)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder / XML_NAME


def _compiled_request(model, x: np.ndarray):
    """(an infer request of ``model`` compiled on the CPU at f32 with ``x`` staged, its output on ``x``)."""
    import openvino as ov

    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    request.set_input_tensor(ov.Tensor(x, shared_memory=True))
    request.infer()
    out = np.array(request.get_output_tensor(0).data, dtype=np.float32, copy=True)
    for _ in range(3):
        request.infer()
    return request, out


def _interleaved_ms(requests: list) -> list[float]:
    """Each request's median (ms) of its round medians, the requests timed in turn, round after round."""
    rounds: list[list[float]] = [[] for _ in requests]
    for r in range(_ROUTE_ROUNDS):
        for i in (range(len(requests)) if r % 2 == 0 else reversed(range(len(requests)))):
            request = requests[i]
            request.infer()  # the other route's run may have pushed this one's weights out of the caches
            times = []
            for _ in range(_CALLS_PER_ROUND):
                t0 = time.perf_counter()
                request.infer()
                times.append((time.perf_counter() - t0) * 1e3)
            rounds[i].append(statistics.median(times))
    return [statistics.median(m) for m in rounds]


def _torch_route(module, x: np.ndarray, shape: list):
    """The module converted by OpenVINO's PyTorch frontend, its input shaped ``shape`` (-1: dynamic, as the ONNX's)."""
    import warnings

    import openvino as ov
    import torch

    # the frontend traces with torch.jit.trace, which torch 2.9+ marks deprecated on every call
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
        return ov.convert_model(module.eval(), example_input=torch.from_numpy(x), input=[ov.PartialShape(shape)])


def onnx_input_shape(onnx_path: Path) -> list:
    """The ONNX's input shape, -1 for each dynamic dimension."""
    import onnx

    dims = onnx.load(str(onnx_path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else -1 for d in dims]


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # the ONNX frontend's report names the unconverted ops on a line after its first
    named = [ln.strip() for ln in text.splitlines() if "Conversion is failed for" in ln or "No conversion rule" in ln]
    return (named[0] if named else (text.splitlines() or [""])[0])[:300]


def _pool_input_dims(model, names: list[str]) -> dict:
    """{tensor: its spatial dims} for these tensors, read from shape inference where it knows them, else from one ONNX
    Runtime run of zeros at the model's static input shape (computed Pads, as in HF EfficientNet's "same" padding,
    leave shape inference without the spatial dims); {} where the input shape is not static."""
    import onnx

    dims: dict = {}
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        known = {v.name: v.type.tensor_type.shape for v in list(inferred.graph.value_info) + list(model.graph.input)}
    except Exception:  # noqa: BLE001 - shapes from the run below
        known = {}
    for name in names:
        shape = known.get(name)
        if shape is not None and len(shape.dim) > 2 and all(d.HasField("dim_value") for d in shape.dim[2:]):
            dims[name] = [d.dim_value for d in shape.dim[2:]]
    missing = [n for n in names if n not in dims]
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if not missing or len(inputs) != 1:
        return dims
    in_dims = inputs[0].type.tensor_type.shape.dim
    if len(in_dims) < 3 or any(not d.HasField("dim_value") for d in in_dims[1:]):
        return dims
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in missing)
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
        x = np.zeros([1] + [d.dim_value for d in in_dims[1:]], np.float32)
        outs = session.run(missing, {inputs[0].name: x})
    except Exception:  # noqa: BLE001 - no shapes, no rewrite
        return dims
    dims.update({n: list(o.shape[2:]) for n, o in zip(missing, outs)})
    return dims


def _with_whole_input_pools_global(onnx_path: Path):
    """The ONNX (an in-memory onnx.ModelProto) with every AveragePool whose window covers its whole input (kernel ≥ the
    input's static height and width, no padding) replaced by GlobalAveragePool; None when there is none.

    Why: OpenVINO 2026.4.1's ONNX and PyTorch frontends both refuse a pool kernel larger than its input ("Check
    'cmp::le(kernel, dim...)'"), which Hugging Face's EfficientNet uses as its head pool (kernel = hidden size, ceil
    mode). Exact: with no padding (ONNX counts only the input's elements), one window over the whole input is its mean,
    which is what GlobalAveragePool computes."""
    import onnx

    model = onnx.load(str(onnx_path))
    pools = []
    for n in model.graph.node:
        if n.op_type != "AveragePool":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if any(p != 0 for p in attrs.get("pads", [])) or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            continue
        pools.append((n, attrs.get("kernel_shape", [])))
    if not pools:
        return None
    dims = _pool_input_dims(model, [n.input[0] for n, _ in pools])
    changed = 0
    for n, kernel in pools:
        d = dims.get(n.input[0])
        if not d or len(kernel) != len(d) or any(k < v for k, v in zip(kernel, d)):
            continue
        n.op_type = "GlobalAveragePool"
        del n.attribute[:]
        changed += 1
    return model if changed else None


def convert(onnx_path: Path, module_loader: Optional[Callable] = None,
            images: Optional[np.ndarray] = None) -> tuple[object, dict]:
    """(ov.Model, {"route", "why"?}): the FP32 ONNX converted by OpenVINO's ONNX frontend, or, where that frontend
    cannot convert an op and the source is a PyTorch module, the module converted by the PyTorch frontend (HF
    EfficientNet's ceil-mode AveragePool: "Conversion is failed for: AveragePool-17" in OpenVINO 2026.4.1)."""
    import openvino as ov

    try:
        return ov.convert_model(str(onnx_path)), {"route": "onnx"}
    except Exception as e:  # noqa: BLE001 - the frontend's own error, named
        why = (f"OpenVINO {ov.__version__.split('-')[0]} could not convert {Path(onnx_path).name}: {type(e).__name__}: "
               f"{_first_line(e)}")
    rewritten = _with_whole_input_pools_global(onnx_path)
    if rewritten is not None:
        import onnx

        with tempfile.TemporaryDirectory(prefix="qdeploy-ov-") as tmp:
            onnx.save(rewritten, str(Path(tmp) / "model.onnx"))
            try:  # the ov.Model holds its weights: the file may go once converted
                return ov.convert_model(str(Path(tmp) / "model.onnx")), {
                    "route": "onnx", "why": f"{why}; converted with each AveragePool whose window covers its whole "
                                            "input read as GlobalAveragePool"}
            except Exception:  # noqa: BLE001 - not the only op it refuses: the PyTorch route, or the first reason
                pass
    if module_loader is None:
        raise ExportError(why)
    shape = onnx_input_shape(onnx_path)
    x = (np.ascontiguousarray(images[:1], dtype=np.float32) if images is not None and len(images)
         else np.zeros([1 if d < 0 else d for d in shape], np.float32))
    try:
        model = _torch_route(module_loader(), x, shape)
    except Exception as e:  # noqa: BLE001 - both frontends failed: both reasons
        raise ExportError(f"{why}; and from the PyTorch module: {type(e).__name__}: {_first_line(e)}") from None
    return model, {"route": "pytorch", "why": f"{why}; converted from the PyTorch module instead"}


def convert_fp32(onnx_path: Path, folder: Path, module_loader: Optional[Callable] = None,
                 images: Optional[np.ndarray] = None) -> tuple[Path, dict]:
    """(model.xml, info) of the FP32 IR in ``folder``: the ONNX route, or the PyTorch route where ``module_loader``
    gives the module and it is faster on ``images`` (one image is timed) with the same outputs, or where the ONNX
    frontend cannot convert the model."""
    import openvino as ov

    from qdeploy.utils.log import log

    model, info = convert(onnx_path, module_loader, images)
    info["openvino"] = ov.__version__.split("-")[0]
    if info["route"] == "onnx" and module_loader is not None and images is not None and len(images):
        x = np.ascontiguousarray(images[:1], dtype=np.float32)
        chosen, info["routes"] = _pick_route(model, module_loader, x)
        info["route"] = "pytorch" if chosen is not model else "onnx"
        model = chosen
        log(f"export: OpenVINO IR from the {info['route']} route ({info['routes']['why']})")
    elif info["route"] == "pytorch":
        log(f"export: OpenVINO IR from the PyTorch route ({info['why']})")
    return save_ir(model, folder), info


def _pick_route(from_onnx, module_loader: Callable, x: np.ndarray):
    """(the ov.Model to keep, what was measured): the PyTorch route replaces the ONNX one only if it converts, compiles,
    gives the same outputs and is ``ROUTE_MIN_GAIN`` faster, the two timed in alternating rounds."""
    onnx_request, onnx_out = _compiled_request(from_onnx, x)
    record: dict = {"image_shape": list(x.shape)}
    try:
        shape = [d.get_length() if d.is_static else -1 for d in from_onnx.inputs[0].get_partial_shape()]
        from_torch = _torch_route(module_loader(), x, shape)
        torch_request, torch_out = _compiled_request(from_torch, x)
    except Exception as e:  # noqa: BLE001 - the PyTorch frontend's failure only removes that route
        record["why"] = f"the PyTorch route failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        return from_onnx, record
    scale = float(np.abs(onnx_out).max()) or 1.0
    diff = float(np.abs(onnx_out - torch_out).max()) / scale if onnx_out.shape == torch_out.shape else float("inf")
    record["max_relative_difference"] = diff
    if diff > ROUTE_TOLERANCE:
        record["why"] = (f"the PyTorch route's outputs differ from the ONNX route's by {diff:.2g} (relative), more than "
                         f"{ROUTE_TOLERANCE:g}: kept the ONNX route, which qdeploy verified against PyTorch")
        return from_onnx, record
    onnx_ms, torch_ms = _interleaved_ms([onnx_request, torch_request])
    record["onnx_ms"], record["pytorch_ms"] = round(onnx_ms, 4), round(torch_ms, 4)
    if torch_ms < onnx_ms * (1 - ROUTE_MIN_GAIN):
        record["why"] = f"the PyTorch route ran in {torch_ms:.3f} ms vs {onnx_ms:.3f} ms from the ONNX"
        return from_torch, record
    record["why"] = (f"{onnx_ms:.3f} ms from the ONNX vs {torch_ms:.3f} ms from the PyTorch module: not "
                     f"{ROUTE_MIN_GAIN:.0%} faster, so the ONNX route (its node names are the placement plan's)")
    return from_onnx, record
