"""Quantizer ``qat``: PTQ (ModelOpt, TensorRT placement) → fine-tune (quantize/qat.py) → an INT8 artifact.

One training serves both placements:
- ``placement: tensorrt``: the fine-tuned fake-quant model exported as TensorRT Q/DQ ONNX (what ``qdeploy qat`` writes);
- ``placement: onnxruntime``: the fine-tuned *weights* in a float model (BN stays folded, the depthwise equalization
  folded back into the weights, every quantizer off), exported to ONNX and quantized by the ``onnx`` quantizer in
  ONNX Runtime's placement with the variant's method. ONNX Runtime's CPU kernels want a different Q/DQ layout
  (uint8 activations, SiLU/hardswish whole, its own Add/Concat rules) than the one the model was trained with, so
  the ranges are calibrated again on the fine-tuned weights; the weights are what QAT contributes there.

Training runs once per (model, PTQ start, qat: settings, training images) in a folder keyed by that fingerprint
(``cache_dir/qat/<fingerprint>``; for ``qdeploy qat --out DIR``, :func:`command_folder`, keyed by DIR): an interrupted
run resumes there, and a second variant of the same training (the other placement) loads the finished checkpoint
instead of training again. The folder is never ``--out`` itself: ``--out`` is written whole, at the end.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from qdeploy.config import Int8Config, QatConfig
from qdeploy.data import normalize
from qdeploy.errors import ConfigError
from qdeploy.quantize.learned_ranges import finalize, make_ranges_learnable
from qdeploy.quantize.modelopt_quantizer import calibrated_model, export_checked
from qdeploy.quantize.modelopt_torch import export_qdq_onnx
from qdeploy.quantize.qat import QatError, QatTrainer, TrainingSet, finished_checkpoint
from qdeploy.quantize.registry import NotApplicable, QuantizeInputs, Quantizer, QuantResult, get_quantizer, register_quantizer
from qdeploy.tasks import get_task
from qdeploy.utils.atomic import atomic_path
from qdeploy.utils.hashing import sha256_json
from qdeploy.utils.log import log


@dataclass
class TrainingData:
    """Decoded training images (uint8 N,C,H,W) with labels (None for distillation) and the folder's classes."""

    images: np.ndarray
    labels: Optional[np.ndarray]
    num_classes: Optional[int] = None
    class_names: Optional[list] = None
    source: str = ""


@dataclass
class QatSetup:
    """What QAT needs beyond PTQ's inputs; built by the build stage (a ``run`` variant) or ``pipeline.qat``."""

    config: QatConfig
    task: str
    ignore_index: int
    training: Callable[[], TrainingData]   # decodes lazily: a finished checkpoint needs no images
    identity: dict                         # the training images (paths and sizes), for the fingerprint
    base_fingerprint: str                  # the FP32 model (and preprocessing) the training starts from
    work_dir: Optional[Path] = None        # checkpoint + log folder; default cache_dir/qat/<fingerprint>
    resume: Optional[bool] = None          # None: resume when this fingerprint's checkpoint exists; True: must; False: never
    evaluate: Optional[Callable[[nn.Module], float]] = None  # per-epoch metric for the log (rank 0)
    before_training: Optional[Callable[[nn.Module, nn.Module], None]] = None  # (student, teacher) after PTQ
    device: Optional[str] = None           # default: qat.device (auto: cuda when visible)
    rank: int = 0
    world: int = 1
    extra: dict = field(default_factory=dict)


def command_folder(cache_dir: Path, out_dir: Path) -> Path:
    """Where ``qdeploy qat --out DIR`` trains (the checkpoint after every epoch and the training log): in the cache,
    keyed by DIR's absolute path, so DIR is only ever replaced whole and ``--resume`` into the same DIR finds the
    checkpoint of the run that was interrupted (and refuses one of another model, data or config)."""
    return Path(cache_dir) / "qat" / f"out-{sha256_json(str(Path(out_dir).expanduser().resolve()))[:16]}"


def ptq_start(int8: Int8Config) -> Int8Config:
    """The PTQ QAT starts from: the variant's range method and exclusions, always ModelOpt's TensorRT placement."""
    return Int8Config(method=int8.method, percentile=int8.percentile, placement="tensorrt", quantizer="modelopt",
                      exclude=int8.exclude, residual_quantizers=int8.residual_quantizers)


def training_fingerprint(setup: QatSetup, int8: Int8Config, calibration_identity: Optional[dict]) -> str:
    start = ptq_start(int8)
    return sha256_json({"base": setup.base_fingerprint, "ptq": start.model_dump(mode="json"), "calibration": calibration_identity,
                        "qat": setup.config.model_dump(mode="json", exclude={"device"}), "train": setup.identity})


def resolve_device(q: QatConfig) -> str:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if q.device == "auto" else q.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("qat.device cuda: no CUDA GPU is visible to PyTorch")
    return device


def finetune(inputs: QuantizeInputs, int8: Int8Config, setup: QatSetup, calibration_identity: Optional[dict] = None):
    """PTQ-calibrate (ModelOpt, TensorRT placement) and fine-tune. Returns (student on its device, PTQ info, log, folder)."""
    q = setup.config
    device = setup.device or resolve_device(q)
    fingerprint = training_fingerprint(setup, int8, calibration_identity)
    work = Path(setup.work_dir) if setup.work_dir is not None else Path(inputs.cache_dir) / "qat" / fingerprint[:20]
    work.mkdir(parents=True, exist_ok=True)
    (student, info), inputs = plan_covering_model(inputs, int8)
    info = dict(info, qat_fingerprint=fingerprint, qat_folder=str(work))
    student = student.to(device)
    if q.ranges == "learned":  # before any checkpoint is loaded: the learned amax are parameters of the state dict
        info["learned_range_parameters"] = make_ranges_learnable(student, info.get("shared_scale_groups"))
    make_teacher = lambda: copy.deepcopy(inputs.torch_model()).to(device).eval()  # noqa: E731
    done = finished_checkpoint(work, fingerprint) if setup.resume is not False and setup.rank == 0 and setup.world == 1 else None
    if done is not None:  # the same training finished before (e.g. for the other placement): no images, no epochs
        if setup.before_training is not None:  # still report the PTQ start (the checkpoint replaces it below)
            setup.before_training(student, make_teacher())
        student.load_state_dict(done["model"])
        log(f"qat: training {fingerprint[:12]} already finished in {work} ({len(done['log'])} epochs); reusing it")
        _finish_ranges(student, q, info)
        return student.eval(), info, done["log"], work
    data = setup.training()
    teacher = make_teacher()
    probe_x = torch.from_numpy(normalize(data.images[:2], inputs.preprocess)).to(device)
    with torch.no_grad():
        probe, s_probe = teacher(probe_x), student(probe_x)
    n_out = probe.shape[1]
    supervised = q.objective in ("supervised", "both")
    # per-image labels index the model's outputs (label maps are checked against the outputs by preflight)
    per_image_labels = not get_task(setup.task).pixel_labels
    if supervised and per_image_labels and data.num_classes is not None and data.num_classes != n_out:
        names = data.class_names or []
        raise QatError(f"training folder {data.source} has {data.num_classes} classes "
                       f"({', '.join(map(str, names[:8]))}{', …' if len(names) > 8 else ''}) "
                       f"but the model outputs {n_out}: the labels would not mean the model's classes")
    if q.objective != "supervised" and s_probe.shape != probe.shape:
        raise QatError(f"distillation needs the same output shape from teacher and student: FP32 {tuple(probe.shape)} vs "
                       f"quantized {tuple(s_probe.shape)}")
    if setup.before_training is not None:
        setup.before_training(student, teacher)
    pre = inputs.preprocess
    train_set = TrainingSet(data.images, data.labels if supervised else None,
                            np.asarray(pre.mean, np.float32) * 255.0, np.asarray(pre.std, np.float32) * 255.0)
    trainer = QatTrainer(student, teacher if q.objective != "supervised" else None, q, train_set, setup.task, setup.ignore_index,
                         work, fingerprint, device, evaluate=setup.evaluate, rank=setup.rank, world=setup.world)
    resume = setup.resume if setup.resume is not None else trainer.checkpoint_path.is_file()
    train_log = trainer.fit(resume=resume)
    if trainer.probabilities is not None:  # what the losses were computed on (a softmax head: log-probabilities)
        info["outputs"] = "probabilities" if trainer.probabilities else "logits"
    del teacher
    _finish_ranges(student, q, info)
    return student, info, train_log, work


def plan_covering_model(inputs: QuantizeInputs, int8: Int8Config):
    """((PTQ-calibrated ModelOpt model, info), the inputs it was made from): ModelOpt on the PyTorch model, or, where
    ModelOpt cannot reach every op the placement plan makes INT8 there (a functional F.linear on a module's weight,
    nn.MultiheadAttention), ModelOpt on the FP32 ONNX as a PyTorch module (onnx2torch, each matmul on a stored weight an
    nn.Linear): PTQ takes the ONNX quantizer then, and QAT, which needs a PyTorch model, must reach the same coverage."""
    import dataclasses

    from qdeploy.config import VerifySpec
    from qdeploy.errors import ModelError
    from qdeploy.export.onnx_to_torch import torch_from_onnx

    try:
        return calibrated_model(inputs, ptq_start(int8)), inputs
    except NotApplicable as first:
        try:
            twin = torch_from_onnx(Path(inputs.fp32_onnx), inputs.check_inputs, VerifySpec())
        except ModelError as e:
            raise NotApplicable(f"{first}; the FP32 ONNX as a PyTorch module neither: {e}") from None
        log(f"qat: {first}; training the FP32 ONNX as a PyTorch module instead (onnx2torch)")
        # a memo of its own: the run's memo holds the user module's statistics and refused placement plan
        twin_inputs = dataclasses.replace(inputs, torch_model=lambda: twin, memo={})
        try:
            student, info = calibrated_model(twin_inputs, ptq_start(int8))
        except NotApplicable as e:
            raise NotApplicable(f"{first}; the FP32 ONNX as a PyTorch module neither: {e}") from None
        info["quantizer_fallback"] = [{"quantizer": "modelopt on the PyTorch model", "reason": str(first),
                                       "instead": "modelopt on the FP32 ONNX as a PyTorch module (onnx2torch)"}]
        return (student, info), twin_inputs


def _finish_ranges(student: nn.Module, q: QatConfig, info: dict) -> None:
    if q.ranges != "learned":
        return
    changes = finalize(student)
    ratios = sorted(new / old for old, new in changes.values() if old > 0)
    info["learned_ranges"] = {"quantizers": len(changes), "amax_ratio_median": ratios[len(ratios) // 2] if ratios else None,
                              "amax_ratio_min": ratios[0] if ratios else None, "amax_ratio_max": ratios[-1] if ratios else None}


def float_model(student: nn.Module) -> nn.Module:
    """The fine-tuned weights as a float model: every quantizer off, the depthwise equalization folded back.

    Equalization computed ``dwconv(x·g, W/g)``; ModelOpt applies ``pre_quant_scale`` (the ·g) even with the quantizer
    disabled, so it is switched off and g multiplied back into the weights. BN stays folded into the convs."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    model = copy.deepcopy(student).cpu().eval()
    for m in model.modules():
        q = getattr(m, "input_quantizer", None)
        g = getattr(q, "pre_quant_scale", None) if isinstance(q, TensorQuantizer) else None
        if g is not None and isinstance(getattr(m, "weight", None), torch.Tensor):
            with torch.no_grad():
                m.weight.mul_(g.detach().reshape(-1, *([1] * (m.weight.dim() - 1))).to(m.weight))
            q._enable_pre_quant_scale = False
    for m in model.modules():
        if isinstance(m, TensorQuantizer):
            m.disable()
    return model


def train_summary(train_log: list, folder: Path, q: QatConfig, seconds: Optional[float] = None) -> dict:
    images = sum(e["images"] for e in train_log)
    train_s = sum(e["seconds"] for e in train_log)
    return {"objective": q.objective, "epochs": q.epochs, "images_per_s": round(images / max(train_s, 1e-9), 1),
            "log": train_log, "config": q.model_dump(mode="json"), "checkpoint": str(folder / "qat-checkpoint.pt"),
            "train_seconds": round(train_s, 2)}


@register_quantizer
class QatQuantizer(Quantizer):
    name = "qat"
    description = ("quantization-aware training: ModelOpt PTQ (TensorRT placement) fine-tuned with the config's qat: section; "
                   "TensorRT Q/DQ ONNX, or the fine-tuned weights quantized for ONNX Runtime")
    automatic = False  # training is asked for (quantizer: qat), never picked by auto

    def check(self, cfg: Int8Config, has_torch: bool) -> None:
        if not has_torch:
            raise NotApplicable("quantizer qat fine-tunes a PyTorch model; this model is ONNX-only")
        if cfg.calibration_cache:
            raise NotApplicable("quantizer qat starts from its own calibration; a TensorRT cache cannot be fine-tuned")
        if cfg.exclude_ops and cfg.placement == "tensorrt":
            raise NotApplicable("quantizer qat (TensorRT placement) does not take exclude_ops; use exclude (node-name regexes)")

    def quantize(self, inputs: QuantizeInputs, cfg: Int8Config, out_path: Path) -> QuantResult:
        setup = inputs.qat
        if setup is None:
            raise ConfigError("quantizer qat needs training images and settings: the build stage passes them from the "
                              "config's qat: and data: sections")
        t0 = time.perf_counter()
        student, info, train_log, folder = finetune(inputs, cfg, setup, inputs.calibration_identity)
        summary = train_summary(train_log, folder, setup.config)
        if cfg.placement == "tensorrt":
            with atomic_path(out_path) as tmp:
                result = export_checked(student.cpu().eval(), inputs, tmp, dict(info, qat=True))
            result.path = out_path
        else:
            result = onnxruntime_artifact(student, inputs, cfg, out_path, folder)
            result.info["qat_ptq_start"] = {k: info.get(k) for k in ("method", "samples", "cache")}
        result.info["qat"] = summary
        result.info["qat_time_s"] = round(time.perf_counter() - t0, 2)
        return result


def onnxruntime_artifact(student: nn.Module, inputs: QuantizeInputs, cfg: Int8Config, out_path: Path, folder: Path) -> QuantResult:
    """ONNX Runtime-placement INT8 of the fine-tuned weights (see the module docstring)."""
    h, w = inputs.preprocess.input_size
    float_onnx = folder / "qat-float.onnx"
    export_qdq_onnx(float_model(student), torch.randn(2, inputs.preprocess.channels, h, w), float_onnx, inputs.opset,
                    inputs.dynamic_batch)
    ort_inputs = copy.copy(inputs)
    ort_inputs.fp32_onnx = float_onnx
    # the run's shared ONNX statistics belong to the FP32 ONNX; the fine-tuned model gets its own
    ort_inputs.memo = inputs.memo.setdefault(("qat-float", str(float_onnx)), {})
    ort_cfg = cfg.model_copy(update={"quantizer": "onnx"})
    result = get_quantizer("onnx").quantize(ort_inputs, ort_cfg, out_path)
    result.info["finetuned_float_onnx"] = str(float_onnx)
    return result
