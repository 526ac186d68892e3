"""Placement on small untrained transformers and modern CNNs (issue 21): timm ViT (fused qkv + SDPA), torchvision ViT
(nn.MultiheadAttention), timm Swin (windowed attention, relative position bias), timm ConvNeXt in both forms (pointwise
Linear on channels-last tensors; 1x1 convs) and timm MobileViT, each exported by torch.onnx and quantized by the real
quantizers, in both placements (TensorRT's by the ONNX Q/DQ quantizer and by ModelOpt; ONNX Runtime's).

What is checked, on the Q/DQ ONNX (the rules in lint/placement.py, the same for every model):
- every Linear/Gemm/MatMul with a weight and every Conv TensorRT runs in INT8 has Q/DQ on its input and its weight;
- attention's matmuls of two activations: float for TensorRT, INT8 for ONNX Runtime;
- LayerNorm, Softmax and GELU have no Q/DQ of their own (a DQ they read is one a quantized consumer shares);
- the TensorRT placements lint without a "blocks-int8" finding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from qdeploy.config import Int8Config, Preprocess
from qdeploy.lint import lint_onnx
from qdeploy.lint.placement import attention_matmuls, float_nodes, rule_for
from qdeploy.quantize.registry import QuantizeInputs, get_quantizer
from qdeploy.utils.onnx_graph import OnnxGraph

timm = pytest.importorskip("timm")
pytestmark = pytest.mark.slow


def _vit_sdpa():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=4, depth=2,
                             embed_dim=32, num_heads=2), 16


def _vit_mha():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=3), 16


def _swin():
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=16, patch_size=2,
                             window_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2]), 16


def _convnext_linear():
    return timm.create_model("convnext_atto", pretrained=False, num_classes=3, depths=(1, 1, 1, 1), dims=(16, 32, 32, 64),
                             conv_mlp=False), 32


def _convnext_conv():
    return timm.create_model("convnext_atto", pretrained=False, num_classes=3, depths=(1, 1, 1, 1), dims=(16, 32, 32, 64),
                             conv_mlp=True), 32


def _mobilevit():
    return timm.create_model("mobilevit_xxs", pretrained=False, num_classes=3), 64


MODELS = {"vit-sdpa": _vit_sdpa, "vit-mha": _vit_mha, "swin": _swin, "convnext-linear": _convnext_linear,
          "convnext-conv": _convnext_conv, "mobilevit": _mobilevit}
PLACEMENTS = [("tensorrt", "onnx"), ("tensorrt", "modelopt"), ("onnxruntime", "onnx")]


def _calibration(size, n=16, batch=8):
    from qdeploy.data.loader import ArrayBatches

    images = np.random.default_rng(0).integers(0, 256, (n, 3, size, size), dtype=np.uint8)
    return ArrayBatches(images, np.zeros(n, np.int64), batch)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            model, size = MODELS[name]()
            model.eval()
            path = tmp_path_factory.mktemp(name) / "fp32.onnx"
            torch.onnx.export(model, torch.randn(1, 3, size, size), str(path), input_names=["input"],
                              output_names=["output"], opset_version=17, dynamic_axes={"input": {0: "n"}}, dynamo=False)
            cache[name] = (model, size, path)
        return cache[name]

    return get


def _quantize(exported, name, placement, quantizer, tmp_path):
    model, size, fp32 = exported(name)
    pre = Preprocess(input_size=[size, size], mean=[0.5] * 3, std=[0.25] * 3)
    calib = _calibration(size)
    check = ((calib.images[:4].astype(np.float32) / 255 - 0.5) / 0.25).astype(np.float32)
    inputs = QuantizeInputs(fp32_onnx=fp32, preprocess=pre, calibration=calib, torch_model=lambda: model,
                            check_inputs=check, cache_dir=tmp_path / "cache")
    out = tmp_path / f"{name}-{placement}-{quantizer}.onnx"
    res = get_quantizer(quantizer).quantize(inputs, Int8Config(method="max", placement=placement, quantizer=quantizer),
                                            out)
    return fp32, out, res


def own_qdq_on_float_ops(g: OnnxGraph, placement: str) -> list[str]:
    """Float-by-rule ops (LayerNorm, Softmax, GELU's pieces) that read a DQ no quantized consumer shares."""
    floats = float_nodes(g, placement)
    bad = []
    for node in g.nodes:
        if (node.name or node.output[0]) not in floats:
            continue
        for i in node.input:
            p = g.producer.get(i)
            if p is None or p.op_type != "DequantizeLinear":
                continue
            users = g.consumers.get(i, [])
            if any((u.name or u.output[0]) not in floats for u in users):
                continue  # shared with a quantized consumer
            q = g.producer.get(p.input[0])
            src = g.producer.get(q.input[0]) if q is not None and q.op_type == "QuantizeLinear" else None
            if src is not None and any(getattr(g.producer.get(j), "op_type", "") == "DequantizeLinear" for j in src.input):
                continue  # the output quantization of an INT8 producer (ONNX Runtime's QLinear ops), not its own
            bad.append(f"{node.op_type} {node.name}")
    return bad


@pytest.mark.parametrize("placement,quantizer", PLACEMENTS, ids=["trt-onnx", "trt-modelopt", "ort"])
@pytest.mark.parametrize("name", list(MODELS))
def test_placement_of_every_linear_matmul_norm_softmax(exported, name, placement, quantizer, tmp_path):
    if (name, quantizer) in (("vit-mha", "modelopt"), ("mobilevit", "modelopt")):
        from qdeploy.quantize.registry import NotApplicable

        # nn.MultiheadAttention computes its projections functionally (in_proj_weight), MobileViT has data-dependent
        # control flow torch.fx cannot trace: ModelOpt cannot place them, and says so (quantizer auto goes to onnx)
        with pytest.raises(NotApplicable, match="the ONNX quantizer places them|use quantizer: onnx"):
            _quantize(exported, name, placement, quantizer, tmp_path)
        return
    fp32, out, res = _quantize(exported, name, placement, quantizer, tmp_path)
    g = OnnxGraph.load(out)
    report = lint_onnx(out)
    ops = report.structure["ops"]
    assert ops, "no compute ops found"
    attention = {n.name or n.output[0] for n in attention_matmuls(g)}
    kinds = {"linear": 0, "attention-matmul": 0, "conv": 0}
    for op in ops:
        node = next(n for n in g.nodes if (n.name or n.output[0]) == op["name"])
        rule = rule_for(g, node, placement)
        assert rule is not None, f"{op['op']} {op['name']} falls under no placement rule"
        kinds[rule.name] = kinds.get(rule.name, 0) + 1
        both = op["int8_input"] and op["int8_weights"]
        if rule.name == "attention-matmul":
            assert op["name"] in attention
            if placement == "tensorrt":
                assert not op["int8_input"] and not op["int8_weights"], op
            else:
                assert both, op
        elif rule.name == "linear":
            assert both, op
        elif rule.name == "conv" and placement == "onnxruntime":
            # a conv ONNX Runtime cannot run as QLinearConv (its output feeds a SiLU kept whole: MobileViT) stays
            # float, and the quantizer names it (lint.placement.CONV_FLOAT_OUTPUT_WHY)
            assert both or op["name"] in res.info["float_convs_without_int8_kernel"], op
    assert kinds["linear"] > 0
    if name in ("vit-sdpa", "vit-mha", "swin", "mobilevit"):
        assert kinds["attention-matmul"] > 0, "the attention was not found as two matmuls of activations"
    assert own_qdq_on_float_ops(g, placement) == []
    g32 = OnnxGraph.load(fp32)
    kinds_fp32 = {r.name for r in (rule_for(g32, n, placement) for n in g32.nodes) if r is not None}
    assert "layernorm" in kinds_fp32 or name == "mobilevit" and "softmax" in kinds_fp32
    assert "gelu" in kinds_fp32 or name == "mobilevit"  # MobileViT's MLPs use SiLU
    if placement == "tensorrt":
        blocking = [f for f in report.findings if f.severity == "blocks-int8"]
        assert not blocking, [(f.rule, f.nodes, f.message) for f in blocking]
