"""Placement rules for transformers (issue 21): the rules in lint/placement.py are read by both ONNX placements and
the lint. A small untrained attention block, exported by torch.onnx, quantized by the real ONNX Q/DQ quantizer."""
import pytest
import torch
from torch import nn

from qdeploy.config import Preprocess
from qdeploy.lint import lint_onnx
from qdeploy.lint.placement import ATTENTION_MATMUL, attention_matmuls
from qdeploy.quantize.onnx_quantizer import OnnxQdqQuantizer
from qdeploy.quantize.registry import QuantizeInputs
from qdeploy.utils.onnx_graph import OnnxGraph


class Block(nn.Module):
    """Pre-norm attention (fused qkv, explicit softmax) and a GELU MLP, on 16 tokens of a 4x4 patch grid."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, dim, 2, stride=2)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(x.mean(1))


@pytest.fixture(scope="module")
def block_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("attn") / "block.onnx"
    torch.onnx.export(Block().eval(), torch.randn(1, 3, 8, 8), str(path), input_names=["input"], output_names=["output"],
                      opset_version=17, dynamic_axes={"input": {0: "n"}}, dynamo=False)
    return path


@pytest.mark.parametrize("placement", ["onnxruntime", "tensorrt"])
def test_linears_int8_in_both_placements_attention_matmuls_float_for_tensorrt(block_onnx, placement, tmp_path):
    from qdeploy.config import Int8Config

    from conftest import write_image_folder
    from qdeploy.config import DatasetSpec
    from qdeploy.data import make_batches

    root = write_image_folder(tmp_path / "calib", per_class=6, size=(8, 8))
    pre = Preprocess(input_size=[8, 8], mean=[0.5] * 3, std=[0.25] * 3)
    calib = make_batches(DatasetSpec(format="imagefolder", root=str(root), batch_size=8, workers=0, labels=False), pre,
                         "classification", progress=False)
    inputs = QuantizeInputs(fp32_onnx=block_onnx, preprocess=pre, calibration=calib, cache_dir=tmp_path / "cache")
    out = tmp_path / f"{placement}.onnx"
    res = OnnxQdqQuantizer().quantize(inputs, Int8Config(method="max", placement=placement), out)
    attention = {n.name for n in attention_matmuls(OnnxGraph.load(block_onnx))}
    assert len(attention) == 2                                  # Q·Kᵀ and softmax·V, found without knowing the names
    rule_float = set(res.info["float_by_placement_rule"])
    if placement == "tensorrt":
        assert attention <= rule_float
    else:  # ONNX Runtime's placement quantizes them (lint/placement.py says why)
        assert not attention & rule_float
    g = OnnxGraph.load(block_onnx)  # LayerNorm, Softmax and GELU's pieces stay float in both placements
    assert {n.name for n in g.nodes if n.op_type in ("LayerNormalization", "Softmax", "Erf")} <= rule_float
    report = lint_onnx(out)
    ops = {op["name"]: op for op in report.structure["ops"]}
    linears = [n for n, op in ops.items() if op["op"] in ("MatMul", "Gemm", "Conv") and n not in attention]
    assert len(linears) == 6 and all(ops[n]["int8_input"] and ops[n]["int8_weights"] for n in linears), ops
    if placement == "tensorrt":  # no Q/DQ in front: TensorRT runs them in its FP16 attention; the lint agrees
        assert not any(ops[n]["int8_input"] or ops[n]["int8_weights"] for n in attention)
        qd011 = [f for f in report.findings if f.rule == "QD011"]
        assert {f.nodes[0] for f in qd011} == attention and all(f.severity == "fine" for f in qd011)
        assert ATTENTION_MATMUL.split(":")[0] in qd011[0].message


@pytest.mark.slow
def test_one_rule_added_changes_both_placements_and_the_lint(block_onnx, tmp_path):
    """lint/placement.py is the one description: a rule added there (every Linear float for TensorRT) reaches the ONNX
    Q/DQ placement, the ModelOpt placement of the PyTorch model and the lint, with nothing else changed."""
    import numpy as np

    from qdeploy.config import Int8Config
    from qdeploy.data.loader import ArrayBatches
    from qdeploy.lint.placement import FLOAT, OpRule, _has_weight, extra_rule
    from qdeploy.quantize.registry import get_quantizer

    pre = Preprocess(input_size=[8, 8], mean=[0.5] * 3, std=[0.25] * 3)
    images = np.random.default_rng(0).integers(0, 256, (16, 3, 8, 8), dtype=np.uint8)
    calib = ArrayBatches(images, np.zeros(16, np.int64), 8)

    def place(quantizer, tag):
        inputs = QuantizeInputs(fp32_onnx=block_onnx, preprocess=pre, calibration=calib, torch_model=lambda: Block().eval(),
                                cache_dir=tmp_path / f"cache-{tag}")
        out = tmp_path / f"{quantizer}-{tag}.onnx"
        get_quantizer(quantizer).quantize(inputs, Int8Config(method="max", placement="tensorrt", quantizer=quantizer), out)
        report = lint_onnx(out)
        ops = {op["name"]: op for op in report.structure["ops"]}
        attention = attention_names(out)
        linear = {n: op for n, op in ops.items() if op["op"] in ("MatMul", "Gemm") and n not in attention}
        return linear, report

    def attention_names(path):
        return {n.name for n in attention_matmuls(OnnxGraph.load(path))}

    why = "every Linear float (a rule added by this test)"
    rule = OpRule("test-linear-float", {"tensorrt": FLOAT}, ("Gemm", "MatMul"), applies=_has_weight, why=why)
    for quantizer in ("onnx", "modelopt"):
        before, lint_before = place(quantizer, "before")
        assert len(before) == 5 and all(op["int8_input"] and op["int8_weights"] for op in before.values()), before
        with extra_rule(rule):
            after, lint_after = place(quantizer, "after")
        assert len(after) == 5 and not any(op["int8_input"] or op["int8_weights"] for op in after.values()), after
        fine = {f.nodes[0] for f in lint_after.findings if f.rule == "QD011" and f.severity == "fine" and why in f.message}
        assert fine == {n for n in after if "head" not in n}, (quantizer, fine)  # a float head is QD013's
        assert not [f for f in lint_after.findings if f.severity == "blocks-int8"]
        assert not [f for f in lint_before.findings if why in f.message]


def test_tensorrt_placement_stores_weights_on_their_grid(block_onnx, tmp_path):
    """TensorRT quantizes the float weights itself: stored as exact multiples of their scales, no rounding tie is left
    for it to resolve differently from the ONNX Runtime evaluation (quantize/qdq.snap_weights_to_grid)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from qdeploy.config import Int8Config
    from qdeploy.data.loader import ArrayBatches

    pre = Preprocess(input_size=[8, 8], mean=[0.5] * 3, std=[0.25] * 3)
    calib = ArrayBatches(np.random.default_rng(0).integers(0, 256, (16, 3, 8, 8), dtype=np.uint8), np.zeros(16, np.int64), 8)
    inputs = QuantizeInputs(fp32_onnx=block_onnx, preprocess=pre, calibration=calib, cache_dir=tmp_path / "cache")
    out = tmp_path / "trt.onnx"
    OnnxQdqQuantizer().quantize(inputs, Int8Config(method="max", placement="tensorrt"), out)
    g = OnnxGraph(onnx.load(str(out)))
    checked = 0
    for q in g.nodes:
        if q.op_type == "QuantizeLinear" and q.input[0] in g.initializers:
            w = numpy_helper.to_array(g.initializers[q.input[0]])
            s = g.constant_value(q.input[1])
            axis = next((a.i for a in q.attribute if a.name == "axis"), 1)
            shape = [1] * w.ndim
            shape[axis] = -1
            ratio = w / s.reshape(shape)
            assert np.abs(ratio - np.rint(ratio)).max() < 1e-3
            checked += 1
    assert checked == 6  # the patch conv and five Linears
