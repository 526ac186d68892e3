"""PyTorch eager engine: FP32 on CPU/GPU, FP16/BF16 on GPU, channels_last, CUDA graphs, torch.compile."""
from __future__ import annotations

import copy
from typing import Callable, Literal, Optional, Union

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from qdeploy.artifacts import ArtifactKind, ArtifactRequest
from qdeploy.artifacts.torch_program_loader import capture_cuda_graph, constants_to_device
from qdeploy.engines.base import CudaTimer, Engine, Variant, register_engine
from qdeploy.errors import VariantUnavailable
from qdeploy.facts.inductor import program_inductor_config
from qdeploy.facts.model_rewrites import REWRITES, apply_rewrites
from qdeploy.facts.torchao import apply_torchao, torchao_problem
from qdeploy.utils.malloc import tune_glibc_malloc

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# torch.compile modes whose Inductor output already replays CUDA graphs: manual capture would nest graphs
_COMPILE_GRAPH_MODES = {"reduce-overhead", "max-autotune"}


class TorchOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    channels_last: bool = Field(False, json_schema_extra={"label": "cl"})
    cuda_graphs: bool = Field(False, json_schema_extra={"label": "cudagraph"})
    compile: Union[bool, Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = Field(
        False, json_schema_extra={"label": "compile"})
    torchao: Optional[Literal["float8-dynamic", "int8-weight-only", "int8-dynamic"]] = Field(
        None, json_schema_extra={"label": "torchao"},
        description="quantize the Linear layers with a torchao scheme (facts/torchao.py) before compiling")
    freezing: bool = Field(False, json_schema_extra={"label": "frozen"},
                           description="compiled programs: Inductor's freezing, the weights folded in as constants "
                                       "(conv-BN folding, constant folding; facts/inductor.py)")
    patch_matmul: bool = Field(False, json_schema_extra={"label": "patchmm"},
                               description="convolutions whose stride equals their kernel (patch embeddings) run as "
                                           "one matmul over the patches (facts/patch_matmul.py)")
    depthwise_stencil: bool = Field(False, json_schema_extra={"label": "dwstencil"},
                                    description="compiled programs: depthwise convolutions run as stencils that "
                                                "Inductor fuses, not cuDNN's kernels (facts/depthwise_stencil.py)")
    gelu_epilogue: bool = Field(False, json_schema_extra={"label": "geluepi"},
                                description="compiled programs: each Linear whose only user is a GELU runs as one "
                                            "cuBLASLt matmul with the bias and GELU in its epilogue "
                                            "(facts/gelu_epilogue.py)")
    tf32: bool = Field(False, json_schema_extra={"label": "tf32"},
                       description="FP32 on a GPU: let cuDNN convolutions and cuBLAS matmuls use TF32 (10-bit mantissa). "
                                   "Off: strict FP32 (PyTorch's own default lets cuDNN use TF32)")


def dynamo_fails_at_recompile_limit():
    """torch._dynamo's switch (named fail_on_cache_limit_hit before torch 2.6) that turns its silent eager fallback at
    the recompile limit into an exception, as a context."""
    import contextlib

    import torch._dynamo

    for flag in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(torch._dynamo.config, flag):
            return torch._dynamo.config.patch(**{flag: True})
    return contextlib.nullcontext()


def resolve_torch_device(requested: str, precision: str) -> str:
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise VariantUnavailable("device 'cuda' was asked for but torch.cuda.is_available() is False")
    device = "cuda" if requested == "cuda" or (requested == "auto" and has_cuda) else "cpu"
    if precision in ("fp16", "bf16") and device != "cuda":
        raise VariantUnavailable(f"{precision.upper()} in PyTorch needs a CUDA GPU; this machine has none (or device: cpu was set)")
    return device


@register_engine
class TorchEngine(Engine):
    name = "torch"
    description = "PyTorch eager (optionally torch.compile / CUDA graphs) on the FP32 module"
    Options = TorchOptions
    precisions = ("fp32", "fp16", "bf16")
    devices = ("cpu", "cuda")

    @classmethod
    def probe(cls) -> list[dict]:
        cuda = torch.cuda.is_available()
        return [
            {"engine": cls.name, "device": "cpu", "precisions": ["fp32"], "usable": True, "note": f"{torch.get_num_threads()} threads"},
            {"engine": cls.name, "device": "cuda", "precisions": ["fp32", "fp16", "bf16"], "usable": cuda,
             "note": torch.cuda.get_device_name() if cuda else "torch.cuda.is_available() is False (no GPU or driver)"},
        ]

    @classmethod
    def check(cls, variant: Variant, has_torch: bool) -> None:
        if not has_torch:
            raise VariantUnavailable("the source is an ONNX or Keras model; the torch engine needs a PyTorch model")
        device = resolve_torch_device(variant.device, variant.precision)
        if variant.options.cuda_graphs and device != "cuda":
            raise VariantUnavailable("CUDA graphs need a CUDA GPU; this variant runs on the CPU")
        if variant.options.torchao:
            problem = torchao_problem(variant.options.torchao, device)
            if problem:
                raise VariantUnavailable(problem)

    @classmethod
    def artifact(cls, variant: Variant) -> ArtifactRequest:
        return ArtifactRequest(ArtifactKind.PYTORCH)  # dtype, layout and compilation are applied at load time

    def load(self) -> None:
        v, opts = self.variant, self.options
        self.device = resolve_torch_device(v.device, v.precision)
        self.malloc_tuned = tune_glibc_malloc()  # see qdeploy.utils.malloc: 3x on CPU for large activations
        if v.threads:
            torch.set_num_threads(v.threads)
        if self.device == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest kernels, as trtexec does
            # said, not inherited: PyTorch's defaults give cuDNN TF32 and cuBLAS strict FP32 (process-wide flags)
            torch.backends.cuda.matmul.allow_tf32 = opts.tf32
            torch.backends.cudnn.allow_tf32 = opts.tf32
        self.dtype = _DTYPES[v.precision]
        self.memory_format = torch.channels_last if opts.channels_last else torch.contiguous_format
        model = copy.deepcopy(self.artifact.module)
        # the source rewrites switched on (facts/model_rewrites.py): the modules each replaced, named in describe()
        self.rewritten = apply_rewrites(model, [name for name in REWRITES if getattr(opts, name)])
        model = model.to(device=self.device, dtype=self.dtype, memory_format=self.memory_format).eval()
        # torchao quantizes at the first input (its kernels' rules on rows need one; facts/torchao.quantizable), before
        # the first compile
        self._torchao_module = model if opts.torchao else None
        self.compile_mode: Optional[str] = None
        if opts.compile:
            mode = "default" if opts.compile is True else opts.compile
            if opts.cuda_graphs and mode in _COMPILE_GRAPH_MODES:
                mode = "max-autotune-no-cudagraphs" if mode == "max-autotune" else "default"
            self.compile_mode = mode
        # compiled at the first input (_compile_for), where the program to compile is exported
        self.model = model
        self.exported: Optional[bool] = None  # a compiled program: whether torch.compile runs on its exported program
        self.export_failure: Optional[str] = None
        self.gelu_epilogues: Optional[int] = None  # Linear → GELU pairs fused, where gelu_epilogue is on
        self._compiled_shapes: set[tuple] = set()
        self._graphs: dict[tuple, tuple] = {}  # input shape → (graph, static input, static output)
        # a compiled or graph-captured model pads a last, smaller batch to the batch size it has seen: a new shape would
        # compile again (torch.compile specialises on shapes) or capture another graph
        self._pad = bool(opts.compile or opts.cuda_graphs)
        self._largest = 0

    def _to_device(self, batch: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(batch))
        if self.device == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        return x.to(dtype=self.dtype).contiguous(memory_format=self.memory_format)

    def _compile_for(self, x: torch.Tensor) -> None:
        """The first call of a compiled model on ``x``'s shape (where torch.compile compiles), with Dynamo told to raise
        rather than fall back to eager when its recompile limit is hit (a candidate that cannot be compiled fails with
        that reason instead of being timed as compiled), under the program's Inductor settings (facts/inductor.py). A
        torchao program is quantized here, at its first input."""
        if self._torchao_module is not None:
            apply_torchao(self._torchao_module, self.options.torchao, example=x)
            self._torchao_module = None
        key = tuple(x.shape)
        if not self.compile_mode or key in self._compiled_shapes:
            return
        from torch._inductor import config as inductor

        if self.exported is None:
            self.model = torch.compile(self._program_to_compile(x), mode=None if self.compile_mode == "default"
                                       else self.compile_mode, dynamic=False)

        with dynamo_fails_at_recompile_limit(), \
                inductor.patch(program_inductor_config(self.options.torchao, self.options.freezing)), \
                torch.inference_mode():
            self.model(x)
        self._compiled_shapes.add(key)

    def _program_to_compile(self, x: torch.Tensor) -> torch.nn.Module:
        """The exported program (dynamic batch) of the model, as the saved program's loader compiles it: what the
        search times is then what a user's process compiles, and the saved program's compile hits Inductor's cache of
        this one (same graph, same key) instead of compiling for as long again. The model itself where torch.export
        cannot trace it with a dynamic batch (the saved program then has one program per batch size)."""
        from qdeploy.artifacts.torch_program import ProgramSettings, export_dynamic_batch

        settings = ProgramSettings(device=self.device, precision=self.variant.precision,
                                   channels_last=self.options.channels_last, input_shape=tuple(x.shape[1:]),
                                   gelu_epilogue=self.options.gelu_epilogue)
        try:
            exported = export_dynamic_batch(self.model, settings)
            program = constants_to_device(exported.module(), self.device)
        except Exception as e:  # noqa: BLE001 - any export failure: the model compiles as it is
            if settings.gelu_epilogue:
                # a rewrite of the exported graph: without it the candidate would be its base program again
                raise RuntimeError(f"gelu_epilogue needs the exported program: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0][:200] if str(e) else ''}") from e
            self.exported = False
            self.export_failure = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            # A fresh Dynamo cache for a program compiled from the model: every model qdeploy loads is wrapped in the
            # same module class (models.loader.SelectOutput), so such programs of one process share one code object's
            # cache, and past its recompile limit (8 entries of dtype x layout x batch shape) Dynamo runs further
            # programs eagerly, silently: a search then times eager code as compiled. Earlier programs stay correct (a
            # reset one compiles again on its next call; captured CUDA graphs replay without Dynamo). An exported
            # program needs none: each has its own generated forward, so its own cache.
            torch.compiler.reset()
            return self.model
        self.exported = True
        if settings.gelu_epilogue:
            from qdeploy.facts.gelu_epilogue import count_fused

            self.gelu_epilogues = count_fused(exported)
        return program

    def _graph_for(self, x: torch.Tensor):
        """Capture (once per input shape) a CUDA graph of the forward pass: the saved program's loader does the same."""
        key = tuple(x.shape)
        if key not in self._graphs:
            self._compile_for(x)
            self._graphs[key] = capture_cuda_graph(self.model, x)
        return self._graphs[key]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self._compile_for(x)
        if self.options.cuda_graphs:
            graph, static_in, static_out = self._graph_for(x)
            static_in.copy_(x)
            graph.replay()
            return static_out
        with torch.inference_mode():
            return self.model(x)

    def infer(self, batch: np.ndarray) -> np.ndarray:
        n = len(batch)
        if self._pad and 0 < n < self._largest:
            batch = np.concatenate([batch, np.repeat(batch[-1:], self._largest - n, axis=0)])
        self._largest = max(self._largest, n)
        out = self._forward(self._to_device(batch))
        return out[:n].float().cpu().numpy()

    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]:
        x = self._to_device(batch)
        if self.options.cuda_graphs:
            graph = self._graph_for(x)[0]  # static input already holds x's values after capture
            return graph.replay
        self._compile_for(x)
        model = self.model

        def step():
            with torch.inference_mode():
                return model(x)

        return step

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timer(self):
        return CudaTimer() if self.device == "cuda" else None

    def describe(self) -> dict:
        d = {
            "device": self.device,
            "dtype": str(self.dtype).replace("torch.", ""),
            "channels_last": self.options.channels_last,
            "cuda_graphs": self.options.cuda_graphs,
            "compile": self.compile_mode,
            "tf32": self.options.tf32 if self.device == "cuda" else None,
            "torchao": self.options.torchao,
            "freezing": self.options.freezing,
            **{name: self.rewritten.get(name) for name in REWRITES},
            "gelu_epilogue": self.gelu_epilogues,
            # a compiled program: torch.compile ran on its exported program (as the saved one does) or on the model
            "compiled_from": None if self.exported is None else "exported program" if self.exported else
            f"model (torch.export failed: {self.export_failure})",
            "threads": torch.get_num_threads() if self.device == "cpu" else None,
            "glibc_malloc_tuned": self.malloc_tuned,
            "torch": torch.__version__,
        }
        if self.device == "cuda":
            d["gpu"] = torch.cuda.get_device_name()
            d["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        return d

    def close(self) -> None:
        self._graphs = {}
        self.model = None
        if self.device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
