"""torchao's low-precision schemes that the PyTorch targets try: what each is, where it runs, and how it is applied.

torchao (pytorch/ao) swaps the weights of ``nn.Linear`` layers for quantized tensor subclasses (``quantize_``); its
kernels come from torch.compile, so a torchao candidate is always compiled. Only Linear layers are quantized (torchao's
default filter): convolutions stay in the model's precision, so a CNN gains little (its classifier only) and a
transformer's projections and MLPs are what changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TorchaoScheme:
    name: str
    config: str                          # the torchao.quantization config class
    min_capability: Optional[tuple]      # CUDA compute capability it needs (None: any device torchao supports)
    cuda_only: bool
    why: str
    # The matmul kernel's shape rules. A Linear layer is quantized only where its in and out features are both
    # multiples of ``features_multiple_of`` (None: any) and, with ``min_rows_per_image``, where one image gives its
    # matmul at least that many rows (a layer on tokens or pixels; not a head or a pooled projection, whose rows are the
    # batch size): then it runs at every batch size, batch 1 included. The others stay in the model's precision.
    features_multiple_of: Optional[int] = None
    min_rows_per_image: Optional[int] = None


SCHEMES = {
    "float8-dynamic": TorchaoScheme(
        "float8-dynamic", "Float8DynamicActivationFloat8WeightConfig", (8, 9), True,
        "FP8 (e4m3) weights and per-token dynamically scaled FP8 activations: FP8 tensor cores exist from compute "
        "capability 8.9 (Ada, Hopper)", 16),  # torch._scaled_mm (torchao's _fp8_mm_compat skips the others itself)
    "int8-weight-only": TorchaoScheme(
        "int8-weight-only", "Int8WeightOnlyConfig", None, False,
        "INT8 per-channel weights dequantized in the matmul: halves weight memory traffic, the math stays in the "
        "activation precision"),
    "int8-dynamic": TorchaoScheme(
        "int8-dynamic", "Int8DynamicActivationInt8WeightConfig", None, True,
        "INT8 weights and dynamically quantized INT8 activations (per token): INT8 tensor-core matmuls",
        # torch._int_mm on cuBLAS: K and N nonzero multiples of 8, more than 16 rows; torchao checks neither, and the
        # call fails at run time
        8, 17),
}


def torchao_problem(scheme: str, device: str) -> Optional[str]:
    """Why ``scheme`` cannot run here (one sentence), or None."""
    import importlib.util

    s = SCHEMES[scheme]
    if importlib.util.find_spec("torchao") is None:
        return f"torchao {scheme} needs the torchao package (pip install torchao)"
    if s.cuda_only and device != "cuda":
        return f"torchao {scheme} runs on a CUDA GPU only"
    if s.min_capability is not None and device == "cuda":
        import torch

        cap = torch.cuda.get_device_capability()
        if cap < s.min_capability:
            return (f"torchao {scheme} needs compute capability {s.min_capability[0]}.{s.min_capability[1]} or newer "
                    f"({s.why.split(': ')[-1]}); this GPU is {cap[0]}.{cap[1]}")
    return None


# torchao's Inductor setting for its quantized matmuls (from torchao.quantization.utils.recommended_inductor_config_setter):
# fuse INT8 matmuls with the rescale that follows. Its configs set their recommended settings process-wide by default
# (set_inductor_config=True), and they stay: every later compile of a search (the finalists, the saved program's cache)
# would then be another program than the one timed, and a fresh process, which does not set them, another again. Here
# the setting belongs to the torchao program: applied while it compiles (the torch engine, the saved program and its
# loader), recorded in its manifest. The recommendation's coordinate-descent tuning is left out: it benchmarks kernel
# configurations for every Triton kernel of the program, not only the quantized matmuls, so it is kernel autotuning of
# the whole model (max-autotune's kind of setting, opt-in through optimize.compile_modes) and the candidate would differ
# from its base in more than its Linear layers; it also cost DeiT-S's FP8 program at 224 px 181 s of compile on an H200
# against 12-24 s for its untuned FP16 base, more than half the default 5-minute search
# (docs/results/realsize/gpu_deit_torchao_2026-11-29/).
INDUCTOR_CONFIG = {"force_fuse_int_mm_with_mul": True}


def inductor_config(scheme: Optional[str]) -> dict:
    """The Inductor settings a program quantized with ``scheme`` compiles under ({} without a scheme)."""
    return dict(INDUCTOR_CONFIG) if scheme else {}


def quantizable(scheme: str, module, rows_per_image: Optional[int] = None) -> bool:
    """Whether ``scheme`` quantizes ``module``: a Linear layer whose shape its matmul kernel takes (``rows_per_image``:
    the rows one image gives its matmul, None where it never ran), with a plain weight (a weight shared by two layers is
    quantized once)."""
    import torch

    s = SCHEMES[scheme]
    m = s.features_multiple_of
    return (isinstance(module, torch.nn.Linear) and type(module.weight.data) is torch.Tensor
            and (m is None or (module.in_features % m == 0 and module.out_features % m == 0))
            and (s.min_rows_per_image is None
                 or (rows_per_image is not None and rows_per_image >= s.min_rows_per_image)))


def rows_per_image(model, example) -> dict:
    """{Linear module: the rows of its matmul for one image}, from one forward pass of ``example`` (a batch of one)."""
    import torch

    rows, hooks = {}, []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args: rows.__setitem__(mod, max(rows.get(mod, 0), args[0].numel() // mod.in_features))))
    try:
        with torch.inference_mode():
            model(example[:1])
    finally:
        for h in hooks:
            h.remove()
    return rows


def apply_torchao(model, scheme: str, example=None):
    """Quantize ``model``'s Linear layers in place with the scheme's torchao config, those its kernel takes
    (``quantizable``; ``example``: an input batch, for schemes with a rule on rows); returns the model. Inductor's
    settings are left alone (INDUCTOR_CONFIG)."""
    import torchao.quantization as q

    if SCHEMES[scheme].min_rows_per_image is not None and example is None:
        raise ValueError(f"torchao {scheme}: quantizing needs an example input (its kernel's rule on rows)")
    rows = rows_per_image(model, example) if example is not None else {}
    q.quantize_(model, getattr(q, SCHEMES[scheme].config)(set_inductor_config=False),
                filter_fn=lambda module, fqn: quantizable(scheme, module, rows.get(module)))
    return model
