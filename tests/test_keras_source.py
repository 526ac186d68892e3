"""Keras sources (issue 24): .keras, legacy .h5 and SavedModel folders converted to one NCHW ONNX, verified against
Keras' own outputs, run by every ONNX engine and both INT8 placements; presets equal keras.applications'
preprocess_input; clear one-line errors. Real TensorFlow (in child processes: tests/keras_models.py writes the models).

CI installs the keras extra and sets QDEPLOY_REQUIRE_KERAS=1: there a missing TensorFlow fails these tests instead of
skipping them."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from qdeploy import api
from qdeploy.cli import main
from qdeploy.config import Preprocess
from qdeploy.data.transforms import normalize
from qdeploy.export import keras as keras_export

from conftest import write_image_folder

HERE = Path(__file__).parent


def _require_keras() -> None:
    problem = keras_export.keras_problem()
    if problem:
        if os.environ.get("QDEPLOY_REQUIRE_KERAS"):
            pytest.fail(f"QDEPLOY_REQUIRE_KERAS is set but {problem}")
        pytest.skip(f"Keras sources need the keras extra: {problem}")


@pytest.fixture(scope="module")
def keras_dir(tmp_path_factory) -> Path:
    _require_keras()
    out = tmp_path_factory.mktemp("keras")
    proc = subprocess.run([sys.executable, str(HERE / "keras_models.py"), str(out)], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def keras_cache(tmp_path_factory) -> Path:
    """One qdeploy cache for the tests that read the same Keras file (convbn.keras, se.keras): each conversion starts
    TensorFlow in a child process, so it is made once. A cache hit still verifies the ONNX against Keras' outputs."""
    return tmp_path_factory.mktemp("keras-cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("images")
    return write_image_folder(root / "eval", size=(8, 8)), write_image_folder(root / "calib", size=(8, 8), seed=1)


def _config(source, folders, variants, preset="keras-tf", **model) -> dict:
    return {"model": {"source": str(source), "preprocess": {"input_size": [8, 8], "preset": preset}, **model},
            "data": {"eval": {"root": str(folders[0]), "batch_size": 6, "workers": 0},
                     "calibration": {"root": str(folders[1]), "batch_size": 6, "workers": 0}},
            "variants": variants, "bench": {"batch_sizes": [2], "warmup": 1, "iterations": 3}}


@pytest.mark.slow
def test_a_keras_file_runs_as_one_nchw_onnx_verified_against_keras_in_every_onnx_engine(tmp_path, keras_dir, folders,
                                                                                         keras_cache):
    variants = [{"engine": "onnxruntime"}, {"engine": "openvino"},
                {"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt"},
                {"engine": "onnxruntime", "precision": "int8", "placement": "onnxruntime"}]
    results = api.run(_config(keras_dir / "convbn.keras", folders, variants), tmp_path / "out", cache_dir=keras_cache)
    assert [v["status"] for v in results["variants"]] == ["ok"] * 4, [v.get("reason") for v in results["variants"]]
    verify = results["model"]["onnx"]["verify"]
    assert verify["reference"] == "Keras" and verify["passed"] and verify["samples"] == 8
    assert verify["max_abs_diff"] <= verify["tolerance"]
    proto = onnx.load(str(tmp_path / "out" / "model.onnx"))
    dims = [d.dim_value or d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims[1:] == [3, 8, 8]  # NCHW: the layout handled once, at conversion
    ops = [n.op_type for n in proto.graph.node]
    assert "Transpose" not in ops  # tf2onnx's inputs_as_nchw pushed the layout through the convs
    assert ops.count("Conv") == 2 and "Mul" not in ops and "Pad" not in ops  # BN of the depthwise conv folded
    fp32 = results["variants"][0]["metrics"]["top1"]
    assert results["variants"][1]["metrics"]["top1"] == fp32  # OpenVINO FP32 on the same graph


@pytest.mark.slow
def test_h5_and_savedmodel_convert_to_the_same_outputs_as_the_keras_file(tmp_path, keras_dir, folders, keras_cache):
    outputs = {}
    for name in ("convbn.keras", "convbn.h5", "convbn_savedmodel"):
        cfg = _config(keras_dir / name, folders, [{"engine": "onnxruntime"}])
        cfg["bench"] = {"enabled": False}
        results = api.run(cfg, tmp_path / name, cache_dir=keras_cache)
        assert results["variants"][0]["status"] == "ok", results["variants"][0].get("reason")
        assert results["model"]["onnx"]["verify"]["passed"]
        sess = ort.InferenceSession(str(tmp_path / name / "model.onnx"), providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).normal(size=(3, 3, 8, 8)).astype(np.float32)
        outputs[name] = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    np.testing.assert_allclose(outputs["convbn.h5"], outputs["convbn.keras"], atol=1e-5)
    np.testing.assert_allclose(outputs["convbn_savedmodel"], outputs["convbn.keras"], atol=1e-5)


@pytest.mark.slow
def test_captured_normalization_constants_become_initializers(tmp_path, keras_dir, folders):
    cfg = _config(keras_dir / "normalization.keras", folders, [{"engine": "onnxruntime"}], preset="keras-none")
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][0]["status"] == "ok" and results["model"]["onnx"]["verify"]["passed"]
    proto = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [i.name for i in proto.graph.input] == ["input"]  # the Normalization mean/variance are not inputs


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["tensorrt", "onnxruntime"])
def test_a_keras_squeeze_excitation_branch_stays_float_through_its_squeeze_and_reshape(tmp_path, keras_dir, folders,
                                                                                          keras_cache, placement):
    """The placement rules read the converted graph: tf2onnx's GlobalAveragePool → Squeeze → Reshape before the SE
    convs is seen through (lint/patterns.py), and the TensorRT lint stays clean."""
    cfg = _config(keras_dir / "se.keras", folders, [{"engine": "onnxruntime", "precision": "int8", "method": "max",
                                                     "placement": placement, "name": "v"}])
    info = api.quantize(cfg, tmp_path / "q", cache_dir=keras_cache)["variants"]["v"]
    assert info["status"] == "ok", info["reason"]
    se = info["excluded_squeeze_excitation"]
    assert any("se_reduce" in n for n in se) and any("se_expand" in n for n in se) and any("se_squeeze" in n for n in se)
    if placement == "tensorrt":
        assert info["lint"]["verdict"] == "clean", info["lint"]
        project = next(o for o in info["structure"]["ops"] if "project" in o["name"])
        assert project["int8_input"] and project["int8_weights"]  # the block's own convs stay INT8


@pytest.mark.slow  # the keras_dir fixture starts TensorFlow
@pytest.mark.parametrize("mode", ["caffe", "tf", "torch"])
def test_presets_equal_keras_applications_preprocess_input(keras_dir, mode):
    pixels = np.load(keras_dir / "pixels.npy")  # uint8 NHWC RGB
    keras_out = np.load(keras_dir / f"{mode}.npy")
    pre = Preprocess(input_size=[8, 8], preset=f"keras-{mode}")
    nchw = pixels.transpose(0, 3, 1, 2)
    if pre.channel_order == "BGR":  # what decoding does (data/transforms.image_to_array)
        nchw = nchw[:, ::-1]
    ours = normalize(np.ascontiguousarray(nchw), pre).transpose(0, 2, 3, 1)
    np.testing.assert_allclose(ours, keras_out, atol=1e-4)


def test_a_bgr_preset_decodes_blue_first(tmp_path):
    from PIL import Image

    from qdeploy.data.transforms import load_image

    arr = np.zeros((4, 4, 3), np.uint8)
    arr[..., 0] = 200  # red
    Image.fromarray(arr).save(tmp_path / "red.png")
    rgb = load_image(tmp_path / "red.png", Preprocess(input_size=[4, 4]))
    bgr = load_image(tmp_path / "red.png", Preprocess(input_size=[4, 4], preset="keras-caffe"))
    assert rgb[0].max() == 200 and bgr[2].max() == 200 and bgr[0].max() == 0


def test_a_preset_with_its_own_values_loads_again_and_contradictions_are_refused():
    pre = Preprocess(input_size=[8, 8], preset="keras-caffe")
    assert Preprocess(**pre.model_dump()) == pre  # results.json's config loads again
    with pytest.raises(ValueError, match="preset keras-tf sets mean, std and channel_order: remove mean"):
        Preprocess(input_size=[8, 8], preset="keras-tf", mean=[0.1, 0.1, 0.1])


def _cli(tmp_path, cfg) -> int:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["--quiet", "run", str(path), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ({"preprocess": {"input_size": [16, 16], "preset": "keras-tf"}},
     "input shape [None, 8, 8, 3] does not take 3-channel 16x16 images: set model.preprocess.input_size"),
    ({"source": "two_outputs.keras"}, "set model.output to an index or one of the names"),
])
def test_keras_model_mismatches_are_one_line_errors(tmp_path, keras_dir, folders, capsys, change, message):
    cfg = _config(keras_dir / "convbn.keras", folders, [{"engine": "onnxruntime"}])
    if "source" in change:
        cfg["model"]["source"] = str(keras_dir / change["source"])
    else:
        cfg["model"].update(change)
    assert _cli(tmp_path, cfg) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_two_outputs_are_chosen_by_model_output(tmp_path, keras_dir, folders):
    cfg = _config(keras_dir / "two_outputs.keras", folders, [{"engine": "onnxruntime"}], output=0)
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert results["variants"][0]["status"] == "ok" and results["model"]["check"]["output_shape"][-1] == 3


def test_keras_source_errors_before_any_work(tmp_path, folders, capsys):
    cfg = _config(tmp_path / "missing.keras", folders, [{"engine": "onnxruntime"}])
    assert _cli(tmp_path, cfg) == 2
    err = capsys.readouterr().err
    assert "missing.keras" in err and "does not exist" in err and "Traceback" not in err
    cfg["model"]["weights"] = "w.pt"
    assert _cli(tmp_path, cfg) == 2
    err = capsys.readouterr().err
    assert "the Keras model" in err and "remove model.weights" in err


def test_a_missing_tensorflow_is_one_line_naming_the_extra(tmp_path, folders, capsys, monkeypatch):
    (tmp_path / "m.keras").write_bytes(b"PK\x03\x04")
    monkeypatch.setattr(keras_export, "keras_problem", lambda: "tensorflow, keras, tf2onnx are not installed "
                                                              f"({keras_export.KERAS_EXTRA})")
    assert _cli(tmp_path, _config(tmp_path / "m.keras", folders, [{"engine": "onnxruntime"}])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'qdeploy[keras]'" in err[0] and "m.keras is a Keras model" in err[0]


@pytest.mark.slow
def test_qat_of_a_keras_model_trains_its_onnx2torch_twin_and_exports_tensorrt_qdq(tmp_path, keras_dir, folders,
                                                                                    keras_cache):
    """Item 3: a Keras model fine-tuned by qdeploy's QAT (onnx2torch module of the verified ONNX, checked equal to
    ONNX Runtime) gives the same TensorRT-placement Q/DQ ONNX, structure report and lint as a PyTorch model."""
    train = write_image_folder(tmp_path / "train", size=(8, 8), per_class=8, seed=5)
    cfg = _config(keras_dir / "convbn.keras", folders,
                  [{"engine": "onnxruntime"},
                   {"engine": "onnxruntime", "precision": "int8", "quantizer": "qat", "placement": "tensorrt", "method": "max"}])
    cfg["data"]["train"] = {"root": str(train), "batch_size": 8, "workers": 0}
    cfg["qat"] = {"objective": "distill", "epochs": 1, "batch_size": 8, "lr": 1e-4, "method": "max"}
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=keras_cache)
    v = results["variants"][1]
    assert v["status"] == "ok", v.get("reason")
    q = v["quantization"]
    assert q["quantizer"] == "qat" and q["placement"] == "tensorrt" and q["qat"]["log"]
    st = q["structure"]
    assert st["compute_ops_int8"] == st["compute_ops"] >= 3  # two convs and the Dense (as a Linear) in INT8
    assert st["residual_add_forms"] == {"fusible": 1}
    assert q["lint"]["verdict"] == "clean", q["lint"]
    assert v["agreement"] >= 0.8  # fine-tuned from the Keras weights: it still predicts what the Keras model does


@pytest.mark.slow
def test_qat_of_a_keras_model_keeps_float_what_ptq_keeps_float(tmp_path, keras_dir, folders, keras_cache):
    """One placement for both quantizers: the SE convs (placement rule) and a node named by ``exclude`` (how
    optimize's fallback keeps a layer float) stay float in QAT of the onnx2torch twin as in the ONNX quantizer's PTQ.
    onnx2torch names modules after ONNX nodes, not PyTorch scopes; before, QAT quantized them all (82/82 on the Keras
    EfficientNet while PTQ kept 36 float)."""
    api.run(_config(keras_dir / "se.keras", folders, [{"engine": "onnxruntime"}]), tmp_path / "fp32", cache_dir=keras_cache)
    graph = onnx.load(str(tmp_path / "fp32" / "model.onnx")).graph
    stem = next(n.name for n in graph.node if n.op_type == "Conv")  # the first conv: the stem (tf2onnx names it Conv__N)
    train = write_image_folder(tmp_path / "train", size=(8, 8), per_class=8, seed=5)
    int8 = {"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "method": "max",
            "exclude": [f"^{re.escape(stem)}$"]}
    cfg = _config(keras_dir / "se.keras", folders, [{**int8, "quantizer": "onnx"}, {**int8, "quantizer": "qat"}])
    cfg["data"]["train"] = {"root": str(train), "batch_size": 8, "workers": 0}
    cfg["qat"] = {"objective": "distill", "epochs": 1, "batch_size": 8, "lr": 1e-4, "method": "max"}
    cfg["bench"] = {"enabled": False}
    results = api.run(cfg, tmp_path / "out", cache_dir=keras_cache)
    assert [v["status"] for v in results["variants"]] == ["ok", "ok"], [v.get("reason") for v in results["variants"]]
    ptq, qat = (v["quantization"] for v in results["variants"])
    assert len(qat["excluded_squeeze_excitation"]) == 2 and qat["excluded_by_user"], qat
    for q in (ptq, qat):  # stem, 2 SE convs, project, Dense: the stem and the SE convs float
        st = q["structure"]
        assert (st["compute_ops"], st["compute_ops_int8"]) == (5, 2), (q["quantizer"], st)
        # ... and the lint knows why (QAT's re-exported nodes carry the twin's module names as scopes)
        assert q["lint"]["verdict"] == "clean", (q["quantizer"], q["lint"])
        assert sum("excluded by the config" in f["fix"] for f in q["lint"]["findings"]) == 1, q["lint"]
    # optimize weighs INT8 by the FP32 model's MACs: the QAT export's layers pair with the FP32 ONNX's nodes through
    # onnx2torch's names (on EfficientNet the graph-order pairing fails); here both pairings exist and must agree
    from qdeploy.optimize.sensitivity import _paired_through_onnx2torch, compute_layers, layer_names_map
    from qdeploy.utils.onnx_graph import OnnxGraph
    fp32_path, qat_path = tmp_path / "fp32" / "model.onnx", tmp_path / "out" / results["variants"][1]["details"]["artifact"]
    names_f = {n.name for n in compute_layers(OnnxGraph.load(fp32_path))}
    by_names = _paired_through_onnx2torch(onnx.load(str(fp32_path)), names_f,
                                          [n.name for n in compute_layers(OnnxGraph.load(qat_path))])
    assert by_names is not None and len(by_names) == 5 and set(by_names.values()) <= names_f, by_names
    assert by_names == layer_names_map(fp32_path, qat_path)


# ------------------------------------------------------------------------------- second route: Keras under torch
# Keras 3 compiles a grouped convolution (ConvNeXt's depthwise convs) with XLA on CPU under TensorFlow: tf2onnx leaves
# that nested function as an unconverted StatefulPartitionedCall (and has no Erfc for the exact GELU), an invalid ONNX.
# A ConvNeXt block at 8x8 has both, as keras.applications.ConvNeXtTiny does (issue 34).
CONVNEXT_BLOCK = """
import os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
import keras
keras.utils.set_random_seed(0)
inp = keras.Input((8, 8, 3))
x = keras.layers.Conv2D(8, 2, strides=2, name="stem")(inp)
y = keras.layers.Conv2D(8, 3, padding="same", groups=8, name="depthwise")(x)
y = keras.layers.LayerNormalization(epsilon=1e-6)(y)
y = keras.layers.Dense(16, activation="gelu", name="pw1")(y)
y = keras.layers.Dense(8, name="pw2")(y)
x = keras.layers.Add()([x, y])
x = keras.layers.GlobalAveragePooling2D()(x)
model = keras.Model(inp, keras.layers.Dense(3, name="logits")(x))
model.save(os.path.join(sys.argv[1], "convnext_block.keras"))
model.export(os.path.join(sys.argv[1], "convnext_block_savedmodel"), format="tf_saved_model")
"""


@pytest.fixture(scope="module")
def convnext_block(tmp_path_factory) -> Path:
    _require_keras()
    out = tmp_path_factory.mktemp("keras_torch")
    (out / "write.py").write_text(CONVNEXT_BLOCK)
    proc = subprocess.run([sys.executable, str(out / "write.py"), str(out)], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def torch_route_run(tmp_path_factory, convnext_block, folders) -> tuple[Path, dict]:
    """One real run of the ConvNeXt block (FP32 and the TensorRT INT8 placement), shared by the tests below."""
    out = tmp_path_factory.mktemp("torch_route")
    cfg = _config(convnext_block / "convnext_block.keras", folders,
                  [{"engine": "onnxruntime"},
                   {"engine": "onnxruntime", "precision": "int8", "placement": "tensorrt", "method": "max"}])
    cfg["bench"] = {"enabled": False}
    return out, api.run(cfg, out / "out", cache_dir=out / "cache")


@pytest.mark.slow
def test_a_model_tf2onnx_cannot_convert_is_exported_by_keras_under_torch_and_verified(torch_route_run):
    out, results = torch_route_run
    assert [v["status"] for v in results["variants"]] == ["ok", "ok"], [v.get("reason") for v in results["variants"]]
    verify = results["model"]["onnx"]["verify"]
    assert verify["passed"] and verify["reference"] == "Keras" and verify["samples"] == 8  # Keras under TensorFlow
    assert verify["max_abs_diff"] <= verify["tolerance"]
    proto = onnx.load(str(out / "out" / "model.onnx"))
    onnx.checker.check_model(proto)
    dims = [d.dim_value or d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims[1:] == [3, 8, 8] and isinstance(dims[0], str)  # NCHW as the first route gives, dynamic batch
    ops = [n.op_type for n in proto.graph.node]
    assert "StatefulPartitionedCall" not in ops and ops.count("Conv") == 2
    assert not any(n.op_type == "Add" and any("depthwise" in i or "stem" in i for i in n.input) for n in proto.graph.node)
    sess = ort.InferenceSession(str(out / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert sess.run(None, {sess.get_inputs()[0].name: np.zeros((3, 3, 8, 8), np.float32)})[0].shape == (3, 3)


@pytest.mark.slow
def test_the_route_and_why_the_first_failed_are_recorded(torch_route_run, convnext_block):
    out, results = torch_route_run
    verify = results["model"]["onnx"]["verify"]
    assert verify["route"] == "keras-torch" and verify["exporter"] in ("keras-torch/torchscript", "keras-torch/dynamo")
    first = verify["first_route_failed"]
    assert "StatefulPartitionedCall" in first and "\n" not in first, first  # one line, naming what tf2onnx left
    meta = json.loads(next((out / "cache" / "exports").glob("convnext_block*.json")).read_text())
    assert meta["route"] == "keras-torch" and meta["first_route_failed"] == first
    # a cache hit keeps the route: no TensorFlow or torch process, the same record
    from qdeploy.config import ExportSpec, ModelSpec

    spec = ModelSpec(source=str(convnext_block / "convnext_block.keras"),
                     preprocess={"input_size": [8, 8], "preset": "keras-tf"})
    art = keras_export.export_keras(spec, ExportSpec(), None, out / "cache")
    assert art.cached and art.exporter == verify["exporter"]


@pytest.mark.slow
def test_where_neither_route_can_one_error_names_both_reasons(tmp_path, convnext_block, folders, capsys):
    """A SavedModel folder is a TensorFlow graph: Keras under torch cannot load it, so both reasons are given."""
    cfg = _config(convnext_block / "convnext_block_savedmodel", folders, [{"engine": "onnxruntime"}])
    assert _cli(tmp_path, cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "converts by neither route: tf2onnx: left" in err[0] and "StatefulPartitionedCall" in err[0]
    assert "Keras under the torch backend → torch.onnx: a SavedModel folder" in err[0]


def test_a_keras_conv_bias_after_the_nhwc_transpose_folds_into_the_conv_exactly():
    from onnx import helper, numpy_helper

    from qdeploy.export.keras_torch import _fold_conv_bias

    rng = np.random.default_rng(0)
    w, b = rng.normal(size=(4, 3, 3, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]),
         helper.make_node("Add", ["t", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 5, 5])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 5, 5, 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b.reshape(1, 1, 1, 4), "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.normal(size=(2, 3, 5, 5)).astype(np.float32)

    def run(p):
        return ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    before = run(proto)
    assert _fold_conv_bias(proto) == 1
    onnx.checker.check_model(proto)
    assert [n.op_type for n in proto.graph.node] == ["Conv", "Transpose"] and len(proto.graph.node[0].input) == 3
    np.testing.assert_allclose(run(proto), before, atol=1e-5)
