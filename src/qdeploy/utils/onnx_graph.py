"""One read-only view of an ONNX graph: who produces and consumes each tensor, which tensors are
constants, which are float activations, which Adds join two activations (residual joins), and where
Q/DQ nodes sit.

Statistics collection (which tensors to observe), Q/DQ placement (which tensors to quantize) and the
structure report (what ended up INT8) all ask these questions; answering them in one place keeps the
three from disagreeing about, say, whether ``x + 3`` (hardswish) is a residual join (it is not: one
input is a constant).
"""
from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from typing import Optional

import numpy as np
import onnx
from onnx import numpy_helper

# Ops that only move or re-label a tensor: a Q/DQ seen through them still quantizes the same values.
PASS_THROUGH = ("Cast", "Identity")


class OnnxGraph:
    """Lookups over ``model.graph`` (built once; the model must not be edited while the view is used)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.nodes = list(model.graph.node)
        self.producer: dict[str, onnx.NodeProto] = {o: n for n in self.nodes for o in n.output if o}
        consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                if i:
                    consumers[i].append(n)
        self.consumers = dict(consumers)
        self.initializers = {t.name: t for t in model.graph.initializer}
        self._constant_nodes = {n.output[0]: n for n in self.nodes if n.op_type == "Constant" and n.output}
        self.constants: set[str] = set(self.initializers) | set(self._constant_nodes)
        for n in self.nodes:  # torch.onnx writes a tied or duplicate weight as Identity(initializer)
            if n.op_type == "Identity" and n.input and n.input[0] in self.constants and n.output:
                self.constants.add(n.output[0])
        self.input_names = [i.name for i in model.graph.input if i.name not in self.initializers]
        self.output_names = [o.name for o in model.graph.output]

    @classmethod
    def load(cls, path, load_external_data: bool = False) -> "OnnxGraph":
        return cls(onnx.load(str(path), load_external_data=load_external_data))

    # ---------------------------------------------------------------- tensors
    def is_constant(self, tensor: str) -> bool:
        return tensor in self.constants

    def constant_value(self, tensor: str) -> Optional[np.ndarray]:
        """The value of an initializer or Constant-node output, else None."""
        if tensor in self.initializers:
            return numpy_helper.to_array(self.initializers[tensor])
        node = self._constant_nodes.get(tensor)
        ident = self.producer.get(tensor)
        if node is None and ident is not None and ident.op_type == "Identity" and ident.input[0] in self.constants:
            return self.constant_value(ident.input[0])
        if node is not None:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                return numpy_helper.to_array(value)
        return None

    def source(self, tensor: str) -> str:
        """``tensor`` followed back through Cast/Identity (ModelOpt's exporter casts before Q)."""
        while tensor in self.producer and self.producer[tensor].op_type in PASS_THROUGH:
            tensor = self.producer[tensor].input[0]
        return tensor

    @cached_property
    def element_types(self) -> dict[str, int]:
        inferred = onnx.shape_inference.infer_shapes(self.model)
        infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
        return {vi.name: vi.type.tensor_type.elem_type for vi in infos}

    def float_activations(self) -> tuple[list[str], dict[str, str]]:
        """Names of all float, non-constant tensors (graph inputs and node outputs), and their producers' names."""
        elem = self.element_types
        names, producer = [], {}
        for name in self.input_names:
            if elem.get(name) == onnx.TensorProto.FLOAT:
                names.append(name)
                producer[name] = "<input>"
        for node in self.nodes:
            if node.op_type == "Constant":
                continue
            for out in node.output:
                if out and out not in self.constants and elem.get(out, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT:
                    names.append(out)
                    producer[out] = node.name or node.op_type
        return names, producer

    # ---------------------------------------------------------------- structure
    @cached_property
    def from_input(self) -> set:
        """Every tensor computed from a graph input (not from weights and constants alone). Nodes are in topological
        order (the ONNX spec; qdeploy sorts what it writes), so one forward pass suffices."""
        dynamic = set(self.input_names)
        for node in self.nodes:
            if any(i in dynamic for i in node.input if i):
                dynamic.update(o for o in node.output if o)
        return dynamic

    def is_activation(self, tensor: str) -> bool:
        """Data that flows from the graph input: not a constant, and not a dequantized constant (a Q/DQ weight)."""
        if tensor in self.constants:
            return False
        node = self.producer.get(tensor)
        if node is not None and node.op_type == "DequantizeLinear":
            return self.is_activation(node.input[0])
        if node is not None and node.op_type == "QuantizeLinear":
            return self.is_activation(node.input[0])
        return True

    def is_dequantized(self, tensor: str) -> bool:
        node = self.producer.get(tensor)
        return node is not None and node.op_type == "DequantizeLinear"

    def residual_adds(self) -> list[onnx.NodeProto]:
        """Adds of two activations: residual joins. ``x + constant`` (a bias, hardswish's +3) is not one."""
        return [n for n in self.nodes if n.op_type == "Add" and len(n.input) == 2 and all(self.is_activation(i) for i in n.input)]

    def constant_adds(self) -> list[onnx.NodeProto]:
        return [n for n in self.nodes if n.op_type == "Add" and any(i in self.constants for i in n.input)]

    def ensure_node_names(self) -> None:
        """Give unnamed or duplicate nodes a unique name: quantizers and exclude lists address nodes by name."""
        seen = set()
        for i, node in enumerate(self.nodes):
            if not node.name or node.name in seen:
                node.name = f"{node.op_type}_{i}"
            seen.add(node.name)


def inline_constant_identities(model: onnx.ModelProto) -> int:
    """Replace every Identity of an initializer (torch.onnx's form of a tied or deduplicated weight) by an initializer
    of its own, so that quantizers see a weight there, not an activation. Returns how many were replaced."""
    inits = {t.name: t for t in model.graph.initializer}
    keep, count = [], 0
    for node in model.graph.node:
        if node.op_type == "Identity" and node.input and node.input[0] in inits and node.output[0] not in inits:
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[node.input[0]])
            copy.name = node.output[0]
            model.graph.initializer.append(copy)
            inits[copy.name] = copy
            count += 1
        else:
            keep.append(node)
    if count:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return count
