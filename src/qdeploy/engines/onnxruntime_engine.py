"""ONNX Runtime engine: CPU execution provider, CUDA execution provider when the installed build has it.

The CUDA path (device: cuda, and ``cuda_graphs``) has never been executed by qdeploy's tests or runs: no machine this
project has can install onnxruntime-gpu (docs/onnxruntime-cuda.md). It follows ONNX Runtime's documented API only:
the CUDA execution provider page ("Using CUDA Graphs") and onnxruntime/test/python/onnxruntime_test_python_cudagraph.py.
"""
from __future__ import annotations

import os
from typing import Callable, Literal, Optional, Sequence

import numpy as np
import onnxruntime as ort
from pydantic import BaseModel, ConfigDict, Field

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.engines.base import Engine, Variant, register_engine
from qdeploy.errors import VariantUnavailable
from qdeploy.facts.onnxruntime import CUDA_EP, build_cuda_version, cuda_ep_problem, cuda_fallback_message
from qdeploy.utils.ort_options import exact_qdq

_OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
# the run config entry "gpu_graph_id" (one captured CUDA graph per id) came with microsoft/onnxruntime#19636 (March 2024)
CUDA_GRAPH_IDS_SINCE = (1, 18)
_ARTIFACTS = {"fp32": ArtifactKind.ONNX_FP32, "fp16": ArtifactKind.ONNX_FP16, "int8": ArtifactKind.ONNX_INT8}


class OnnxRuntimeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    providers: Optional[list[str]] = Field(None, json_schema_extra={"label": "providers"})
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field("all", json_schema_extra={"label": "opt"})
    cuda_graphs: bool = Field(False, description="CUDA execution provider only: ONNX Runtime captures the model in a CUDA "
                             "graph (provider option enable_cuda_graph) and replays it on input/output buffers bound "
                             "once on the GPU", json_schema_extra={"label": "cudagraph"})


def resolve_providers(requested_device: str, precision: str, explicit: list[str] | None,
                      cuda_graphs: bool = False) -> list[str]:
    """The execution providers a variant runs on, or VariantUnavailable saying why it cannot run here (the reasons
    about the CUDA execution provider all come from ``facts.onnxruntime.cuda_ep_problem``)."""
    available = ort.get_available_providers()
    problem = cuda_ep_problem()
    if explicit:
        missing = [p for p in explicit if p not in available]
        if missing:
            why = f": {problem}" if CUDA_EP in missing and problem else ""
            raise VariantUnavailable(f"ONNX Runtime providers {missing} are not in this build (available: {available}){why}")
        if CUDA_EP in explicit and problem:
            raise VariantUnavailable(f"providers {explicit}: {problem}")
        providers = list(explicit)
    elif requested_device == "cuda":
        if problem:
            raise VariantUnavailable(f"device 'cuda': {problem}")
        providers = [CUDA_EP, "CPUExecutionProvider"]
    elif requested_device == "auto" and problem is None:
        providers = [CUDA_EP, "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    # the CUDA execution provider was left out because it cannot run here (not because the config asked for the CPU)
    why_not_cuda = f"; {problem}" if problem and requested_device == "auto" and not explicit else ""
    if precision == "fp16" and providers[0] == "CPUExecutionProvider":
        raise VariantUnavailable("FP16 in ONNX Runtime needs a GPU execution provider (CUDA); this variant runs on "
                                 f"{providers[0]}{why_not_cuda}")
    if cuda_graphs and providers[0] != CUDA_EP:
        raise VariantUnavailable("cuda_graphs: ONNX Runtime captures CUDA graphs with the CUDA execution provider (its "
                                 f"option enable_cuda_graph), and this variant runs on {providers[0]}: use device: cuda "
                                 f"or drop cuda_graphs{why_not_cuda}")
    if cuda_graphs and tuple(int(p) for p in ort.__version__.split(".")[:2] if p.isdigit()) < CUDA_GRAPH_IDS_SINCE:
        raise VariantUnavailable(f"cuda_graphs needs onnxruntime-gpu >= 1.18, whose run option gpu_graph_id keeps one "
                                 f"CUDA graph per input shape; this is {ort.__version__}")
    return providers


def bound_output_shape(input_dims: Sequence, input_shape: Sequence[int], output_dims: Sequence) -> list[int]:
    """The output's shape for an input of ``input_shape``, known before any run (a CUDA graph replays into an output
    buffer bound up front): ``*_dims`` are the session's declared dims (ints, or names of dynamic dims, or None).
    A named output dim takes the size of the input dim of that name; an unnamed or unknown first dim is the batch."""
    sizes = {d: n for d, n in zip(input_dims, input_shape) if isinstance(d, str)}
    shape = []
    for i, d in enumerate(output_dims):
        if isinstance(d, int) and d > 0:
            shape.append(d)
        elif isinstance(d, str) and d in sizes:
            shape.append(sizes[d])
        elif i == 0 and input_dims and not isinstance(input_dims[0], int):
            shape.append(int(input_shape[0]))
        else:
            raise VariantUnavailable(f"cuda_graphs needs the output's shape before the first run, and dimension {i} of "
                                     f"the output {list(output_dims)} is none of the input's {list(input_dims)}")
    return shape


@register_engine
class OnnxRuntimeEngine(Engine):
    name = "onnxruntime"
    description = "ONNX Runtime InferenceSession on the built ONNX (FP32, FP16 or INT8 Q/DQ)"
    Options = OnnxRuntimeOptions
    precisions = ("fp32", "fp16", "int8")
    devices = ("cpu", "cuda")
    graph_device = "cuda"  # where cuda_graphs's bound buffers live (tests/test_onnxruntime_cuda.py binds CPU ones)

    @classmethod
    def probe(cls) -> list[dict]:
        problem = cuda_ep_problem()
        return [
            {"engine": cls.name, "device": "cpu", "precisions": ["fp32", "int8"], "usable": True,
             "note": f"onnxruntime {ort.__version__}; int8: ONNX Runtime-placement Q/DQ runs INT8 kernels, "
                     "TensorRT-placement Q/DQ is simulated"},
            {"engine": cls.name, "device": "cuda", "precisions": ["fp32", "fp16", "int8"], "usable": problem is None,
             "note": problem or f"{CUDA_EP} (onnxruntime-gpu {ort.__version__}, built for CUDA "
                                f"{build_cuda_version() or 'unknown'})"},
        ]

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        resolve_providers(variant.device, variant.precision, variant.options.providers, variant.options.cuda_graphs)

    @classmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest:
        return ArtifactRequest(_ARTIFACTS[variant.precision], variant.int8)

    @classmethod
    def speed_is_deployment(cls, variant: Variant) -> bool:
        # a TensorRT-placement Q/DQ graph is meant for TensorRT; ONNX Runtime runs it mostly in float
        return not (variant.int8 is not None and variant.int8.placement == "tensorrt")

    @classmethod
    def note(cls, variant: Variant) -> Optional[str]:
        if variant.int8 is not None and variant.int8.placement == "tensorrt":
            return "TensorRT Q/DQ artifact: INT8 accuracy simulated in ONNX Runtime with exact Q/DQ semantics (TensorRT not run); speed is ONNX Runtime's, not TensorRT's"
        if variant.int8 is not None:
            return "ONNX Runtime-placement INT8 (uint8 activations, per-channel int8 weights)"
        return None

    def load(self) -> None:
        v = self.variant
        self.providers = resolve_providers(v.device, v.precision, self.options.providers, self.options.cuda_graphs)
        self.device = "cuda" if self.providers[0] in (CUDA_EP, "TensorrtExecutionProvider") else "cpu"
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[self.options.graph_optimization])
        if v.threads:
            opts.intra_op_num_threads = v.threads
        if v.int8 is not None and v.int8.placement == "tensorrt":
            exact_qdq(opts)  # simulate TensorRT's Q/DQ semantics, not ONNX Runtime's fused int8 kernels
        providers = [(p, {"enable_cuda_graph": "1"}) if p == CUDA_EP and self.options.cuda_graphs else p
                     for p in self.providers]
        self.session = ort.InferenceSession(str(self.artifact.path), opts, providers=providers)
        got = self.session.get_providers()
        if self.providers[0] not in got:  # InferenceSession caught the EP's error and retried on the CPU
            if self.providers[0] == CUDA_EP:
                raise VariantUnavailable(cuda_fallback_message(got, build_cuda_version(), ort.__version__,
                                                               self.options.cuda_graphs))
            raise VariantUnavailable(f"ONNX Runtime could not start {self.providers[0]} and fell back to {got}")
        self.input_name = self.session.get_inputs()[0].name
        self._graphs: dict[tuple, tuple] = {}  # cuda_graphs: input shape -> (IOBinding, input, output, RunOptions)
        self.threads = v.threads or os.cpu_count()  # ORT's default: one intra-op thread per core

    def _graph(self, shape: tuple) -> tuple:
        """cuda_graphs (unexecuted here: no onnxruntime-gpu): the IOBinding of device OrtValues that ONNX Runtime's CUDA
        graph for inputs of ``shape`` reads and writes, made on first use. ONNX Runtime's rules ("Using CUDA Graphs"):
        the input/output addresses and shapes must not change between runs of one graph, new inputs are copied into
        the bound input (``update_inplace``), and each shape gets its own graph (run config ``gpu_graph_id``); the
        first run(s) of a graph run normally and capture it, later ones replay it."""
        g = self._graphs.get(shape)
        if g is None:
            inp, out = self.session.get_inputs()[0], self.session.get_outputs()[0]
            x = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, self.graph_device, 0)
            y = ort.OrtValue.ortvalue_from_shape_and_type(bound_output_shape(inp.shape, shape, out.shape), np.float32,
                                                          self.graph_device, 0)  # float32 IO (fp16: keep_io_types)
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(inp.name, x)
            binding.bind_ortvalue_output(out.name, y)
            run_options = ort.RunOptions()
            run_options.add_run_config_entry("gpu_graph_id", str(len(self._graphs) + 1))
            g = self._graphs[shape] = (binding, x, y, run_options)
        return g

    def infer(self, batch: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        if self.options.cuda_graphs:
            binding, bound_x, bound_y, run_options = self._graph(x.shape)
            bound_x.update_inplace(x)
            self.session.run_with_iobinding(binding, run_options)
            return bound_y.numpy().astype(np.float32, copy=False)
        out = self.session.run(None, {self.input_name: x})[0]
        return out.astype(np.float32, copy=False)

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        x = np.ascontiguousarray(batch, dtype=np.float32)
        if self.options.cuda_graphs:  # input and output bound once on the GPU; each step replays the graph
            binding, bound_x, _, run_options = self._graph(x.shape)
            bound_x.update_inplace(x)
            session = self.session

            def replay():
                session.run_with_iobinding(binding, run_options)

            return replay
        if self.device == "cuda":
            # keep input and output on the GPU so the timing covers the model, not PCIe copies
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(self.input_name, ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
            binding.bind_output(self.session.get_outputs()[0].name, "cuda", 0)
            session = self.session

            def step():
                session.run_with_iobinding(binding)

            return step
        session, feed = self.session, {self.input_name: x}
        return lambda: session.run(None, feed)

    def describe(self) -> dict:
        return {
            "device": self.device,
            "providers": self.session.get_providers(),
            "threads": self.threads if self.device == "cpu" else None,
            "graph_optimization": self.options.graph_optimization,
            "cuda_graphs": self.options.cuda_graphs,
            "qdq": "exact Q/DQ (session.disable_quant_qdq)" if self.variant.int8 is not None and self.variant.int8.placement == "tensorrt" else None,
            "artifact": self.artifact.kind.value,
            "opset": self.artifact.opset,
            "onnxruntime": ort.__version__,
        }

    def close(self) -> None:
        self._graphs = {}
        self.session = None
