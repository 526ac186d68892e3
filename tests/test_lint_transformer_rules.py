"""Lint rules for transformers (issue 21 item 3): QD019 (a MatMul of two activations with Q/DQ on one input only),
QD020 (one tensor quantized once per consumer), QD021 (a Q/DQ pair inside a Reshape/Transpose chain). Each on a small
ONNX built here that triggers it and one that does not; the safe fixes checked in ONNX Runtime; and the placements that
must stay silent: qdeploy's own TensorRT placement of a small attention block, and ModelOpt's."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from qdeploy.lint import lint_model
from qdeploy.lint.fixes import apply_fixes
from test_lint import C, Net, rules_of, run, x_input

NEW_RULES = {"QD019", "QD020", "QD021"}
TOKENS = 64  # the 8x8 map of Net's input, as tokens of C channels


def tokens(n: Net, x: str = "x") -> str:
    """(1, C, 8, 8) → (1, 64 tokens, C), the way a ViT's patch embedding is exported."""
    flat = n.node("Reshape", [x, n.const(np.array([1, C, TOKENS]), np.int64)])
    return n.node("Transpose", [flat], perm=[0, 2, 1])


def linear(n: Net, x: str, out: int = C, quantize_input=True, quantize_weight=True, name=None, scale=0.05) -> str:
    """torch.onnx's Linear on a 3-D tensor: MatMul(x, Wᵀ) with W (in, out) per channel along axis 1, then the bias."""
    xin = n.qdq(x, scale) if quantize_input is True else x
    w = n.weight((C, out), quantize_weight, axis=1)
    return n.node("Add", [n.node("MatMul", [xin, w], name=name), n.const(np.zeros(out))])


def run_exact(model, x):
    """ONNX Runtime with its graph optimizations off: the ONNX graph's own arithmetic. With them on, ORT fuses
    DQ → MatMul into integer kernels differently when a DQ feeds one consumer or three, so a merge of identical Q/DQ
    pairs that is exact in ONNX can still move ORT's optimized output (by ~1e-2 on ModelOpt's separate-q/k/v block)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def fixed_copy(model, rules):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    applied = apply_fixes(out, rules)
    onnx.checker.check_model(out)
    return out, applied


def findings(model, rule):
    return [f for f in lint_model(model).findings if f.rule == rule]


# ---------------------------------------------------------------- QD019: a matmul of two activations, one side quantized
def attention_scores(quantize_q: bool, quantize_k: bool):
    """proj(softmax(q·kᵀ)·v) of projections of the same tokens: q and k are activations, no weight on either side;
    softmax·v stays float on both sides."""
    n = Net()
    t = tokens(n, n.node("Relu", ["x"]))
    q, k, v = (linear(n, t, name=f"{p}_proj") for p in "qkv")
    k_t = n.node("Transpose", [n.qdq(k) if quantize_k else k], perm=[0, 2, 1])
    scores = n.node("MatMul", [n.qdq(q) if quantize_q else q, k_t], name="qk")
    attn = n.node("MatMul", [n.node("Softmax", [scores], axis=-1), v], name="av")
    return n.model(linear(n, attn, name="out_proj"))


def test_qd019_matmul_with_one_input_quantized():
    bad = attention_scores(quantize_q=True, quantize_k=False)
    (f,) = findings(bad, "QD019")
    assert f.nodes[0] == "qk" and f.severity == "costs-reformat" and not f.fixable
    assert "input 0 is INT8" in f.message and "input 1 is float" in f.message
    # one finding for the node: QD011 does not report the same matmul as a float op as well
    assert not [g for g in findings(bad, "QD011") if g.nodes == ["qk"]]
    # the other side quantized, seen through the Transpose of k (DQ_SEES_THROUGH)
    (f,) = findings(attention_scores(quantize_q=False, quantize_k=True), "QD019")
    assert "input 1 is INT8" in f.message


def test_qd019_silent_on_float_attention_both_sides_and_linears():
    # attention left float on purpose (lint/placement.py): no Q/DQ on either side → QD011 says "fine", QD019 nothing
    clean = attention_scores(False, False)
    assert "QD019" not in rules_of(clean)
    assert [f.severity for f in findings(clean, "QD011") if f.nodes == ["qk"]] == ["fine"]
    # both inputs quantized (ONNX Runtime's placement quantizes attention matmuls): INT8-capable, nothing to say
    assert "QD019" not in rules_of(attention_scores(True, True))
    # a Linear (activation × constant weight): both quantized → clean; a float weight is QD011's, not QD019's
    n = Net()
    assert not {"QD019", "QD011"} & rules_of(n.model(linear(n, tokens(n, n.node("Relu", ["x"])), name="fc")))
    n = Net()
    float_weight = n.model(linear(n, tokens(n, n.node("Relu", ["x"])), quantize_weight=False, name="fc"))
    assert "QD019" not in rules_of(float_weight)
    assert [f.severity for f in findings(float_weight, "QD011") if f.nodes == ["fc"]] == ["blocks-int8"]


# ---------------------------------------------------------------- QD020: one tensor quantized once per consumer
def qkv_from_layernorm(per_consumer: bool, scales=(0.05, 0.05, 0.05)):
    """LayerNorm → three Linears (HF-style separate q/k/v): Q/DQ of the norm's output per Linear, or one shared pair."""
    n = Net()
    t = tokens(n, n.node("Relu", ["x"]))
    ln = n.node("LayerNormalization", [t, n.const(np.ones(C)), n.const(np.zeros(C))], name="norm", axis=-1)
    shared = None if per_consumer else n.qdq(ln, scales[0], name="norm_out")
    outs = []
    for i, name in enumerate(("q", "k", "v")):
        xin = n.qdq(ln, scales[i], name=f"{name}_in") if per_consumer else shared
        outs.append(linear(n, xin, quantize_input=False, name=name))
    return n.model(n.node("Concat", outs, axis=-1))


def test_qd020_identical_qdq_per_consumer_is_merged_exactly():
    bad = qkv_from_layernorm(per_consumer=True)
    (f,) = findings(bad, "QD020")
    assert f.nodes == ["q_in_q", "k_in_q", "v_in_q"] and f.fixable
    assert f.severity == "fine"  # identical scales: TensorRT's builder merges duplicate Qs itself (the docstring says)
    fixed, applied = fixed_copy(bad, {"QD020"})
    assert applied == {"QD020": 1} and "QD020" not in rules_of(fixed)
    qs = [node for node in fixed.graph.node if node.op_type == "QuantizeLinear" and node.input[0] == "norm_out"]
    assert len(qs) == 1 and len([node for node in fixed.graph.node if node.op_type == "DequantizeLinear"
                                 and node.input[0] == qs[0].output[0]]) == 1
    x = x_input()
    np.testing.assert_array_equal(run_exact(fixed, x), run_exact(bad, x))  # numerically identical, not just close


def test_qd020_different_scales_cost_a_quantize_each_and_are_not_auto_fixed():
    bad = qkv_from_layernorm(per_consumer=True, scales=(0.05, 0.05, 0.08))
    (f,) = findings(bad, "QD020")
    assert f.severity == "costs-reformat" and not f.fixable and "0.05, 0.08" in f.message
    fixed, applied = fixed_copy(bad, {"QD020"})
    assert applied == {} and findings(fixed, "QD020")


def test_qd020_silent_on_one_shared_qdq():
    assert "QD020" not in rules_of(qkv_from_layernorm(per_consumer=False))


# ---------------------------------------------------------------- QD021: Q/DQ inside a Reshape/Transpose chain
def reshape_chain(inner_qdq: bool, inner_scale=0.05, quantized_producer=True):
    """INT8 activation → Reshape → [Q → DQ] → Transpose → Linear: the DQ before the chain should reach the MatMul."""
    n = Net()
    a = n.node("Relu", ["x"])
    src = n.qdq(a, 0.05, name="first") if quantized_producer else a
    flat = n.node("Reshape", [src, n.const(np.array([1, C, TOKENS]), np.int64)], name="reshape")
    mid = n.qdq(flat, inner_scale, name="inner") if inner_qdq else flat
    t = n.node("Transpose", [mid], name="transpose", perm=[0, 2, 1])
    return n.model(linear(n, t, quantize_input=not inner_qdq and not quantized_producer, name="fc"))


def test_qd021_qdq_between_reshape_and_transpose_and_its_exact_fix():
    bad = reshape_chain(inner_qdq=True)
    (f,) = findings(bad, "QD021")
    assert f.nodes[:3] == ["inner_q", "inner_dq", "first_dq"] and f.severity == "costs-reformat" and f.fixable
    assert "same scale" in f.message
    fixed, applied = fixed_copy(bad, {"QD021"})
    assert applied == {"QD021": 1} and "QD021" not in rules_of(fixed)
    assert not any(node.name.startswith("inner") for node in fixed.graph.node)
    assert not {"QD011", "QD019"} & rules_of(fixed)  # the MatMul still sees its INT8 input, through the chain
    x = x_input()
    np.testing.assert_array_equal(run_exact(fixed, x), run_exact(bad, x))  # same scale: the pair was an identity


def test_qd021_different_inner_scale_fix_is_close():
    bad = reshape_chain(inner_qdq=True, inner_scale=0.03)
    (f,) = findings(bad, "QD021")
    assert "different scale" in f.message
    fixed, _ = fixed_copy(bad, {"QD021"})
    x = x_input()
    before, after = run(bad, x), run(fixed, x)
    cos = float(np.dot(before.ravel(), after.ravel()) / (np.linalg.norm(before) * np.linalg.norm(after)))
    assert cos > 0.995, cos


def test_qd021_silent_without_an_int8_producer_or_an_inner_pair():
    # DQ → Reshape → Transpose → MatMul: the DQ is carried to the MatMul (what the fix produces)
    assert "QD021" not in rules_of(reshape_chain(inner_qdq=False))
    # a float producer (a Conv's output reshaped into tokens): the Q/DQ after the Reshape is the first one, not a re-quantize
    assert "QD021" not in rules_of(reshape_chain(inner_qdq=True, quantized_producer=False))
    # a Linear's weight: W → Q → DQ → Transpose → MatMul (ModelOpt's export) is a weight, not an activation chain
    n = Net()
    w_t = n.node("Transpose", [n.weight((10, C), axis=0)], perm=[1, 0])
    assert "QD021" not in rules_of(n.model(n.node("MatMul", [n.qdq(tokens(n, n.node("Relu", ["x"]))), w_t])))


def test_new_rules_are_registered_with_their_sources():
    from qdeploy.lint.fixes import FIXERS
    from qdeploy.lint.rules import RULES

    for rule_id in NEW_RULES:
        doc = RULES[rule_id].check.__doc__
        assert "Sources:" in doc and ("TensorRT developer guide" in doc and "modelopt/onnx/" in doc), rule_id
    assert {"QD020", "QD021"} <= set(FIXERS) and "QD019" not in FIXERS


# ---------------------------------------------------------------- real placements stay silent
@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    from conftest import write_image_folder
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.data import make_batches

    root = write_image_folder(tmp_path_factory.mktemp("calib"), per_class=6, size=(8, 8))
    pre = Preprocess(input_size=[8, 8], mean=[0.5] * 3, std=[0.25] * 3)
    return pre, make_batches(DatasetSpec(format="imagefolder", root=str(root), batch_size=8, workers=0, labels=False), pre,
                             "classification", progress=False)


def _onnx_placement(module, calibration, tmp_path, placement="tensorrt"):
    import torch

    from qdeploy.config import Int8Config
    from qdeploy.quantize.onnx_quantizer import OnnxQdqQuantizer
    from qdeploy.quantize.registry import QuantizeInputs

    fp32 = tmp_path / "fp32.onnx"
    torch.onnx.export(module.eval(), torch.randn(1, 3, 8, 8), str(fp32), input_names=["input"], output_names=["output"],
                      opset_version=17, dynamic_axes={"input": {0: "n"}}, dynamo=False)
    pre, calib = calibration
    out = tmp_path / f"{placement}.onnx"
    inputs = QuantizeInputs(fp32_onnx=fp32, preprocess=pre, calibration=calib, cache_dir=tmp_path / "cache")
    OnnxQdqQuantizer().quantize(inputs, Int8Config(method="max", placement=placement), out)
    return onnx.load(str(out))


def _modelopt_placement(module, tmp_path, fixes=False):
    import torch

    import qdeploy.quantize.modelopt_torch as mt

    x = np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32)
    qm, _, _ = mt.quantize_torch_model(module.eval(), [x[:8], x[8:]], 16, "max")
    path = tmp_path / "modelopt.onnx"
    if fixes:
        applied = mt.export_qdq_onnx(qm, torch.from_numpy(x[:2]), path, 17)
        return onnx.load(str(path)), applied
    raw = mt._export_fixes  # ModelOpt's own export, before qdeploy's fixes
    mt._export_fixes = lambda p: {}
    try:
        mt.export_qdq_onnx(qm, torch.from_numpy(x[:2]), path, 17)
    finally:
        mt._export_fixes = raw
    return onnx.load(str(path))


def sep_qkv():
    """HF-style attention (BERT, HF ViT): separate query/key/value Linears reading one LayerNorm output."""
    import torch
    from torch import nn

    class SepQKV(nn.Module):
        def __init__(self, dim=16, heads=2):
            super().__init__()
            torch.manual_seed(0)
            self.patch, self.norm, self.heads = nn.Conv2d(3, dim, 2, stride=2), nn.LayerNorm(dim), heads
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
            self.head = nn.Linear(dim, 3)

        def forward(self, x):
            x = self.patch(x).flatten(2).transpose(1, 2)
            b, n, d = x.shape
            h = self.norm(x)
            split = lambda t: t.reshape(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
            q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
            attn = (q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5).softmax(-1)
            x = x + self.o((attn @ v).transpose(1, 2).reshape(b, n, d))
            return self.head(x.mean(1))

    return SepQKV()


@pytest.mark.slow
def test_new_rules_silent_on_qdeploys_tensorrt_placement_of_an_attention_block(calibration, tmp_path):
    """qdeploy's ONNX TensorRT placement of the attention Block (fused qkv, explicit softmax, GELU MLP) and of the
    HF-style separate-q/k/v block: none of QD019–QD021 fires (attention matmuls float on both sides, each tensor
    quantized once, no Q/DQ inside the reshape chains)."""
    from test_transformer_placement import Block

    for module in (Block(), sep_qkv()):
        report = lint_model(_onnx_placement(module, calibration, tmp_path))
        assert not NEW_RULES & {f.rule for f in report.findings}, [(f.rule, f.nodes) for f in report.findings]


@pytest.mark.slow
def test_modelopt_placement_fused_qkv_silent_separate_qkv_quantizes_the_norm_output_three_times(tmp_path):
    """ModelOpt's PyTorch placement (one input quantizer per nn.Linear): the fused-qkv Block lints silent; separate
    q/k/v Linears give the LayerNorm output three identical Q/DQ pairs (QD020, fine: TensorRT merges them), which the
    safe fix merges into one with bit-identical ONNX Runtime outputs (graph optimizations off: see run_exact); qdeploy's
    ModelOpt export applies it."""
    from test_transformer_placement import Block

    fused = _modelopt_placement(Block(), tmp_path)
    assert not NEW_RULES & rules_of(fused)
    sep = _modelopt_placement(sep_qkv(), tmp_path)
    new = [f for f in lint_model(sep).findings if f.rule in NEW_RULES]
    assert [(f.rule, f.severity, len(f.nodes)) for f in new] == [("QD020", "fine", 3)]
    assert all(name.split("/")[2] in ("q", "k", "v") for name in new[0].nodes)
    fixed, applied = fixed_copy(sep, {"QD020"})
    assert applied == {"QD020": 1} and not NEW_RULES & rules_of(fixed)
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run_exact(fixed, x), run_exact(sep, x))
    # qdeploy's ModelOpt export applies that fix itself: one shared pair, as ModelOpt's ONNX path places it
    exported, applied = _modelopt_placement(sep_qkv(), tmp_path, fixes=True)
    assert applied.get("QD020") == 1 and not NEW_RULES & rules_of(exported)


def test_helper_graph_is_valid_onnx():
    """The builders above make models ONNX's checker and ONNX Runtime accept (the Concat of three Linears included)."""
    for model in (attention_scores(True, False), qkv_from_layernorm(True), reshape_chain(True)):
        onnx.checker.check_model(model)
        assert run(model, x_input()).shape[0] == 1
