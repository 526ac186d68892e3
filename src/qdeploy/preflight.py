"""Checks that run before the first variant: everything a user can get wrong fails here, with one line
naming the key, file or layer, instead of after the FP32 variants were evaluated and benchmarked.

- calibration data of int8 variants: present, readable, disjoint from the evaluation images;
- the model on one real batch at ``model.preprocess.input_size`` (PyTorch, or ONNX Runtime for .onnx);
  a fixed-shape ONNX input must agree with the configured size and batch sizes;
- output count vs the data: classes of the folder (classification), label values (segmentation);
- every evaluation image decodes (or is skipped and listed, with ``on_error: skip``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import numpy as np
import onnxruntime as ort
import torch

from qdeploy.artifacts import ArtifactKind, ArtifactRequest, Builder
from qdeploy.config import RunConfig
from qdeploy.data import make_batches, normalize
from qdeploy.errors import DataError, ModelError, QDeployError
from qdeploy.models import is_onnx_source
from qdeploy.tasks import get_task
from qdeploy.utils.inputs import check_calibration_cache
from qdeploy.utils.log import log
from qdeploy.utils.onnx_graph import OnnxGraph

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def first_line(exc: BaseException) -> str:
    """An exception as one readable line: no ANSI colour codes, no traceback-like continuation."""
    text = _ANSI.sub("", str(exc)).strip()
    return (text.splitlines() or [type(exc).__name__])[0][:300]


def class_subset_hint(outputs: int, folders: Optional[list]) -> str:
    """How to evaluate on a subset of a classifier's classes: name all of them, in output order, in data.eval.classes."""
    shown = ", ".join(str(f) for f in (folders or [])[:3])
    return (f"for a subset of the model's classes, list all {outputs} of them in output order in data.eval.classes: a YAML "
            f"list of folder names (classes: [{shown}{', ...' if shown else '...'}], {outputs} entries) or a file with one "
            "name per line; folders it lists that are absent here are fine")


def check_qat_data(cfg: RunConfig, eval_batches) -> None:
    """QAT's training images exist (the spec resolves) and none of them is an evaluation image."""
    spec = cfg.qat_training_data()  # ConfigError naming the missing key
    train = make_batches(spec, cfg.model.preprocess, cfg.model.task, progress=False)
    eval_paths = {str(p) for p, _ in getattr(eval_batches.dataset, "samples", [])}
    shared = [str(p) for p, _ in getattr(train.dataset, "samples", []) if str(p) in eval_paths]
    if shared:
        raise QDeployError(f"QAT's training images ({spec.root}) include {len(shared)} of data.eval's (e.g. {shared[0]}): "
                           "training on evaluation images inflates the accuracy QAT reports; use a disjoint folder or split "
                           "(count + complement)")
    if train.num_samples == 0:
        raise DataError(f"QAT training data {spec.root}: no image found")


def check_calibration(cfg: RunConfig, variants, eval_batches):
    """The calibration Batches (decoded) when an int8 variant needs them, else None."""
    if any(v.int8 is not None and v.int8.quantizer == "qat" for v in variants):
        check_qat_data(cfg, eval_batches)
    needs = [v for v in variants if v.int8 is not None and not v.int8.calibration_cache]
    for v in variants:
        if v.int8 is not None and v.int8.calibration_cache:
            check_calibration_cache(v.index, v.int8.calibration_cache)
    if not needs:
        # TensorRT 11's FP16 ONNX keeps FP32 where calibration activations overflow: decode them when given
        trt_fp16 = any(v.engine.name == "tensorrt" and v.precision == "fp16" for v in variants)
        return _decode_calibration(cfg, eval_batches) if trt_fp16 and cfg.data.calibration is not None else None
    if cfg.data.calibration is None:
        raise QDeployError(f"variant {needs[0].label} is INT8 and needs calibration images: add data.calibration to the config "
                           "(or give a calibration_cache)")
    return _decode_calibration(cfg, eval_batches)


def _decode_calibration(cfg: RunConfig, eval_batches):
    calib = make_batches(cfg.data.calibration, cfg.model.preprocess, cfg.model.task, desc="decode calibration images")
    eval_paths = {str(p) for p, _ in getattr(eval_batches.dataset, "samples", [])}
    shared = [str(p) for p, _ in getattr(calib.dataset, "samples", []) if str(p) in eval_paths]
    if shared:
        raise QDeployError(
            f"data.calibration shares {len(shared)} images with data.eval (e.g. {shared[0]}): "
            "calibrating on evaluation images inflates INT8 accuracy; use a disjoint folder or split (count + complement)")
    for _ in calib:  # decode now: an unreadable calibration image stops the run before any variant
        pass
    if calib.num_samples == 0:
        raise DataError(f"data.calibration: no image under {cfg.data.calibration.root} could be decoded")
    return calib


def _onnx_input_shape(path) -> tuple[str, list]:
    graph = OnnxGraph.load(path)
    name = graph.input_names[0]
    info = next(i for i in graph.graph.input if i.name == name)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in info.type.tensor_type.shape.dim]
    return name, dims


def fit_static_batch(cfg: RunConfig) -> tuple[RunConfig, Optional[dict]]:
    """An ONNX source with a static batch N (hub exports: mostly 1) runs: evaluation and calibration in batches of N,
    timing at batch N only, whatever the config asked (the model takes no other size). Returns the adjusted config and a
    record for results.json (``model.check.static_batch``; ``message`` when the config changed, warned once the checks
    pass), or (cfg, None) for a dynamic batch or a PyTorch model. Image counts that are not a multiple of N are refused
    by :func:`check_static_batch`: the last images would fit no batch."""
    if not is_onnx_source(cfg.model.source):
        return cfg, None
    path = Path(cfg.model.source).expanduser()
    try:
        name, dims = _onnx_input_shape(path)
    except Exception:  # noqa: BLE001 - a missing or broken file is reported by the model check, with its own message
        return cfg, None
    if len(dims) != 4 or not dims[0]:  # not an image input (the model check says so), or a dynamic batch
        return cfg, None
    n = dims[0]
    record = {"batch": n, "input": name, "shape": dims}
    skipped = sorted({b for b in cfg.bench.batch_sizes if b != n}) if cfg.bench.enabled else []
    data = {"eval": cfg.data.eval.model_copy(update={"batch_size": n})}
    if cfg.data.calibration is not None:
        data["calibration"] = cfg.data.calibration.model_copy(update={"batch_size": n})
    if all(data[k].batch_size == getattr(cfg.data, k).batch_size for k in data) and not skipped:
        return cfg, record
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update=data),
                                 "bench": cfg.bench.model_copy(update={"batch_sizes": [n]})})
    shape = "x".join("?" if d is None else str(d) for d in dims)
    message = (f"{path.name} has a static batch of {n} (input '{name}' [{shape}]): evaluating in batches of {n}"
               + (f" and timing batch {n} only" if cfg.bench.enabled else "")
               + (f"; bench.batch_sizes {', '.join(map(str, skipped))} skipped (export the model with a dynamic batch "
                  "axis to time them)" if skipped else ""))
    return cfg, {**record, "skipped_batch_sizes": skipped, "message": message}


def check_static_batch(static: Optional[dict], batches, key: str) -> None:
    """Every image of ``batches`` fits a batch of the model's static size: a last partial batch would need padding
    images (which would count in the metrics or the ranges) or dropping some (the figures would not cover the data set
    the config names), so the count is refused here, before any work, with the fix."""
    if static is None or batches is None or batches.num_samples % static["batch"] == 0:
        return
    n, count = static["batch"], batches.num_samples
    fix = f"set {key}.count to {count // n * n} (or another multiple of {n})" if count > n else "add images"
    raise DataError(f"{key} has {count} images, not a multiple of the model's static batch of {n} (input "
                    f"'{static['input']}'; qdeploy neither pads nor drops images): {fix}, or export the model with a "
                    "dynamic batch axis")


def _check_onnx_shape(cfg: RunConfig, path) -> None:
    pre = cfg.model.preprocess
    _, dims = _onnx_input_shape(path)
    if len(dims) != 4:
        raise ModelError(f"ONNX model {path} has a {len(dims)}-D input; qdeploy feeds images as (N, C, H, W)")
    n, c, h, w = dims
    if c is not None and c != pre.channels:
        raise ModelError(f"ONNX model {path} expects {c} input channels but model.preprocess.mode {pre.mode} gives {pre.channels}")
    if (h is not None and h != pre.input_size[0]) or (w is not None and w != pre.input_size[1]):
        raise ModelError(f"ONNX model {path} has a fixed input of {h}x{w} (HxW) but model.preprocess.input_size is "
                         f"{pre.input_size[0]}x{pre.input_size[1]}: set input_size to the model's size")
    if n is not None:
        wrong = sorted({b for b in [cfg.data.eval.batch_size, *cfg.bench.batch_sizes] if b != n})
        if wrong:
            raise ModelError(f"ONNX model {path} has a fixed batch size of {n}, but data.eval.batch_size / bench.batch_sizes "
                             f"ask for {wrong}: set them to {n} or export with a dynamic batch axis")


def _run_once(cfg: RunConfig, builder: Builder, x: np.ndarray) -> np.ndarray:
    pre = cfg.model.preprocess
    where = (f"model.preprocess.input_size {list(pre.input_size)}: the model fails on a real batch of shape "
             f"{tuple(x.shape)}")
    if builder.has_torch:
        model = builder.torch_model()
        try:
            with torch.inference_mode():
                out = model(torch.from_numpy(x))
        except QDeployError:
            raise
        except Exception as e:
            raise ModelError(f"{where}: {first_line(e)}") from None
        return out.float().numpy()
    fp32 = builder.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
    _check_onnx_shape(cfg, fp32.path)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(str(fp32.path), opts, providers=["CPUExecutionProvider"])
        return sess.run(None, {sess.get_inputs()[0].name: x})[0]
    except Exception as e:
        raise ModelError(f"{where} in ONNX Runtime: {first_line(e)}") from None


def check_model(cfg: RunConfig, builder: Builder, eval_batches, decode_all: bool = True,
                static: Optional[dict] = None) -> dict:
    """One real batch through the model; output shape vs task and data. Returns what was checked. ``static``: the
    :func:`fit_static_batch` record of an ONNX model with a static batch (fed exactly that many images)."""
    task = get_task(cfg.model.task)
    if decode_all:
        label_max = -1
        ignore = cfg.data.eval.ignore_index
        for _, labels in eval_batches:  # decodes (and caches) every image now, so a bad one stops the run here
            if task.pixel_labels:
                valid = labels[labels != ignore]
                if valid.size:
                    label_max = max(label_max, int(valid.max()))
        if eval_batches.num_samples == 0:
            raise DataError(f"data.eval: no image under {cfg.data.eval.root} could be decoded")
        if eval_batches.skipped:
            log(f"data.eval: skipped {len(eval_batches.skipped)} unreadable images (on_error: skip), "
                f"e.g. {eval_batches.skipped[0]['path']}")
    if static is not None:
        if decode_all:
            check_static_batch(static, eval_batches, "data.eval")
        images, labels = eval_batches.first(static["batch"])
        images, labels = (a[np.arange(static["batch"]) % len(a)] for a in (images, labels))  # bench-only: fewer images
    else:
        images, labels = eval_batches.first(2)
    x = normalize(images, cfg.model.preprocess)
    out = _run_once(cfg, builder, x)
    if not np.all(np.isfinite(out)):
        raise ModelError("the model produces NaN/Inf on real images: check model.preprocess (mean/std) and the weights")
    check = {"batch_shape": list(x.shape), "output_shape": list(out.shape)}
    if task.check_output is not None:  # a task that decodes its outputs checks them itself (detection)
        try:
            check.update(task.bind(cfg.model).check_output(out, labels, eval_batches.class_names))
        except ValueError as e:
            raise ModelError(f"model.task {task.name}: {e}") from None
    elif not task.pixel_labels:  # per-image labels: (N, classes) outputs; else (N, classes, H, W) beside label maps
        if out.ndim != 2:
            raise ModelError(f"model.task classification needs an output of shape (N, classes); the model gives {tuple(out.shape)} "
                             "(set model.output or model.task)")
        classes = getattr(eval_batches, "num_classes", None)
        if classes is not None and out.shape[1] != classes:
            raise ModelError(
                f"the model has {out.shape[1]} outputs but data.eval ({cfg.data.eval.root}) has {classes} classes: "
                "labels would not match predictions (" + class_subset_hint(int(out.shape[1]), eval_batches.class_names) + ")")
        check["outputs"] = int(out.shape[1])
    else:
        if out.ndim != 4:
            raise ModelError(f"model.task segmentation needs an output of shape (N, classes, H, W); the model gives {tuple(out.shape)} "
                             "(set model.output, e.g. 'out')")
        classes = int(out.shape[1])
        names = eval_batches.class_names
        if names is not None and len(names) != classes:
            raise ModelError(f"the model has {classes} output classes but data.eval names {len(names)} classes")
        if decode_all and label_max >= classes:
            raise ModelError(f"the label maps of data.eval hold class value {label_max}, but the model has only {classes} "
                             f"output classes (0..{classes - 1}); set data.eval.ignore_index if {label_max} means 'void'")
        if tuple(out.shape[2:]) != tuple(labels.shape[1:]):
            raise ModelError(f"the model's output is {tuple(out.shape[2:])} (HxW) but the label maps are {tuple(labels.shape[1:])}")
        check["outputs"] = classes
    log(f"check: model on a real batch {tuple(x.shape)} → {tuple(out.shape)}")
    return check
