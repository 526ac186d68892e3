"""export.fp16: FP16 ONNX whose FP32 islands come from measured activations (TensorRT 11's FP16 = an FP16 ONNX)."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qdeploy.export import fp16


def _model(path, scale=20000.0):
    """x → Conv (weights ·scale: activations far beyond FP16's 65504) → Mul 1/scale → Relu → Conv → y."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * scale).astype(np.float32)
    w2 = (rng.standard_normal((4, 8, 1, 1)) * 0.5).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(np.array(1.0 / scale, np.float32), "s")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="big_conv", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["a", "s"], ["b"], name="rescale"),
             helper.make_node("Relu", ["b"], ["c"], name="relu"),
             helper.make_node("Conv", ["c", "w2"], ["y"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _run(path, x):
    opts = ort.SessionOptions()
    # unfused, as TensorRT would see the tensors (ORT's optimizer would fold the Mul into the conv's weights)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def test_nodes_whose_real_activations_overflow_fp16_stay_fp32(tmp_path):
    src = _model(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    calib = [rng.uniform(0, 1, (4, 3, 16, 16)).astype(np.float32) for _ in range(2)]
    info = fp16.convert_fp16_calibrated(src, tmp_path / "m16.onnx", calib)
    assert [k["node"] for k in info["kept_fp32"]] == ["big_conv"] and info["kept_fp32"][0]["peak"] > fp16.FP16_MAX
    assert info["images"] == 8
    x = rng.uniform(0, 1, (2, 3, 16, 16)).astype(np.float32)
    ref, got = _run(src, x), _run(tmp_path / "m16.onnx", x)
    assert got.dtype == np.float32 and np.isfinite(got).all()  # FP32 I/O kept, no overflow
    assert np.allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    # the rest really is FP16: the head conv's weights are stored as float16
    m16 = onnx.load(str(tmp_path / "m16.onnx"))
    dtypes = {i.name: i.data_type for i in m16.graph.initializer}
    assert dtypes["w2"] == TensorProto.FLOAT16 and dtypes["w1"] == TensorProto.FLOAT


def test_without_measured_peaks_the_overflowing_conv_would_be_fp16(tmp_path):
    """The contrast: with the limit out of reach every node converts, the conv whose real outputs reach 160,000 included
    (its output tensor would be FP16, max 65,504, in a strongly typed TensorRT engine). ONNX Runtime's CPU kernels do
    not reproduce that overflow (measured: finite outputs), so this check is structural."""
    src = _model(tmp_path / "m.onnx")
    x = np.random.default_rng(1).uniform(0, 1, (2, 3, 16, 16)).astype(np.float32)
    assert fp16.activation_peaks(src, [x])["a"] > 2 * fp16.FP16_MAX
    info = fp16.convert_fp16_calibrated(src, tmp_path / "all16.onnx", [x], margin=1e-9)  # limit FP16_MAX / margin: never reached
    assert info["kept_fp32"] == []
    dtypes = {i.name: i.data_type for i in onnx.load(str(tmp_path / "all16.onnx")).graph.initializer}
    assert dtypes["w1"] == TensorProto.FLOAT16


def test_a_model_within_range_converts_entirely(tmp_path):
    src = _model(tmp_path / "m.onnx", scale=1.0)
    x = np.random.default_rng(2).uniform(0, 1, (2, 3, 16, 16)).astype(np.float32)
    info = fp16.convert_fp16_calibrated(src, tmp_path / "m16.onnx", [x])
    assert info["kept_fp32"] == []
    assert np.allclose(_run(tmp_path / "m16.onnx", x), _run(src, x), rtol=1e-2, atol=1e-2)
