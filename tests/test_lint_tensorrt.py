"""lint.tensorrt_confirm: the TensorRT names it touches exist in the versions each build path is for (checked
against API surfaces dumped from the real bindings, ../shared/tensorrt-api), the no-TensorRT path, and, where
TensorRT is installed, a real engine built from a tiny Q/DQ residual block (skipped elsewhere; never mocked)."""
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import shared_path
from qdeploy.lint import tensorrt_confirm as tc
from qdeploy.lint.qdq_graph import QdqGraph
from qdeploy.lint.rules import run_rules

SOURCE = Path(tc.__file__).read_text()
SURFACES = {"10": ["10.3.0", "10.16.1"], "11": ["11.4.0"]}


def _surface(version: str) -> dict:
    return json.loads(shared_path("tensorrt-api", f"tensorrt-{version}.json").read_text())


def _exists(surface: dict, dotted: str) -> bool:
    if dotted == "__version__":
        return bool(surface.get("version"))  # the dump's "version" is trt.__version__
    cls, _, member = dotted.partition(".")
    entry = surface["names"].get(cls)
    if entry is None:
        return False
    return not member or member in entry.get("values", []) or member in entry.get("members", {})


@pytest.mark.parametrize("path", sorted(SURFACES))
def test_trt_names_exist_in_every_version_of_their_path(path):
    for version in SURFACES[path]:
        surface = _surface(version)
        missing = [n for n in tc.TRT_NAMES_USED[path] if not _exists(surface, n)]
        assert not missing, f"TensorRT {version} lacks {missing}"


def test_path_split_is_needed():
    """The 10.x precision flags are gone in 11.4, so the 10 path must never run there."""
    t11 = _surface("11.4.0")
    assert not _exists(t11, "BuilderFlag.INT8") and not _exists(t11, "BuilderFlag.FP16")
    assert all(_exists(_surface(v), "BuilderFlag.INT8") for v in SURFACES["10"])


def test_trt_names_used_covers_the_source():
    used = set(tc.TRT_NAMES_USED["10"]) | set(tc.TRT_NAMES_USED["11"])
    in_source = {m.group(0)[4:] for m in re.finditer(r"(?<![\w.])trt\.\w+(?:\.\w+)?", SOURCE)}
    assert in_source and in_source <= used, f"not in TRT_NAMES_USED: {sorted(in_source - used)}"
    for dotted in used:  # method names on TensorRT objects appear as calls; Polygraphy's flags are set for us
        member = dotted.split(".")[-1]
        if dotted.startswith(("ICudaEngine.", "EngineInspector.")):
            assert f".{member}(" in SOURCE, dotted


def test_polygraphy_sets_the_flags_we_list():
    # polygraphy is a dependency; the GPU machine's preinstalled environment lacks it
    ptrt = pytest.importorskip("polygraphy.backend.trt", reason="polygraphy not installed (pip install .)")
    root = Path(ptrt.__file__).parent
    config, loader = (root / "config.py").read_text(), (root / "loader.py").read_text()
    assert 'try_set_flag("INT8")' in config and 'try_set_flag("FP16")' in config
    assert "trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED" in loader


def test_precision_strings():
    # format strings as listed by NVIDIA's trt-engine-explorer (activations.py); pure string parsing
    cases = {"Int8": "Int8", "Half": "Half", "Float": "Float", "Row major linear FP32": "Float",
             "Channel major FP16 format where channel % 8 == 0": "Half",
             "Thirty-two wide channel vectorized row major Int8 format": "Int8",
             "Channel major INT8 format where channel % 16 == 0": "Int8", "Row major linear UInt8 format": "UInt8",
             "Row major linear BFloat16 format": "BF16", "Row major linear FP8 format": "FP8", "Unknown format": "Unknown"}
    assert {k: tc.precision_of(k) for k in cases} == cases
    assert tc.split_layer_name("/c/Conv + /a/Add + /r/Relu") == ["/c/Conv", "/a/Add", "/r/Relu"]
    assert tc.split_layer_name("PWN(PWN(/s/Sigmoid), /m/Mul)") == ["/s/Sigmoid", "/m/Mul"]


def _qdq(name, tensor, scale, nodes, inits):
    inits.append(numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"))
    inits.append(numpy_helper.from_array(np.array(0, np.int8), f"{name}_z"))
    nodes.append(helper.make_node("QuantizeLinear", [tensor, f"{name}_s", f"{name}_z"], [f"{name}_q"], name=f"{name}_Q"))
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"], name=f"{name}_DQ"))
    return f"{name}_dq"


def residual_qdq_model(path: Path, conv_path_qdq: bool = True) -> Path:
    """x → Q/DQ → conv1 → relu → Q/DQ → conv2 (→ Q/DQ when ``conv_path_qdq``) → Add(skip) → relu → Q/DQ;
    16 channels (INT8-capable convs), batch symbolic."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i in (1, 2):
        w = rng.normal(0, 0.1, (16, 16, 3, 3)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        _qdq(f"w{i}", f"w{i}", float(np.abs(w).max() / 127), nodes, inits)
    xq = _qdq("x", "x", 0.02, nodes, inits)
    nodes.append(helper.make_node("Conv", [xq, "w1_dq"], ["c1"], name="conv1", pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"], name="relu1"))
    rq = _qdq("r1", "r1", 0.02, nodes, inits)
    nodes.append(helper.make_node("Conv", [rq, "w2_dq"], ["c2"], name="conv2", pads=[1, 1, 1, 1]))
    c2 = _qdq("c2", "c2", 0.03, nodes, inits) if conv_path_qdq else "c2"
    nodes.append(helper.make_node("Add", [c2, rq], ["a"], name="add"))
    nodes.append(helper.make_node("Relu", ["a"], ["r2"], name="relu2"))
    y = _qdq("r2", "r2", 0.03, nodes, inits)  # the next layer's input Q/DQ: the fused block can write INT8
    graph = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16, 8, 8])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", 16, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_profile_shapes_symbolic_batch(tmp_path):
    path = residual_qdq_model(tmp_path / "m.onnx")
    assert tc.profile_shapes(path) == {"x": [1, 16, 8, 8]}
    assert tc.profile_shapes(path, batch=4) == {"x": [4, 16, 8, 8]}


def test_without_tensorrt_findings_are_untouched(tmp_path):
    if tc.tensorrt_version() is not None:
        pytest.skip("tensorrt is importable here: the static-analysis path is not taken")
    path = residual_qdq_model(tmp_path / "m.onnx")
    g = QdqGraph.load(path)
    findings = run_rules(g)
    assert any(f.rule == "QD001" for f in findings)
    before = [f.to_dict() for f in findings]
    assert tc.confirm_findings(path, findings, g) == {"by": "static analysis", "tensorrt": None}
    assert [f.to_dict() for f in findings] == before


def test_real_engine_confirms_residual_qdq(tmp_path):
    pytest.importorskip("tensorrt")
    path = residual_qdq_model(tmp_path / "m.onnx")
    layers = tc.inspect_engine_layers(path)
    assert layers and all({"name", "type", "onnx_nodes", "input_precisions", "output_precisions"} <= set(l) for l in layers)
    assert any("conv2" in l["onnx_nodes"] for l in layers)
    findings = run_rules(QdqGraph.load(path))
    result = tc.confirm_findings(path, findings)
    assert result["by"].startswith("TensorRT "), result  # a failed build says "static analysis (… build failed …)"
    qd001 = next(f for f in findings if f.rule == "QD001")
    assert qd001.confirmed and qd001.confirmed.split(":")[0] in ("confirmed", "refuted"), qd001.confirmed
    assert "conv2" not in result["float_compute_nodes"]
    assert result["layers"]["Int8"] >= 1


def test_real_engine_fuses_conv_add_without_conv_path_qdq(tmp_path):
    pytest.importorskip("tensorrt")
    path = residual_qdq_model(tmp_path / "m.onnx", conv_path_qdq=False)
    layers = tc.inspect_engine_layers(path)
    assert any({"conv2", "add"} <= set(l["onnx_nodes"]) for l in layers), [l["name"] for l in layers]
