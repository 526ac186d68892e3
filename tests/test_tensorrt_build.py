"""TensorRT build pieces (issue #10). Plain code is tested for real: the version strategy, profiles, trtexec lines,
the sidecar and portability guard, the inspector-precision check. The TensorRT calls are checked only for API
conformance against the surfaces dumped from NVIDIA's bindings (../shared/tensorrt-api): names and signatures, not
behaviour. A real build runs only where ``tensorrt`` imports (skipped here; never mocked)."""
import ast
import json
from pathlib import Path

import pytest
import torch

from conftest import shared_path
from qdeploy.artifacts.tensorrt import (
    EngineNotPortable, InputProfile, TrtUnsupported, check_profile, derive_profile, engine_problem, explicit_profiles,
    plan_build, portability_problem, read_sidecar, trtexec_command, write_sidecar,
)
from qdeploy.artifacts.tensorrt import engine_build as eb
from qdeploy.errors import ConfigError
from qdeploy.facts.tensorrt import REMOVED_IN_11

# ---------------------------------------------------------------------------- strategy


def test_tensorrt_10_sets_precision_by_flags():
    assert plan_build("10.3.0", "fp32").builder_flags == ()
    fp16 = plan_build("10.16.1", "fp16")
    assert fp16.builder_flags == ("FP16",) and fp16.onnx == "fp32" and not fp16.strongly_typed
    q = plan_build("10.16.1", "int8")
    assert q.builder_flags == ("INT8",) and q.onnx == "qdq" and not q.calibration_cache
    legacy = plan_build("10.3.0", "int8", "calibration-cache")
    assert legacy.onnx == "fp32" and legacy.calibration_cache and legacy.builder_flags == ("INT8",)


def test_tensorrt_11_is_strongly_typed_and_has_no_precision_flags():
    for precision, onnx in (("fp32", "fp32"), ("fp16", "fp16"), ("int8", "qdq")):
        p = plan_build("11.4.0", precision)
        assert p.strongly_typed and p.builder_flags == () and p.onnx == onnx and not p.calibration_cache
    with pytest.raises(TrtUnsupported, match="removed implicit INT8 calibration"):
        plan_build("11.4.0", "int8", "calibration-cache")


@pytest.mark.parametrize("version", ["8.6.1", "12.0.0", "9.3"])
def test_other_major_versions_are_refused_with_the_reason(version):
    with pytest.raises(TrtUnsupported, match="10.x and 11.x only"):
        plan_build(version, "fp16")


def test_unreadable_version_string():
    with pytest.raises(TrtUnsupported, match="cannot read a major version"):
        plan_build("dev", "fp32")

# ---------------------------------------------------------------------------- profiles


def test_profile_derived_from_batch_sizes_and_input_size():
    p = derive_profile("input", 3, (224, 224), [1, 8, 32])
    assert p.min == (1, 3, 224, 224) and p.opt == (32, 3, 224, 224) and p.max == (32, 3, 224, 224)
    check_profile(p, rank=4)


def test_profile_with_opt_outside_min_max_names_the_input_and_dimension():
    with pytest.raises(ConfigError, match=r"input 'images': dimension 0 .* min 1, opt 16, max 8 \(opt outside min..max\)"):
        explicit_profiles([{"input": "images", "min": [1, 3, 64, 64], "opt": [16, 3, 64, 64], "max": [8, 3, 64, 64]}])
    with pytest.raises(ConfigError, match="different ranks"):
        check_profile(InputProfile("x", (1, 3, 8, 8), (1, 3, 8), (1, 3, 8, 8)))
    with pytest.raises(ConfigError, match="not a positive integer"):
        check_profile(InputProfile("x", (0, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8)))
    with pytest.raises(ConfigError, match="missing opt, max"):
        explicit_profiles([{"input": "x", "min": [1, 3, 8, 8]}])
    with pytest.raises(ConfigError, match="bench.batch_sizes is empty"):
        derive_profile("x", 3, (8, 8), [])

# ---------------------------------------------------------------------------- trtexec


def test_trtexec_line_follows_the_major_version():
    prof = [derive_profile("input", 3, (32, 32), [1, 8])]
    t10 = trtexec_command(plan_build("10.16.1", "int8"), "model-int8.onnx", "m.engine", prof, workspace_mib=1024,
                          optimization_level=3, timing_cache="timing.cache", layer_info="layers.json")
    assert "--int8" in t10 and "--stronglyTyped" not in t10 and "--fp16" not in t10
    assert "--minShapes=input:1x3x32x32" in t10 and "--optShapes=input:8x3x32x32" in t10 and "--maxShapes=input:8x3x32x32" in t10
    assert "--memPoolSize=workspace:1024M" in t10 and "--builderOptimizationLevel=3" in t10
    assert "--timingCacheFile=timing.cache" in t10 and "--exportLayerInfo=layers.json" in t10
    t11 = trtexec_command(plan_build("11.4.0", "fp16"), "model-fp16.onnx", "m.engine", prof)
    assert "--stronglyTyped" in t11 and "--fp16" not in t11 and "--int8" not in t11 and "--onnx=model-fp16.onnx" in t11
    legacy = trtexec_command(plan_build("10.3.0", "int8", "calibration-cache"), "model.onnx", "m.engine", prof,
                             calibration_cache="v.trtcache")
    assert "--int8" in legacy and "--calib=v.trtcache" in legacy

# ---------------------------------------------------------------------------- sidecar and portability


def _sidecar(tmp_path, content=b"plan", **over):
    engine = tmp_path / "m.engine"
    engine.write_bytes(content)
    kw = dict(tensorrt_version="10.16.1", gpu_name="NVIDIA H200", compute_capability="9.0", precision="int8",
              plan=plan_build("10.16.1", "int8").to_json(), profiles=[derive_profile("input", 3, (32, 32), [1]).to_json()],
              source_onnx="model-int8.onnx", source_sha256="ab" * 32, build_options={"workspace_mib": 1024})
    kw.update(over)
    write_sidecar(engine, **kw)
    return engine


def test_sidecar_round_trip_and_portability(tmp_path):
    engine = _sidecar(tmp_path)
    data = read_sidecar(engine)
    assert data["tensorrt_version"] == "10.16.1" and data["gpu"]["compute_capability"] == "9.0"
    assert data["source_onnx"]["sha256"] == "ab" * 32 and data["plan"]["builder_flags"] == ["INT8"]
    assert portability_problem(data, "10.16.1", "NVIDIA H200", "9.0") is None
    assert "built by TensorRT 10.16.1 and this machine has TensorRT 11.4.0" in portability_problem(data, "11.4.0", "NVIDIA H200", "9.0")
    assert "compute capability 9.0) and this GPU is NVIDIA A100" in portability_problem(data, "10.16.1", "NVIDIA A100", "8.0")
    assert "tuned on NVIDIA H200" in portability_problem(data, "10.16.1", "NVIDIA H100", "9.0")


def test_missing_or_corrupt_sidecar_refuses(tmp_path):
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"plan")
    with pytest.raises(EngineNotPortable, match="no sidecar m.engine.json"):
        read_sidecar(engine)
    (tmp_path / "m.engine.json").write_text("{not json")
    with pytest.raises(EngineNotPortable, match="cannot be read"):
        read_sidecar(engine)
    (tmp_path / "m.engine.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(EngineNotPortable, match="has format 'other'"):
        read_sidecar(engine)


# the machine the _sidecar engines were "built" on
HERE = ("10.16.1", "NVIDIA H200", "9.0")


def _plan_bytes(n=4096):
    import random

    return random.Random(7).randbytes(n)


def test_sidecar_records_the_engine_files_size_and_sha256(tmp_path):
    import hashlib

    content = _plan_bytes()
    data = read_sidecar(_sidecar(tmp_path, content))
    assert data["engine_file"] == {"sha256": hashlib.sha256(content).hexdigest(), "bytes": 4096}


def test_an_intact_engine_on_the_machine_that_built_it_has_no_problem(tmp_path):
    assert engine_problem(_sidecar(tmp_path, _plan_bytes()), *HERE) is None


@pytest.mark.parametrize("damage", ["truncated", "one byte flipped", "appended"])
def test_a_corrupt_engine_file_is_caught_without_tensorrt(tmp_path, damage):
    engine = _sidecar(tmp_path, _plan_bytes())
    content = bytearray(engine.read_bytes())
    if damage == "truncated":
        content = content[:1000]
    elif damage == "one byte flipped":
        content[2048] ^= 0x01
    else:
        content += b"\0" * 16
    engine.write_bytes(bytes(content))
    problem = engine_problem(engine, *HERE)
    assert problem is not None and str(engine) in problem and "is corrupt" in problem
    assert "rebuild it from the source ONNX model-int8.onnx" in problem
    if damage == "truncated":
        assert "truncated: 1000 bytes, its sidecar recorded 4096" in problem
    if damage == "one byte flipped":
        assert "same size (4096 bytes) but its sha256 differs" in problem


def test_a_missing_engine_or_sidecar_is_a_problem_naming_the_file(tmp_path):
    engine = _sidecar(tmp_path, _plan_bytes())
    (tmp_path / "m.engine.json").unlink()
    problem = engine_problem(engine, *HERE)
    assert str(engine) in problem and "no sidecar m.engine.json" in problem
    (tmp_path / "m.engine.json").write_text("{not json")
    assert "cannot be read" in engine_problem(engine, *HERE)
    engine = _sidecar(tmp_path, _plan_bytes())
    engine.unlink()
    problem = engine_problem(engine, *HERE)
    assert str(engine) in problem and "does not exist" in problem


def test_an_engine_from_another_version_or_gpu_is_a_problem_naming_the_file(tmp_path):
    engine = _sidecar(tmp_path, _plan_bytes())
    version = engine_problem(engine, "11.4.0", "NVIDIA H200", "9.0")
    assert str(engine) in version and "built by TensorRT 10.16.1 and this machine has TensorRT 11.4.0" in version
    assert "rebuild it from the source ONNX model-int8.onnx" in version
    cc = engine_problem(engine, "10.16.1", "NVIDIA A100-SXM4-80GB", "8.0")
    assert str(engine) in cc and "built on NVIDIA H200 (compute capability 9.0) and this GPU is NVIDIA A100-SXM4-80GB " \
                                 "(compute capability 8.0)" in cc
    name = engine_problem(engine, "10.16.1", "NVIDIA H100 80GB HBM3", "9.0")
    assert str(engine) in name and "tuned on NVIDIA H200 and this GPU is NVIDIA H100 80GB HBM3" in name


def test_a_sidecar_of_the_first_format_is_not_trusted(tmp_path):
    engine = _sidecar(tmp_path, _plan_bytes())
    old = json.loads((tmp_path / "m.engine.json").read_text())
    old.pop("engine_file")
    (tmp_path / "m.engine.json").write_text(json.dumps({**old, "format": "qdeploy.tensorrt-engine/1"}))
    assert "has format 'qdeploy.tensorrt-engine/1'" in engine_problem(engine, *HERE)

# ---------------------------------------------------------------------------- no silent precision


def _layers(specs):
    """Inspector JSON in the layout NVIDIA's trt-engine-explorer parses (what lint.tensorrt_confirm reads)."""
    return eb.parse_engine_information(json.dumps({"Layers": [
        {"Name": n, "LayerType": t, "Outputs": [{"Name": n + "_out", "Format/Datatype": f}]} for n, t, f in specs]}))


def test_layer_precisions_count_compute_layers_by_output_precision():
    layers = _layers([("conv1", "CaskConvolution", "Row major linear Int8 format"),
                      ("conv2", "CaskConvolution", "Channel major FP16 format where channel % 8 == 0"),
                      ("fc", "CaskGemmConvolution", "Row major linear FP32"), ("relu", "PointWise", "Row major linear FP32")])
    p = eb.layer_precisions(layers)
    assert p["INT8"] == 1 and p["FP16"] == 1 and p["FP32"] == 1 and p["compute_layers"] == 3
    assert p["layers"]["FP32"] == ["fc"]


def test_a_build_that_asked_for_fp16_and_got_fp32_is_flagged():
    mostly_fp32 = eb.layer_precisions(_layers([(f"c{i}", "CaskConvolution", "Row major linear FP32") for i in range(3)]
                                              + [("c9", "CaskConvolution", "Channel major FP16 format")]))
    assert "asked for FP16 but 3 of 4 compute layers run in FP32" in eb.precision_shortfall("fp16", mostly_fp32)
    fine = eb.layer_precisions(_layers([("c1", "CaskConvolution", "Int8"), ("c2", "CaskConvolution", "Int8")]))
    assert eb.precision_shortfall("int8", fine) is None and eb.precision_shortfall("fp32", mostly_fp32) is None

# ---------------------------------------------------------------------------- API conformance (names only)


def _surface(version):
    return json.loads(shared_path("tensorrt-api", f"tensorrt-{version}.json").read_text())


def _entry(surface, dotted):
    if dotted == "__version__":
        return {"kind": "attribute"} if surface.get("version") else None
    cls, _, member = dotted.partition(".")
    entry = surface["names"].get(cls)
    if entry is None or not member:
        return entry
    if member in entry.get("values", []):
        return {"kind": "enum value"}
    return entry.get("members", {}).get(member)


@pytest.mark.parametrize("path", sorted(eb.TRT_NAMES_USED))
def test_every_trt_name_of_a_build_path_exists_in_its_versions(path):
    for version in eb.PATH_VERSIONS[path]:
        surface = _surface(version)
        missing = [n for n in eb.TRT_NAMES_USED[path] if _entry(surface, n) is None]
        assert not missing, f"TensorRT {version} lacks {missing} (path {path})"


def test_the_11_path_touches_no_name_removed_in_11():
    s11 = _surface("11.4.0")
    for removed in ("BuilderFlag.FP16", "BuilderFlag.INT8", "IBuilderConfig.int8_calibrator", "IInt8EntropyCalibrator2"):
        assert _entry(s11, removed) is None, f"{removed} exists in 11.4 after all"
        assert removed not in eb.TRT_NAMES_USED["11"] + eb.TRT_NAMES_USED["common"]
    assert set(REMOVED_IN_11).isdisjoint(eb.TRT_NAMES_USED["11"] + eb.TRT_NAMES_USED["common"])
    assert all(plan_build("11.4.0", p).builder_flags == () for p in ("fp32", "fp16", "int8"))
    # and the 10.x plans' flags are exactly the BuilderFlag members the 10 path declares
    flags = {f"BuilderFlag.{f}" for p in ("fp32", "fp16", "int8") for f in plan_build("10.3.0", p).builder_flags}
    assert flags <= set(eb.TRT_NAMES_USED["10"])


def test_signatures_of_the_calls_with_arguments():
    for version in ("10.3.0", "10.16.1", "11.4.0"):
        s = _surface(version)
        for dotted, params in (("IBuilderConfig.set_memory_pool_limit", ("pool", "pool_size")),
                               ("IBuilderConfig.set_timing_cache", ("cache", "ignore_mismatch")),
                               ("IBuilderConfig.create_timing_cache", ("serialized_timing_cache",)),
                               ("IOptimizationProfile.set_shape", ("input", "min", "opt", "max")),
                               ("Builder.create_network", ("flags",)), ("OnnxParser.parse_from_file", ("model",)),
                               ("OnnxParser.get_error", ("index",)), ("IExecutionContext.execute_async_v3", ("stream_handle",)),
                               ("IExecutionContext.set_tensor_address", ("name", "memory"))):
            doc = " ".join((_entry(s, dotted) or {}).get("doc") or [])
            assert all(f"{p}:" in doc for p in params), f"{version} {dotted}: {doc[:200]}"
        # settable properties the build assigns
        for dotted in ("IBuilderConfig.builder_optimization_level", "IBuilderConfig.profiling_verbosity"):
            assert _entry(s, dotted)["kind"] == "property (settable)", (version, dotted)


def test_the_runner_names_exist_in_every_version():
    from qdeploy.engines import tensorrt_engine as te

    for version in ("10.3.0", "10.16.1", "11.4.0"):
        missing = [n for n in te.TRT_NAMES_USED if _entry(_surface(version), n) is None]
        assert not missing, f"TensorRT {version} lacks {missing} (runner)"


def _declared(module):
    names = module.TRT_NAMES_USED
    return {n for v in names.values() for n in v} if isinstance(names, dict) else set(names)


@pytest.mark.parametrize("module", ["qdeploy.artifacts.tensorrt.engine_build", "qdeploy.engines.tensorrt_engine"])
def test_every_trt_attribute_in_the_source_is_declared(module):
    """The declared lists cannot drift from the code: every ``trt.X`` / ``trt.X.Y`` chain in the module is in its list."""
    import importlib

    mod = importlib.import_module(module)
    tree = ast.parse(Path(mod.__file__).read_text())
    declared = _declared(mod)
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trt":
            used.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == "trt":
            used.add(f"{node.value.attr}.{node.attr}")
    simple = {u for u in used if "." not in u}
    dotted = used - simple
    # a bare class (getattr(trt.BuilderFlag, flag)) counts when members of it are declared: the plans' flag names
    # are checked against the declaration in test_the_11_path_touches_no_name_removed_in_11
    missing = sorted(d for d in dotted if d not in declared) + \
        sorted(s for s in simple if s not in declared and not any(n.startswith(s + ".") for n in declared))
    assert not missing, f"{module} uses undeclared TensorRT names {missing}"

# ---------------------------------------------------------------------------- real TensorRT only


def test_build_a_real_engine_where_tensorrt_is_installed(tmp_path):
    trt = pytest.importorskip("tensorrt")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT is installed but no CUDA GPU is visible")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    onnx_path = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.randn(1, 3, 16, 16),), str(onnx_path), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False)
    plan = plan_build(trt.__version__, "fp16")
    out = eb.build_engine(onnx_path, tmp_path / "m.engine", plan, [derive_profile("input", 3, (16, 16), [1, 4])],
                          workspace_mib=256, timing_cache=tmp_path / "timing.cache", layer_info=tmp_path / "layers.json")
    assert (tmp_path / "m.engine").stat().st_size > 0 and (tmp_path / "timing.cache").is_file()
    assert out["precisions"]["compute_layers"] >= 1


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (and TensorRT)")


@needs_cuda
def test_the_parser_rejecting_a_node_names_it(tmp_path):
    """A node TensorRT's ONNX parser has no importer (nor plugin) for: TrtBuildError carries the parser's errors with
    the node's name and operator, before any build."""
    trt = pytest.importorskip("tensorrt")
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["input"], ["r"], name="ok_relu"),
             helper.make_node("QDeployNoSuchOp", ["r"], ["output"], name="qdeploy_rejected_node", domain="qdeploy.test")]
    graph = helper.make_graph(nodes, "rejected", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3, 8, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("qdeploy.test", 1)])
    onnx_path = tmp_path / "rejected.onnx"
    onnx.save(model, str(onnx_path))
    with pytest.raises(eb.TrtBuildError) as e:
        eb.build_engine(onnx_path, tmp_path / "m.engine", plan_build(trt.__version__, "fp32"), [])
    message = str(e.value)
    assert "ONNX parser rejected" in message and str(onnx_path) in message
    assert "node qdeploy_rejected_node" in message
    assert not (tmp_path / "m.engine").exists()


@needs_cuda
def test_a_corrupt_engine_whose_sidecar_matches_is_refused_by_name_not_a_crash(tmp_path):
    """Random bytes with a sidecar written for them pass the integrity check (size and sha256 agree) on this machine;
    TensorRT's deserializer is then what refuses, and the runner's load path turns that into VariantUnavailable
    naming the file and the ONNX to rebuild from."""
    trt = pytest.importorskip("tensorrt")
    from qdeploy.engines.tensorrt_engine import deserialize_engine
    from qdeploy.errors import VariantUnavailable

    gpu, cc = torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0)
    engine = _sidecar(tmp_path, _plan_bytes(1 << 16), tensorrt_version=trt.__version__, gpu_name=gpu, compute_capability=cc)
    assert engine_problem(engine, trt.__version__, gpu, cc) is None
    with pytest.raises(VariantUnavailable) as e:
        deserialize_engine(engine, "model-int8.onnx")
    assert f"could not deserialize {engine}" in str(e.value) and "rebuild it from model-int8.onnx" in str(e.value)


@needs_cuda
def test_a_tiny_workspace_either_builds_or_says_the_workspace_may_be_too_small(tmp_path):
    """workspace_mib=1 on the demo model: TensorRT may find tactics that fit in 1 MiB (then a real engine is built) or
    fail the build (then the message names the workspace limit). Nothing else is acceptable."""
    trt = pytest.importorskip("tensorrt")
    from qdeploy.demo.model import digits_cnn

    model = digits_cnn(num_classes=10).eval()
    onnx_path = tmp_path / "digits.onnx"
    torch.onnx.export(model, (torch.randn(1, 1, 16, 16),), str(onnx_path), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}}, dynamo=False)
    engine = tmp_path / "digits.engine"
    try:
        out = eb.build_engine(onnx_path, engine, plan_build(trt.__version__, "fp32"),
                              [derive_profile("input", 1, (16, 16), [1, 8])], workspace_mib=1)
    except eb.TrtBuildError as e:
        assert "a workspace limit of 1 MiB may be too small" in str(e) and str(onnx_path) in str(e)
        assert not engine.exists()
    else:
        assert engine.stat().st_size > 0 and out["precisions"]["compute_layers"] >= 1


def test_deserialize_engine_refuses_a_missing_file_by_name(tmp_path):
    """The part of the runner's load path that needs no TensorRT: a missing engine file is refused before import."""
    from qdeploy.engines.tensorrt_engine import deserialize_engine
    from qdeploy.errors import VariantUnavailable

    with pytest.raises(VariantUnavailable, match=r"TensorRT engine .*gone\.engine does not exist; rebuild it from m\.onnx"):
        deserialize_engine(tmp_path / "gone.engine", "m.onnx")


def test_a_mostly_fp32_engine_is_degraded_and_shown_in_the_report():
    """The results/report side of "no silent precision", on a results dict as the pipeline writes it for an engine."""
    from qdeploy.report import tables
    from qdeploy.report.verdict import mark_degraded

    precisions = eb.layer_precisions(_layers([(f"c{i}", "CaskConvolution", "Row major linear FP32") for i in range(4)]))
    engine = {"tensorrt_version": "10.16.1", "plan": plan_build("10.16.1", "fp16").to_json(), "precisions": precisions,
              "precision_shortfall": eb.precision_shortfall("fp16", precisions)}
    variants = [{"name": "tensorrt-fp16", "engine": "tensorrt", "precision": "fp16", "status": "ok", "reason": None,
                 "metrics": {"top1": 0.9}, "agreement": 1.0, "tensorrt_engine": engine}]
    mark_degraded(variants, "classification")
    assert variants[0]["status"] == "degraded" and "asked for FP16 but 4 of 4 compute layers run in FP32" in variants[0]["reason"]
    t = tables.tensorrt_table({"variants": variants})
    assert t.rows[0][3] == "0 / 0 / 4" and t.rows[0][4] == "c0, c1, c2, c3" and "mostly FP32" in t.rows[0][5]


def test_tensorrt_facts_have_one_home():
    """The lint, the quantizers, the engine builder and the runner read one facts module: no consumer keeps its own copy
    of a TensorRT fact (version strategy, kernel constraints, API names)."""
    import qdeploy.facts.tensorrt as facts
    from qdeploy.engines import tensorrt_engine as te
    from qdeploy.lint import qdq_graph, rules, tensorrt_confirm as tc
    from qdeploy.optimize import sensitivity

    assert eb.TRT_NAMES_USED is facts.NAMES_USED["engine_build"] and tc.TRT_NAMES_USED is facts.NAMES_USED["lint_confirm"]
    assert te.TRT_NAMES_USED is facts.NAMES_USED["runner"]["common"]
    assert rules.conv_int8_supported is facts.conv_int8_supported and te.plan_build is facts.plan_build
    # the compute ops are the op types of the placement rules marked compute (lint/placement.py: one list, derived)
    from qdeploy.lint import placement

    assert rules.COMPUTE_OPS is placement.COMPUTE_OPS and sensitivity.COMPUTE_OPS is placement.COMPUTE_OPS
    assert tc.COMPUTE_OPS is placement.COMPUTE_OPS and set(placement.COMPUTE_OPS) == {"Conv", "ConvTranspose", "Gemm", "MatMul"}
    assert not hasattr(qdq_graph, "COMPUTE_OPS") and not hasattr(facts, "COMPUTE_OPS")
    src = Path(facts.__file__).parents[1]
    for path in src.rglob("*.py"):  # no second definition of a fact anywhere else
        if path.name == "tensorrt.py" and path.parent.name == "facts":
            continue
        text = path.read_text()
        for name in ("COMPUTE_OPS = ", "COMPUTE_OPS: ", "SUPPORTED_MAJORS = ", "def plan_build", "def conv_int8_supported",
                     "def tensorrt_version", "BACKBONE_OPS = "):
            if name.startswith("COMPUTE_OPS") and path.name == "placement.py":
                continue
            assert name not in text, f"{path}: defines {name.strip(' =')} (it belongs in qdeploy/facts/tensorrt.py)"
