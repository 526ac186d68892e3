"""The ONNX Runtime placement's speed rules (issue #23): a conv ONNX Runtime cannot run as QLinearConv stays float,
or keeps a quantized output when asked (quantized_conv_outputs); gating Muls and global pools stay float; and the
per-op-class profile that measured them (benchmark/op_profile.py), on real ONNX Runtime sessions."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from pydantic import ValidationError
from torch import nn

from qdeploy.benchmark.op_profile import compare, op_class, profile_onnx, summary_line
from qdeploy.config import Int8Config
from qdeploy.lint.placement import convs_without_int8_kernel, float_nodes
from qdeploy.quantize.collect import collect_activation_stats
from qdeploy.quantize.qdq import quantize_onnx
from qdeploy.quantize.ranges import compute_ranges
from qdeploy.utils.onnx_graph import OnnxGraph


class MBConvSE(nn.Module):
    """EfficientNet's block: 1x1 expand, SiLU, 3x3 depthwise, SiLU, squeeze-excitation, 1x1 project, residual."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.expand = nn.Conv2d(16, 64, 1)
        self.dw = nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.se1, self.se2 = nn.Conv2d(64, 8, 1), nn.Conv2d(8, 64, 1)
        self.project = nn.Conv2d(64, 16, 1)
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        x = self.stem(x)
        y = nn.functional.silu(self.expand(x))
        y = nn.functional.silu(self.dw(y))
        y = y * torch.sigmoid(self.se2(torch.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        x = x + self.project(y)
        return self.head(x).mean((2, 3))


@pytest.fixture(scope="module")
def mbconv(tmp_path_factory):
    path = tmp_path_factory.mktemp("mbconv") / "m.onnx"
    torch.onnx.export(MBConvSE().eval(), (torch.randn(1, 3, 16, 16),), str(path), input_names=["input"],
                      output_names=["output"], opset_version=17, dynamic_axes={"input": {0: "n"}}, dynamo=False)
    x = np.random.default_rng(0).normal(size=(32, 3, 16, 16)).astype(np.float32)
    stats = collect_activation_stats(path, [x[i:i + 16] for i in range(0, len(x), 16)], len(x), histograms=False)
    return path, x, compute_ranges(stats, "max")


def _conv(model, weight_name: str):
    return next(n for n in model.graph.node if n.op_type == "Conv" and any(weight_name in i for i in n.input))


def _run(path, x):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def _cosine(a, b):
    return float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_convs_before_an_activation_kept_whole_stay_float_by_default(mbconv, tmp_path):
    path, x, ranges = mbconv
    out = tmp_path / "default.onnx"
    info = quantize_onnx(path, ranges, "onnxruntime", out)
    q = onnx.load(str(out))
    producers = {o: n for n in q.graph.node for o in n.output}
    # expand and dw feed SiLU (kept whole): ONNX Runtime could not fuse them, so they are float (float weights; expand
    # still reads the DQ'd stem output the residual Add's QLinearAdd needs)
    assert len(info["float_convs_without_int8_kernel"]) == 2
    for w in ("expand.weight", "dw.weight"):
        conv = _conv(q, w)
        assert conv.input[1] not in producers, conv.name
    assert convs_without_int8_kernel(q) == []  # every conv left with a DQ input now has a Q-only output
    int8_convs = [n.name for n in q.graph.node if n.op_type == "Conv"
                  and getattr(producers.get(n.input[1]), "op_type", None) == "DequantizeLinear"]
    assert any("project" in n for n in int8_convs), int8_convs  # its output goes into the residual QLinearAdd
    assert _cosine(_run(out, x), _run(path, x)) > 0.99


def test_quantized_conv_outputs_keeps_those_convs_int8(mbconv, tmp_path):
    path, x, ranges = mbconv
    out = tmp_path / "qconv.onnx"
    info = quantize_onnx(path, ranges, "onnxruntime", out, quantized_conv_outputs=True)
    q = onnx.load(str(out))
    consumers: dict = {}
    for n in q.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    assert info["float_convs_without_int8_kernel"] == [] and info["quantized_conv_outputs"] is True
    for w in ("expand.weight", "dw.weight"):
        assert [c.op_type for c in consumers[_conv(q, w).output[0]]] == ["QuantizeLinear"]
    assert _cosine(_run(out, x), _run(path, x)) > 0.99
    # the optimized session really runs them as QLinearConv (its profiler names the kernels)
    prof = profile_onnx(out, x[:4], runs=3, warmup=1, threads=1)
    qlinear = sum(n["op"] == "QLinearConv" for n in prof["nodes"])
    float_convs = sum(n["op"] in ("Conv", "FusedConv", "NchwcConv") for n in prof["nodes"])
    assert qlinear >= 4 and float_convs <= 2  # stem, expand, dw, project (, head) in INT8; only the float SE's two convs


def test_quantized_conv_outputs_is_checked_and_labelled():
    assert "qconv" in Int8Config(quantized_conv_outputs=True).label_parts()
    with pytest.raises(ValidationError, match="quantized_conv_outputs applies to placement onnxruntime"):
        Int8Config(placement="tensorrt", quantized_conv_outputs=True)
    with pytest.raises(ValidationError, match="quantized_conv_outputs applies"):
        Int8Config(split_activations=True, quantized_conv_outputs=True)


def test_gating_mul_and_global_pool_are_float_rules_of_the_onnxruntime_placement_only(mbconv):
    path, _, _ = mbconv
    g = OnnxGraph.load(path)
    ort_float = float_nodes(g, "onnxruntime")
    gating = [n.name for n in g.nodes if n.op_type == "Mul" and "QLinearMul" in ort_float.get(n.name, "")]
    assert gating, "the SE gate x·sigmoid(z) and SiLU's x·sigmoid(x) are gating Muls"
    trt_float = float_nodes(g, "tensorrt")
    assert not any(n in trt_float for n in gating)


def test_op_classes_pair_fused_and_layout_kernels_with_their_layer():
    assert op_class("QLinearConv") == op_class("NchwcConv") == op_class("FusedConv") == "Conv"
    assert op_class("MatMulIntegerToFloat") == op_class("QLinearMatMul") == "MatMul"
    assert op_class("QuantizeLinear") == op_class("DequantizeLinear") == "Q/DQ"
    assert op_class("ReorderInput") == "layout" and op_class("QLinearGlobalAveragePool") == "GlobalAveragePool"
    fp32 = {"p50_ms": 1.0, "threads": 2, "runs": 5, "nodes": [{"node": "a", "op": "NchwcConv", "us": 500.0},
                                                              {"node": "b", "op": "Mul", "us": 100.0}],
            "op_classes_us": {"Conv": 500.0, "Mul": 100.0}}
    int8 = {"p50_ms": 1.2, "threads": 2, "runs": 5, "nodes": [{"node": "a", "op": "QLinearConv", "us": 300.0},
                                                              {"node": "b", "op": "QLinearMul", "us": 400.0},
                                                              {"node": "q", "op": "QuantizeLinear", "us": 10.0}],
            "op_classes_us": {"Conv": 300.0, "Mul": 400.0, "Q/DQ": 10.0}}
    cmp = compare(fp32, int8)
    assert cmp["slower"] == ["Mul"]  # Q/DQ's 10 µs is below the jitter floor; Conv got faster
    cmp["batch_size"] = 32
    assert "Mul 0.400 vs 0.100 ms" in summary_line(cmp)


def test_profile_of_the_real_int8_graph_names_its_op_classes(mbconv, tmp_path):
    path, x, ranges = mbconv
    out = tmp_path / "q.onnx"
    quantize_onnx(path, ranges, "onnxruntime", out)
    f, q = profile_onnx(path, x[:8], runs=3, warmup=1, threads=1), profile_onnx(out, x[:8], runs=3, warmup=1, threads=1)
    assert f["runs"] >= 3 and "Conv" in f["op_classes_us"] and "Conv" in q["op_classes_us"]
    assert "Q/DQ" in q["op_classes_us"] or "QLinearConv" in q["op_types_us"]
    cmp = compare(f, q)
    assert {r["op_class"] for r in cmp["classes"]} >= {"Conv"}
