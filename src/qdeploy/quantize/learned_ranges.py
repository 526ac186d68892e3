"""``qat.ranges: learned``: activation ranges trained with the weights (LSQ, Esser et al. 2019).

Why our own piece: ModelOpt's INT8 fake quantization gives its ``amax`` no gradient (``FakeTensorQuantFunction``'s
backward returns None for it), and ModelOpt's LSQ mode (``mtq`` algorithm ``lsq``) learns NVFP4 per-block *weight*
scales only. ModelOpt does provide a hook for custom fake-quant functions (``register_quant_backend``), so the
smallest replacement is a backend that runs PyTorch's own learnable fake quantization
(``torch._fake_quantize_learnable_per_tensor_affine``, the op behind ``torch.ao.quantization``'s
``_LearnableFakeQuantize``: the LSQ gradient for the scale) with the quantizer's
calibrated amax as the starting point. Everything else (placement, equalization's ``pre_quant_scale``, export)
stays ModelOpt's: ``finalize`` writes the learned amax back into the quantizers and removes the backend, so the
export and its checks see an ordinary calibrated ModelOpt model.

Scope: per-tensor activation quantizers (``*input_quantizer``, the residual-Add inputs). Weight quantizers stay
per-channel max of the weights. Quantizers that must share one scale (residual-Add inputs without a conv path,
concat inputs: ``shared_scale_groups``) share one learned parameter, so the constraint survives training.
"""
from __future__ import annotations

import math

import torch
from torch import nn

BACKEND = "qdeploy-lsq-int8"
PARAM = "learned_amax"
QMAX = 127.0      # symmetric signed INT8 as ModelOpt quantizes it: scale = amax / 127, codes -128..127


def _lsq_int8(inputs: torch.Tensor, quantizer: nn.Module) -> torch.Tensor:
    amax = getattr(quantizer, PARAM)
    scale = (amax.abs() + 1e-12).reshape(1) / QMAX
    # LSQ's gradient scale: 1/sqrt(elements per sample x Qmax), so the step's gradient is on the weights' scale
    grad_factor = 1.0 / math.sqrt(max(1, inputs[0].numel()) * QMAX)
    x = inputs.float()  # the learnable op has no bf16 kernel; AMP's matmuls stay bf16 around it
    out = torch._fake_quantize_learnable_per_tensor_affine(x, scale.float(), torch.zeros(1, device=x.device), -128, 127,
                                                           grad_factor)
    return out.to(inputs.dtype)


def _register_backend() -> None:
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import is_registered_quant_backend, register_quant_backend

    if not is_registered_quant_backend(BACKEND):
        register_quant_backend(BACKEND, _lsq_int8)


def _learnable(name: str, q) -> bool:
    amax = getattr(q, "amax", None)
    return (q.is_enabled and name.endswith("input_quantizer") and amax is not None and amax.numel() == 1
            and getattr(q, "_num_bits", 8) == 8)


def make_ranges_learnable(model: nn.Module, shared_groups: list | None = None) -> int:
    """Give every per-tensor activation quantizer a learnable amax (started at its calibrated value); returns how many
    parameters were added (tied groups count once)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    _register_backend()
    quantizers = {n: m for n, m in model.named_modules() if isinstance(m, TensorQuantizer) and _learnable(n, m)}
    group_of = {}
    for group in shared_groups or []:
        members = [n for n in group if n in quantizers]
        for n in members:
            group_of[n] = members[0]
    params: dict[str, nn.Parameter] = {}
    for name, q in quantizers.items():
        owner = group_of.get(name, name)
        if owner not in params:
            params[owner] = nn.Parameter(quantizers[owner].amax.detach().float().reshape(()).clone())
        q.register_parameter(PARAM, params[owner])
        q.backend = BACKEND
    return len(params)


def finalize(model: nn.Module) -> dict:
    """Learned amax → the quantizers' amax; backend and parameters removed. Returns {quantizer: (start, learned)}."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    changed = {}
    for name, q in model.named_modules():
        if isinstance(q, TensorQuantizer) and PARAM in q._parameters:
            learned = getattr(q, PARAM).detach().abs().clamp_min(1e-8)
            start = float(q.amax.reshape(-1)[0])
            q.amax = learned.reshape(q.amax.shape).to(q.amax)
            del q._parameters[PARAM]
            q.backend = None
            changed[name] = (start, float(learned))
    return changed
