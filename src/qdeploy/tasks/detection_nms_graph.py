"""A detector exported with its non-maximum suppression inside the ONNX graph (``model.decode: onnx-nms``).

End-to-end exports put NMS in the graph: ONNX's ``NonMaxSuppression`` (torchvision's ``nms`` exported, YOLOv5/v8
"end2end" ONNX exports, mmdeploy) or TensorRT's ``EfficientNMS_TRT`` plugin node (YOLOv8-TensorRT, YOLOv6/v7's TensorRT
exports). Such a graph cannot be quantized as a whole (NMS has no INT8 form; selected indices are not a tensor a
calibrator can range), ONNX Runtime and OpenVINO cannot run the TensorRT plugin at all, and the outputs are a
variable number of boxes. qdeploy therefore works on the network up to the NMS node: the node's two inputs (boxes and
per-class scores) become one output ``(N, A, 4 + C)`` — boxes, then scores — and the same suppression runs after every
variant, class-wise, with the thresholds read from the node (its attributes, or its constant inputs). Nothing is
guessed that the node does not say; what it cannot say is stated:

* ``NonMaxSuppression`` (opset 10+): boxes ``(N, A, 4)``, scores ``(N, C, A)``; ``center_point_box`` 1 = ``cx cy w
  h``, 0 = two corners. The ONNX specification writes the corners as ``y1 x1 y2 x2`` (TensorFlow's order), but the
  operator is symmetric in x and y, and PyTorch exporters (torchvision's ``nms`` symbolic, YOLO end2end exports) feed
  ``x1 y1 x2 y2``: qdeploy reads x first (a model fed y-first gets near-zero mAP, not a silent small error).
  ``iou_threshold`` and ``score_threshold`` come from its constant inputs (ONNX's defaults: 0 and none where absent);
  ``max_output_boxes_per_class`` is per class, qdeploy keeps ``model.nms.max_detections`` per image.
* ``EfficientNMS_TRT``: boxes ``(N, A, 4)`` (or ``(N, A, 1, 4)``), scores ``(N, A, C)``; ``box_coding`` 0 = ``x1 y1 x2
  y2``, 1 = ``cx cy w h``; ``score_activation`` 1 = a sigmoid on the scores (applied in the graph here);
  ``iou_threshold``, ``score_threshold``, ``max_output_boxes`` (per image), ``class_agnostic``. Boxes per class
  (``(N, A, C, 4)``) and ``background_class`` other than -1 are refused with a message.
* ``BatchedNMS_TRT`` / ``BatchedNMSDynamic_TRT`` (deprecated by TensorRT in favour of EfficientNMS): refused with a
  message.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qdeploy.errors import ModelError

NMS_OPS = ("NonMaxSuppression", "EfficientNMS_TRT", "EfficientNMSCustom_TRT", "BatchedNMS_TRT", "BatchedNMSDynamic_TRT")
HEAD_OUTPUT = "qdeploy_boxes_scores"


@dataclass(frozen=True)
class GraphNms:
    """What a graph's NMS node says: where its boxes and scores come from, how to read them, its thresholds."""

    op: str
    node: str
    boxes: str                       # the tensor feeding the node's boxes input
    scores: str                      # ... and its scores input
    box_coding: str                  # "xyxy" | "cxcywh"
    scores_layout: str               # "NCA" (ONNX NonMaxSuppression) | "NAC" (EfficientNMS)
    sigmoid_scores: bool             # EfficientNMS score_activation: the plugin applies a sigmoid first
    boxes_rank4: bool                # EfficientNMS boxes (N, A, 1, 4)
    iou_threshold: float
    score_threshold: float
    max_detections: Optional[int]    # per image (EfficientNMS max_output_boxes); None: per class only (ONNX)
    class_agnostic: bool

    def describe(self) -> str:
        return (f"{self.op} '{self.node}' (boxes {self.box_coding}, IoU {self.iou_threshold:g}, score "
                f"{self.score_threshold:g}{', class-agnostic' if self.class_agnostic else ''}"
                f"{f', {self.max_detections} per image' if self.max_detections else ''})")

    def to_dict(self) -> dict:
        return asdict(self)


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _constant(proto: onnx.ModelProto, name: str, what: str, node_name: str) -> Optional[np.ndarray]:
    """The value of a tensor that is an initializer or a Constant node's output (None for an absent optional input)."""
    if not name:
        return None
    for t in proto.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in proto.graph.node:
        if n.op_type == "Constant" and name in n.output:
            a = _attrs(n)
            if "value" in a:
                return numpy_helper.to_array(a["value"])
            for k in ("value_float", "value_int"):
                if k in a:
                    return np.asarray(a[k])
    raise ModelError(f"the ONNX NonMaxSuppression node '{node_name}' takes its {what} from '{name}', which is computed in "
                     "the graph, not a constant: qdeploy cannot read the threshold to apply it after the cut; export with "
                     "constant thresholds, or use model.decode: file.py:function on the raw head")


def _shape_ranks(proto: onnx.ModelProto) -> dict:
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # custom ops (the TensorRT plugins) can stop ONNX's inference: ranks are then unknown
        return {}
    ranks = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            ranks[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
    return ranks


def find_graph_nms(proto: onnx.ModelProto, where: str = "the ONNX model") -> Optional[GraphNms]:
    """The graph's one NMS node read as :class:`GraphNms`, None where it has none; a ModelError for what qdeploy cannot
    read (two NMS nodes, the deprecated BatchedNMS plugins, per-class boxes, a background class, computed thresholds)."""
    nodes = [n for n in proto.graph.node if n.op_type in NMS_OPS]
    if not nodes:
        return None
    if len(nodes) > 1:
        raise ModelError(f"{where} has {len(nodes)} NMS nodes ({', '.join(n.name or n.op_type for n in nodes)}): qdeploy "
                         "reads a graph with one")
    n = nodes[0]
    name = n.name or n.op_type
    a = _attrs(n)
    if n.op_type in ("BatchedNMS_TRT", "BatchedNMSDynamic_TRT"):
        raise ModelError(f"{where} ends in TensorRT's {n.op_type} node '{name}' (deprecated by TensorRT for "
                         "EfficientNMS_TRT): export with EfficientNMS_TRT or ONNX NonMaxSuppression, or without NMS "
                         "(model.decode: yolov8, yolov5, xyxy-scores or file.py:function)")
    if n.op_type == "NonMaxSuppression":
        if len(n.input) < 2:
            raise ModelError(f"{where}: NonMaxSuppression node '{name}' has {len(n.input)} inputs, not boxes and scores")
        iou = _constant(proto, n.input[3] if len(n.input) > 3 else "", "iou_threshold", name)
        score = _constant(proto, n.input[4] if len(n.input) > 4 else "", "score_threshold", name)
        return GraphNms(op=n.op_type, node=name, boxes=n.input[0], scores=n.input[1],
                        box_coding="cxcywh" if int(a.get("center_point_box", 0)) == 1 else "xyxy",
                        scores_layout="NCA", sigmoid_scores=False, boxes_rank4=False,
                        iou_threshold=float(np.asarray(iou).reshape(-1)[0]) if iou is not None else 0.0,
                        score_threshold=float(np.asarray(score).reshape(-1)[0]) if score is not None else 0.0,
                        max_detections=None, class_agnostic=False)
    # EfficientNMS_TRT (and its Custom variant, the same attributes)
    if int(a.get("background_class", -1)) != -1:
        raise ModelError(f"{where}: {n.op_type} node '{name}' has background_class {a['background_class']}: qdeploy reads "
                         "scores without a background column (export with background_class -1)")
    rank = _shape_ranks(proto).get(n.input[0])
    boxes_rank4 = bool(rank and len(rank) == 4)
    if boxes_rank4 and rank[2] not in (1, None):
        raise ModelError(f"{where}: {n.op_type} node '{name}' takes one box per class (boxes {rank}): qdeploy reads one box "
                         "per anchor shared by the classes")
    return GraphNms(op=n.op_type, node=name, boxes=n.input[0], scores=n.input[1],
                    box_coding="cxcywh" if int(a.get("box_coding", 0)) == 1 else "xyxy", scores_layout="NAC",
                    sigmoid_scores=bool(int(a.get("score_activation", 0))), boxes_rank4=boxes_rank4,
                    iou_threshold=float(a.get("iou_threshold", 0.5)), score_threshold=float(a.get("score_threshold", 0.0)),
                    max_detections=int(a["max_output_boxes"]) if "max_output_boxes" in a else None,
                    class_agnostic=bool(int(a.get("class_agnostic", 0))))


def cut_at_nms(proto: onnx.ModelProto, g: GraphNms) -> onnx.ModelProto:
    """A copy of ``proto`` whose one output is the NMS node's inputs joined, ``(N, A, 4 + C)`` float32 (boxes as the
    node reads them, then the per-class scores, after the node's sigmoid where it applies one); the NMS node and
    everything after it, and whatever only they used, are gone."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    graph = m.graph
    new = []
    boxes, scores = g.boxes, g.scores
    if g.boxes_rank4:
        shape = HEAD_OUTPUT + "_box_shape"
        graph.initializer.append(numpy_helper.from_array(np.array([0, -1, 4], np.int64), shape))
        new.append(helper.make_node("Reshape", [boxes, shape], [HEAD_OUTPUT + "_boxes"], name=HEAD_OUTPUT + "_reshape"))
        boxes = HEAD_OUTPUT + "_boxes"
    if g.scores_layout == "NCA":
        new.append(helper.make_node("Transpose", [scores], [HEAD_OUTPUT + "_scores"], perm=[0, 2, 1],
                                    name=HEAD_OUTPUT + "_transpose"))
        scores = HEAD_OUTPUT + "_scores"
    if g.sigmoid_scores:
        new.append(helper.make_node("Sigmoid", [scores], [HEAD_OUTPUT + "_sigmoid"], name=HEAD_OUTPUT + "_sigmoid"))
        scores = HEAD_OUTPUT + "_sigmoid"
    new.append(helper.make_node("Concat", [boxes, scores], [HEAD_OUTPUT], axis=2, name=HEAD_OUTPUT + "_concat"))
    graph.node.extend(new)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(HEAD_OUTPUT, onnx.TensorProto.FLOAT, [None, None, None]))
    # keep what the new output needs: walk the (topologically ordered) nodes backwards from it
    needed, keep = {HEAD_OUTPUT}, []
    for node in reversed(list(graph.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for node in keep for i in node.input}
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    vis = [v for v in graph.value_info if v.name in used or v.name in needed]
    del graph.value_info[:]
    graph.value_info.extend(vis)
    # the TensorRT plugin's domain/opset import may stay: harmless without its node
    return m


@lru_cache(maxsize=16)
def _graph_nms_of_file(path: str, mtime_ns: int, size: int) -> Optional[GraphNms]:
    return find_graph_nms(onnx.load(path, load_external_data=False), f"ONNX model {path}")


def graph_nms_of(path: Path) -> Optional[GraphNms]:
    """:func:`find_graph_nms` of an ONNX file, read once per version of the file (the source loader and every
    ``Detection.bind`` ask it)."""
    st = Path(path).stat()
    return _graph_nms_of_file(str(path), st.st_mtime_ns, st.st_size)


def no_nms_node(path: Path) -> ModelError:
    """``model.decode: onnx-nms`` on an ONNX without an NMS node."""
    return ModelError(f"model.decode is onnx-nms but ONNX model {path} has no NMS node (NonMaxSuppression or "
                      "EfficientNMS_TRT): name the decoder of its raw head (model.decode: yolov8, yolov5, xyxy-scores, "
                      "fastestdet or file.py:function)")
