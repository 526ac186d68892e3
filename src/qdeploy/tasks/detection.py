"""Object detection: boxes per image, COCO mAP by pycocotools, agreement as the share of the reference's detections kept.

How detection fits the stages without a branch of their own:

* **labels** are one float32 table per image, :data:`LABEL_COLUMNS` wide and ``1 + max boxes`` long (the same length
  over a data set, so batches stack, cache and subset as classification labels do): row 0 holds the image's geometry
  (original width and height, the x/y scale and padding of the resize or letterbox that fed the model, and whether
  it is labelled), rows 1.. its boxes (class id in the model's classes, ``xmin ymin xmax ymax`` in original pixels),
  padded with class -1. ``data/datasets.DetectionDataset`` writes them, :func:`label_table` is their one layout.
* **outputs** are the model's raw head tensor (what is quantized and deployed); a bound task (:meth:`Detection.bind`:
  the model's ``decode`` and ``nms`` settings) decodes them (``detection_decode``), maps the boxes back to the original
  image and scores them with :class:`~qdeploy.tasks.detection_metrics.DetectionMetrics` (COCOeval).
* **predictions** (for agreement) are the detections per image, (N, max_detections, 6): ``xmin ymin xmax ymax score
  class`` in original pixels, class -1 = none. Agreement (:meth:`DetectionPredictions.agreement_with`): the share of the reference's detections
  at a deployment's confidence threshold (``nms.agreement_score``) that a variant keeps (same class, IoU ≥ 0.5), less
  the ones it adds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from qdeploy.tasks.base import Task, register_task
from qdeploy.tasks.detection_decode import matched, postprocess
from qdeploy.tasks.detection_metrics import DetectionMetrics

LABEL_COLUMNS = 7
# row 0 of a label table
WIDTH, HEIGHT, SCALE_X, SCALE_Y, PAD_X, PAD_Y, LABELLED = range(LABEL_COLUMNS)


def label_table(width: int, height: int, geometry: Sequence[float], boxes: np.ndarray, classes: np.ndarray,
                max_boxes: int, labelled: bool = True) -> np.ndarray:
    """One image's label table (see the module docstring). ``geometry``: (scale_x, scale_y, pad_x, pad_y) taking an
    original pixel to the model's input: ``x_in = x * scale_x + pad_x``."""
    t = np.zeros((1 + max_boxes, LABEL_COLUMNS), np.float32)
    t[0, [WIDTH, HEIGHT]] = width, height
    t[0, SCALE_X:PAD_Y + 1] = geometry
    t[0, LABELLED] = 1.0 if labelled else 0.0
    t[1:, 0] = -1
    n = len(boxes)
    if n > max_boxes:
        raise ValueError(f"{n} boxes in a table of {max_boxes}")
    t[1:1 + n, 0] = classes
    t[1:1 + n, 1:5] = boxes
    return t


def unlabelled_table(image: np.ndarray) -> np.ndarray:
    """The label of an image without annotations: its detections stay in model-input pixels (IoU, hence agreement,
    is the same in either frame: it does not change under axis-wise scaling and shifts)."""
    return label_table(image.shape[-1], image.shape[-2], (1.0, 1.0, 0.0, 0.0), np.zeros((0, 4)), np.zeros(0), 0,
                       labelled=False)


class DetectionPredictions(np.ndarray):
    """Detections per image, (N, max_detections, 6) ``xmin ymin xmax ymax score class`` (class -1: none), that know
    how to agree with another set (``evaluate.metrics.agreement`` asks the predictions for ``agreement_with``, so every
    caller that compares a variant with its reference needs no task). Slices and index selections (a search subset of
    the reference) stay DetectionPredictions with the same threshold."""

    def __new__(cls, a, agreement_score: float = 0.25):
        obj = np.asarray(a, np.float32).view(cls)
        obj.agreement_score = float(agreement_score)
        return obj

    def __array_finalize__(self, obj):
        self.agreement_score = getattr(obj, "agreement_score", 0.25)

    def agreement_with(self, reference) -> Optional[float]:
        """The share of the reference's detections this set keeps, less the ones it adds: ``kept / (reference + added)``
        over the detections scoring at least ``agreement_score`` (t). A reference detection is kept where this set has
        one of the same class at IoU ≥ 0.5 scoring at least t/2; a detection of this set is added where the reference
        has none scoring t/2. The half-threshold margin keeps a box whose score moves from just above t to just below
        it (INT8 rounding of a confidence) from counting as lost, while a box whose score halves still does.
        None where the two are not of the same images."""
        pred, ref = np.asarray(self), np.asarray(reference)
        if ref.ndim != 3 or pred.shape[0] != ref.shape[0] or not len(pred):
            return None
        t = self.agreement_score
        kept = total = 0
        for p, r in zip(pred, ref):
            p, r = p[p[:, 5] >= 0], r[r[:, 5] >= 0]
            r_hi, p_hi, r_lo, p_lo = r[r[:, 4] >= t], p[p[:, 4] >= t], r[r[:, 4] >= t / 2], p[p[:, 4] >= t / 2]
            k, n_ref = matched((r_hi[:, :4], r_hi[:, 5]), (p_lo[:, :4], p_lo[:, 5]))
            found, n_pred = matched((p_hi[:, :4], p_hi[:, 5]), (r_lo[:, :4], r_lo[:, 5]))
            kept += k
            total += n_ref + (n_pred - found)
        return float(kept / total) if total else 1.0


class DetectionEvaluation:
    """The metrics accumulator of a bound :class:`Detection`: ``update(raw outputs, label tables)``, ``result()``,
    ``predictions``."""

    def __init__(self, task: "Detection", class_names: Sequence[str]):
        self.task = task
        self.class_names = list(class_names)
        self.metrics = DetectionMetrics(self.class_names)
        self.samples = 0
        self._preds: list[np.ndarray] = []

    def update(self, outputs: np.ndarray, labels: np.ndarray) -> None:
        labels = np.asarray(labels, np.float32)
        if labels.ndim != 3 or labels.shape[2] != LABEL_COLUMNS:
            raise ValueError(f"detection labels must be (N, 1 + boxes, {LABEL_COLUMNS}) tables; got {labels.shape}")
        nms = self.task.nms
        dets = postprocess(self.task.decoder, outputs, self.task.input_hw, nms.score_threshold, nms.iou_threshold,
                           nms.max_detections, len(self.class_names), nms.class_agnostic)
        pred = np.zeros((len(dets), nms.max_detections, 6), np.float32)
        pred[:, :, 5] = -1
        for i, ((boxes, scores, classes), table) in enumerate(zip(dets, labels)):
            head, rows = table[0], table[1:]
            scale = head[[SCALE_X, SCALE_Y, SCALE_X, SCALE_Y]]
            pad = head[[PAD_X, PAD_Y, PAD_X, PAD_Y]]
            boxes = (boxes - pad) / scale
            if head[LABELLED]:
                boxes = np.clip(boxes, 0, head[[WIDTH, HEIGHT, WIDTH, HEIGHT]])
            k = len(scores)
            pred[i, :k, :4], pred[i, :k, 4], pred[i, :k, 5] = boxes, scores, classes
            if head[LABELLED]:
                gt = rows[rows[:, 0] >= 0]
                self.metrics.update(gt[:, 1:5], gt[:, 0].astype(np.int64), boxes, scores, classes,
                                    (int(head[WIDTH]), int(head[HEIGHT])))
        self.samples += len(dets)
        self._preds.append(pred)

    @property
    def predictions(self) -> np.ndarray:
        a = np.concatenate(self._preds) if self._preds else np.zeros((0, self.task.nms.max_detections, 6), np.float32)
        return DetectionPredictions(a, self.task.nms.agreement_score)

    def result(self) -> dict:
        out = self.metrics.result()
        out["samples"] = self.samples
        if self.metrics.count != self.samples:
            out["labelled_samples"] = self.metrics.count
        return out


def metrics_of_detections(tables: np.ndarray, predictions: np.ndarray, class_names: Sequence[str]) -> DetectionMetrics:
    """The COCO metrics of ``predictions`` (:class:`DetectionPredictions`, original pixels) against the label tables of
    the same images (the labelled ones)."""
    m = DetectionMetrics(class_names)
    for table, pred in zip(np.asarray(tables), np.asarray(predictions)):
        if not table[0, LABELLED]:
            continue
        gt, pred = table[1:][table[1:, 0] >= 0], pred[pred[:, 5] >= 0]
        m.update(gt[:, 1:5], gt[:, 0].astype(np.int64), pred[:, :4], pred[:, 4], pred[:, 5].astype(np.int64),
                 (int(table[0, WIDTH]), int(table[0, HEIGHT])))
    return m


def graph_nms_settings(model) -> tuple:
    """(decoder, NMS settings) of an ONNX detector with NMS inside (``model.decode: onnx-nms``): the node's box coding,
    and its IoU / score thresholds, per-image maximum and class-agnosticism wherever ``model.nms`` does not set them
    (a setting the config names wins, and is stated beside the node's)."""
    from qdeploy.tasks.detection_decode import graph_nms_decoder
    from qdeploy.tasks.detection_nms_graph import graph_nms_of, no_nms_node

    path = Path(model.source).expanduser()
    g = graph_nms_of(path)
    if g is None:
        raise no_nms_node(path)
    from_graph = {"iou_threshold": g.iou_threshold, "score_threshold": g.score_threshold,
                  "class_agnostic": g.class_agnostic}
    if g.max_detections:
        from_graph["max_detections"] = g.max_detections
    update = {k: v for k, v in from_graph.items() if k not in model.nms.model_fields_set}
    return graph_nms_decoder(g.box_coding), model.nms.model_copy(update=update)


class Detection(Task):
    name = "detection"
    metric, metric_label = "map", "mAP@0.5:0.95"
    metric_columns = (("map", "mAP %"), ("map50", "mAP50 %"))
    per_class_scores = "per_class_ap"
    predictions_word = "detections"
    pixel_labels = False
    dataset_format = "voc"
    dataset_formats = ("voc", "coco", "yolo")
    needs_decoder = True
    # a detector's raw head mixes box regressions and class scores on axis 1: no softmax over it. Distillation on the
    # head output with a squared error, as NVIDIA's yolov7_qat supervises its QAT by the MSE between the FP32 and the
    # quantized model's outputs; supervised QAT would need the detector's own loss (anchor/box assignment)
    distillation = "output-mse"
    supervised_qat = False
    program_output = "logits"  # the raw head output, decoded here
    # mAP is a statistic of the whole split (ranked detections of every image), no per-image binomial error: a paired
    # bootstrap over images (detection_metrics.map_change) tests a change; budgets read the point estimate (as mIoU's)
    paired_comparison = "bootstrap-map"
    per_sample_standard_error = False
    reference_chance = False
    sensitivity_batch_size = 4
    # below classification's 0.9: a detection set has few, threshold-sensitive members (a box per object, scores
    # near the deployment threshold). Measured: FastestDet's INT8 (TensorRT placement, mAP +0.2 points on fruit-test)
    # keeps 0.89 of FP32's detections by this definition; a collapsed detector keeps near 0. One model: a floor to
    # revisit with the BCCD detectors
    default_min_agreement = 0.8

    def __init__(self, decoder=None, nms=None, input_hw: Optional[tuple[int, int]] = None):
        self.decoder, self.nms, self.input_hw = decoder, nms, input_hw

    def bind(self, model, base=None) -> "Detection":
        """This task with a model's decoding settings (``model.decode``, ``model.nms``, its input size)."""
        from qdeploy.tasks.detection_decode import load_decoder

        if model.decode == "onnx-nms":
            return Detection(*graph_nms_settings(model), tuple(model.preprocess.input_size))
        return Detection(load_decoder(model.decode, base), model.nms, tuple(model.preprocess.input_size))

    def _bound(self) -> None:
        if self.decoder is None:
            raise RuntimeError("the detection task decodes outputs only when bound to a model (Task.bind(cfg.model))")

    def make_metrics(self, num_classes: Optional[int] = None, ignore_index: int = 255,
                     class_names: Optional[Sequence[str]] = None, topk: Sequence[int] = (1, 5)) -> DetectionEvaluation:
        self._bound()
        if not class_names:
            raise ValueError("detection metrics need the model's class names (data.eval.classes)")
        return DetectionEvaluation(self, class_names)

    def metrics_of_program(self, outputs: np.ndarray, labels: np.ndarray, num_classes: Optional[int] = None,
                           ignore_index: int = 255, class_names: Optional[Sequence[str]] = None):
        metrics = self.make_metrics(num_classes, ignore_index, class_names)
        metrics.update(outputs.astype(np.float32), labels)
        return metrics

    def check_output(self, outputs: np.ndarray, labels: np.ndarray, class_names: Optional[Sequence[str]]) -> dict:
        """One real batch decoded: the decoder reads the output's layout and its class ids fit the model's classes."""
        self._bound()
        dets = self.make_metrics(class_names=class_names)
        dets.update(outputs, labels)
        return {"outputs": len(class_names), "decoder": getattr(self.decoder, "__name__", str(self.decoder)),
                "detections_on_check_batch": int((dets.predictions[..., 5] >= 0).sum())}

    def examples(self, batches, predictions: dict, reference: Optional[str], count: int = 4) -> Optional[list]:
        """Up to ``count`` labelled images for the report's picture, those where the variants disagree most with the
        reference first: the image file, its ground truth and each variant's detections scoring at least
        ``nms.agreement_score`` (original pixels)."""
        ref = predictions.get(reference)
        samples = getattr(getattr(batches, "dataset", None), "samples", None)
        if ref is None or samples is None or len(samples) != len(ref):
            return None
        tables = np.concatenate([np.asarray(y) for _, y in batches])
        if len(tables) != len(ref):
            return None
        t = ref.agreement_score
        others = [k for k, p in predictions.items() if k != reference and p is not None and len(p) == len(ref)]
        labelled = [i for i in range(len(ref)) if tables[i, 0, LABELLED]]
        disagreement = {i: sum(1.0 - (predictions[k][i:i + 1].agreement_with(ref[i:i + 1]) or 0.0) for k in others)
                        for i in labelled}
        picked = sorted(labelled, key=lambda i: (-disagreement[i], i))[:count]
        out = []
        for i in picked:
            gt = tables[i, 1:][tables[i, 1:, 0] >= 0]
            dets = {}
            for k in [reference, *others]:
                p = np.asarray(predictions[k][i])
                p = p[(p[:, 5] >= 0) & (p[:, 4] >= t)]
                dets[k] = [[round(float(v), 2) for v in row] for row in p]
            out.append({"image": str(samples[i][0]), "width": int(tables[i, 0, WIDTH]), "height": int(tables[i, 0, HEIGHT]),
                        "ground_truth": [[int(r[0]), *[round(float(v), 2) for v in r[1:5]]] for r in gt],
                        "detections": dets, "score_threshold": t})
        return out

    def unlabelled_label(self, image: np.ndarray, ignore_index: int = 255) -> np.ndarray:
        return unlabelled_table(image)


DETECTION = register_task(Detection())
