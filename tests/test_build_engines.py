"""The build stage, the quantizer registry and the engines, each used directly (no api.run)."""
import numpy as np
import pytest
import torch

from conftest import write_image_folder
from qdeploy.artifacts import ArtifactKind, ArtifactRequest, Builder
from qdeploy.config import Int8Config, VariantSpec, parse_config
from qdeploy.data import make_batches, normalize
from qdeploy.engines import ENGINES, create_engine, resolve_variant
from qdeploy.errors import QDeployError, VariantUnavailable
from qdeploy.lint import structure_of
from qdeploy.quantize import NotApplicable, candidates
from qdeploy.quantize.exclude import module_of_node


@pytest.fixture
def res_setup(tiny_model_file, tmp_path):
    evalset = write_image_folder(tmp_path / "eval", per_class=4, size=(16, 16), seed=1)
    calib = write_image_folder(tmp_path / "calib", per_class=6, size=(16, 16), seed=2)
    cfg = parse_config({
        "model": {"source": f"{tiny_model_file}:tiny_res", "preprocess": {"input_size": [16, 16], "mean": [0.5] * 3, "std": [0.25] * 3}},
        "data": {"eval": {"root": str(evalset), "workers": 0}, "calibration": {"root": str(calib), "workers": 0}},
    })
    pre = cfg.model.preprocess
    eval_batches = make_batches(cfg.data.eval, pre, "classification", progress=False)
    calibration = make_batches(cfg.data.calibration, pre, "classification", progress=False)

    def builder(cache="cache"):
        return Builder(cfg, tmp_path / cache, calibration, check_inputs=lambda: normalize(eval_batches.first(4)[0], pre))

    return cfg, builder, normalize(eval_batches.first(6)[0], pre)


def test_builder_makes_each_artifact_once_and_caches_by_fingerprint(res_setup):
    cfg, builder, _ = res_setup
    b = builder()
    fp32 = b.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
    assert fp32.path.is_file() and fp32.info["verify"]["passed"] and fp32.inputs[0].startswith("pytorch:")
    assert b.build(ArtifactRequest(ArtifactKind.ONNX_FP32)) is fp32  # memoised within the run
    int8 = b.build(ArtifactRequest(ArtifactKind.ONNX_INT8, Int8Config(method="max", placement="tensorrt", quantizer="onnx")))
    assert int8.cache_hit is False and int8.inputs[0] == fp32.ref
    assert [c.kind for c in int8.companions] == [ArtifactKind.TRT_CALIBRATION_CACHE] and int8.companions[0].path.is_file()
    assert int8.info["structure"]["residual_add_forms"] == {"fusible": 1}
    # a new run with the same cache: nothing is calibrated again
    again = builder().build(ArtifactRequest(ArtifactKind.ONNX_INT8, Int8Config(method="max", placement="tensorrt", quantizer="onnx")))
    assert again.cache_hit is True and again.fingerprint == int8.fingerprint and again.info["structure"] == int8.info["structure"]
    # any setting that shapes the artifact changes its fingerprint
    other = builder().build(ArtifactRequest(ArtifactKind.ONNX_INT8, Int8Config(method="percentile", placement="tensorrt", quantizer="onnx")))
    assert other.fingerprint != int8.fingerprint and other.path != int8.path
    fp16 = b.build(ArtifactRequest(ArtifactKind.ONNX_FP16))
    assert fp16.path.is_file() and fp16.inputs == [fp32.ref]


def test_quantizer_registry_resolves_auto_and_refuses_what_cannot_work():
    names = lambda cfg, torch_model: [q.name for q in candidates(cfg, torch_model)]  # noqa: E731
    assert names(Int8Config(placement="tensorrt"), True) == ["modelopt", "onnx"]  # ModelOpt first, ONNX as fallback
    assert names(Int8Config(placement="tensorrt"), False) == ["onnx"]  # ONNX-only model
    assert names(Int8Config(placement="onnxruntime"), True) == ["onnx"]
    assert names(Int8Config(placement="tensorrt", exclude_ops=["Gemm"]), True) == ["onnx"]
    with pytest.raises(NotApplicable, match="needs a PyTorch model"):
        candidates(Int8Config(placement="tensorrt", quantizer="modelopt"), False)
    assert names(Int8Config(placement="openvino"), True) == ["nncf"]  # OpenVINO's own placement: NNCF only
    with pytest.raises(QDeployError, match="unknown quantizer 'olive'"):
        candidates(Int8Config(quantizer="olive"), True)


def test_exclude_means_onnx_node_names_for_modelopt_too(res_setup):
    cfg, builder, _ = res_setup
    assert module_of_node("/model/layer1/layer1.0/conv1/Conv") == "layer1.0.conv1"
    assert module_of_node("/model/conv2/Conv") == "conv2"
    b = builder()
    fp32 = b.build(ArtifactRequest(ArtifactKind.ONNX_FP32))
    conv2 = next(n.name for n in __import__("onnx").load(str(fp32.path)).graph.node if "conv2" in n.name)
    art = b.build(ArtifactRequest(ArtifactKind.ONNX_INT8, Int8Config(method="max", placement="tensorrt", exclude=["conv2/Conv$"])))
    assert art.info["quantizer"] == "modelopt" and art.info["excluded_nodes"] == [conv2]
    assert art.info["excluded_by_user"] == ["conv2"]
    st = structure_of(art.path)
    assert st["compute_ops_int8"] == 2 and any("conv2" in n for n in st["compute_ops_float"] + st["compute_ops_partly_quantized"])


def _variant(**spec):
    return resolve_variant(VariantSpec.model_validate(spec), 0)


def test_engines_load_only_built_artifacts_and_agree(res_setup):
    cfg, builder, x = res_setup
    b = builder()
    outputs = {}
    for spec in ({"engine": "torch", "device": "cpu"}, {"engine": "onnxruntime", "device": "cpu"},
                 {"engine": "onnxruntime", "device": "cpu", "graph_optimization": "disable"}):
        v = _variant(**spec)
        v.engine.check(v, has_torch=True)
        engine = create_engine(v, b.build(v.artifact_request()))
        engine.load()
        outputs[v.label] = engine.infer(x)
        step = engine.prepare_timed(x[:2])
        step()
        d = engine.describe()
        assert d["device"] == "cpu"
        engine.close()
    ref = outputs["torch-fp32-cpu"]
    assert ref.shape == (6, 3)
    for label, out in outputs.items():
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4, err_msg=label)
    assert "onnxruntime-fp32-cpu-opt-disable" in outputs


def test_int8_engine_runs_the_quantized_artifact(res_setup):
    _, builder, x = res_setup
    b = builder()
    v = _variant(engine="onnxruntime", precision="int8", method="max")
    art = b.build(v.artifact_request())
    assert art.kind == ArtifactKind.ONNX_INT8
    engine = create_engine(v, art)
    engine.load()
    out = engine.infer(x)
    ref = create_engine(_variant(engine="onnxruntime"), b.build(ArtifactRequest(ArtifactKind.ONNX_FP32)))
    ref.load()
    assert (out.argmax(1) == ref.infer(x).argmax(1)).mean() >= 0.5
    assert v.engine.speed_is_deployment(v) and "ONNX Runtime-placement" in v.engine.note(v)
    trt = _variant(engine="onnxruntime", precision="int8", placement="tensorrt")
    assert not trt.engine.speed_is_deployment(trt) and "simulated" in trt.engine.note(trt)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a CPU-only machine refuses")
def test_engines_say_what_this_machine_cannot_run():
    with pytest.raises(VariantUnavailable, match="FP16 in PyTorch needs a CUDA GPU"):
        v = _variant(engine="torch", precision="fp16")
        v.engine.check(v, has_torch=True)
    with pytest.raises(VariantUnavailable, match="CUDA graphs need a CUDA GPU"):
        v = _variant(engine="torch", cuda_graphs=True)
        v.engine.check(v, has_torch=True)
    with pytest.raises(VariantUnavailable, match="FP16 in ONNX Runtime needs a GPU"):
        v = _variant(engine="onnxruntime", precision="fp16")
        v.engine.check(v, has_torch=True)
    with pytest.raises(VariantUnavailable, match="an ONNX or Keras model; the torch engine needs a PyTorch model"):
        v = _variant(engine="torch")
        v.engine.check(v, has_torch=False)


def test_capability_table_drives_probe_rows():
    for name, cls in ENGINES.items():
        rows = cls.probe()
        assert rows and all(r["engine"] == name and set(r["precisions"]) <= set(cls.precisions) for r in rows)
        assert {r["device"] for r in rows} == set(cls.devices)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mobilenet_v3_small", "efficientnet_b0", "resnet18"])
def test_every_exported_conv_maps_back_to_its_module(arch, tmp_path):
    """ONNX scope names → PyTorch module names through nested Sequentials (``features.1.0`` / ``block`` /
    ``block.1``): the ModelOpt quantizer turns exclude patterns and squeeze-excitation convs into modules this way."""
    import onnx
    import torch
    import torchvision

    from qdeploy.models.loader import SelectOutput

    net = getattr(torchvision.models, arch)(num_classes=10).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(SelectOutput(net, None), (torch.randn(1, 3, 64, 64),), str(path), dynamo=False, opset_version=17)
    modules = dict(net.named_modules())
    convs = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Conv"]
    assert convs and all(isinstance(modules.get(module_of_node(n)), torch.nn.Conv2d) for n in convs), \
        [(n, module_of_node(n)) for n in convs if module_of_node(n) not in modules][:3]


@pytest.mark.slow  # four CPU compiles, ~10 s
def test_compiled_torch_engines_in_one_process_each_really_compile(res_setup):
    """Every compiled candidate of a search wraps the same module class, so their torch.compile entries share one code
    object's cache: past torch._dynamo's recompile limit (8 entries: dtype x layout x batch shape, reached by a DeiT's
    12th), Dynamo silently ran the next candidates eagerly and the search timed eager code as compiled (FP8 3.5x slower
    than FP16, INT8 failing in CUDA-graph capture). Here the limit is 2 and each engine needs two entries."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    _, builder, x = res_setup
    b = builder()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):  # (monkeypatch's undo would delete the config key)
        for spec in ({"channels_last": False}, {"channels_last": True}, {"channels_last": False}):
            v = _variant(engine="torch", device="cpu", options={"compile": True, **spec})
            engine = create_engine(v, b.build(v.artifact_request()))
            engine.load()
            before = counters["stats"]["unique_graphs"]
            engine.infer(x[:2])
            engine.prepare_timed(x[:3])()
            assert counters["stats"]["unique_graphs"] >= before + 2, f"{v.label} ran eagerly: {dict(counters['stats'])}"
            engine.close()
    # a program that still needs more entries than the limit fails, with Dynamo's reason, instead of running eagerly
    with torch._dynamo.config.patch(recompile_limit=1):
        v = _variant(engine="torch", device="cpu", options={"compile": True})
        engine = create_engine(v, b.build(v.artifact_request()))
        engine.load()
        engine.infer(x[:2])
        with pytest.raises(Exception, match="recompile_limit|cache_size_limit|cache limit"):
            engine.prepare_timed(x[:3])
        engine.close()


def _spy_on_the_first_compiled_call(monkeypatch, record):
    """Call ``record()`` at each call of what the engine's ``torch.compile`` returns, before the call: the first call
    is where Inductor compiles, under whatever settings the engine has patched in then."""
    import torch

    real_compile = torch.compile

    def spy_compile(model, **kwargs):
        compiled = real_compile(model, **kwargs)

        def call(inp):
            record()
            return compiled(inp)

        return call

    monkeypatch.setattr(torch, "compile", spy_compile)


@pytest.mark.slow  # a CPU compile
def test_a_torchao_program_compiles_under_its_own_inductor_settings_and_leaves_the_process_its_own(res_setup,
                                                                                                   monkeypatch):
    """torchao's configs set Inductor's settings process-wide by default, and they stayed for every later compile of a
    search (another program than the one timed); qdeploy applies them while the torchao program compiles only."""
    pytest.importorskip("torchao", reason="torchao is a dependency; this environment lacks it")
    import torch._inductor.config as inductor

    from qdeploy.facts.torchao import INDUCTOR_CONFIG, inductor_config

    assert inductor_config("int8-weight-only") == INDUCTOR_CONFIG and inductor_config(None) == {}
    before = {k: getattr(inductor, k) for k in INDUCTOR_CONFIG}
    assert before != INDUCTOR_CONFIG  # Inductor's defaults differ, so a leak would show
    _, builder, x = res_setup
    v = _variant(engine="torch", device="cpu", options={"compile": True, "torchao": "int8-weight-only"})
    engine = create_engine(v, builder().build(v.artifact_request()))
    seen = {}
    engine.load()
    _spy_on_the_first_compiled_call(monkeypatch, lambda: seen or seen.update(
        {k: getattr(inductor, k) for k in INDUCTOR_CONFIG}))
    out = engine.infer(x)
    engine.close()
    assert seen == INDUCTOR_CONFIG and out.shape == (6, 3) and np.isfinite(out).all()
    assert {k: getattr(inductor, k) for k in INDUCTOR_CONFIG} == before


@pytest.mark.slow  # a CPU compile
def test_a_frozen_program_compiles_with_freezing_and_leaves_the_process_its_own(res_setup, monkeypatch):
    """optimize's frozen candidate: Inductor's freezing set while its program compiles, and only then."""
    import torch._inductor.config as inductor

    from qdeploy.facts.inductor import FREEZING, program_inductor_config

    assert program_inductor_config(None, True) == FREEZING and program_inductor_config(None, False) == {}
    before = inductor.freezing
    assert before is False  # Inductor's default: a leak would show
    _, builder, x = res_setup
    plain = _variant(engine="torch", device="cpu")
    want = create_engine(plain, builder().build(plain.artifact_request()))
    want.load()
    expected = want.infer(x)
    want.close()
    v = _variant(engine="torch", device="cpu", options={"compile": True, "freezing": True})
    engine = create_engine(v, builder().build(v.artifact_request()))
    seen = []
    engine.load()
    _spy_on_the_first_compiled_call(monkeypatch, lambda: seen.append(inductor.freezing))
    out = engine.infer(x)
    engine.close()
    assert seen[0] is True and inductor.freezing is before
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)  # BatchNorm folded into the conv: close, FP32


@pytest.mark.slow  # a CPU compile, then the saved program's
def test_saving_the_chosen_program_reuses_the_engines_compile_of_the_same_exported_program(res_setup, tmp_path,
                                                                                          monkeypatch):
    """The torch engine compiles a candidate's exported program (dynamic batch), the graph the saved program's loader
    compiles: saving the chosen program then finds that compile in Inductor's cache instead of compiling for as long
    again (Swin-T at 224 on an H200: 60 s), and the search times what a user's process runs. A fresh Inductor cache
    folder, so that no earlier run's entry can answer."""
    from torch._dynamo.utils import counters

    from qdeploy.artifacts.torch_program import ProgramSettings, save_program

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    _, builder, x = res_setup
    b = builder()
    plain = _variant(engine="torch", device="cpu")
    reference = create_engine(plain, b.build(plain.artifact_request()))
    reference.load()
    want = reference.infer(x)
    reference.close()
    v = _variant(engine="torch", device="cpu", options={"compile": True})
    engine = create_engine(v, b.build(v.artifact_request()))
    engine.load()
    np.testing.assert_allclose(engine.infer(x), want, rtol=1e-4, atol=1e-4)
    assert engine.describe()["compiled_from"] == "exported program"
    engine.close()
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    settings = ProgramSettings("cpu", "fp32", compile="default", batch_sizes=(len(x),), input_shape=tuple(x.shape[1:]))
    manifest = save_program(b.torch_model(), settings, tmp_path / "out")
    assert manifest["format"] == "exported" and manifest["compile_cache"]
    assert counters["inductor"]["fxgraph_cache_hit"] > hits and counters["inductor"]["fxgraph_cache_miss"] == misses


class BatchBranch(torch.nn.Module):
    """A branch on the batch size: torch.export cannot keep that dimension dynamic."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y * 2 if x.shape[0] > 4 else y


@pytest.mark.slow  # a CPU compile
def test_a_model_torch_export_cannot_trace_with_a_dynamic_batch_compiles_as_it_is(res_setup):
    """Where torch.export cannot trace the model with a dynamic batch, the engine compiles the model itself and says
    so (the saved program then has one program per batch size): the candidate is still compiled and right."""
    _, builder, x = res_setup
    v = _variant(engine="torch", device="cpu", options={"compile": True})
    engine = create_engine(v, builder().build(v.artifact_request()))
    engine.load()
    with torch.no_grad():
        want = BatchBranch(engine.model)(torch.from_numpy(x)).numpy()
    engine.model = BatchBranch(engine.model)
    np.testing.assert_allclose(engine.infer(x), want, rtol=1e-4, atol=1e-4)
    assert engine.describe()["compiled_from"].startswith("model (torch.export failed: ")
    engine.close()


@pytest.mark.slow  # two CPU compiles
def test_compiled_engines_alive_together_keep_their_programs(res_setup):
    """Each compiled engine's exported program has its own generated forward, so its own Dynamo cache: a second
    engine's compile leaves the first one's program compiled (no compile again at its next call, and so none outside its
    own Inductor settings)."""
    from torch._dynamo.utils import counters

    _, builder, x = res_setup
    b = builder()
    engines = []
    for spec in ({"channels_last": False}, {"channels_last": True}):
        v = _variant(engine="torch", device="cpu", options={"compile": True, **spec})
        engine = create_engine(v, b.build(v.artifact_request()))
        engine.load()
        engine.infer(x)
        engines.append(engine)
    before = counters["stats"]["unique_graphs"]
    first = engines[0].infer(x)
    assert counters["stats"]["unique_graphs"] == before, "the first engine compiled again"
    np.testing.assert_allclose(first, engines[1].infer(x), rtol=1e-4, atol=1e-4)
    for engine in engines:
        engine.close()
