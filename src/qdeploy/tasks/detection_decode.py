"""A detector's raw output → boxes, scores and classes per image (``model.decode``), then class-wise NMS.

What is quantized, benchmarked and deployed is the network up to its raw head output (one tensor, as YOLO and
FastestDet export it); the decoding runs here, in NumPy and torchvision's NMS, the same for every variant, so a
change of mAP is the network's. Each decoder is a function ``decode(output, input_hw) -> list of (boxes, scores,
classes)`` per image of the batch: ``boxes`` (K, 4) ``xmin ymin xmax ymax`` in pixels of the model's input, before NMS.
A built-in decoder is registered with :func:`register_decoder`; ``model.decode: file.py:function`` loads any other
(same signature; it may also run its own NMS and return at most ``max_detections`` per image, which is then kept as
it is: :data:`FINAL` on the function).

The built-in heads (their output layouts, as their authors' export code writes them):

* ``yolov8`` — Ultralytics YOLOv8/v9/v10/11 ``Detect`` export: (N, 4 + C, A), rows ``cx cy w h`` in input pixels then C
  class scores after the sigmoid (no objectness). A transposed (N, A, 4 + C) output is read too (A > 4 + C).
* ``yolov5`` — YOLOv5/v7 ``Detect`` export: (N, A, 5 + C), ``cx cy w h`` in input pixels, objectness, C class
  probabilities (sigmoids applied); a candidate's score is objectness × class probability (YOLOv5's
  ``non_max_suppression``).
* ``xyxy-scores`` — boxes already decoded by the network, (N, A, 4 + C): ``xmin ymin xmax ymax`` in input pixels then
  C per-class scores (torchvision's SSD/RetinaNet/FCOS heads with their box coder and anchors in the graph and
  their NMS left out, as bench/train/bccd_models.py's SSDlite exports; DETR-style sets without a no-object column).
* ``onnx-nms`` — an ONNX detector with its NMS inside (ONNX NonMaxSuppression or TensorRT's EfficientNMS_TRT): the
  graph is cut at that node (:mod:`qdeploy.tasks.detection_nms_graph`), its boxes and per-class scores become the
  output, and the node's own settings apply: box coding, IoU and score thresholds, per-image maximum, class-agnostic
  or not. Every (box, class) pair is a candidate, as in those operators (a box can be kept for two classes).
* ``fastestdet`` — dog-qiuqiu/FastestDet's single-scale anchor-free head: (N, 5 + C, H, W) per grid cell: objectness
  (sigmoid applied), box-centre offsets (tanh, added to the cell index, over the grid size), width and height
  (sigmoid, a fraction of the image), C class probabilities (softmax applied); score = obj^0.6 × max(class)^0.4 (its
  ``utils/tool.py handle_preds``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

Detections = tuple[np.ndarray, np.ndarray, np.ndarray]  # boxes (K, 4) float32 xyxy, scores (K,), classes (K,) int64
Decoder = Callable[[np.ndarray, tuple[int, int]], list]

DECODERS: dict[str, Decoder] = {}


def register_decoder(name: str):
    def wrap(fn: Decoder) -> Decoder:
        if name in DECODERS:
            raise ValueError(f"decoder {name!r} is registered twice")
        DECODERS[name] = fn
        return fn
    return wrap


def _names() -> str:
    return ", ".join(sorted(DECODERS))


def check_decode_name(value: str) -> None:
    """``model.decode`` is a built-in name or ``file.py:function`` (the file is read when the data is, not here)."""
    if value in DECODERS:
        return
    path, sep, fn = value.rpartition(":")
    if not sep or not path.endswith(".py") or not fn.isidentifier():
        raise ValueError(f"model.decode {value!r} is neither a built-in decoder ({_names()}) nor file.py:function")


check_decode_name.names = _names  # for the config's message


def load_decoder(value: str, base: Optional[Path] = None) -> Decoder:
    """The decoder ``model.decode`` names (``file.py`` relative to ``base``, the config's folder, where not absolute)."""
    from qdeploy.errors import ConfigError

    if value in DECODERS:
        return DECODERS[value]
    check_decode_name(value)
    path, _, fn = value.rpartition(":")
    file = Path(path).expanduser()
    if not file.is_absolute() and base is not None:
        file = base / file
    if not file.is_file():
        raise ConfigError(f"model.decode: {file} does not exist")
    name = f"qdeploy_user_decoder_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: its own error, named
        raise ConfigError(f"model.decode: importing {file} failed: {type(e).__name__}: {e}") from None
    decoder = getattr(module, fn, None)
    if not callable(decoder):
        raise ConfigError(f"model.decode: {file} has no function {fn}")
    return decoder


def _xywh_to_xyxy(b: np.ndarray) -> np.ndarray:
    out = np.empty_like(b)
    out[:, :2] = b[:, :2] - b[:, 2:] / 2
    out[:, 2:] = b[:, :2] + b[:, 2:] / 2
    return out


def _check_rank(output: np.ndarray, rank: int, name: str, layout: str) -> None:
    if output.ndim != rank:
        raise ValueError(f"decoder {name} expects an output of shape {layout}; the model gives {tuple(output.shape)}")


@register_decoder("yolov8")
def decode_yolov8(output: np.ndarray, input_hw: tuple[int, int]) -> list:
    _check_rank(output, 3, "yolov8", "(N, 4 + classes, anchors)")
    if output.shape[1] > output.shape[2]:  # (N, A, 4 + C): exported transposed
        output = output.transpose(0, 2, 1)
    if output.shape[1] < 5:
        raise ValueError(f"decoder yolov8 expects (N, 4 + classes, anchors); the model gives {tuple(output.shape)}")
    out = []
    for o in output:  # (4 + C, A)
        scores_all = o[4:].T
        classes = scores_all.argmax(1)
        out.append((_xywh_to_xyxy(o[:4].T.astype(np.float32)), scores_all[np.arange(len(classes)), classes], classes))
    return out


@register_decoder("yolov5")
def decode_yolov5(output: np.ndarray, input_hw: tuple[int, int]) -> list:
    _check_rank(output, 3, "yolov5", "(N, anchors, 5 + classes)")
    if output.shape[2] < 6:
        raise ValueError(f"decoder yolov5 expects (N, anchors, 5 + classes); the model gives {tuple(output.shape)}")
    out = []
    for o in output:  # (A, 5 + C)
        cls = o[:, 5:] * o[:, 4:5]
        classes = cls.argmax(1)
        out.append((_xywh_to_xyxy(o[:, :4].astype(np.float32)), cls[np.arange(len(classes)), classes], classes))
    return out


@register_decoder("xyxy-scores")
def decode_xyxy_scores(output: np.ndarray, input_hw: tuple[int, int]) -> list:
    _check_rank(output, 3, "xyxy-scores", "(N, anchors, 4 + classes)")
    if output.shape[2] < 5:
        raise ValueError(f"decoder xyxy-scores expects (N, anchors, 4 + classes); the model gives {tuple(output.shape)}")
    out = []
    for o in output:  # (A, 4 + C)
        classes = o[:, 4:].argmax(1)
        out.append((o[:, :4].astype(np.float32), o[:, 4:][np.arange(len(classes)), classes], classes))
    return out


def graph_nms_decoder(box_coding: str) -> Decoder:
    """The decoder of a detector cut at its NMS node: (N, A, 4 + C), boxes in ``box_coding`` ("xyxy" or "cxcywh",
    input pixels), then C class scores; every (box, class) pair scoring above 0 is a candidate (NonMaxSuppression and
    EfficientNMS suppress per class over every box, not over each box's best class)."""
    def decode_graph_nms(output: np.ndarray, input_hw: tuple[int, int]) -> list:
        _check_rank(output, 3, "onnx-nms", "(N, boxes, 4 + classes)")
        out = []
        for o in output.astype(np.float32):
            boxes = o[:, :4] if box_coding == "xyxy" else _xywh_to_xyxy(o[:, :4])
            anchor, cls = np.nonzero(o[:, 4:] > 0)
            out.append((boxes[anchor], o[anchor, 4 + cls], cls))
        return out

    decode_graph_nms.__name__ = f"onnx-nms ({box_coding})"
    return decode_graph_nms


@register_decoder("onnx-nms")
def decode_onnx_nms_unbound(output: np.ndarray, input_hw: tuple[int, int]) -> list:
    raise RuntimeError("model.decode onnx-nms decodes once bound to its ONNX model (Detection.bind reads the NMS node)")


@register_decoder("fastestdet")
def decode_fastestdet(output: np.ndarray, input_hw: tuple[int, int]) -> list:
    _check_rank(output, 4, "fastestdet", "(N, 5 + classes, H, W)")
    n, c, gh, gw = output.shape
    if c < 6:
        raise ValueError(f"decoder fastestdet expects (N, 5 + classes, H, W); the model gives {tuple(output.shape)}")
    ih, iw = input_hw
    gy, gx = np.meshgrid(np.arange(gh, dtype=np.float32), np.arange(gw, dtype=np.float32), indexing="ij")
    out = []
    for o in output.astype(np.float32):
        obj, reg, cls = o[0], o[1:5], o[5:]
        best = cls.max(0)
        # a negative objectness or class score (a variant's rounding) has no real power: clipped at 0
        score = np.power(np.clip(obj, 0, None), 0.6) * np.power(np.clip(best, 0, None), 0.4)
        cx = (np.tanh(reg[0]) + gx) / gw
        cy = (np.tanh(reg[1]) + gy) / gh
        w, h = 1 / (1 + np.exp(-reg[2])), 1 / (1 + np.exp(-reg[3]))
        boxes = np.stack([(cx - w / 2) * iw, (cy - h / 2) * ih, (cx + w / 2) * iw, (cy + h / 2) * ih], -1)
        out.append((boxes.reshape(-1, 4), score.reshape(-1), cls.argmax(0).reshape(-1)))
    return out


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, score_threshold: float, iou_threshold: float,
        max_detections: int, class_agnostic: bool = False) -> Detections:
    """Class-wise NMS (torchvision.ops.batched_nms) of one image's candidates above ``score_threshold``, the
    ``max_detections`` best kept; boxes with no area or non-finite coordinates are dropped first. ``class_agnostic``:
    one suppression over all classes (EfficientNMS_TRT's class_agnostic)."""
    import torch
    from torchvision.ops import batched_nms

    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    scores = np.asarray(scores, np.float32).reshape(-1)
    classes = np.asarray(classes).astype(np.int64).reshape(-1)
    keep = (scores >= score_threshold) & np.isfinite(boxes).all(1) & np.isfinite(scores) & \
        (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    boxes, scores, classes = boxes[keep], scores[keep], classes[keep]
    if len(scores) > 30000:  # YOLOv5's max_nms: the best 30,000 candidates go into NMS
        top = np.argsort(-scores, kind="stable")[:30000]
        boxes, scores, classes = boxes[top], scores[top], classes[top]
    if not len(scores):
        return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64)
    groups = torch.zeros(len(classes), dtype=torch.int64) if class_agnostic else torch.from_numpy(classes)
    idx = batched_nms(torch.from_numpy(boxes), torch.from_numpy(scores), groups, iou_threshold).numpy()[:max_detections]
    return boxes[idx], scores[idx], classes[idx]


def postprocess(decoder: Decoder, output: np.ndarray, input_hw: tuple[int, int], score_threshold: float,
                iou_threshold: float, max_detections: int, num_classes: int, class_agnostic: bool = False) -> list:
    """``decoder`` then :func:`nms` per image (unless the decoder is marked ``FINAL``: its detections are kept as they
    are, cut to ``max_detections``); class ids are checked against ``num_classes``."""
    per_image = decoder(output, tuple(input_hw))
    if len(per_image) != len(output):
        raise ValueError(f"model.decode returned {len(per_image)} images for a batch of {len(output)}")
    out = []
    for boxes, scores, classes in per_image:
        if getattr(decoder, "FINAL", False):
            order = np.argsort(-np.asarray(scores), kind="stable")[:max_detections]
            dets = (np.asarray(boxes, np.float32).reshape(-1, 4)[order], np.asarray(scores, np.float32)[order],
                    np.asarray(classes).astype(np.int64)[order])
        else:
            dets = nms(boxes, scores, classes, score_threshold, iou_threshold, max_detections, class_agnostic)
        bad = dets[2][(dets[2] < 0) | (dets[2] >= num_classes)]
        if len(bad):
            raise ValueError(f"the decoder gives class {int(bad[0])}, outside the {num_classes} classes of data.eval.classes")
        out.append(dets)
    return out


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU matrix (len(a), len(b)) of xyxy boxes."""
    if not len(a) or not len(b):
        return np.zeros((len(a), len(b)), np.float32)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-12)


def matched(reference: Sequence[np.ndarray], other: Sequence[np.ndarray], iou: float = 0.5) -> tuple[int, int]:
    """How many of ``reference``'s detections (boxes, classes) ``other`` reproduces: same class, IoU ≥ ``iou``, each
    of ``other``'s used once (greedy, by IoU). Returns (matched, reference count)."""
    rb, rc = reference
    ob, oc = other
    if not len(rb):
        return 0, 0
    m = box_iou(rb, ob)
    m[rc[:, None] != oc[None, :]] = 0
    used, hits = set(), 0
    for i in np.argsort(-m.max(1, initial=0), kind="stable") if m.size else []:
        j = int(np.argmax(m[i]))
        while m[i, j] >= iou and j in used:
            m[i, j] = 0
            j = int(np.argmax(m[i]))
        if m[i, j] >= iou:
            used.add(j)
            hits += 1
    return hits, len(rb)


__all__ = ["DECODERS", "Detections", "box_iou", "check_decode_name", "decode_fastestdet", "decode_yolov5",
           "decode_xyxy_scores", "decode_yolov8", "graph_nms_decoder", "load_decoder", "matched", "nms", "postprocess",
           "register_decoder"]
