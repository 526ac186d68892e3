"""The run configuration: one strict, typed schema for YAML files and for the Python API.

Unknown keys and wrong types are rejected with the key's full path (``bench.warmpu: unknown key
(did you mean 'warmup'?)``) instead of being silently ignored: a typo in a deployment config must not
quietly change what gets measured.
"""
from __future__ import annotations

import importlib.util

import difflib
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from qdeploy.errors import ConfigError
from qdeploy.tasks import DEFAULT_TASK, TASKS, get_task

Task = Literal[tuple(TASKS)]  # the registered tasks (qdeploy.tasks)
Precision = Literal["fp32", "fp16", "bf16", "int8"]
Size = Union[int, tuple[int, int]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# Named normalisations: (mean, std, channel order, what it is), on pixels scaled to [0, 1] like every Preprocess.
# The keras-* entries are keras.applications' ``preprocess_input`` modes (keras/src/applications/imagenet_utils.py):
# "caffe" flips RGB to BGR and subtracts the ImageNet BGR mean on 0..255 (std 1/255 undoes the scaling), "tf" maps to
# [-1, 1], "torch" is ImageNet's mean/std on [0, 1]; keras-none feeds 0..255 pixels to models that rescale inside
# (keras.applications EfficientNet, ConvNeXt, RegNet: their preprocess_input is the identity).
_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PREPROCESS_PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...], str, str]] = {
    "imagenet": (_IMAGENET_MEAN, _IMAGENET_STD, "RGB", "[0, 1] then ImageNet mean/std (torchvision, timm)"),
    "keras-torch": (_IMAGENET_MEAN, _IMAGENET_STD, "RGB", "keras.applications mode 'torch' (same as imagenet)"),
    "keras-tf": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "RGB", "keras.applications mode 'tf': [-1, 1]"),
    "keras-caffe": ((103.939 / 255, 116.779 / 255, 123.68 / 255), (1 / 255, 1 / 255, 1 / 255), "BGR",
                    "keras.applications mode 'caffe': BGR, ImageNet BGR mean subtracted on 0..255"),
    "keras-none": ((0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255), "RGB",
                   "0..255 pixels, for models that rescale inside (keras.applications EfficientNet, ConvNeXt)"),
}


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
    channel_order: Literal["RGB", "BGR"] = Field("RGB", description="BGR: the model takes blue first (Caffe-trained "
                                                                    "models); mean and std are then in BGR order too")
    preset: Optional[Literal[tuple(PREPROCESS_PRESETS)]] = Field(
        None, description="the normalisation a model was trained with, by name (sets mean, std and channel_order): "
                          + "; ".join(f"{k}: {v[3]}" for k, v in PREPROCESS_PRESETS.items()))
    interpolation: Literal["bilinear", "bicubic", "nearest", "cv2-linear"] = Field(
        "bilinear", description="bilinear/bicubic/nearest: PIL's (antialiased when shrinking, as torchvision's); cv2-linear: "
                                "OpenCV's cv2.resize INTER_LINEAR (no antialiasing), what YOLO and most detectors' own "
                                "pipelines use")
    letterbox: bool = Field(False, description="detection: scale the image to fit input_size keeping its aspect ratio and "
                                               "pad the rest with grey 114, centred (Ultralytics' letterbox); boxes are "
                                               "mapped back through the same scale and padding. Else input_size is an "
                                               "exact resize")

    @model_validator(mode="after")
    def _check(self) -> "Preprocess":
        if self.preset is not None:
            mean, std, order, _ = PREPROCESS_PRESETS[self.preset]
            preset = {"mean": list(mean), "std": list(std), "channel_order": order}
            # a dumped config (preset and its values) loads again; other values next to a preset are a contradiction
            given = sorted(k for k in preset.keys() & self.model_fields_set
                           if not (getattr(self, k) == preset[k] or (k != "channel_order" and
                                                                     np.allclose(getattr(self, k), preset[k], rtol=1e-6))))
            if given:
                raise ValueError(f"preset {self.preset} sets mean, std and channel_order: remove {', '.join(given)}")
            if self.mode != "RGB":
                raise ValueError(f"preset {self.preset} is for RGB images (mode: RGB)")
            self.__dict__.update(mean=list(mean), std=list(std), channel_order=order)
        if self.interpolation == "cv2-linear" and importlib.util.find_spec("cv2") is None:
            raise ValueError("interpolation cv2-linear resizes with OpenCV, which is not installed: pip install "
                             "'qdeploy[opencv]' (or opencv-python-headless)")
        if self.letterbox and (self.resize is not None or self.crop is not None or self.input_size is None):
            raise ValueError("letterbox scales and pads to input_size: give input_size and leave out resize and crop")
        if self.mode == "L" and self.channel_order == "BGR":
            raise ValueError("channel_order BGR needs mode RGB")
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


# ``model.weights: random``: run a torchvision/timm architecture with its random initialisation, on purpose. Not
# null/none: YAML's null means "not given", and torchvision's own ``weights=None`` kwarg is its default.
RANDOM_WEIGHTS = "random"


# What a model.source names, by its form (one home: read by the config, the loader and the builder). A Keras model:
# a Keras 3 ``.keras`` file, a legacy HDF5 ``.h5``/``.hdf5`` file, or a TensorFlow SavedModel folder.
KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")


def source_format(source: str) -> Literal["onnx", "keras", "pytorch"]:
    """'onnx' (a .onnx file), 'keras' (.keras, .h5, or a SavedModel folder: saved_model.pb inside) or 'pytorch'
    (torchvision:/timm: names, file.py:factory, package.module:factory)."""
    lower = source.lower().rstrip("/\\")
    if lower.endswith(".onnx"):
        return "onnx"
    if lower.endswith(KERAS_SUFFIXES) or (Path(source).expanduser() / "saved_model.pb").is_file():
        return "keras"
    return "pytorch"


class NmsSpec(_Strict):
    """Detection post-processing after a built-in decoder (or a ``model.decode`` function that returns candidates):
    class-wise non-maximum suppression. The defaults are those of a mAP evaluation (YOLOv5's val.py: keep nearly every
    candidate, the precision-recall curve needs the low scores); a deployment filters at its own score afterwards."""

    score_threshold: float = Field(0.001, ge=0, lt=1, description="candidates scoring below this are dropped before NMS")
    iou_threshold: float = Field(0.6, gt=0, le=1, description="a box overlapping a higher-scoring box of the same class by "
                                                              "this IoU or more is suppressed")
    max_detections: int = Field(100, gt=0, description="detections kept per image, highest scores first (COCO's AP reads "
                                                       "100)")
    class_agnostic: bool = Field(False, description="one suppression over all classes instead of one per class (TensorRT "
                                                    "EfficientNMS_TRT's class_agnostic)")
    agreement_score: float = Field(0.25, gt=0, lt=1, description="agreement with the reference counts its detections "
                                                                 "scoring at least this (a deployment's confidence "
                                                                 "threshold; Ultralytics' predict default)")


class ModelSpec(_Strict):
    """Where the model comes from and how to feed it (see ``qdeploy.models``)."""

    source: str = Field(description="torchvision:NAME | timm:NAME | file.py:factory | pkg.module:factory | model.onnx | "
                                    "Keras: model.keras, model.h5 or a SavedModel folder (pip install 'qdeploy[keras]')")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    weights: Optional[str] = Field(None, validate_default=True,
                                   description="state_dict file, or pkg:PACKAGE/path for weights shipped in a package; "
                                               "'random': keep the factory's random initialisation on purpose (required "
                                               "for a torchvision:/timm: source without weights)")
    weights_key: Optional[str] = Field(None, description="take the state_dict from this key of the checkpoint")
    task: Task = DEFAULT_TASK
    output: Optional[Union[str, int]] = Field(None, description="key/index to take when the model returns a dict/tuple")
    preprocess: Preprocess
    decode: Optional[str] = Field(None, description="task detection: how the model's raw output becomes boxes: a built-in "
                                                    "decoder (yolov8, yolov5, fastestdet, xyxy-scores; onnx-nms for an ONNX with "
                                                    "NMS inside; qdeploy.tasks.detection_decode) "
                                                    "or file.py:function for any other head")
    nms: NmsSpec = Field(default_factory=NmsSpec, description="task detection: NMS and score thresholds")

    @model_validator(mode="after")
    def _decode_for_detection(self) -> "ModelSpec":
        from qdeploy.tasks.detection_decode import check_decode_name

        detection = get_task(self.task).needs_decoder
        if detection and self.decode is None:
            raise ValueError("model.task detection needs model.decode: a built-in decoder (" + check_decode_name.names() +
                             ") or file.py:function")
        if not detection and self.decode is not None:
            raise ValueError(f"model.decode applies to task detection only (model.task is {self.task})")
        if detection:
            check_decode_name(self.decode)
            if self.decode == "onnx-nms" and source_format(self.source) != "onnx":
                raise ValueError(f"model.decode onnx-nms reads the NMS node of an ONNX model; model.source {self.source!r} "
                                 "is not a .onnx file")
            if self.preprocess.crop is not None:
                raise ValueError("model.preprocess.crop would cut boxes off: a detector takes the whole image (input_size, "
                                 "letterbox: true or false)")
        return self

    @field_validator("weights")
    @classmethod
    def _weights_given(cls, v: Optional[str], info) -> Optional[str]:
        source, kwargs = info.data.get("source"), info.data.get("kwargs") or {}
        if not isinstance(source, str):
            return v
        if source_format(source) != "pytorch":
            if v is not None:
                kind = {"onnx": "ONNX", "keras": "Keras"}[source_format(source)]
                raise ValueError(f"applies to PyTorch sources only; the {kind} model {source} carries its own weights: "
                                 "remove model.weights")
            return v
        prefix = source.partition(":")[0]
        pretrained = (prefix == "torchvision" and kwargs.get("weights") is not None) or \
                     (prefix == "timm" and bool(kwargs.get("pretrained")))
        if v is None and prefix in ("torchvision", "timm") and not pretrained:
            raise ValueError(f"missing for {source}, which would run with random initialisation: give the trained "
                             f"state_dict file (model.weights: FILE), or write model.weights: {RANDOM_WEIGHTS} to "
                             "measure random weights on purpose")
        if v is not None and not v.strip():
            raise ValueError(f"is empty: give a state_dict file, or {RANDOM_WEIGHTS}")
        return v

    @property
    def weights_file(self) -> Optional[str]:
        """The weights file to load (None: none, or ``weights: random``)."""
        return None if self.weights in (None, RANDOM_WEIGHTS) else self.weights


class Subsplit(_Strict):
    """A second seeded split, of the samples that count/complement already selected."""

    count: int = Field(gt=0)
    seed: int = 0
    complement: bool = False


def _distinct_names(v, empty: str):
    """A list of class names (``classes``, ``names``) with no empty entry and none twice: a duplicate would shift every
    later index by one, or merge two classes."""
    if isinstance(v, list):
        if not v:
            raise ValueError(empty)
        seen: dict[str, int] = {}
        for i, name in enumerate(v):
            if not name.strip():
                raise ValueError(f"entry {i} is empty")
            if name in seen:
                raise ValueError(f"'{name}' is listed twice (entries {seen[name]} and {i})")
            seen[name] = i
    return v


class DatasetSpec(_Strict):
    """One set of images. ``key`` is where it sits in the config (``data.eval``), for messages; set by its parent."""

    _key: Optional[str] = PrivateAttr(None)

    format: Literal["imagefolder", "segnet", "voc", "coco", "yolo"] = "imagefolder"
    root: str = Field(description="the data set's folder (yolo: or its data.yaml, then split picks its images)")
    labels: bool = Field(True, description="false: images without labels (every image under root, any layout, for either "
                                           "task): only agreement with a reference can be measured (optimize: "
                                           "budget.min_agreement); calibration and QAT distill need no labels either")
    classes: Optional[Union[str, list[str]]] = Field(
        None, description="the model's classes in output-index order: a list of folder names (classification; segmentation: "
                          "class names, index = label value) or a class-list file with one per line (first word = folder "
                          "name, the rest its display name). Lists every class the model has, also those without images "
                          "here (a folder of a subset still gets the model's index)")
    class_names: Optional[list[str]] = Field(None, description="display names in label-index order (indices still come from the "
                                                               "folders or classes)")

    @field_validator("classes")
    @classmethod
    def _classes_given(cls, v):
        return _distinct_names(v, "an empty list: list the model's classes in output-index order, or leave classes out")

    @property
    def classes_file(self) -> Optional[str]:
        """``classes`` when it names a file (a path to read), else None."""
        return self.classes if isinstance(self.classes, str) else None
    split: str = Field("test", description="segnet: the split folder (test → test/ + testannot/); voc: the split file "
                                           "ImageSets/Main/<split>.txt where the data set has split files (without "
                                           "them the default reads every annotation); yolo with root a data.yaml: "
                                           "its train/val/test entry")
    annotations: Optional[str] = Field(None, description="coco: the annotation JSON (root: its images); yolo: the label "
                                                         "folder (default: images/ → labels/, else beside each image)")
    names: Optional[Union[str, list[str]]] = Field(None, description="yolo: the data set's class names that its txt "
                                                                     "files' indices refer to: a list, its data.yaml "
                                                                     "(names: a list or {0: name, ...}) or a file with "
                                                                     "one name a line; without classes, also the "
                                                                     "model's classes in output order")

    @field_validator("names")
    @classmethod
    def _names_given(cls, v):
        return _distinct_names(v, "an empty list: list the data set's class names in index order, or give its data.yaml")
    bad_boxes: Literal["error", "skip"] = Field("error", description="detection: a box outside its image or of no area "
                                                                     "stops the run (error) or is left out and listed "
                                                                     "(skip)")
    unannotated: Literal["error", "empty"] = Field("error", description="detection (VOC flat folder, YOLO): an image "
                                                                        "without an annotation file is an error, or an "
                                                                        "image with no boxes (empty)")
    ignore_index: int = Field(255, description="segmentation label that is excluded from metrics")
    count: Optional[int] = Field(None, gt=0, description="seeded random subset of this many samples")
    seed: int = 0
    complement: bool = Field(False, description="take every sample except the seeded `count` subset (disjoint eval/calibration splits of one folder)")
    subsplit: Optional[Subsplit] = Field(None, description="{count, seed, complement} applied to the samples count/complement "
                                                           "selected (qdeploy optimize splits data.eval into search and "
                                                           "confirm this way)")
    batch_size: int = Field(32, gt=0)
    on_error: Literal["error", "skip"] = Field("error", description="an unreadable image: stop with its name (error) or leave it out and list it (skip)")
    workers: Optional[int] = Field(None, ge=0, description="decoding worker threads (default: min(4, CPUs))")

    @property
    def key(self) -> Optional[str]:
        """Config path of this dataset (``data.eval``, ``data.calibration``, ``qat.data``), or None outside a config."""
        return self._key

    @property
    def labels_optional(self) -> bool:
        """Calibration never uses labels: a flat folder (or a SegNet split without annotations) is read without them.
        (Not tied to whether ``labels`` was written: optimize re-parses dumped configs, which spell every default.)"""
        return self._key == "data.calibration"

    def keyed(self, key: str) -> "DatasetSpec":
        self._key = key
        return self


class DataConfig(_Strict):
    eval: DatasetSpec
    calibration: Optional[DatasetSpec] = None
    train: Optional[DatasetSpec] = Field(None, description="labelled training images (supervised QAT)")

    @model_validator(mode="after")
    def _name_sections(self) -> "DataConfig":
        for name in ("eval", "calibration", "train"):
            spec = getattr(self, name)
            if spec is not None:
                spec.keyed(f"data.{name}")
        return self


@dataclass(frozen=True)
class RangeMethod:
    """A range method (``Int8Config.method``): how an activation's clipping range is chosen from its statistics
    (computed in quantize/ranges.py, or by ModelOpt's and NNCF's own calibrators)."""

    name: str
    how: str
    nncf: bool = False  # NNCF has a range estimator of its own for it (quantizer nncf, placement openvino)


RANGE_METHODS: dict[str, RangeMethod] = {m.name: m for m in (
    RangeMethod("max", "the largest |x| observed over the calibration images", nncf=True),
    RangeMethod("entropy", "the range whose quantized |x| histogram is closest to the observed one (KL divergence)"),
    RangeMethod("percentile", "the given percentile of the |x| histogram (Int8Config.percentile)"),
    RangeMethod("mse", "the range of least mean squared quantization error over the |x| histogram"),
    RangeMethod("mean-minmax", "each image's largest |x|, averaged over the images (NNCF's MEAN_MINMAX)", nncf=True),
)}
RangeMethodName = Literal[tuple(RANGE_METHODS)]


@dataclass(frozen=True)
class Placement:
    """A Q/DQ placement style (``Int8Config.placement``): the runtime whose INT8 kernels it lays Q/DQ out for, the
    registered quantizers that make it (quantize/registry.py), and what the lint checks on its artifacts."""

    name: str
    runtime: str                  # whose INT8 kernels the layout is for (said in messages)
    quantizers: tuple[str, ...]   # the quantizers that make it; quantizer auto tries its automatic ones in this order
    lint_rules: Optional[str]     # the rules the lint checks its artifacts against; None: the lint does not apply
    label: str                    # the variant label's part ("": the default placement)
    description: str
    default_for: tuple[str, ...] = ()  # engines whose INT8 variants get this placement when theirs does not say one


PLACEMENTS: dict[str, Placement] = {p.name: p for p in (
    Placement("onnxruntime", "ONNX Runtime", ("onnx", "qat"), None, "",
              "ONNX Runtime's QDQ placement for its CPU kernels (uint8 activations; SiLU/hardswish kept whole unless "
              "split_activations)"),
    Placement("tensorrt", "TensorRT", ("modelopt", "onnx", "qat"), "TensorRT's Q/DQ rules (lint/rules.py)", "trt",
              "TensorRT's explicit-quantization rules (symmetric int8; simulated in ORT)"),
    Placement("openvino", "OpenVINO", ("nncf",), None, "ov",
              "OpenVINO's own placement, made by NNCF (engine openvino: nncf.quantize on the OpenVINO model, an INT8 "
              "IR; engine onnxruntime: on the ONNX, a Q/DQ ONNX; quantizer nncf); engine openvino's default",
              default_for=("openvino",)),
)}
PlacementName = Literal[tuple(PLACEMENTS)]
# Keys of earlier releases: named in the error so an old config is fixed in one step, not guessed at.
RENAMED_KEYS = {"calibrator": "method", "target": "placement"}


class Int8Config(_Strict):
    """How to make an INT8 artifact: the quantization settings of one int8 variant, as one object.

    Written flat in a variant (``{engine: onnxruntime, precision: int8, method: mse}``) or as
    ``int8: {...}``; the Python API takes it directly (``Int8Config(method="mse", placement="tensorrt")``).
    The quantizer that executes it is looked up by name in ``qdeploy.quantize``'s registry.
    """

    method: RangeMethodName = Field(
        "mean-minmax", description="range method: how an activation's clipping range is chosen from its statistics; "
                                   "default mean-minmax, the one method that collapsed on no model measured (README)")
    percentile: float = Field(99.99, gt=0, le=100, description="for method: percentile")
    placement: PlacementName = Field(
        "onnxruntime", description="Q/DQ placement style: " + "; ".join(f"{p.name} = {p.description}"
                                                                        for p in PLACEMENTS.values()))
    exclude: list[str] = Field(default_factory=list, description="regexes on ONNX node names kept in float (every quantizer)")
    exclude_ops: list[str] = Field(default_factory=list, description="ONNX op types kept in float, e.g. [Resize, Gemm]")
    calibration_cache: Optional[str] = Field(None, description="existing TensorRT calibration cache to take ranges from")
    quantizer: str = Field("auto", description="registered quantizer: auto | modelopt | onnx | qat | nncf (see qdeploy doctor); "
                                                "qat fine-tunes with the config's qat: section, starting from this method's PTQ")
    split_activations: bool = Field(
        False, description="placement onnxruntime only: quantize SiLU/hardswish as x, gate and product separately, so that "
                           "ONNX Runtime runs the convs around them in int8 (2-3x faster on the MobileNet-class models "
                           "measured, but 1.4 points less accurate on EfficientNet-B0); by default they stay whole, as in "
                           "NNCF and TensorRT")
    quantized_conv_outputs: bool = Field(
        False, description="placement onnxruntime only: a conv before an activation kept whole (SiLU, hardswish) keeps a "
                           "quantized output, so that ONNX Runtime runs it as QLinearConv (the activation runs float "
                           "between a DQ and a Q): 3-7x less conv time on the MobileNet-class models measured, for one more "
                           "rounding before the activation (0.6 point on EfficientNet-B0@48); by default such convs stay "
                           "float, because ONNX Runtime has no INT8 conv with a float output (lint/placement.py)")
    nncf_model_type: Literal["auto", "cnn", "transformer"] = Field(
        "auto", description="placement openvino (NNCF): the scheme NNCF quantizes with: transformer (NNCF's "
                            "ModelType.TRANSFORMER: Add, normalization and attention outputs stay float) or cnn (NNCF's "
                            "default); auto takes transformer where the graph has attention or LayerNorm, else cnn "
                            "(lint/placement.NNCF_TRANSFORMER_WHY); optimize measures transformer and, beside it, cnn on "
                            "an attention model and cnn with exclude_ops [Add] on a LayerNorm model without attention")
    residual_quantizers: bool = Field(
        True, description="placement tensorrt: quantize the skip input of residual Adds (TensorRT's recommendation: the Add "
                          "then runs in INT8, fused into the conv); false leaves every residual Add float, as "
                          "pytorch-quantization's default QAT models do")

    @model_validator(mode="after")
    def _split_needs_ort_placement(self):
        if self.split_activations and self.placement != "onnxruntime":
            raise ValueError("split_activations applies to placement onnxruntime only: TensorRT fuses SiLU/hardswish into "
                             "the conv, and Q/DQ inside them blocks that fusion (lint rule QD007)")
        if self.quantized_conv_outputs and (self.placement != "onnxruntime" or self.split_activations):
            raise ValueError("quantized_conv_outputs applies to placement onnxruntime with activations kept whole "
                             "(split_activations quantizes the conv outputs already)")
        if self.nncf_model_type != "auto" and self.placement != "openvino":
            raise ValueError("nncf_model_type applies to placement openvino only (NNCF's own placement)")
        if not self.residual_quantizers and self.placement != "tensorrt":
            raise ValueError("residual_quantizers: false applies to placement tensorrt only (ONNX Runtime's placement "
                             "quantizes Adds by its own rules)")
        return self

    @field_validator("exclude")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"exclude pattern '{pattern}' is not a valid regular expression: {e}") from None
        return v

    def label_parts(self) -> list[str]:
        """Label pieces that tell two settings apart: every setting that changes the artifact is in the label."""
        parts = [PLACEMENTS[self.placement].label] if PLACEMENTS[self.placement].label else []
        if self.quantizer != "auto":
            parts.append(self.quantizer)
        if self.calibration_cache:
            parts.append("trtcache-" + _slug(Path(self.calibration_cache).stem))
        else:
            method = self.method + (f"{self.percentile:g}" if self.method == "percentile" and self.percentile != 99.99 else "")
            parts.append(method)
        if self.exclude or self.exclude_ops:
            parts.append("excl-" + _slug("+".join(self.exclude_ops + self.exclude)))
        if self.split_activations:
            parts.append("split")
        if self.quantized_conv_outputs:
            parts.append("qconv")
        if self.nncf_model_type != "auto":
            parts.append(f"nncf-{self.nncf_model_type}")
        if not self.residual_quantizers:
            parts.append("noresq")
        return parts


def _slug(text: str, limit: int = 32) -> str:
    """A label-safe rendering of free text; long or symbol-heavy text gets a short hash so labels stay unique."""
    clean = "".join(c if c.isalnum() or c in "-_.+" else "_" for c in text).strip("_")
    if clean != text or len(clean) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        clean = (clean[: limit - 7].rstrip("_") + "_" if clean else "") + digest
    return clean


def _engine_default_placement(engine: Any, int8: Any) -> Any:
    """An INT8 variant's settings with its engine's own placement where they name none (engine openvino: NNCF's INT8
    IR, what OpenVINO's users make); otherwise Int8Config's default."""
    own = next((p.name for p in PLACEMENTS.values() if engine in p.default_for), None)
    if int8 is None:
        int8 = {}
    if own is None:
        return int8
    if isinstance(int8, Int8Config):
        return int8 if "placement" in int8.model_fields_set else int8.model_copy(update={"placement": own})
    if isinstance(int8, dict) and "placement" not in int8:
        return {**int8, "placement": own}
    return int8


class VariantSpec(_Strict):
    """One variant: engine × precision × options. Engine options are checked against the engine's own
    declaration (``qdeploy.engines``), so the schema here stays the same whichever engines exist."""

    engine: str
    precision: Precision = "fp32"
    name: Optional[str] = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: Optional[int] = Field(None, gt=0, description="CPU threads (torch.set_num_threads / ORT intra-op)")
    options: dict[str, Any] = Field(default_factory=dict, description="engine options (flat keys in YAML are gathered here)")
    int8: Optional[Int8Config] = None

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data: Any) -> Any:
        """Flat YAML → structure: Int8Config keys into ``int8``, any other unknown key into ``options``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for old, new in RENAMED_KEYS.items():
            if old in data:
                raise ValueError(f"option '{old}' was renamed to '{new}'")
        own = set(cls.model_fields)
        int8_keys = [k for k in data if k in Int8Config.model_fields]
        if int8_keys:
            if data.get("precision", "fp32") != "int8":
                raise ValueError(f"option '{int8_keys[0]}' applies only to precision int8 (this variant is "
                                 f"{data.get('precision', 'fp32')})")
            nested = dict(data.get("int8") or {})
            nested.update({k: data.pop(k) for k in int8_keys})
            data["int8"] = nested
        extra = {k: data.pop(k) for k in list(data) if k not in own}
        if extra:
            data["options"] = {**dict(data.get("options") or {}), **extra}
        if data.get("precision") == "int8":
            data["int8"] = _engine_default_placement(data.get("engine"), data.get("int8"))
        return data

    @model_validator(mode="after")
    def _int8_only_for_int8(self) -> "VariantSpec":
        if self.int8 is not None and self.precision != "int8":
            raise ValueError(f"int8 settings apply only to precision int8 (this variant is {self.precision})")
        return self


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
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 32])
    warmup: int = Field(10, ge=0)
    iterations: int = Field(100, gt=0)
    repeats: int = Field(1, gt=0, description="repeat the whole timing of each batch size; the repeat with the lowest median is kept")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(b <= 0 for b in v):
            raise ValueError("batch_sizes must be a non-empty list of positive integers")
        return v


class EvalSpec(_Strict):
    enabled: bool = True
    reference: Optional[str] = Field(None, description="variant name that agreement is measured against (default: first FP32 variant)")
    min_agreement: Optional[float] = Field(None, ge=0, le=1, description="an INT8 variant agreeing less than this with the "
                                                                         "reference is marked degraded, with labels too "
                                                                         "(whatever its accuracy change); default: the "
                                                                         "task's (0.9; detection 0.8)")


class ReportSpec(_Strict):
    tolerance: float = Field(0.5, ge=0, description="recommendation: accuracy within this many points of the reference")
    batch_size: Optional[int] = Field(None, gt=0, description="recommendation: rank by p50 latency at this batch size (default: the smallest measured)")


class QatConfig(_Strict):
    """Quantization-aware training (``qdeploy qat``): fine-tune the PTQ-calibrated ModelOpt model (TensorRT placement).

    Defaults and where they come from (docs/qat.md measures them):
    - ``lr`` 1e-4, cosine schedule, ranges frozen, a few epochs: ModelOpt's ``cnn_qat`` example;
    - "about 1 % of the original LR for about 10 % of the original schedule": pytorch-quantization's guide
      (1e-4 is ~1 % of the 0.01-0.1 SGD rates CNNs are trained with);
    - BN statistics frozen after some epochs: torchvision's quantization reference scripts
      (``--num-observer-update-epochs`` / freeze BN after a few epochs); here from the start of QAT (0), since
      QAT starts from a trained, BN-folded model whose statistics are final;
    - ``optimizer`` sgd with momentum 0.9 and weight decay 1e-4 (the CIFAR/ImageNet recipes the models come from).
    """

    objective: Literal["supervised", "distill", "both"] = Field(
        "distill", description="supervised = cross entropy on data.train labels; distill = KL to the frozen FP32 model's "
                               "logits (no labels: any image folder); both = their sum with distill_weight on the KL")
    data: Optional[DatasetSpec] = Field(None, description="training images (default: data.train for supervised/both, "
                                                          "data.calibration for distill)")
    method: RangeMethodName = Field("mean-minmax", description="PTQ range method the QAT starts from")
    epochs: float = Field(1.0, gt=0, description="passes over the training data (fractional allowed)")
    lr: float = Field(1e-4, gt=0)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(1e-4, ge=0)
    warmup_epochs: float = Field(0.0, ge=0, description="linear LR warm-up, then cosine decay to 0")
    batch_size: int = Field(64, gt=0)
    augment: bool = Field(True, description="seeded flip + padded crop (classification), flip + crop (segmentation)")
    freeze_bn_after: Optional[float] = Field(0.0, ge=0, description="epochs after which BatchNorm statistics stop updating "
                                                                   "(BN is folded into convs for ModelOpt; this covers any left)")
    grad_clip: Optional[float] = Field(None, gt=0, description="clip the gradients' global norm")
    amp: bool = Field(True, description="bf16 autocast on a CUDA GPU (ignored on the CPU)")
    residual_quantizers: bool = Field(True, description="as Int8Config.residual_quantizers: false leaves residual Adds float")
    ranges: Literal["frozen", "learned"] = Field(
        "frozen", description="frozen: activation ranges stay at their PTQ values (ModelOpt cnn_qat); learned: they train "
                              "with the weights (LSQ gradient, no weight decay), starting from the PTQ values")
    temperature: float = Field(1.0, gt=0, description="distillation temperature")
    distill_weight: float = Field(1.0, ge=0, description="objective both: weight of the KL term")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _name_data(self) -> "QatConfig":
        if self.data is not None:
            self.data.keyed("qat.data")
        return self


# The agreement floor of every optimize budget when budget.min_agreement is not given: a candidate whose predictions
# match FP32's on fewer than this share of the images (classification) or pixels (segmentation) is never within budget,
# whatever its accuracy (a random-weight or near-chance FP32 lets a collapsed INT8 model "keep" its accuracy). The same
# 0.9 for segmentation: a healthy INT8 segmentation model disagrees with FP32 only along object boundaries (typically
# 97-99 % of pixels agree), so 0.9 never rejects one, while a model collapsed onto one class agrees only on that class's
# share of the pixels. Where one class covers more than 90 % of the pixels the floor cannot see that collapse; the
# mIoU budget, which weighs every class equally, does. Also eval.min_agreement's default (qdeploy run's degraded mark).
DEFAULT_MIN_AGREEMENT = 0.9


class BudgetSpec(_Strict):
    """How much accuracy the chosen artifact may lose against FP32, measured on the split that decides, and the
    agreement with FP32 below which no candidate is within budget (see ``min_agreement``)."""

    max_drop: Optional[float] = Field(None, ge=0, description="points of the task metric (top-1 % / mIoU %): 0.3 = 0.3 points")
    relative: Optional[float] = Field(None, ge=0, lt=1, description="fraction of the FP32 metric, e.g. 0.01 = 1 % of it")
    min_agreement: Optional[float] = Field(
        None, gt=0, le=1,
        description="share of FP32's predictions (classes, or pixels for segmentation) a candidate keeps on the same "
                    "images. With max_drop or relative: a floor, checked too (default 0.9 for both tasks: healthy INT8 "
                    "agrees far above it, a collapsed model far below; segmentation's disagreements are boundary "
                    "pixels). Alone: the budget (the only one without labels). Either way a candidate more than 10 "
                    "points below the median agreement of two or more INT8 siblings is not within budget")

    @model_validator(mode="after")
    def _one_kind(self):
        if self.max_drop is not None and self.relative is not None:
            raise ValueError("give one of max_drop, relative (min_agreement may go with either, as a floor)")
        if self.max_drop is None and self.relative is None and self.min_agreement is None:
            raise ValueError("give max_drop or relative (min_agreement may go with either, as a floor), or "
                             "min_agreement alone (got none)")
        return self

    @property
    def agreement_only(self) -> bool:
        """The budget is agreement with FP32 alone (min_agreement without max_drop or relative)."""
        return self.max_drop is None and self.relative is None

    @property
    def kind(self) -> str:
        """The budget's own test, by its key: ``max_drop``, ``relative``, or ``min_agreement`` (agreement alone)."""
        if self.max_drop is not None:
            return "max_drop"
        return "relative" if self.relative is not None else "min_agreement"

    def allowed_points(self, reference: float) -> float:
        """The drop this budget allows below an FP32 metric ``reference`` (a fraction), in points of the task metric:
        max_drop, or relative's share of the reference. Not defined for an agreement-only budget."""
        if self.agreement_only:
            raise ValueError("an agreement-only budget (min_agreement alone) allows no drop in points")
        return self.max_drop if self.max_drop is not None else 100.0 * self.relative * reference

    _default_floor: float = PrivateAttr(DEFAULT_MIN_AGREEMENT)  # the task's (RunConfig sets it)

    @property
    def floor(self) -> float:
        """The agreement with FP32 every candidate needs: min_agreement, else the task's default
        (``Task.default_min_agreement``: DEFAULT_MIN_AGREEMENT, detection's lower)."""
        return self.min_agreement if self.min_agreement is not None else self._default_floor

    def describe(self, task: str = DEFAULT_TASK, default: bool = False) -> str:
        """The budget in words: "at most 1.00 point of top-1 below FP32 (default), agreement with FP32 ≥ 90 % (default)".
        ``default``: this budget is OptimizeConfig's default (no optimize.budget given)."""
        metric = get_task(task).metric_label
        dflt = " (default)" if default else ""
        agree = f"agreement with FP32 ≥ {100 * self.floor:g} %"
        if self.agreement_only:
            return agree + dflt
        if self.max_drop is not None:
            kind = f"at most {self.max_drop:.2f} point{'' if self.max_drop == 1 else 's'} of {metric} below FP32"
        else:
            kind = f"at most {100 * self.relative:g} % of FP32's {metric} lost"
        return f"{kind}{dflt}, {agree}" + (" (default)" if self.min_agreement is None else "")


# the names optimize.target accepts; what each target is (its engine, placement, steps) is optimize.candidates.TARGETS,
# which checks at import that it defines exactly these
OptimizeTarget = Literal["onnxruntime-cpu", "cpu", "tensorrt", "torch-cuda", "torch-cpu", "onnxruntime-cuda"]


class OptimizeConfig(_Strict):
    """``qdeploy optimize``: the fastest artifact within ``budget``, chosen on a search split, confirmed once on another."""

    target: OptimizeTarget = Field(
        "onnxruntime-cpu", description="where the answer runs: onnxruntime-cpu (ONNX Runtime's CPU provider), cpu (ONNX "
                                       "Runtime or OpenVINO, whichever is faster within budget), tensorrt, torch-cuda, "
                                       "torch-cpu, onnxruntime-cuda")
    threads: Optional[int] = Field(None, gt=0, description="CPU targets: intra-op threads every candidate runs and is timed "
                                                           "with (default: every core); stated in the report")
    budget: BudgetSpec = Field(default_factory=lambda: BudgetSpec(max_drop=1.0),
                               description="max_drop or relative, with min_agreement as a floor (default 0.9); or "
                                           "min_agreement alone (without labels). Default: max_drop 1.0, floor 0.9")
    time_limit: Optional[float] = Field(None, gt=0, description="seconds for the search; the best candidate so far is "
                                                                "written when it runs out; saving the chosen artifact "
                                                                "and its confirm run come after it (default: none; for "
                                                                "the PyTorch targets 300 for the whole optimize, "
                                                                "compiles, saving and confirm included)")
    search_fraction: float = Field(0.5, gt=0, lt=1, description="share of data.eval that decides (seeded); the rest confirms")
    seed: int = 0
    batch_size: Optional[int] = Field(None, gt=0, description="rank by p50 latency at this batch size (default: the largest "
                                                                "of bench.batch_sizes)")
    methods: list[RangeMethodName] = Field(
        default_factory=lambda: ["mean-minmax", "max", "percentile", "mse", "entropy"],
        description="PTQ range methods tried (one statistics pass serves them all)")
    confidence: float = Field(0.9, ge=0.5, lt=1, description="decide on the one-sided bound of this confidence (drop + z*SE, "
                                                              "agreement - z*SE, paired over the search split's samples); 0.5: "
                                                              "the point estimate. mIoU has no per-sample SE: point estimate")
    fallback: bool = Field(True, description="when no PTQ candidate is within budget, keep the most harmful layers in float, "
                                             "one at a time (sensitivity-ranked, NNCF-style refinement)")
    subset_size: int = Field(300, gt=0, description="search-split samples the fallback ranks layers on: the ones the best "
                                                    "PTQ model disagrees with FP32 on most (NNCF's default 300)")
    refine_top: int = Field(8, ge=1, description="layers of the one-pass SQNR ranking refined by reverting each alone on "
                                                 "the subset, per ranking")
    sensitivity_images: int = Field(32, gt=0, description="images of the search split for the one-pass SQNR ranking")
    max_float_fraction: float = Field(0.25, ge=0, le=1, description="share of compute (MACs) the fallback may leave in "
                                                                    "float before it stops (then QAT, when allowed)")
    accuracy_control: Literal["auto", "always", "off"] = Field(
        "auto", description="target cpu (OpenVINO): NNCF's quantize_with_accuracy_control as a peer of the per-layer "
                            "fallback. auto: where it could pay (its start outside max_drop and faster than the answer "
                            "within budget by more than the noise of two timings); always: wherever the fallback ran "
                            "or no INT8 is within budget; off: never")
    retime_rounds: int = Field(5, ge=0, description="CPU targets: the fastest candidates within budget (within 15 % of the "
                                                    "fastest, at most 4) timed again side by side in this many "
                                                    "interleaved rounds before the answer is chosen; the median of the "
                                                    "round medians decides. 0: each candidate's single search timing")
    compile_modes: list[Literal["default", "max-autotune-no-cudagraphs"]] = Field(
        default_factory=lambda: ["default"],
        description="PyTorch targets: torch.compile modes tried (each with and without CUDA graphs on a GPU). "
                    "max-autotune-no-cudagraphs benchmarks kernels while compiling: minutes per model, so opt-in")
    freezing: Optional[bool] = Field(
        None, description="PyTorch targets: the fastest compiled candidate compiled again with Inductor's freezing "
                          "(weights folded in as constants: conv-BN folding, constant folding, oneDNN weight packing "
                          "on the CPU; facts/inductor.py), one more compile. Default: on for torch-cpu; on torch-cuda "
                          "for a model with a BatchNorm or with Linear layers sharing an input, which freezing concatenates "
                          "into one matmul (facts/inductor.freezing_default)")
    patch_matmul: Optional[bool] = Field(
        None, description="PyTorch targets: the fastest compiled candidate compiled again with its patch convolutions "
                          "(stride equal to kernel: ViT/DeiT/Swin patch embeddings) as one matmul over the patches "
                          "(facts/patch_matmul.py; on the faster of that program and its frozen one), one more compile. "
                          "Default: on where the model has such a convolution")
    depthwise_stencil: Optional[bool] = Field(
        None, description="PyTorch targets: the fastest compiled candidate compiled again with its depthwise "
                          "convolutions (MobileNet, EfficientNet, ConvNeXt) as stencils Inductor fuses instead of "
                          "cuDNN's / oneDNN's kernels (facts/depthwise_stencil.py), one more compile. Default: off "
                          "(facts/depthwise_stencil.DEPTHWISE_STENCIL_DEFAULT_WHY)")
    gelu_epilogue: Optional[bool] = Field(
        None, description="PyTorch targets: the fastest compiled candidate compiled again with each Linear whose only "
                          "user is a GELU as one cuBLASLt matmul with the bias and the GELU (tanh approximation) in "
                          "its epilogue (facts/gelu_epilogue.py), one more compile. Default: on for torch-cuda where "
                          "the model has a Linear and a GELU (ViT, DeiT, Swin, ConvNeXt MLPs)")
    torchao: list[Literal["float8-dynamic", "int8-weight-only", "int8-dynamic"]] = Field(
        default_factory=list,
        description="torch-cuda: torchao schemes tried on the Linear layers of the best compiled BF16/FP16 candidate, "
                    "where the GPU runs them (FP8: compute capability 8.9+). Opt-in: on an H200 at 224, batch 32-128, "
                    "FP8 ran 0.74-0.83x and INT8 dynamic 0.57-0.72x FP16's speed on DeiT-S and Swin-T (docs/gpu.md), "
                    "and one compile cannot be interrupted by time_limit")
    finalists: int = Field(3, ge=1, description="PyTorch targets: candidates measured fully (evaluation + timing) after "
                                                "every candidate was timed briefly")
    qat: Literal["off", "distill", "supervised", "both"] = Field(
        "off", description="QAT on the partially quantized model when fallback alone misses the budget or would leave "
                           "more than max_float_fraction in float: the objective (the qat: section sets the rest); off: "
                           "never train")

    def budget_text(self, task: str = DEFAULT_TASK) -> str:
        """The budget in words, "(default)" on what was not given (BudgetSpec.describe)."""
        return self.budget.describe(task, default="budget" not in self.model_fields_set)


class RunConfig(_Strict):
    model: ModelSpec
    data: DataConfig
    variants: list[VariantSpec] = Field(default_factory=lambda: [VariantSpec(engine="torch"), VariantSpec(engine="onnxruntime")])
    export: ExportSpec = Field(default_factory=ExportSpec)
    bench: BenchSpec = Field(default_factory=BenchSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    report: ReportSpec = Field(default_factory=ReportSpec)
    qat: Optional[QatConfig] = None
    optimize: Optional[OptimizeConfig] = None

    @model_validator(mode="after")
    def _task_defaults(self) -> "RunConfig":
        """The agreement floors the task sets where the config gives none (eval.min_agreement, budget.min_agreement)."""
        floor = get_task(self.model.task).default_min_agreement
        if self.eval.min_agreement is None:
            self.eval.__dict__["min_agreement"] = floor
        if self.optimize is not None:
            self.optimize.budget._default_floor = floor
        return self

    def qat_settings(self) -> QatConfig:
        return self.qat or QatConfig()

    def qat_training_data(self) -> DatasetSpec:
        """The images QAT trains on: ``qat.data``, else data.train (supervised / both), else data.calibration (distill)."""
        q = self.qat_settings()
        if q.objective in ("supervised", "both") and not get_task(self.model.task).supervised_qat:
            raise ConfigError(f"qat.objective {q.objective} trains on {self.model.task} labels, which needs the model's own "
                              f"training loss; qdeploy distils a {self.model.task} model from its FP32 outputs: set "
                              "qat.objective: distill")
        if q.objective in ("supervised", "both"):
            spec = q.data or self.data.train
            if spec is None:
                raise ConfigError(f"qat.objective {q.objective} trains on labels: add data.train (labelled images) or qat.data; "
                                  "with unlabelled images only, use qat.objective: distill")
            if not spec.labels:
                raise ConfigError(f"qat.objective {q.objective} trains on labels but {spec.root} has labels: false; "
                                  "use qat.objective: distill")
            return spec
        spec = q.data or self.data.calibration or self.data.train
        if spec is None:
            raise ConfigError("qat.objective distill needs images (no labels): add data.calibration, data.train or qat.data")
        return spec


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
    # one line (the CLI prints one line per error): every problem, separated by '; '
    return f"invalid config {source}: " + "; ".join(" ".join(line.split()) for line in lines)


def parse_config(data: dict, source: str = "<dict>") -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source, RunConfig)) from None


def _looks_like_path(source: str) -> bool:
    return source.endswith(".onnx") or ".py:" in source or source.endswith(".py") or source.lower().endswith(KERAS_SUFFIXES)


def _resolve_paths(data: dict, base: Path) -> dict:
    """Make relative paths in the config relative to the config file, not to the current directory."""

    def fix(p: Any) -> Any:
        if isinstance(p, str) and p and not p.startswith("pkg:") and not Path(p).expanduser().is_absolute():
            return str((base / p).resolve())
        return p

    model = data.get("model")
    if isinstance(model, dict):
        src = model.get("source")
        if isinstance(src, str) and (_looks_like_path(src) or (base / src / "saved_model.pb").is_file()):
            path, sep, factory = src.rpartition(":") if ".py:" in src else (src, "", "")
            model["source"] = str(Path(fix(path)).expanduser()) + (sep + factory if sep else "")
        if isinstance(model.get("weights"), str) and model["weights"] != RANDOM_WEIGHTS:
            model["weights"] = fix(model["weights"])
        dec = model.get("decode")
        if isinstance(dec, str) and ".py:" in dec:  # model.decode: file.py:function
            path, _, fn = dec.rpartition(":")
            model["decode"] = f"{fix(path)}:{fn}"
    for variant in data.get("variants") or []:
        if isinstance(variant, dict):
            for holder in (variant, variant.get("int8")):
                if isinstance(holder, dict) and isinstance(holder.get("calibration_cache"), str):
                    holder["calibration_cache"] = fix(holder["calibration_cache"])
    d = data.get("data")
    specs = list(d.values()) if isinstance(d, dict) else []
    if isinstance(data.get("qat"), dict):
        specs.append(data["qat"].get("data"))  # qat.data is a dataset spec too
    for part in specs:
        if isinstance(part, dict):
            for key in ("root", "classes", "annotations", "names"):
                if isinstance(part.get(key), str):
                    part[key] = fix(part[key])
    return data


def input_paths(cfg: RunConfig) -> list[tuple[str, Path]]:
    """``(config key, path)`` of every file or folder a run reads: model source file, weights, data folders, class lists,
    calibration caches."""
    out: list[tuple[str, Path]] = []
    source = cfg.model.source
    if _looks_like_path(source):
        out.append(("model.source", Path(source.rpartition(":")[0] if ".py:" in source else source)))
    if cfg.model.weights_file and not cfg.model.weights_file.startswith("pkg:"):
        out.append(("model.weights", Path(cfg.model.weights_file)))
    if cfg.model.decode and ".py:" in cfg.model.decode:
        out.append(("model.decode", Path(cfg.model.decode.rpartition(":")[0])))
    specs = [("data.eval", cfg.data.eval), ("data.calibration", cfg.data.calibration), ("data.train", cfg.data.train)]
    if cfg.qat is not None:
        specs.append(("qat.data", cfg.qat.data))
    for key, spec in specs:
        if spec is not None:
            out.append((key, Path(spec.root)))
            if spec.classes_file:
                out.append((f"{key}.classes", Path(spec.classes_file)))
            for name in ("annotations", "names"):
                if isinstance(getattr(spec, name), str):
                    out.append((f"{key}.{name}", Path(getattr(spec, name))))
    for i, v in enumerate(cfg.variants):
        if v.int8 is not None and v.int8.calibration_cache:
            out.append((f"variants[{i}].calibration_cache", Path(v.int8.calibration_cache)))
    return [(k, p.expanduser().resolve()) for k, p in out]


def check_output_folder(cfg: RunConfig, out_dir: str | Path, cache_dir: Optional[str | Path]) -> None:
    """--out must hold none of the run's inputs (the finished run replaces it whole), must not sit inside a data folder
    (the next run would read its files as images) and must not overlap the cache folder."""
    out = Path(out_dir).expanduser().resolve()
    blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"output directory {out_dir} cannot be made: {blocker} is a file, not a folder; choose another "
                          "--out")
    if cache_dir is None:
        from qdeploy.utils.cache import default_cache_dir

        cache_dir = default_cache_dir()
    cache = Path(cache_dir).expanduser().resolve()
    if out == cache or cache in out.parents or out in cache.parents:
        raise ConfigError(f"--out {out_dir} and the cache folder {cache} (--cache-dir) overlap: the run replaces --out whole; "
                          "choose an output folder outside the cache, and a cache outside --out")
    for key, path in input_paths(cfg):
        if path == out or out in path.parents:
            raise ConfigError(f"--out {out_dir} holds the run's input {key} ({path}), and the run replaces --out whole: "
                              "choose another output folder")
        if key.startswith(("data.", "qat.data")) and not key.endswith(".classes") and path in out.parents:
            raise ConfigError(f"--out {out_dir} is inside {key}'s folder {path}: the next run would read its files as "
                              "images; choose an output folder outside the input data")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where (1-based line and column), and a fix."""
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{problem}{where}" + (f" ({context})" if context else "") + ": fix the YAML there"


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
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        raise ConfigError(f"config file {path} is empty")
    if isinstance(data, dict):
        data = _resolve_paths(data, path.resolve().parent)
    return parse_config(data, str(path))
