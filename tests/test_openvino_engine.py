"""engine: openvino (issue #23 item 2), with real OpenVINO and real ONNX files: the capability table, one engine against
ONNX Runtime on a small hand-built ONNX (fast), and a whole `qdeploy run` of FP32, INT8 and FP16 variants beside the
matching ONNX Runtime ones on real image folders (slow)."""
from pathlib import Path

import numpy as np
import onnx
import openvino as ov
import pytest
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper
from PIL import Image

from qdeploy import api
from qdeploy.artifacts import Artifact, ArtifactKind
from qdeploy.config import VariantSpec
from qdeploy.engines import create_engine, engine_table, resolve_variant
from qdeploy.engines.openvino_engine import OpenVinoEngine, cpu_capabilities
from qdeploy.errors import ConfigError, VariantUnavailable

from conftest import TINY_MODEL


def _onnx(path: Path, batch="n", seed=0) -> Path:
    """conv 3→8 → relu → global average pool → gemm 8→3: a real, small float ONNX (opset 17), batch dim ``batch``."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b")
    fw = numpy_helper.from_array(rng.normal(0, 0.5, (3, 8)).astype(np.float32), "fw")
    fb = numpy_helper.from_array(np.zeros(3, np.float32), "fb")
    nodes = [oh.make_node("Conv", ["input", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["r"]),
             oh.make_node("GlobalAveragePool", ["r"], ["p"]),
             oh.make_node("Flatten", ["p"], ["f"]),
             oh.make_node("Gemm", ["f", "fw", "fb"], ["output"], transB=1)]
    graph = oh.make_graph(nodes, "tiny", [oh.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, 8, 8])],
                          [oh.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 3])], [w, b, fw, fb])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _engine(spec: VariantSpec, path: Path, kind=ArtifactKind.ONNX_FP32):
    engine = create_engine(resolve_variant(spec, 0), Artifact(kind, "f" * 20, "test", path=path, opset=17))
    engine.load()
    return engine


# ------------------------------------------------------------------------------------------------------------ fast
def test_doctor_lists_openvino_with_version_and_capabilities():
    rows = [r for r in engine_table() if r["engine"] == "openvino"]
    assert len(rows) == 1 and rows[0]["device"] == "cpu" and rows[0]["usable"] is True
    assert ov.__version__.split("-")[0] in rows[0]["note"] and "FP32" in rows[0]["note"]
    assert {"fp32", "int8"} <= set(rows[0]["precisions"])


def test_config_validation_from_the_capability_table():
    # engine openvino's INT8 is its own placement (NNCF's INT8 IR) unless the variant names another
    v = resolve_variant(VariantSpec(engine="openvino", precision="int8", performance_hint="throughput"), 0)
    assert v.label == "openvino-int8-ov-mean-minmax-hint-throughput" and v.int8.placement == "openvino"
    assert v.artifact_request().kind == ArtifactKind.OPENVINO_IR_INT8 and v.artifact_request().int8 == v.int8
    qdq = resolve_variant(VariantSpec(engine="openvino", precision="int8", placement="onnxruntime"), 0)
    assert qdq.label == "openvino-int8-mean-minmax" and qdq.artifact_request().kind == ArtifactKind.ONNX_INT8
    # the float precisions compile the FP32 IR; INT8 of OpenVINO's own placement is NNCF's INT8 IR
    assert resolve_variant(VariantSpec(engine="openvino", precision="fp16"), 0).artifact_request().kind == ArtifactKind.OPENVINO_IR
    own = resolve_variant(VariantSpec(engine="openvino", precision="int8", int8={"placement": "openvino"}), 0)
    assert own.artifact_request().kind == ArtifactKind.OPENVINO_IR_INT8
    with pytest.raises(ConfigError, match="runs on cpu"):
        resolve_variant(VariantSpec(engine="openvino", device="cuda"), 0)
    assert resolve_variant(VariantSpec(engine="openvino", precision="bf16"), 0).artifact_request().kind == ArtifactKind.OPENVINO_IR
    with pytest.raises(ConfigError, match="performance_hint"):
        resolve_variant(VariantSpec(engine="openvino", performanc_hint="latency"), 0)


def test_each_compile_setting_has_its_own_cache_folder():
    """OpenVINO 2026.4.1's cache key leaves the precision hint out (an f32 blob loaded under a bf16 hint crashed): each
    hint, performance hint and thread count gets its own CACHE_DIR."""
    from qdeploy.engines.openvino_engine import compile_config

    dirs = {compile_config("int8", t, fp, cache_dir="ir/compile-cache")["CACHE_DIR"]
            for t in (None, 4) for fp in ("f32", "bf16")}
    assert len(dirs) == 4 and all(d.startswith("ir/compile-cache/") for d in dirs)
    assert "CACHE_DIR" not in compile_config("fp32")


def test_fp16_runs_only_where_the_cpu_lists_fp16():
    caps = cpu_capabilities()
    variant = resolve_variant(VariantSpec(engine="openvino", precision="fp16"), 0)
    if "FP16" in caps:
        OpenVinoEngine.check(variant, has_torch=False)
    else:
        with pytest.raises(VariantUnavailable, match="OPTIMIZATION_CAPABILITIES") as e:
            OpenVinoEngine.check(variant, has_torch=False)
        assert ", ".join(caps) in str(e.value) and "FP16" in str(e.value)
    OpenVinoEngine.check(resolve_variant(VariantSpec(engine="openvino"), 0), has_torch=False)  # fp32: always


def test_bf16_runs_only_where_the_cpu_lists_bf16_and_then_computes_in_bf16(tmp_path):
    """OpenVINO BF16 (AMX-BF16 / AVX512-BF16) as a candidate that needs no calibration, never picked on a CPU without
    native BF16: there the variant is refused with the CPU's capability list."""
    caps = cpu_capabilities()
    variant = resolve_variant(VariantSpec(engine="openvino", precision="bf16"), 0)
    if "BF16" not in caps:
        with pytest.raises(VariantUnavailable, match="OPTIMIZATION_CAPABILITIES") as e:
            OpenVinoEngine.check(variant, has_torch=False)
        assert ", ".join(caps) in str(e.value) and "BF16" in str(e.value)
        from qdeploy.optimize.candidates import engine_floats
        assert "bf16" not in engine_floats("openvino")
        pytest.skip(f"this CPU does not run BF16 natively (OpenVINO capabilities {', '.join(caps)}): refusal checked")
    OpenVinoEngine.check(variant, has_torch=False)
    path = _onnx(tmp_path / "m.onnx")
    x = np.random.default_rng(1).normal(0, 1, (5, 3, 8, 8)).astype(np.float32)
    bf16 = _engine(VariantSpec(engine="openvino", precision="bf16", threads=1), path)
    ort = _engine(VariantSpec(engine="onnxruntime", threads=1), path)
    try:
        y, ref = bf16.infer(x), ort.infer(x)
        d = bf16.describe()
        assert d["precision_hint"] == "bf16"
        # bfloat16 keeps 8 bits of mantissa: close to FP32, but not equal to it (it did compute in BF16)
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert 0 < err < 0.05, err
    finally:
        bf16.close()
        ort.close()


def test_fp32_matches_onnxruntime_and_honours_threads(tmp_path):
    path = _onnx(tmp_path / "m.onnx")
    x = np.random.default_rng(1).normal(0, 1, (5, 3, 8, 8)).astype(np.float32)
    ovo = _engine(VariantSpec(engine="openvino", threads=1), path)
    ort = _engine(VariantSpec(engine="onnxruntime", threads=1), path)
    try:
        y, ref = ovo.infer(x), ort.infer(x)
        assert y.dtype == np.float32 and y.shape == (5, 3)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
        assert ovo.infer(x[:2]).shape == (2, 3)  # dynamic batch: another size, same compiled model
        step = ovo.prepare_timed(x)
        step()
        d = ovo.describe()
        assert d["threads"] == 1 and d["precision_hint"] == "f32" and d["performance_hint"] == "latency"
        assert d["device_name"] and d["openvino"] == ov.__version__ and d["input_shape"] == "[?,3,8,8]"
        assert d["compute_layer_precisions"]["Convolution"] == {"f32": 1}
    finally:
        ovo.close()
        ort.close()


def test_static_batch_input_is_read_as_it_is(tmp_path):
    path = _onnx(tmp_path / "static.onnx", batch=1)
    engine = _engine(VariantSpec(engine="openvino"), path)
    try:
        assert engine.describe()["input_shape"] == "[1,3,8,8]"
        assert engine.infer(np.zeros((1, 3, 8, 8), np.float32)).shape == (1, 3)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------------------------ slow
def _color_folder(root: Path, seed: int, per_class: int) -> Path:
    """Image folders whose images differ (a random colour each, plus noise), so that a random-weight model's
    predictions differ between images and agreement is not trivially 100 %."""
    rng = np.random.default_rng(seed)
    for c in ("a", "b", "c"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            base = rng.integers(0, 256, 3)
            arr = np.clip(base + rng.normal(0, 40, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.png")
    return root


def _images(root: Path) -> np.ndarray:
    """Every image of ``root`` as float32 NCHW, normalised as the config says ((x/255 - 0.5) / 0.25)."""
    files = sorted(root.glob("*/*.png"))
    x = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files]).transpose(0, 3, 1, 2)
    return ((x.astype(np.float32) / 255 - 0.5) / 0.25).astype(np.float32)


def _tiny_run_config(tmp_path: Path, variants: list, eval_per_class: int, calib_per_class: int, bench: dict) -> dict:
    """tiny_res on colour folders (eval, calibration: every calibration image), 16x16, with ``variants``."""
    (tmp_path / "tiny_model.py").write_text(TINY_MODEL)
    evalset = _color_folder(tmp_path / "eval", seed=1, per_class=eval_per_class)
    calib = _color_folder(tmp_path / "calib", seed=2, per_class=calib_per_class)
    return {
        "model": {"source": f"{tmp_path / 'tiny_model.py'}:tiny_res",
                  "preprocess": {"input_size": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3}},
        "data": {"eval": {"root": str(evalset), "workers": 0, "batch_size": 8},
                 "calibration": {"root": str(calib), "workers": 0, "batch_size": 8, "count": 3 * calib_per_class,
                                 "seed": 0}},
        "variants": variants, "eval": {"reference": "onnxruntime-fp32"}, "bench": bench,
    }


@pytest.mark.slow
def test_run_openvino_beside_onnxruntime(tmp_path):
    cfg = _tiny_run_config(tmp_path, [
        {"engine": "onnxruntime"}, {"engine": "openvino"}, {"engine": "openvino", "threads": 1, "name": "openvino-1-thread"},
        {"engine": "onnxruntime", "precision": "int8"},
        {"engine": "openvino", "precision": "int8", "placement": "onnxruntime"},
        {"engine": "openvino", "precision": "fp16"}], 30, 10, {"batch_sizes": [1, 8], "warmup": 2, "iterations": 10})
    evalset = tmp_path / "eval"
    out = tmp_path / "out"
    results = api.run(cfg, out, cache_dir=tmp_path / "cache")
    by = {v["name"]: v for v in results["variants"]}
    ort32, ov32, ov1 = by["onnxruntime-fp32"], by["openvino-fp32"], by["openvino-1-thread"]
    ort8, ov8, ov16 = by["onnxruntime-int8-mean-minmax"], by["openvino-int8-mean-minmax"], by["openvino-fp16"]
    for v in (ort32, ov32, ov1, ort8, ov8):
        assert v["status"] == "ok", (v["name"], v["reason"])
    for v in (ov32, ov1, ov8):
        assert all(lat["p50"] > 0 for lat in v["latency_ms"].values()) and set(v["latency_ms"]) == {"1", "8"}
        assert v["details"]["precision_hint"] == "f32" and v["details"]["openvino"] == ov.__version__
    assert ov32["agreement"] >= 0.99 and ov1["agreement"] >= 0.99
    assert ov32["metrics"]["top1"] == pytest.approx(ort32["metrics"]["top1"], abs=0.01)
    assert ov1["details"]["threads"] == 1 and ov32["details"]["threads"] >= 1
    # OpenVINO ran the Q/DQ layers with its INT8 kernels (u8/i8 runtime precision), not in float
    int8_layers = ov8["details"]["compute_layer_precisions"]
    assert any(p in ("u8", "i8") for counts in int8_layers.values() for p in counts), int8_layers
    assert ov8["details"]["artifact"] == ort8["details"]["artifact"] == "onnxruntime-int8-mean-minmax.onnx"
    if "FP16" in cpu_capabilities():
        assert ov16["status"] == "ok" and ov16["details"]["precision_hint"] == "f16"
    else:
        assert ov16["status"] == "skipped" and "OPTIMIZATION_CAPABILITIES" in ov16["reason"]
        assert ", ".join(cpu_capabilities()) in ov16["reason"]

    # the same files, engine against engine, on the evaluation images: FP32 logits, INT8 predictions
    x = _images(evalset)
    pairs = {}
    for precision, kind, name in (("fp32", ArtifactKind.ONNX_FP32, "model.onnx"),
                                  ("int8", ArtifactKind.ONNX_INT8, "onnxruntime-int8-mean-minmax.onnx")):
        logits = []
        for engine_name in ("onnxruntime", "openvino"):
            e = _engine(VariantSpec(engine=engine_name, precision=precision), out / name, kind)
            try:
                logits.append(np.concatenate([e.infer(x[i:i + 8]) for i in range(0, len(x), 8)]))
            finally:
                e.close()
        pairs[precision] = logits
    ort_fp32, ov_fp32 = pairs["fp32"]
    assert len(set(ort_fp32.argmax(1))) > 1, "the test images should not all get one class"
    np.testing.assert_allclose(ov_fp32, ort_fp32, rtol=1e-4, atol=1e-4 * np.abs(ort_fp32).max())
    assert (ov_fp32.argmax(1) == ort_fp32.argmax(1)).mean() >= 0.99
    ort_int8, ov_int8 = pairs["int8"]
    assert (ov_int8.argmax(1) == ort_int8.argmax(1)).mean() >= 0.8
    spread = np.abs(ort_fp32).max()
    assert np.abs(ov_int8 - ort_int8).max() < 0.25 * spread  # same quantized model, different INT8 kernels


def test_the_tensorrt_placement_is_refused_on_openvino_with_the_measured_reason():
    from qdeploy.config import VariantSpec
    from qdeploy.engines.base import resolve_variant
    from qdeploy.errors import VariantUnavailable

    v = resolve_variant(VariantSpec.model_validate({"engine": "openvino", "precision": "int8", "placement": "tensorrt"}), 0)
    with pytest.raises(VariantUnavailable, match="placement tensorrt is TensorRT's Q/DQ, placed for TensorRT's "
                                                 "fusions.*use placement onnxruntime or openvino"):
        v.engine.check(v, True)
    ok = resolve_variant(VariantSpec.model_validate({"engine": "openvino", "precision": "int8"}), 0)
    ok.engine.check(ok, True)
    assert ok.int8.placement == "openvino"


def _int8_activations_qdq(path: Path, seed=0) -> Path:
    """_onnx's network as Q/DQ with signed int8 activations (zero point 0, as NNCF's and TensorRT's placements make
    them) and int8 per-channel weights."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32)
    w_scale = np.abs(w).reshape(8, -1).max(1) / 127
    inits = [numpy_helper.from_array(np.round(w / w_scale[:, None, None, None]).astype(np.int8), "wq"),
             numpy_helper.from_array(w_scale.astype(np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(8, np.int8), "w_zp"),
             numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.normal(0, 0.5, (3, 8)).astype(np.float32), "fw"),
             numpy_helper.from_array(np.zeros(3, np.float32), "fb"),
             numpy_helper.from_array(np.float32(3.0 / 127), "x_scale"),
             numpy_helper.from_array(np.int8(0), "x_zp"),  # shared by Q and DQ, as NNCF writes it
             numpy_helper.from_array(np.float32(6.0 / 127), "r_scale"),
             numpy_helper.from_array(np.int8(0), "r_zp_q"),
             numpy_helper.from_array(np.int8(0), "r_zp_dq")]
    nodes = [oh.make_node("QuantizeLinear", ["input", "x_scale", "x_zp"], ["xq"]),
             oh.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
             oh.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], axis=0),
             oh.make_node("Conv", ["xd", "wd", "b"], ["c"], pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["r"]),
             oh.make_node("QuantizeLinear", ["r", "r_scale", "r_zp_q"], ["rq"]),
             oh.make_node("DequantizeLinear", ["rq", "r_scale", "r_zp_dq"], ["rd"]),
             oh.make_node("GlobalAveragePool", ["rd"], ["p"]),
             oh.make_node("Flatten", ["p"], ["f"]),
             oh.make_node("Gemm", ["f", "fw", "fb"], ["output"], transB=1)]
    graph = oh.make_graph(nodes, "tiny-qdq", [oh.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 8, 8])],
                          [oh.make_tensor_value_info("output", TensorProto.FLOAT, ["n", 3])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _ort_reference(model, x: np.ndarray) -> np.ndarray:
    """ONNX Runtime with graph optimizations off: the Q/DQ nodes as the ONNX spec defines them, no fused kernels."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"input": x})[0]


def test_signed_int8_activations_are_read_as_uint8_exactly(tmp_path):
    """OpenVINO runs Q/DQ ONNX with signed int8 activations wrong (NNCF's MobileViT-XXS: 26.4 % top-1 vs 84.6 % in
    ONNX Runtime); the engine reads them as uint8 with the zero point + 128, the same grid: spec-exact outputs equal."""
    from qdeploy.engines.openvino_engine import signed_activations_as_uint8
    from qdeploy.utils.hashing import sha256_file

    path = _int8_activations_qdq(tmp_path / "s8.onnx")
    before = sha256_file(path)
    x = np.random.default_rng(2).normal(0, 1.5, (6, 3, 8, 8)).astype(np.float32)  # beyond ±3: saturates both ways
    model = onnx.load(str(path))
    ref = _ort_reference(model, x)
    assert signed_activations_as_uint8(model) == 2
    onnx.checker.check_model(model)
    zps = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if "zp" in t.name}
    q_nodes = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert all(zps[n.input[2]].dtype == np.uint8 and zps[n.input[2]].ravel()[0] == 128 for n in q_nodes)
    assert zps["w_zp"].dtype == np.int8  # weights stay int8
    assert "x_zp" not in zps and "r_zp_q" not in zps  # the replaced int8 zero points are gone
    np.testing.assert_array_equal(_ort_reference(model, x), ref)  # one grid: bit-identical dequantized values

    engine = _engine(VariantSpec(engine="openvino", precision="int8"), path, kind=ArtifactKind.ONNX_INT8)
    try:
        np.testing.assert_allclose(engine.infer(x), ref, atol=0.05)  # OpenVINO's own INT8 kernels: a step or so
        assert engine.describe()["int8_activations_read_as_uint8"] == 2
    finally:
        engine.close()
    assert sha256_file(path) == before  # the artifact itself is untouched


def _constant_operand_qdq(path: Path) -> Path:
    """Conv -> ``* 0.25`` -> ``+ bias`` -> Conv as ONNX Runtime's placement writes it: both inputs of Mul and Add
    quantized, the constant's as QuantizeLinear(float constant) (ONNX Runtime 1.30) or as a quantized initializer (1.32)."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.5, (4, 3, 3, 3)).astype(np.float32)
    # 7-bit weights (|q| <= 63): on a CPU without VNNI (AVX2, AVX-512 without VNNI) OpenVINO's INT8 conv adds u8 x s8
    # pairs in 16 bits (vpmaddubsw), which saturates for full-range activations (zero point 128) and weights (2 x 255 x
    # 127 > 32767; on an AVX2-only CPU 7 % of outputs come out off by up to 0.72). That is the CPU's arithmetic, not the
    # folding tested here, and qdeploy's own ONNX Runtime-placement files are 7-bit on such CPUs for the same reason
    # (facts/onnxruntime.u8s8_saturates); 2 x 255 x 63 fits, so the comparison below holds on every CPU
    w_scale = (np.abs(w).reshape(4, -1).max(1) / 63).astype(np.float32)
    bias = rng.normal(0, 0.3, (1, 4, 1, 1)).astype(np.float32)
    b_scale = np.float32(np.abs(bias).max() / 255)
    inits = [numpy_helper.from_array(np.round(w / w_scale[:, None, None, None]).astype(np.int8), "wq"),
             numpy_helper.from_array(w_scale, "w_scale"), numpy_helper.from_array(np.zeros(4, np.int8), "w_zp"),
             numpy_helper.from_array(np.float32(0.25), "k"), numpy_helper.from_array(np.float32(1 / 255), "k_scale"),
             numpy_helper.from_array(np.uint8(0), "k_zp"),
             numpy_helper.from_array(np.round(bias / b_scale).astype(np.uint8) + np.uint8(128), "bq"),
             numpy_helper.from_array(b_scale, "b_scale"), numpy_helper.from_array(np.uint8(128), "b_zp"),
             numpy_helper.from_array(np.float32(4.0 / 255), "s"), numpy_helper.from_array(np.uint8(128), "z")]
    qdq = lambda x, tag: [oh.make_node("QuantizeLinear", [x, "s", "z"], [f"{tag}q"]),  # noqa: E731
                          oh.make_node("DequantizeLinear", [f"{tag}q", "s", "z"], [f"{tag}d"])]
    nodes = [*qdq("input", "x"), oh.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], axis=0),
             oh.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1]), *qdq("c", "c"),
             oh.make_node("QuantizeLinear", ["k", "k_scale", "k_zp"], ["kq"]),  # 1.30: Q of the float constant
             oh.make_node("DequantizeLinear", ["kq", "k_scale", "k_zp"], ["kd"]),
             oh.make_node("Mul", ["cd", "kd"], ["m"]), *qdq("m", "m"),
             oh.make_node("DequantizeLinear", ["bq", "b_scale", "b_zp"], ["bd"]),  # 1.32: the quantized initializer
             oh.make_node("Add", ["md", "bd"], ["output"])]
    graph = oh.make_graph(nodes, "const-operand-qdq", [oh.make_tensor_value_info("input", TensorProto.FLOAT, ["n", 3, 8, 8])],
                          [oh.make_tensor_value_info("output", TensorProto.FLOAT, ["n", 4, 8, 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_constant_operands_of_add_and_mul_are_dequantized_ahead_exactly(tmp_path):
    """OpenVINO 2026.4.1's low-precision transformations throw ("index '0' out of range") on Mul/Add whose constant
    operand is a DequantizeLinear (ONNX Runtime's placement of LeViT, Swin, MobileOne...): the engine reads those
    operands as the float constants they compute; spec-exact outputs stay equal and the weights keep their Q/DQ."""
    from qdeploy.engines.openvino_engine import constant_dequantize_folded

    path = _constant_operand_qdq(tmp_path / "c.onnx")
    x = np.random.default_rng(4).normal(0, 1.5, (2, 3, 8, 8)).astype(np.float32)
    model = onnx.load(str(path))
    ref = _ort_reference(model, x)
    assert constant_dequantize_folded(model) == 2
    onnx.checker.check_model(model)
    kinds = [n.op_type for n in model.graph.node]
    assert kinds.count("DequantizeLinear") == 4 and kinds.count("QuantizeLinear") == 3  # x, c, m and the weight
    folded = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert folded["kd"] == np.float32(np.round(0.25 * 255) / 255)  # the quantized constant, not the float 0.25
    assert "kq" not in folded and "bq" not in folded and "k" not in folded  # the originals are gone
    np.testing.assert_array_equal(_ort_reference(model, x), ref)

    engine = _engine(VariantSpec(engine="openvino", precision="int8"), path, kind=ArtifactKind.ONNX_INT8)
    try:
        np.testing.assert_allclose(engine.infer(x), ref, atol=0.1)
        assert engine.describe()["constant_dequantize_folded"] == 2
    finally:
        engine.close()


def test_an_int8_graph_openvino_cannot_compile_is_refused_not_a_crash(tmp_path):
    """OpenVINO 2026.4.1 segfaults compiling Swin's Q/DQ ONNX: INT8 artifacts are compiled in a child process first,
    so that a native crash becomes a refused variant instead of the end of the qdeploy process."""
    from qdeploy.engines.openvino_engine import compile_crash

    good = _int8_activations_qdq(tmp_path / "good.onnx")
    assert compile_crash(good, {"INFERENCE_NUM_THREADS": 1}) is None
    bad = tmp_path / "bad.onnx"
    model = onnx.load(str(good))
    model.graph.node[3].input[1] = "no_such_tensor"  # the Conv's weight: OpenVINO refuses the graph
    onnx.save(model, str(bad))
    got = compile_crash(bad, {"INFERENCE_NUM_THREADS": 1})
    assert got is not None and got.startswith("failed (") and "no_such_tensor" in got
    with pytest.raises(VariantUnavailable, match=r"OpenVINO .* failed .* bad.onnx on the CPU \(tried in a child "
                                                 r"process\); this INT8 graph is not runnable in OpenVINO here"):
        _engine(VariantSpec(engine="openvino", precision="int8"), bad, kind=ArtifactKind.ONNX_INT8)


def test_per_layer_counters_compare_int8_with_fp32_per_op_class(tmp_path):
    """OpenVINO's per-layer counters (PERF_COUNT) in benchmark/op_profile's record: the Q/DQ network's conv ran an
    INT8 kernel, and its time sits in the same op class as the FP32 network's conv."""
    from qdeploy.benchmark.op_profile import int8_cost_by_op_class, profile_openvino, summary_line

    fp32, int8 = _onnx(tmp_path / "f.onnx"), _int8_activations_qdq(tmp_path / "q.onnx")
    x = np.random.default_rng(3).normal(0, 1, (4, 3, 8, 8)).astype(np.float32)
    rec = profile_openvino(int8, x, runs=3, warmup=1, threads=1)
    conv = [n for n in rec["nodes"] if n["op"] == "Convolution"]
    assert rec["engine"] == "openvino" and rec["threads"] == 1 and rec["runs"] == 3 and rec["p50_ms"] > 0
    assert conv and all("I8" in n["exec"] or "u8" in n["exec"].lower() for n in conv), conv
    cmp = int8_cost_by_op_class(fp32, int8, x, runs=3, threads=1, engine="openvino")
    rows = {r["op_class"]: r for r in cmp["classes"]}
    assert cmp["engine"] == "openvino" and cmp["batch_size"] == 4
    assert rows["Conv"]["fp32_us"] > 0 and rows["Conv"]["int8_us"] > 0 and rows["Conv"]["int8_ops"] == ["Convolution"]
    assert "OpenVINO per-layer counters" in summary_line(cmp) or "no op class costs more" in summary_line(cmp)


@pytest.mark.slow  # a subprocess or a whole pipeline
def test_missing_openvino_leaves_qdeploy_importable_and_the_engine_unusable():
    """An image without openvino (the GPU machine has none) still imports qdeploy; doctor and a variant say why."""
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['openvino'] = None\n"  # `import openvino` raises ImportError, as when it is absent
        "from qdeploy import api\n"
        "from qdeploy.engines.openvino_engine import OpenVinoEngine\n"
        "from qdeploy.errors import VariantUnavailable\n"
        "row, = OpenVinoEngine.probe()\n"
        "assert row['usable'] is False and 'openvino is not installed' in row['note'], row\n"
        "from qdeploy.engines.openvino_engine import core\n"
        "try:\n"
        "    core(); raise SystemExit('core() ran without openvino')\n"
        "except VariantUnavailable as e:\n"
        "    assert 'openvino is not installed' in str(e)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_target_cpu_plans_a_bf16_candidate_exactly_where_the_cpu_runs_bf16_and_says_how_to_deploy_it():
    """optimize --target cpu weighs OpenVINO BF16 (no calibration) beside FP32 and INT8 on CPUs with native
    BF16, never elsewhere; the chosen BF16 answer is the FP32 ONNX, so optimize.json says the compile call that makes it
    BF16 (and FP32/INT8 say f32: the plugin's default would be bf16 on such a CPU)."""
    from qdeploy.config import OptimizeConfig
    from qdeploy.engines.openvino_engine import deploy_line
    from qdeploy.optimize.candidates import TARGETS, EngineCandidate, plan

    names = [c.variant for c in plan(OptimizeConfig(target="cpu"), TARGETS["cpu"])]
    assert "openvino-fp32" in names
    assert ("openvino-bf16" in names) == ("BF16" in cpu_capabilities())
    assert ("openvino-fp16" in names) == ("FP16" in cpu_capabilities())
    bf16 = EngineCandidate.planned_float(TARGETS["cpu"], "openvino", "bf16")
    assert bf16.deploy("model.onnx") == deploy_line("model.onnx", "bf16")
    assert "'INFERENCE_PRECISION_HINT': 'bf16'" in bf16.deploy("model.onnx")
    assert "'INFERENCE_PRECISION_HINT': 'f32'" in deploy_line("int8.onnx", "int8", threads=4)
    assert "'INFERENCE_NUM_THREADS': 4" in deploy_line("int8.onnx", "int8", threads=4)
    assert EngineCandidate.planned_float(TARGETS["cpu"], "onnxruntime", "fp32").deploy("model.onnx") is None


def test_an_int8_models_float_layers_run_in_bf16_only_where_asked_and_where_the_cpu_runs_bf16(tmp_path, monkeypatch):
    """OpenVINO INT8 with its float layers (here the Gemm after the pooled Q/DQ conv) in BF16, as the CPU
    plugin runs an INT8 model by default on an AMX/AVX512-BF16 CPU: an option of INT8 variants only, planned by
    optimize beside the f32-hinted NNCF candidate, refused on a CPU without native BF16 with its capability list."""
    import qdeploy.engines.openvino_engine as ove
    from qdeploy.optimize.candidates import TARGETS, EngineCandidate

    with pytest.raises(ConfigError, match="float_precision: only for precision int8"):
        resolve_variant(VariantSpec(engine="openvino", precision="bf16", float_precision="bf16"), 0)
    with pytest.raises(ConfigError, match="float_precision"):
        resolve_variant(VariantSpec(engine="openvino", precision="int8", float_precision="fp16"), 0)
    spec = VariantSpec(engine="openvino", precision="int8", placement="openvino", quantizer="nncf", float_precision="bf16")
    assert resolve_variant(spec, 0).label.endswith("-float-bf16")
    cand = EngineCandidate.planned_own_placement(TARGETS["cpu"], "openvino", float_precision="bf16")
    assert cand.variant == "openvino-int8-mean-minmax-nncf-bf16" and "float layers in BF16" in cand.describe()
    assert "'INFERENCE_PRECISION_HINT': 'bf16'" in cand.deploy("int8.onnx")
    assert resolve_variant(VariantSpec.model_validate(cand.spec), 0).options.float_precision == "bf16"
    assert "float_precision" not in EngineCandidate.planned_own_placement(TARGETS["cpu"], "openvino").spec

    path = _int8_activations_qdq(tmp_path / "q.onnx")
    x = np.random.default_rng(3).normal(0, 1, (5, 3, 8, 8)).astype(np.float32)
    bf16_spec = VariantSpec(engine="openvino", precision="int8", threads=1, float_precision="bf16")
    caps = cpu_capabilities()
    monkeypatch.setattr(ove, "cpu_capabilities", lambda: [c for c in caps if c != "BF16"])
    with pytest.raises(VariantUnavailable, match="float_precision bf16: .*OPTIMIZATION_CAPABILITIES"):
        OpenVinoEngine.check(resolve_variant(bf16_spec, 0), has_torch=False)
    monkeypatch.undo()
    if "BF16" not in caps:
        pytest.skip(f"this CPU does not run BF16 natively (OpenVINO capabilities {', '.join(caps)}): refusal checked")
    f32 = _engine(VariantSpec(engine="openvino", precision="int8", threads=1), path, ArtifactKind.ONNX_INT8)
    bf16 = _engine(bf16_spec, path, ArtifactKind.ONNX_INT8)
    try:
        y, ref = bf16.infer(x), f32.infer(x)
        assert bf16.describe()["precision_hint"] == "bf16" and f32.describe()["precision_hint"] == "f32"
        assert bf16.describe()["compute_layer_precisions"]["Convolution"] == {"u8": 1}  # the conv stays INT8
        err = np.abs(y - ref).max() / np.abs(ref).max()
        assert 0 < err < 0.05, err  # the float Gemm computed in bfloat16: close, not equal
    finally:
        bf16.close()
        f32.close()


@pytest.mark.slow
def test_openvino_ir_variants_are_deployable_from_out(tmp_path):
    """FP32 and BF16 compile the FP32 IR (FP32 weights in its .bin, the f32 hint read back), INT8 of OpenVINO's own
    placement is NNCF's INT8 IR; both land in --out as model.xml + model.bin, and the report's one-line deploy snippet,
    run from --out, gives the variant's outputs, with a compile cache that a second compile reuses."""
    import json
    import subprocess
    import sys

    cfg = _tiny_run_config(tmp_path, [
        {"engine": "onnxruntime"}, {"engine": "openvino"},
        {"engine": "openvino", "precision": "int8", "int8": {"placement": "openvino"}}]
        # the same INT8 IR compiled again with its float layers in BF16 (a second compile setting on one IR)
        + ([{"engine": "openvino", "precision": "int8", "float_precision": "bf16"}] if "BF16" in cpu_capabilities() else []),
        20, 8, {"batch_sizes": [1], "warmup": 2, "iterations": 5})
    evalset = tmp_path / "eval"
    out = tmp_path / "out"
    results = api.run(cfg, out, cache_dir=tmp_path / "cache")
    by = {v["name"]: v for v in results["variants"]}
    ov32, ov8 = by["openvino-fp32"], by["openvino-int8-ov-mean-minmax"]
    assert all(v["status"] == "ok" for v in by.values()), {v["name"]: v["reason"] for v in by.values()}
    assert ov32["details"]["artifact"] == "openvino-ir/model.xml"
    assert ov8["details"]["artifact"] == "openvino-int8-ov-mean-minmax/model.xml"
    assert ov32["details"]["ir_route"] in ("onnx", "pytorch") and ov32["details"]["precision_hint"] == "f32"
    assert ov32["agreement"] >= 0.99 and ov8["agreement"] >= 0.8
    int8_layers = ov8["details"]["compute_layer_precisions"]
    assert any(p in ("u8", "i8") for counts in int8_layers.values() for p in counts), int8_layers
    # FP32 weights stay FP32 in the .bin (openvino.save_model's default would have written FP16)
    params = sum(int(np.prod(w.dims)) for w in onnx.load(str(out / "model.onnx")).graph.initializer)
    assert (out / "openvino-ir" / "model.bin").stat().st_size >= 4 * params * 0.9
    files = {a["path"] for a in results["artifacts"]}
    assert {"openvino-ir/model.xml", "openvino-int8-ov-mean-minmax/model.xml"} <= files
    assert all((out / f).is_file() for f in ("openvino-ir/model.bin", "openvino-int8-ov-mean-minmax/model.bin"))

    x = _images(evalset)[:4]
    np.save(tmp_path / "x.npy", x)
    for v in (ov32, ov8):
        line = v["details"]["deploy"]
        assert line.startswith("openvino.Core().compile_model(") and "CACHE_DIR" in line
        script = (f"import numpy as np, openvino\nm = {line}\nx = np.load({str(tmp_path / 'x.npy')!r})\n"
                  "print(__import__('json').dumps(np.asarray(m(x)[0]).tolist()))")
        first = subprocess.run([sys.executable, "-c", script], cwd=out, capture_output=True, text=True, timeout=300)
        assert first.returncode == 0, first.stderr[-2000:]
        blobs = list((out / line.split("'")[1]).parent.joinpath("compile-cache").glob("*"))
        assert blobs, "the deploy line's compile cache was not written"
        own = {"placement": "openvino"} if v["precision"] == "int8" else None
        e = _engine(VariantSpec(engine="openvino", precision=v["precision"], int8=own),
                    out / line.split("'")[1], ArtifactKind.OPENVINO_IR if v["precision"] == "fp32"
                    else ArtifactKind.OPENVINO_IR_INT8)
        try:
            np.testing.assert_allclose(np.array(json.loads(first.stdout)), e.infer(x), rtol=1e-4, atol=1e-4)
        finally:
            e.close()


CEIL_POOL_MODEL = '''
import torch
from torch import nn


class CeilPool(nn.Module):
    """Pools with a kernel larger than its input, in ceil mode (as Hugging Face's EfficientNet pools): OpenVINO's ONNX
    and PyTorch frontends both refuse it. The explicit pad before it (as its "same" padding) leaves ONNX shape inference
    without the pool input's height and width."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(64, ceil_mode=True)  # the 16x16 input is smaller than the kernel
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(self.pad(x)))), 1))


def ceil_pool(num_classes=3):
    torch.manual_seed(0)
    return CeilPool(num_classes)
'''


@pytest.mark.slow
def test_a_pool_window_over_its_whole_input_is_read_as_a_global_pool_by_openvino(tmp_path):
    (tmp_path / "ceil_pool.py").write_text(CEIL_POOL_MODEL)
    cfg = {
        "model": {"source": f"{tmp_path / 'ceil_pool.py'}:ceil_pool",
                  "preprocess": {"input_size": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3}},
        "data": {"eval": {"root": str(_color_folder(tmp_path / "eval", seed=1, per_class=6)), "workers": 0},
                 "calibration": {"root": str(_color_folder(tmp_path / "calib", seed=2, per_class=4)), "workers": 0}},
        "variants": [{"engine": "onnxruntime"}, {"engine": "openvino"}, {"engine": "openvino", "precision": "int8"}],
        "eval": {"reference": "onnxruntime-fp32"},
        "bench": {"enabled": False},
    }
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    by = {v["name"]: v for v in results["variants"]}
    assert all(v["status"] == "ok" for v in by.values()), {v["name"]: v["reason"] for v in by.values()}
    assert by["openvino-fp32"]["details"]["ir_route"] == "onnx" and by["openvino-fp32"]["agreement"] == 1.0
    int8 = by["openvino-int8-ov-mean-minmax"]
    assert "AveragePool-17" in int8["quantization"]["route"]["why"] and "GlobalAveragePool" in int8["quantization"]["route"]["why"]
    assert int8["agreement"] >= 0.9


@pytest.mark.slow
def test_the_pytorch_route_is_timed_beside_the_onnx_route_in_alternating_rounds(tmp_path, monkeypatch):
    """export/openvino_ir._pick_route: both routes of one small CNN timed in rounds, each round's median kept; the
    PyTorch route kept only at ROUTE_MIN_GAIN faster by the median of the rounds; routes whose outputs differ are not
    timed at all (the ONNX route, verified against PyTorch, is kept)."""
    import torch

    from qdeploy.export import openvino_ir

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(8, 3)).eval()
    x = np.random.default_rng(0).random((1, 3, 16, 16), dtype=np.float32)
    path = tmp_path / "net.onnx"
    torch.onnx.export(net, torch.from_numpy(x), str(path), opset_version=17, dynamo=False,
                      input_names=["input"], dynamic_axes={"input": {0: "n"}})
    rounds = []
    timed = openvino_ir._interleaved_ms
    monkeypatch.setattr(openvino_ir, "_interleaved_ms", lambda requests: rounds.append(len(requests)) or timed(requests))
    model, record = openvino_ir._pick_route(ov.convert_model(str(path)), lambda: net, x)
    assert rounds == [2] and record["onnx_ms"] > 0 and record["pytorch_ms"] > 0
    assert record["max_relative_difference"] < openvino_ir.ROUTE_TOLERANCE
    kept_torch = record["pytorch_ms"] < record["onnx_ms"] * (1 - openvino_ir.ROUTE_MIN_GAIN)
    assert ("ran in" in record["why"]) == kept_torch and ("not 5% faster" in record["why"]) != kept_torch

    other = torch.nn.Sequential(*net[:4], torch.nn.Linear(8, 3)).eval()  # another head: other outputs
    model, record = openvino_ir._pick_route(ov.convert_model(str(path)), lambda: other, x)
    assert rounds == [2] and "onnx_ms" not in record and "differ from the ONNX route's" in record["why"]
