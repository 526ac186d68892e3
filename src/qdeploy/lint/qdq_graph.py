"""A Q/DQ-aware view of an ONNX graph: which tensors are quantized, with which scale, and which chains
TensorRT fuses. The lint rules, the safe fixes, the structure report and the ONNX placement all read
the graph through this one view.

Conventions (any Q/DQ ONNX: qdeploy's, ModelOpt's, ONNX Runtime's ``quantize_static``, a QAT export):
- a tensor is *quantized* when its producer, seen through Cast/Identity, is a DequantizeLinear;
- a DequantizeLinear of a constant (an initializer, or a Q of an initializer) is a *weight* DQ;
- the *backbone* of a tensor is the Conv/ConvTranspose/Gemm that TensorRT would fuse it into, following
  ModelOpt's ``get_fusible_backbone`` path types (BiasAdd, ConstMul, BatchNormalization, Relu, SiLU, ...).
"""
from __future__ import annotations

from collections import deque
from functools import cached_property
from typing import Optional

import numpy as np
import onnx

from qdeploy.facts.tensorrt import DQ_SEES_THROUGH, FUSIBLE_ACTIVATIONS, FUSION_BACKBONE_OPS
from qdeploy.utils.onnx_graph import OnnxGraph

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
GATES = ("Sigmoid", "HardSigmoid")  # x·sigmoid(x) = SiLU, x·hardsigmoid(x) = hardswish; y·sigmoid(z) is an SE gate
# Ops that only move or re-label data (no arithmetic, no change of type): a DequantizeLinear commutes forward across
# them and a QuantizeLinear backward (TensorRT developer guide, "Processing of Q/DQ networks": Q/DQ propagation), so a
# tensor INT8 before such a chain is still INT8 after it. A subset of ``DQ_SEES_THROUGH`` (no Cast: it changes type).
DATA_MOVEMENT_OPS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity")


class QdqGraph(OnnxGraph):
    """OnnxGraph plus Q/DQ lookups. Build a new one after editing the model."""

    # ------------------------------------------------------------ Q/DQ lookups
    def dq_of(self, tensor: str) -> Optional[onnx.NodeProto]:
        """The DequantizeLinear producing ``tensor``, or None. Seen through the ops TensorRT folds or moves a DQ across
        (``facts.tensorrt.DQ_SEES_THROUGH``), so DQ→Flatten→Gemm and a Linear's DQ(W)→Transpose→MatMul count as INT8."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in DQ_SEES_THROUGH:
            node = self.producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    def q_of(self, dq: onnx.NodeProto) -> Optional[onnx.NodeProto]:
        """The QuantizeLinear feeding ``dq`` (None when the DQ reads a stored INT8 constant)."""
        node = self.producer.get(dq.input[0])
        return node if node is not None and node.op_type == "QuantizeLinear" else None

    def float_input_of(self, dq: onnx.NodeProto) -> Optional[str]:
        """The float tensor that was quantized: the Q's input (through Cast), or None for a stored INT8 constant."""
        q = self.q_of(dq)
        return self.source(q.input[0]) if q is not None else None

    def is_weight_dq(self, dq: onnx.NodeProto) -> bool:
        if self.is_constant(dq.input[0]):
            return True
        q = self.q_of(dq)
        return q is not None and self.is_constant(self.source(q.input[0]))

    def scale(self, node: onnx.NodeProto) -> Optional[np.ndarray]:
        """The (constant) scale of a Q or DQ node; None when it is missing or computed at run time."""
        if len(node.input) < 2 or not node.input[1]:
            return None
        value = self.constant_value(node.input[1])
        return None if value is None else np.asarray(value, dtype=np.float64)

    def zero_point(self, node: onnx.NodeProto) -> Optional[np.ndarray]:
        if len(node.input) < 3 or not node.input[2]:
            return None
        return self.constant_value(node.input[2])

    def zero_point_type(self, node: onnx.NodeProto) -> Optional[int]:
        """ONNX element type of the quantized tensor (INT8/UINT8/...): the zero point's, else the output_dtype attr, else UINT8."""
        if len(node.input) >= 3 and node.input[2]:
            if node.input[2] in self.initializers:
                return self.initializers[node.input[2]].data_type
            const = self._constant_nodes.get(node.input[2])
            if const is not None:
                value = next((a.t for a in const.attribute if a.name == "value"), None)
                return value.data_type if value is not None else None
            return None
        attr = self.attr(node, "output_dtype", 0)
        return attr or onnx.TensorProto.UINT8  # ONNX default without a zero point

    @staticmethod
    def attr(node: onnx.NodeProto, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def axis(self, node: onnx.NodeProto) -> Optional[int]:
        """Per-channel axis of a Q/DQ (None when per-tensor)."""
        scale = self.scale(node)
        if scale is None or scale.size <= 1:
            return None
        return int(self.attr(node, "axis", 1))

    def qdq_params(self, node: onnx.NodeProto) -> Optional[tuple]:
        """What a Q or DQ node computes, as a hashable key: scale (values, shape and stored type), zero point (values and
        type), per-channel axis, block size, saturate. Two nodes with equal keys on the same input give identical
        outputs. None when the scale is not a constant."""
        scale = self.scale(node)
        if scale is None:
            return None
        zp = self.zero_point(node)
        zp_key = None if zp is None else (np.asarray(zp).shape, np.asarray(zp).astype(np.int64).tobytes())
        return (scale.shape, scale.tobytes(), self._stored_type(node.input[1]), zp_key, self.zero_point_type(node),
                self.axis(node), self.attr(node, "block_size", 0), self.attr(node, "saturate", 1))

    def _stored_type(self, tensor: str) -> Optional[int]:
        if tensor in self.initializers:
            return self.initializers[tensor].data_type
        const = self._constant_nodes.get(tensor)
        value = next((a.t for a in const.attribute if a.name == "value"), None) if const is not None else None
        return value.data_type if value is not None else None

    def qdq_nodes(self) -> list[onnx.NodeProto]:
        return [n for n in self.nodes if n.op_type in QDQ_OPS]

    @cached_property
    def shapes(self) -> dict[str, list]:
        """Static shapes from ONNX shape inference (unknown dims as None); missing tensors are absent."""
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model)
        except Exception:  # shape inference is advisory here
            return {}
        out = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            t = vi.type.tensor_type
            if t.HasField("shape"):
                out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        for name, init in self.initializers.items():
            out[name] = list(init.dims)
        return out

    # ------------------------------------------------------------ fusion structure
    def single_consumer(self, tensor: str) -> Optional[onnx.NodeProto]:
        users = self.consumers.get(tensor, [])
        return users[0] if len(users) == 1 and tensor not in self.output_names else None

    def backbone(self, tensor: str, max_depth: int = 6) -> Optional[onnx.NodeProto]:
        """The Conv/ConvTranspose/Gemm that ``tensor`` is the fused output of, seen through epilogue ops
        (BN, bias/scale by a constant, ReLU-like activations, SiLU = x·sigmoid(x)), or None.

        Mirrors ModelOpt's ``get_fusible_backbone``; Q/DQ nodes stop the walk (they separate kernels).
        """
        node = self.producer.get(tensor)
        for _ in range(max_depth):
            if node is None:
                return None
            if node.op_type in FUSION_BACKBONE_OPS:
                return node
            if node.op_type in ("BatchNormalization",) + FUSIBLE_ACTIVATIONS or node.op_type in ("Identity", "Cast"):
                node = self.producer.get(node.input[0])
                continue
            if node.op_type in ("Add", "Mul", "Sub", "Div") and len(node.input) == 2:
                acts = [i for i in node.input if self.is_activation(i)]
                if len(acts) == 1:  # bias / scale by a constant
                    node = self.producer.get(acts[0])
                    continue
                swish = self.swish(node) if node.op_type == "Mul" else None
                if swish is not None:  # SiLU / hardswish: x * sigmoid(x), both from the same tensor
                    node = self.producer.get(swish[0])
                    continue
            return None
        return None

    def swish(self, mul: onnx.NodeProto) -> Optional[tuple[str, onnx.NodeProto]]:
        """For a Mul computing x·sigmoid(x) (SiLU) or x·hardsigmoid(x) (hardswish), with x seen through Q/DQ:
        (the x input as the Mul reads it, the gate node); None for any other Mul (e.g. an SE gate y·sigmoid(z))."""
        if mul.op_type != "Mul" or len(mul.input) != 2:
            return None
        for gate_t, x_t in ((mul.input[0], mul.input[1]), (mul.input[1], mul.input[0])):
            gate = self.producer.get(gate_t)
            if gate is not None and gate.op_type in GATES and self._through_qdq(gate.input[0]) == self._through_qdq(x_t):
                return x_t, gate
        return None

    def ancestors_depth(self, tensor: str, limit: int = 400) -> dict[str, int]:
        """Node name → shortest distance (in nodes) from ``tensor`` back to that node (breadth first)."""
        out: dict[str, int] = {}
        start = self.producer.get(tensor)
        if start is None:
            return out
        queue = deque([(start, 0)])
        while queue and len(out) < limit:
            node, d = queue.popleft()
            if node.name in out:
                continue
            out[node.name] = d
            for i in node.input:
                p = self.producer.get(i)
                if p is not None and p.name not in out and not self.is_constant(i):
                    queue.append((p, d + 1))
        return out

    @cached_property
    def residual_add_names(self) -> set[str]:
        return {n.name for n in self.residual_adds()}

    def residual_conv_input(self, add: onnx.NodeProto) -> tuple[Optional[int], str]:
        cache = self.__dict__.setdefault("_conv_input_cache", {})
        key = (add.name, tuple(add.input))
        if key not in cache:
            cache[key] = self._residual_conv_input(add)
        return cache[key]

    def _residual_conv_input(self, add: onnx.NodeProto) -> tuple[Optional[int], str]:
        """Which input of a two-activation Add is the conv path that TensorRT fuses the Add into, and why.

        ModelOpt's ``build_non_residual_input_map``: one input with a backbone → that one; both → the
        one on the longer path to the lowest common ancestor (the skip is the short way round); the same
        backbone on both, or a backbone that is itself the common ancestor (ConvNeXt-style) → none.
        Returns (input index or None, rule).
        """
        a, b = (self._through_qdq(i) for i in add.input[:2])
        ba, bb = self.backbone(a), self.backbone(b)
        if ba is None and bb is None:
            return None, "activation+activation"
        da, db = self.ancestors_depth(a), self.ancestors_depth(b)
        common = set(da) & set(db)
        lca = min(common, key=lambda n: (max(da[n], db[n]), da[n] + db[n])) if common else None
        if ba is not None and bb is not None:
            if ba.name == bb.name:
                return None, "same backbone"
            return (0 if (da.get(lca, 0) > db.get(lca, 0)) else 1), "both conv outputs: longer path to the common ancestor"
        one, idx = (ba, 0) if ba is not None else (bb, 1)
        if lca is not None and lca == one.name:
            return None, "backbone is the common ancestor"
        return idx, "one conv output"

    def _through_qdq(self, tensor: str) -> str:
        """The float tensor behind a Q/DQ pair (itself when not quantized)."""
        dq = self.dq_of(tensor)
        if dq is not None:
            src = self.float_input_of(dq)
            if src is not None:
                return src
        return tensor

    def is_depthwise(self, conv: onnx.NodeProto) -> bool:
        group = int(self.attr(conv, "group", 1))
        w = self.shapes.get(self._through_qdq(conv.input[1])) if len(conv.input) > 1 else None
        return group > 1 and w is not None and len(w) >= 2 and w[1] == 1

