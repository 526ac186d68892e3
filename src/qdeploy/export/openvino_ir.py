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
_TIMED_RUNS = 20


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


def ir_files(xml: Path) -> list[Path]:
    """The files an IR consists of: the .xml and the .bin beside it."""
    return [Path(xml), Path(xml).with_suffix(".bin")]


def _time_and_run(model, x: np.ndarray) -> tuple[float, np.ndarray]:
    """(median ms of one inference at f32, the output) of an ov.Model compiled on the CPU."""
    import openvino as ov

    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    out = np.array(request.infer({0: x})[compiled.outputs[0]], dtype=np.float32, copy=True)
    for _ in range(3):
        request.infer({0: x})
    times = []
    for _ in range(_TIMED_RUNS):
        t0 = time.perf_counter()
        request.infer({0: x})
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def _torch_route(module, x: np.ndarray, onnx_model):
    """The module converted by OpenVINO's PyTorch frontend, its input shaped as the ONNX's (dynamic batch stays
    dynamic)."""
    import warnings

    import openvino as ov
    import torch

    shape = [d.get_length() if d.is_static else -1 for d in onnx_model.inputs[0].get_partial_shape()]
    # the frontend traces with torch.jit.trace, which torch 2.9+ marks deprecated on every call
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
        return ov.convert_model(module.eval(), example_input=torch.from_numpy(x), input=[ov.PartialShape(shape)])


def convert_fp32(onnx_path: Path, folder: Path, module_loader: Optional[Callable] = None,
                 images: Optional[np.ndarray] = None) -> tuple[Path, dict]:
    """(model.xml, info) of the FP32 IR in ``folder``: the ONNX route, or the PyTorch route where ``module_loader``
    gives the module and it is faster on ``images`` (one image is timed) with the same outputs."""
    import openvino as ov

    from qdeploy.utils.log import log

    try:
        from_onnx = ov.convert_model(str(onnx_path))
    except Exception as e:  # noqa: BLE001 - the frontend's own error, named
        raise ExportError(f"OpenVINO {ov.__version__.split('-')[0]} could not convert {Path(onnx_path).name} to an "
                          f"IR: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}") from None
    info: dict = {"route": "onnx", "openvino": ov.__version__.split("-")[0]}
    chosen = from_onnx
    if module_loader is not None and images is not None and len(images):
        x = np.ascontiguousarray(images[:1], dtype=np.float32)
        chosen, info["routes"] = _pick_route(from_onnx, module_loader, x)
        info["route"] = "pytorch" if chosen is not from_onnx else "onnx"
        log(f"export: OpenVINO IR from the {info['route']} route ({info['routes']['why']})")
    return save_ir(chosen, folder), info


def _pick_route(from_onnx, module_loader: Callable, x: np.ndarray):
    """(the ov.Model to keep, what was measured): the PyTorch route replaces the ONNX one only if it converts, compiles,
    gives the same outputs and is ``ROUTE_MIN_GAIN`` faster."""
    onnx_ms, onnx_out = _time_and_run(from_onnx, x)
    record: dict = {"onnx_ms": round(onnx_ms, 4), "image_shape": list(x.shape)}
    try:
        from_torch = _torch_route(module_loader(), x, from_onnx)
        torch_ms, torch_out = _time_and_run(from_torch, x)
    except Exception as e:  # noqa: BLE001 - the PyTorch frontend's failure only removes that route
        record["why"] = f"the PyTorch route failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        return from_onnx, record
    record["pytorch_ms"] = round(torch_ms, 4)
    scale = float(np.abs(onnx_out).max()) or 1.0
    diff = float(np.abs(onnx_out - torch_out).max()) / scale if onnx_out.shape == torch_out.shape else float("inf")
    record["max_relative_difference"] = diff
    if diff > ROUTE_TOLERANCE:
        record["why"] = (f"the PyTorch route's outputs differ from the ONNX route's by {diff:.2g} (relative), more than "
                         f"{ROUTE_TOLERANCE:g}: kept the ONNX route, which qdeploy verified against PyTorch")
        return from_onnx, record
    if torch_ms < onnx_ms * (1 - ROUTE_MIN_GAIN):
        record["why"] = f"the PyTorch route ran in {torch_ms:.3f} ms vs {onnx_ms:.3f} ms from the ONNX"
        return from_torch, record
    record["why"] = (f"{onnx_ms:.3f} ms from the ONNX vs {torch_ms:.3f} ms from the PyTorch module: not "
                     f"{ROUTE_MIN_GAIN:.0%} faster, so the ONNX route (its node names are the placement plan's)")
    return from_onnx, record
