"""`qdeploy lint`: every rule on a small ONNX built here that triggers it and one that does not; the safe
fixes checked in ONNX Runtime; bad input refused with one line."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdeploy.cli import main
from qdeploy.lint import FloatModel, LintInputError, RULES, fix_onnx, lint_model, lint_onnx
from qdeploy.lint.fixes import FIXERS, apply_fixes
from qdeploy.facts.tensorrt import conv_int8_supported

C = 16  # channels: wide enough for TensorRT's INT8 kernels unless a test says otherwise


class Net:
    """A tiny ONNX graph builder: float input x (1, C, 8, 8), explicit Q/DQ helpers."""

    def __init__(self, channels: int = C, size: int = 8):
        self.nodes, self.inits, self.n = [], [], 0
        self.channels, self.size = channels, size
        self.rng = np.random.default_rng(0)

    def _name(self, prefix):
        self.n += 1
        return f"{prefix}_{self.n}"

    def const(self, value, dtype=np.float32):
        name = self._name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def node(self, op, inputs, name=None, **attrs):
        name = name or self._name(op)
        out = f"{name}_out"
        self.nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    def qdq(self, x, scale=0.05, zp_dtype=np.int8, axis=None, name=None):
        s = self.const(scale)
        z = self.const(np.zeros(np.shape(scale), zp_dtype), zp_dtype)
        kw = {} if axis is None else {"axis": axis}
        q = self.node("QuantizeLinear", [x, s, z], name=f"{name}_q" if name else None, **kw)
        return self.node("DequantizeLinear", [q, s, z], name=f"{name}_dq" if name else None, **kw)

    def weight(self, shape, quantize=True, axis=0):
        w = self.rng.normal(0, 0.1, shape).astype(np.float32)
        name = self.const(w)
        if not quantize:
            return name
        amax = np.abs(w).max(axis=tuple(i for i in range(w.ndim) if i != axis)) + 1e-6
        return self.qdq(name, (amax / 127).astype(np.float32), axis=axis)

    def conv(self, x, cout, cin=None, k=3, quantize_input=True, quantize_weight=True, group=1, name=None, pads=None):
        cin = cin or self.channels
        xin = self.qdq(x) if quantize_input else x
        w = self.weight((cout, cin // group, k, k), quantize_weight)
        pads = [k // 2] * 4 if pads is None else pads
        return self.node("Conv", [xin, w, self.const(np.zeros(cout))], name=name, pads=pads, group=group)

    def model(self, out, inputs=None, opset=17):
        inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, self.channels, self.size, self.size])]
        outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)]
        graph = helper.make_graph(self.nodes, "g", inputs, outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        inferred = onnx.shape_inference.infer_shapes(model)  # fills in the output's shape for onnx.checker
        return inferred if inferred.graph.output[0].type.tensor_type.HasField("shape") else model


def rules_of(model) -> set[str]:
    return {f.rule for f in lint_model(model).findings}


def run(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def x_input(channels=C, size=8, seed=1):
    return np.random.default_rng(seed).normal(0, 1, (1, channels, size, size)).astype(np.float32)


# ---------------------------------------------------------------- residual blocks
def residual_block(qdq_conv_path: bool, qdq_skip: bool, conv_input_q: bool = True):
    n = Net()
    a = n.node("Relu", ["x"])
    y = n.conv(a, C, quantize_input=conv_input_q, name="conv")
    left = n.qdq(y) if qdq_conv_path else y
    right = n.qdq(a) if qdq_skip else a
    out = n.node("Add", [left, right], name="add")
    return n.model(n.node("Relu", [out]))


def test_qd001_conv_path_qdq_before_residual_add():
    bad = residual_block(qdq_conv_path=True, qdq_skip=True)
    report = lint_model(bad)
    f = next(f for f in report.findings if f.rule == "QD001")
    assert f.nodes == ["add", "conv"] and f.fixable and f.severity == "costs-reformat"
    assert report.structure["residual_add_forms"] == {"conv-path-quantized": 1}
    good = residual_block(qdq_conv_path=False, qdq_skip=True)
    assert "QD001" not in rules_of(good)
    assert lint_model(good).structure["residual_add_forms"] == {"fusible": 1}
    assert lint_model(good).structure["ops"][0]["fuses"] == ["Add", "Relu"]


def test_qd002_float_skip_input():
    assert "QD002" in rules_of(residual_block(qdq_conv_path=False, qdq_skip=False))
    assert "QD002" not in rules_of(residual_block(qdq_conv_path=False, qdq_skip=True))
    # a float conv path too: nothing of this block is INT8, so QD011 speaks, not QD002
    assert "QD002" not in rules_of(residual_block(False, False, conv_input_q=False))


def test_downsample_block_quantizes_the_shortcut_conv_not_the_main_path():
    """Both Add inputs are conv outputs: the main path (longer way to the common ancestor) is the conv path."""
    n = Net()
    a = n.node("Relu", ["x"])
    main = n.conv(n.node("Relu", [n.conv(a, C, name="conv1")]), C, name="conv2")
    short = n.conv(a, C, k=1, name="shortcut")
    model = n.model(n.node("Add", [main, n.qdq(short)], name="add"))
    g_report = lint_model(model)
    assert g_report.structure["adds"][0]["conv_input"] == 0 and g_report.structure["residual_add_forms"] == {"fusible": 1}
    n2 = Net()
    a = n2.node("Relu", ["x"])
    main = n2.conv(n2.node("Relu", [n2.conv(a, C, name="conv1")]), C, name="conv2")
    short = n2.conv(a, C, k=1, name="shortcut")
    assert "QD001" in rules_of(n2.model(n2.node("Add", [n2.qdq(main), n2.qdq(short)], name="add")))


def act_act_add(scale_a, scale_b):
    n = Net()
    a, b = n.node("Relu", ["x"]), n.node("Sigmoid", ["x"])
    return n.model(n.node("Add", [n.qdq(a, scale_a), n.qdq(b, scale_b)], name="add"))


def test_qd003_activation_add_scales_differ():
    assert "QD003" in rules_of(act_act_add(0.05, 0.01))
    report = lint_model(act_act_add(0.05, 0.05))
    assert "QD003" not in {f.rule for f in report.findings} and report.structure["residual_add_forms"] == {"shared-scale": 1}


# ---------------------------------------------------------------- shared scales
def concat_model(sa, sb, out_scale=None):
    n = Net()
    a, b = n.node("Relu", ["x"]), n.node("Sigmoid", ["x"])
    cat = n.node("Concat", [n.qdq(a, sa), n.qdq(b, sb)], name="cat", axis=1)
    if out_scale is not None:
        cat = n.qdq(cat, out_scale)
    return n.model(n.conv(cat, C, cin=2 * C, quantize_input=out_scale is None))


def test_qd004_concat_scales():
    assert "QD004" in rules_of(concat_model(0.05, 0.01))
    assert "QD004" in rules_of(concat_model(0.05, 0.05, out_scale=0.02))
    assert "QD004" not in rules_of(concat_model(0.05, 0.05, out_scale=0.05))


def pool_model(s_in, s_out, op="MaxPool"):
    n = Net()
    a = n.node("Relu", ["x"])
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]} if op != "GlobalAveragePool" else {}
    p = n.node(op, [n.qdq(a, s_in)], name="pool", **attrs)
    return n.model(n.conv(n.qdq(p, s_out), C, quantize_input=False))


def test_qd005_pool_scales():
    assert "QD005" in rules_of(pool_model(0.05, 0.02))
    assert "QD005" in rules_of(pool_model(0.05, 0.02, "GlobalAveragePool"))
    assert "QD005" not in rules_of(pool_model(0.05, 0.05))


# ---------------------------------------------------------------- fusions
def conv_bn_relu(qdq_inside: bool):
    n = Net()
    y = n.conv("x", C, name="conv")
    bn = n.node("BatchNormalization", [y if not qdq_inside else n.qdq(y), n.const(np.ones(C)), n.const(np.zeros(C)),
                                       n.const(np.zeros(C)), n.const(np.ones(C))], name="bn")
    return n.model(n.node("Relu", [bn], name="relu"))


def test_qd006_qdq_inside_conv_bn_relu():
    assert "QD006" in rules_of(conv_bn_relu(True))
    report = lint_model(conv_bn_relu(False))
    assert "QD006" not in {f.rule for f in report.findings}
    assert report.structure["ops"][0]["fuses"] == ["BatchNormalization", "Relu"]


def swish(qdq_inside: bool, depthwise: bool = False, hard: bool = False):
    n = Net()
    y = n.conv("x", C, group=C if depthwise else 1, name="conv")
    x_in = n.qdq(y) if qdq_inside else y
    gate = n.node("HardSigmoid" if hard else "Sigmoid", [x_in], name="gate")
    return n.model(n.qdq(n.node("Mul", [x_in, gate], name="mul")))


def test_qd007_swish_and_hardswish_stay_fusible():
    assert "QD007" in rules_of(swish(True)) and "QD007" in rules_of(swish(True, hard=True))
    assert "QD007" not in rules_of(swish(False)) and "QD007" not in rules_of(swish(False, hard=True))
    assert lint_model(swish(False)).structure["ops"][0]["fuses"] == ["SiLU"]


def test_qd014_depthwise_conv_then_swish_is_noted():
    assert "QD014" in rules_of(swish(False, depthwise=True))
    assert "QD014" not in rules_of(swish(False, depthwise=False))


def convtranspose(axis: int):
    n = Net()
    w = n.weight((C, C, 2, 2), axis=axis)
    return n.model(n.node("ConvTranspose", [n.qdq("x"), w], name="deconv", strides=[2, 2]))


def test_qd008_convtranspose_weight_axis():
    assert "QD008" in rules_of(convtranspose(1))
    assert "QD008" not in rules_of(convtranspose(0))


def pad_model(pad_before_qdq: bool):
    n = Net()
    a = n.node("Relu", ["x"])
    pads = n.const(np.array([0, 0, 1, 1, 0, 0, 1, 1]), np.int64)
    if pad_before_qdq:
        p = n.node("Pad", [a, pads], name="pad")
        y = n.conv(p, C, pads=[0, 0, 0, 0], name="conv")
    else:
        p = n.node("Pad", [n.qdq(a), pads], name="pad")
        y = n.conv(p, C, quantize_input=False, pads=[0, 0, 0, 0], name="conv")
    return n.model(y)


def test_qd009_pad_between_dq_and_conv_and_its_fold_is_exact():
    bad = pad_model(False)
    assert "QD009" in rules_of(bad) and "QD009" not in rules_of(pad_model(True))
    fixed = onnx.ModelProto()
    fixed.CopyFrom(bad)
    assert apply_fixes(fixed, {"QD009"}) == {"QD009": 1}
    assert not any(n.op_type == "Pad" for n in fixed.graph.node) and "QD009" not in rules_of(fixed)
    x = x_input()
    np.testing.assert_allclose(run(fixed, x), run(bad, x), atol=1e-5)  # numerically neutral


def narrow_conv(cout, cin, first_layer):
    n = Net(channels=cin)
    src = "x" if first_layer else n.node("Relu", ["x"])
    return n.model(n.conv(src, cout, cin=cin, name="conv"))


def test_qd010_small_channel_convs_follow_modelopts_rule():
    assert "QD010" in rules_of(narrow_conv(4, 3, first_layer=False))  # 3→4: no INT8 kernel
    assert "QD010" not in rules_of(narrow_conv(16, 3, first_layer=True))  # RGB stem with 16 outputs
    assert "QD010" not in rules_of(narrow_conv(32, 32, first_layer=False))
    assert conv_int8_supported(8, 16, 1, [3, 3], False)       # 8 outputs (a multiple of 8), 16 inputs
    assert not conv_int8_supported(8, 8, 1, [3, 3], False)    # both < 16 and not the first layer
    assert not conv_int8_supported(8, 8, 1, [1, 3], False)    # non-square kernel
    assert conv_int8_supported(8, 1, 8, [3, 3], False)        # depthwise, 8 channels, 3x3
    assert not conv_int8_supported(4, 1, 4, [3, 3], False)


def test_qd011_float_compute_op_and_explained_narrow_conv():
    n = Net()
    y = n.conv(n.node("Relu", ["x"]), C, quantize_input=False, quantize_weight=False, name="conv")
    report = lint_model(n.model(n.conv(y, C, name="conv2")))
    f = next(f for f in report.findings if f.rule == "QD011")
    assert f.nodes == ["conv"] and f.severity == "blocks-int8" and report.structure["compute_ops_float"] == ["conv"]
    n = Net(channels=3)
    narrow = n.model(n.conv(n.node("Relu", ["x"]), 4, cin=3, quantize_input=False, quantize_weight=False, name="conv"))
    n.nodes.append(helper.make_node("Identity", [narrow.graph.output[0].name], ["y2"]))  # keep a Q/DQ-free float conv
    fine = [f for f in lint_model(narrow).findings if f.rule == "QD011"]
    assert fine and fine[0].severity == "fine"  # TensorRT would not run it in INT8 anyway
    assert "QD011" not in rules_of(residual_block(False, True))


def resize_model(quantize_resize_input: bool, mode="linear"):
    n = Net()
    y = n.conv(n.node("Relu", ["x"]), C, name="conv1")
    r_in = n.qdq(y) if quantize_resize_input else y
    r = n.node("Resize", [r_in, "", n.const([1, 1, 2, 2])], name="resize", mode=mode)
    return n.model(n.conv(r, C, name="conv2"))


def test_qd012_float_resize_between_quantized_ops():
    assert "QD012" in rules_of(resize_model(False))
    assert "QD012" not in rules_of(resize_model(True))


def head_model(quantized_head: bool):
    n = Net()
    y = n.conv(n.node("Relu", ["x"]), C, name="conv")
    flat = n.node("Flatten", [n.node("GlobalAveragePool", [y])])
    w = n.weight((10, C), quantize=quantized_head)
    x_in = n.qdq(flat) if quantized_head else flat
    return n.model(n.node("Gemm", [x_in, w, n.const(np.zeros(10))], name="fc", transB=1))


def test_qd013_float_classifier_head():
    assert "QD013" in rules_of(head_model(False))
    assert not {"QD013", "QD011", "QD016"} & rules_of(head_model(True))


def scale_model(scale):
    n = Net()
    return n.model(n.conv(n.node("Relu", ["x"]), C, name="conv") if scale is None else
                   n.node("Relu", [n.qdq("x", scale, name="bad")]))


def test_qd015_bad_scales():
    for bad in (0.0, -0.1, float("nan"), float("inf"), 1e-40):
        assert "QD015" in rules_of(scale_model(bad)), bad
    assert "QD015" not in rules_of(scale_model(0.05))


def test_qd016_weight_axis_mismatch():
    n = Net()
    w = n.weight((C, C, 3, 3), axis=1)
    bad = n.model(n.node("Conv", [n.qdq("x"), w], name="conv", pads=[1, 1, 1, 1]))
    assert "QD016" in rules_of(bad)
    assert "QD016" not in rules_of(residual_block(False, True))


def test_qd017_asymmetric_uint8_is_not_tensorrt_int8():
    n = Net()
    bad = n.model(n.node("Relu", [n.qdq("x", zp_dtype=np.uint8)]))
    assert "QD017" in rules_of(bad)
    assert "QD017" not in rules_of(residual_block(False, True))


def test_qd018_run_time_scale():
    n = Net()
    s = n.node("Mul", [n.const(0.05), n.const(1.0)])
    z = n.const(0, np.int8)
    q = n.node("QuantizeLinear", ["x", s, z])
    bad = n.model(n.node("DequantizeLinear", [q, s, z]))
    assert "QD018" in rules_of(bad)
    assert "QD018" not in rules_of(scale_model(0.05))


def test_every_rule_is_tested_and_every_fixer_has_a_rule():
    from pathlib import Path

    # this file and the other lint test files (test_lint_transformer_rules.py: QD019-QD021)
    source = "".join(p.read_text() for p in Path(__file__).parent.glob("test_lint*.py"))
    assert all(rule_id in source for rule_id in RULES)
    assert set(FIXERS) <= set(RULES) and all(RULES[r].safe_fix for r in FIXERS)


# ---------------------------------------------------------------- fixes in ONNX Runtime
@pytest.mark.parametrize("build, rule", [
    (lambda: residual_block(True, True), "QD001"),
    (lambda: concat_model(0.05, 0.01), "QD004"),
    (lambda: pool_model(0.05, 0.02), "QD005"),
    (lambda: conv_bn_relu(True), "QD006"),
    (lambda: swish(True), "QD007"),
])
def test_safe_fix_removes_the_finding_and_stays_close(build, rule, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(build(), str(src))
    report = fix_onnx(src, tmp_path / "fixed.onnx")
    assert report.fixed.get(rule) and rule not in {f.rule for f in report.findings}
    x = x_input()
    before, after = run(onnx.load(str(src)), x), run(onnx.load(str(tmp_path / "fixed.onnx")), x)
    # one rounding step fewer (dropped Q/DQ) or a coarser shared scale: close, not identical
    cos = float(np.dot(before.ravel(), after.ravel()) / (np.linalg.norm(before) * np.linalg.norm(after)))
    assert cos > 0.995, cos


# ---------------------------------------------------------------- bad input and the CLI
def test_bad_input_is_refused_with_one_line(tmp_path, capsys):
    not_onnx = tmp_path / "model.onnx"
    not_onnx.write_text("hello")
    with pytest.raises(LintInputError, match="is not an ONNX model"):
        lint_onnx(not_onnx)
    # external data that is missing
    model = residual_block(False, True)
    ext = tmp_path / "ext.onnx"
    onnx.save(model, str(ext), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
              size_threshold=0)
    (tmp_path / "ext.data").unlink()
    with pytest.raises(LintInputError, match="external data is missing"):
        lint_onnx(ext)
    # a float model: says so, and what qdeploy quantize would do
    n = Net()
    f32 = tmp_path / "float.onnx"
    onnx.save(n.model(n.node("Add", [n.conv(n.node("Relu", ["x"]), C, quantize_input=False, quantize_weight=False), "x"])), str(f32))
    with pytest.raises(FloatModel, match="float model.*skip input of 1 residual Adds"):
        lint_onnx(f32)
    # an old opset
    old = tmp_path / "old.onnx"
    m = residual_block(False, True)
    m.opset_import[0].version = 11
    onnx.save(m, str(old))
    with pytest.raises(LintInputError, match="opset 11 is not supported"):
        lint_onnx(old)
    # a Q/DQ node without its scale
    broken = residual_block(False, True)
    dq = next(n for n in broken.graph.node if n.op_type == "DequantizeLinear")
    dq.input[1] = "nowhere"
    bad = tmp_path / "noscale.onnx"
    onnx.save(broken, str(bad))
    with pytest.raises(LintInputError, match=f"DequantizeLinear '{dq.name}' has no scale input"):
        lint_onnx(bad)
    # the CLI: exit 2 and one line for each
    for path in (not_onnx, ext, f32, old, bad):
        assert main(["lint", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("qdeploy: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_cli_exit_codes_json_and_fix(tmp_path, capsys):
    clean, dirty = tmp_path / "clean.onnx", tmp_path / "dirty.onnx"
    onnx.save(residual_block(False, True), str(clean))
    onnx.save(residual_block(True, True), str(dirty))
    assert main(["lint", str(clean), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "qdeploy.lint/1" and report["verdict"] == "clean" and report["by"] == "static analysis"
    assert main(["lint", str(dirty)]) == 1
    out = capsys.readouterr().out
    assert "QD001 residual-add-conv-path-qdq" in out and "costs-reformat" in out
    assert main(["lint", str(dirty), "--fix", str(tmp_path / "fixed.onnx")]) == 0
    assert "fixed: QD001 ×1" in capsys.readouterr().out
    assert main(["lint", str(dirty), "--fix", str(dirty)]) == 2  # never overwrite the input


def linear_through_transpose(axis: int):
    """ModelOpt's Linear on a 3-D tensor: W (out, in) -> Q -> DQ (per channel along ``axis``) -> Transpose -> MatMul."""
    n = Net()
    tokens = n.node("Reshape", [n.node("Relu", ["x"]), n.const(np.array([1, C, 64], np.int64))])
    x = n.node("Transpose", [tokens], perm=[0, 2, 1])                       # (1, 64 tokens, C)
    w_t = n.node("Transpose", [n.weight((10, C), axis=axis)], perm=[1, 0])  # (C, 10)
    return n.model(n.node("MatMul", [n.qdq(x), w_t], name="fc"))


def test_qd016_follows_the_weight_axis_through_a_transpose():
    """Axis 0 of W (out, in) is the output-channel axis 1 of the MatMul's (in, out) weight after the Transpose that
    TensorRT folds: clean. Per-channel along the input axis is still caught."""
    good = linear_through_transpose(0)
    assert "QD016" not in rules_of(good) and "QD011" not in rules_of(good)
    assert "QD016" in rules_of(linear_through_transpose(1))
