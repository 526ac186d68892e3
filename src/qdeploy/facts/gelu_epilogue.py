"""A Linear layer followed by a GELU, run as one cuBLASLt matmul with the bias and the GELU in its epilogue
(``aten._addmm_activation(bias, x, weight.T, use_gelu=True)``, cuBLASLt's ``CUBLASLT_EPILOGUE_GELU_BIAS``), as
TensorRT fuses a GEMM and its activation.

Why: a transformer's or ConvNeXt's MLP expands to 4x the width, and Inductor runs its GELU as a Triton kernel of its own
after cuBLAS's matmul (Inductor calls cuBLAS as an external kernel; it fuses a pointwise epilogue only into the Triton
matmul templates of max-autotune), so the widest activation of the model is written by the matmul, read and written
again by the GELU, and read by the next matmul. In ConvNeXt-T's compiled program at batch 128 (H200, FP16,
channels_last) the GELU kernels took 1,584 of 7,408 us a forward (21 %: docs/results/realsize/gpu_b128_b8_2026-11-30/
kernels_convnext_b128.json), the time of moving that activation twice. In the epilogue the GELU is computed on the FP32
accumulator while the tile is in registers.

The rewrite is of the exported program (a graph, where a Linear's output having the GELU as its only user is a fact,
not a guess from module order), so what is timed, saved and loaded is the same graph, and a loader needs nothing of
qdeploy: ``_addmm_activation`` is an ATen operator, which Inductor runs as an external kernel (a fallback; it does not
decompose it). cuBLASLt's GELU is the tanh approximation (as the operator's decomposition says for CUDA): exact for a
model written with ``approximate="tanh"`` (GPT-2 style ``gelu_new``), within 5e-4 of the erf GELU otherwise, less than
half a unit in the last place of FP16 at |x| > 0.5; the candidate is evaluated against the accuracy budget like every
other. Where the exported program cannot be traced again (``rewrite`` raises), the candidate fails with that reason.
"""
from __future__ import annotations

import torch
from torch import fx, nn

_LINEAR = torch.ops.aten.linear.default
_GELU = torch.ops.aten.gelu.default


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate="tanh")`` as one matmul with the bias and GELU in its epilogue on
    CUDA (on the CPU the operator is a matmul and the erf GELU); ``x`` of any rank (its last dimension the features),
    as ``F.linear``."""
    out = torch.ops.aten._addmm_activation.default(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear_gelu_pairs(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """The (linear, gelu) nodes of ``graph`` where the GELU is the Linear's only user and the Linear has a bias (the
    epilogue adds a bias; a Linear without one is rare in an MLP and left as it is)."""
    pairs = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _GELU:
            continue
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "call_function" or src.target is not _LINEAR:
            continue
        if len(src.users) != 1 or len(src.args) < 3 or src.args[2] is None:
            continue
        pairs.append((src, node))
    return pairs


def rewrite(program, args: tuple, dynamic_shapes=None):
    """``program`` (a torch.export ExportedProgram) with every Linear → GELU pair as ``linear_gelu``, exported again
    with the same example inputs and dynamic shapes; returns (program, the number of pairs). A program without such a
    pair is returned as it is."""
    module = program.module()
    pairs = linear_gelu_pairs(module.graph)
    if not pairs:
        return program, 0
    for lin, gelu in pairs:
        x, weight, bias = lin.args[:3]
        with module.graph.inserting_before(gelu):
            fused = module.graph.call_function(linear_gelu, (x, weight, bias))
        gelu.replace_all_uses_with(fused)
        module.graph.erase_node(gelu)
        module.graph.erase_node(lin)
    module.graph.lint()
    module.recompile()
    with torch.inference_mode(False), torch.no_grad():
        again = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    return again, len(pairs)


def count_fused(program) -> int:
    """How many ``_addmm_activation`` GELU epilogues ``program``'s graph holds."""
    return sum(1 for n in program.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten._addmm_activation.default)


def has_linear_and_gelu(model: nn.Module) -> bool:
    """Whether ``model`` has a Linear and a GELU module (nn.GELU, timm's and Hugging Face's GELU classes): where the
    rewrite may find a pair. A GELU called as a function only (``F.gelu``) is found by the graph, not here."""
    kinds = [type(m) for m in model.modules()]
    return any(issubclass(k, nn.Linear) for k in kinds) and any("gelu" in k.__name__.lower() for k in kinds)


def gelu_epilogue_by_default(model: nn.Module | None, device: str) -> bool:
    """Whether optimize tries the rewrite when optimize.gelu_epilogue is unset: on the GPU (cuBLASLt's epilogue) for a
    model with a Linear and a GELU. Not on the CPU: there ``_addmm_activation`` is a matmul and a separate GELU, while
    Inductor's freezing (on by default on torch-cpu) already fuses a Linear's GELU into oneDNN's linear
    (torch/_inductor/fx_passes/mkldnn_fusion.py)."""
    return device == "cuda" and model is not None and has_linear_and_gelu(model)
