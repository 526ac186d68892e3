"""ONNX Runtime's CUDA execution provider (issue #22, the onnxruntime-cuda target): why it cannot run here, in one
sentence (facts.onnxruntime.cuda_ep_problem), and the engine's cuda_graphs option.

No machine this project has can install onnxruntime-gpu: the tests that need the CUDA execution provider skip, and
the CUDA path itself has never run. What runs here: every branch of the messages on plain values, the refusals on
this CPU build, and the IO-binding plumbing of cuda_graphs on CPU OrtValues (everything but the device and the capture).
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdeploy.artifacts import ArtifactKind
from qdeploy.artifacts.types import Artifact
from qdeploy.config import VariantSpec
from qdeploy.engines import create_engine, resolve_variant
from qdeploy.engines.onnxruntime_engine import OnnxRuntimeEngine, bound_output_shape
from qdeploy.errors import VariantUnavailable
from qdeploy.facts.onnxruntime import (CUDA_EP, build_cuda_version, cuda_ep_problem, cuda_ep_problem_from,
                                       cuda_fallback_message, cuda_major, parse_smi_cuda)

GPU_BUILD = ["TensorrtExecutionProvider", CUDA_EP, "CPUExecutionProvider"]
HAS_CUDA_EP = CUDA_EP in ort.get_available_providers()
needs_cuda_ep = pytest.mark.skipif(not HAS_CUDA_EP, reason="needs onnxruntime-gpu (CUDAExecutionProvider): this "
                                   "onnxruntime is the CPU build, and no machine we have can install onnxruntime-gpu")


def _variant(**spec):
    return resolve_variant(VariantSpec.model_validate(spec), 0)


# ------------------------------------------------------------------------------ the message, on plain values

def test_the_cpu_build_is_named_with_the_command_that_replaces_it():
    msg = cuda_ep_problem_from(["AzureExecutionProvider", "CPUExecutionProvider"], None, "12.4", "1.32.0")
    assert msg == ("onnxruntime 1.32.0 is the CPU build (providers: AzureExecutionProvider, CPUExecutionProvider), "
                   "without the CUDA execution provider; onnxruntime-gpu provides the same Python module `onnxruntime` "
                   "as the CPU build qdeploy depends on, so it is installed instead of it: "
                   "pip uninstall -y onnxruntime && pip install onnxruntime-gpu")
    assert cuda_ep_problem_from(["CPUExecutionProvider"], None, None, "1.20.1").startswith("onnxruntime 1.20.1 is the CPU build")


def test_a_gpu_build_without_a_visible_gpu():
    msg = cuda_ep_problem_from(GPU_BUILD, "12.8", None, "1.22.0")
    assert msg == ("onnxruntime-gpu 1.22.0 has the CUDA execution provider, but no NVIDIA GPU is visible here "
                   "(nvidia-smi lists none and PyTorch sees no CUDA device): run on a machine with an NVIDIA GPU and its "
                   "driver, or use device: cpu")


def test_a_build_for_a_newer_cuda_major_than_the_driver_names_both_and_the_build_to_install():
    msg = cuda_ep_problem_from(GPU_BUILD, "13.0", "12.4", "1.24.1")
    assert msg == ("onnxruntime-gpu 1.24.1 is built for CUDA 13.0, but this machine's CUDA is 12.4 (nvidia-smi), an "
                   "older major: install an onnxruntime-gpu built for CUDA 12.x (pip uninstall -y onnxruntime-gpu, then "
                   "the release that https://onnxruntime.ai/docs/execution-providers/CUDA-ExecutionProvider.html"
                   "#requirements lists for CUDA 12) or update the NVIDIA driver to one that runs CUDA 13")
    assert "(torch.version.cuda)" in cuda_ep_problem_from(GPU_BUILD, "12.2", "11.8", "1.18.0", "torch.version.cuda")


@pytest.mark.parametrize("build, machine", [
    ("12.8", "12.4"),   # same major: CUDA minor version compatibility
    ("12.2", "12.9"),
    ("12.8", "13.0"),   # a newer driver runs an older CUDA major (its libraries are checked when the session starts)
    (None, "12.4"),     # build's CUDA unknown (a GPU build without cuda_version): nothing to compare
    ("12.x", "banana"),  # unreadable versions: nothing to compare
])
def test_no_problem_when_the_driver_runs_the_builds_cuda(build, machine):
    assert cuda_ep_problem_from(GPU_BUILD, build, machine, "1.22.0") is None


def test_versions_are_read_as_they_are_printed():
    header = ("| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |\n"
              "|-----------------------------------------+------------------------+----------------------+\n")
    assert parse_smi_cuda(header) == "12.4"
    assert parse_smi_cuda("Driver Version                            : 580.65.06\nCUDA Version                              : 13.0\n") == "13.0"
    assert parse_smi_cuda("No devices were found") is None and parse_smi_cuda("") is None
    assert (cuda_major("12.8"), cuda_major("13"), cuda_major(None), cuda_major(""), cuda_major("x.1")) == (12, 13, None, None, None)


def test_a_session_that_fell_back_to_the_cpu_is_explained():
    plain = cuda_fallback_message(["CPUExecutionProvider"], "12.8", "1.22.0")
    assert plain == ("ONNX Runtime could not start the CUDA execution provider and fell back to ['CPUExecutionProvider'] "
                     "(ONNX Runtime printed why, as 'EP Error ...' or 'Failed to create CUDAExecutionProvider ...'): "
                     "onnxruntime-gpu 1.22.0 needs CUDA 12.x and cuDNN libraries "
                     "it can load (from PyTorch built for the same CUDA major, or NVIDIA's pip wheels)")
    graph = cuda_fallback_message(["CPUExecutionProvider"], None, "1.22.0", cuda_graphs=True)
    assert "needs the CUDA and cuDNN libraries" in graph
    assert graph.endswith("and cuda_graphs (enable_cuda_graph) needs every node on the CUDA execution provider and no "
                          "If/Loop/Scan")


def test_the_output_shape_bound_for_a_cuda_graph_follows_the_inputs_dims():
    assert bound_output_shape(["batch", 3, 32, 32], (8, 3, 32, 32), ["batch", 10]) == [8, 10]
    assert bound_output_shape([4, 3, 32, 32], (4, 3, 32, 32), [4, 10]) == [4, 10]
    assert bound_output_shape(["batch", 3, "h", "w"], (2, 3, 64, 48), ["batch", 21, "h", "w"]) == [2, 21, 64, 48]
    assert bound_output_shape(["batch", 3, 32, 32], (5, 3, 32, 32), ["s0", 10]) == [5, 10]   # unnamed first dim: batch
    assert bound_output_shape([None, 4], (5, 4), [None, 3]) == [5, 3]
    with pytest.raises(VariantUnavailable, match=r"dimension 1 of the output \['batch', 'tokens'\] is none of the input's"):
        bound_output_shape(["batch", 3, 32, 32], (5, 3, 32, 32), ["batch", "tokens"])


# ------------------------------------------------------------------------------ this machine

@pytest.mark.skipif(HAS_CUDA_EP, reason="checks the CPU build's sentence; this onnxruntime has the CUDA EP")
def test_on_the_cpu_build_the_problem_is_the_build():
    msg = cuda_ep_problem()
    assert msg == cuda_ep_problem_from(ort.get_available_providers(), None, None, ort.__version__)
    assert f"onnxruntime {ort.__version__} is the CPU build" in msg and "pip install onnxruntime-gpu" in msg
    assert build_cuda_version() is None  # the CPU wheel's build_and_package_info has no cuda_version
    row = [r for r in OnnxRuntimeEngine.probe() if r["device"] == "cuda"][0]
    assert row["usable"] is False and row["note"] == msg


@pytest.mark.skipif(HAS_CUDA_EP, reason="checks what the CPU build refuses; this onnxruntime has the CUDA EP")
def test_the_cpu_build_refuses_cuda_variants_with_the_reason():
    problem = cuda_ep_problem()
    v = _variant(engine="onnxruntime", device="cuda")
    with pytest.raises(VariantUnavailable) as e:
        v.engine.check(v, True)
    assert str(e.value) == f"device 'cuda': {problem}"
    v = _variant(engine="onnxruntime", device="cuda", cuda_graphs=True)
    with pytest.raises(VariantUnavailable, match="device 'cuda': .*onnxruntime-gpu"):
        v.engine.check(v, True)
    v = _variant(engine="onnxruntime", providers=[CUDA_EP])
    with pytest.raises(VariantUnavailable, match=r"providers \['CUDAExecutionProvider'\] are not in this build .*: "
                                                  r"onnxruntime .* is the CPU build"):
        v.engine.check(v, True)


@pytest.mark.skipif(HAS_CUDA_EP, reason="checks what the CPU build refuses; this onnxruntime has the CUDA EP")
def test_cuda_graph_on_the_cpu_execution_provider_is_refused():
    v = _variant(engine="onnxruntime", cuda_graphs=True)  # device auto: the CPU here
    assert v.label == "onnxruntime-fp32-cudagraph"
    with pytest.raises(VariantUnavailable) as e:
        v.engine.check(v, True)
    assert str(e.value) == ("cuda_graphs: ONNX Runtime captures CUDA graphs with the CUDA execution provider (its option "
                            "enable_cuda_graph), and this variant runs on CPUExecutionProvider: use device: cuda or drop "
                            f"cuda_graphs; {cuda_ep_problem()}")
    v = _variant(engine="onnxruntime", device="cpu", cuda_graphs=True)  # asked for the CPU: no word about the build
    with pytest.raises(VariantUnavailable) as e:
        v.engine.check(v, True)
    assert str(e.value).endswith("runs on CPUExecutionProvider: use device: cuda or drop cuda_graphs")
    v = _variant(engine="onnxruntime", precision="fp16")
    with pytest.raises(VariantUnavailable, match=r"FP16 in ONNX Runtime needs a GPU execution provider \(CUDA\); this "
                                                  r"variant runs on CPUExecutionProvider; onnxruntime .* is the CPU build"):
        v.engine.check(v, True)


# ------------------------------------------------------------------------------ the cuda_graphs path on a tiny model

def _tiny_onnx(path):
    """input [batch, 4] -> MatMul(4x3) + bias -> Relu -> output [batch, 3]"""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["input", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["pre"]),
             helper.make_node("Relu", ["pre"], ["output"])]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return Artifact(ArtifactKind.ONNX_FP32, "f" * 20, "test", path=path, opset=17)


def _batches():
    rng = np.random.default_rng(1)
    return [rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 2, 5)]  # the last shape again: its binding


def test_the_cuda_graph_binding_plumbing_on_cpu_ortvalues(tmp_path):
    """ONNX Runtime's real IOBinding / OrtValue / RunOptions calls of the cuda_graphs path, with the bound buffers on the
    CPU (graph_device): one binding per input shape, inputs copied in with update_inplace, outputs read from the bound
    OrtValue, distinct gpu_graph_ids. What this cannot check: the CUDA graph capture and replay themselves."""
    art = _tiny_onnx(tmp_path / "tiny.onnx")
    plain = create_engine(_variant(engine="onnxruntime", device="cpu"), art)
    plain.load()
    graph = create_engine(_variant(engine="onnxruntime", device="cpu"), art)
    graph.load()
    graph.options = graph.options.model_copy(update={"cuda_graphs": True})
    graph.graph_device = "cpu"
    for x in _batches():
        np.testing.assert_allclose(graph.infer(x), plain.infer(x), rtol=1e-6, atol=1e-6)
    assert sorted(graph._graphs) == [(2, 4), (5, 4)]
    assert sorted(g[3].get_run_config_entry("gpu_graph_id") for g in graph._graphs.values()) == ["1", "2"]
    x = _batches()[0] * 2
    step = graph.prepare_timed(x)
    step()
    step()
    np.testing.assert_allclose(graph._graphs[x.shape][2].numpy(), plain.infer(x), rtol=1e-6, atol=1e-6)
    assert graph.describe()["cuda_graphs"] is True
    graph.close()
    plain.close()


@needs_cuda_ep
def test_cuda_graph_gives_the_plain_cuda_outputs(tmp_path):
    if cuda_ep_problem():
        pytest.skip(cuda_ep_problem())
    art = _tiny_onnx(tmp_path / "tiny.onnx")
    plain = create_engine(_variant(engine="onnxruntime", device="cuda"), art)
    graph = create_engine(_variant(engine="onnxruntime", device="cuda", cuda_graphs=True), art)
    plain.load()
    graph.load()
    assert graph.describe()["providers"][0] == CUDA_EP and graph.device == "cuda"
    for x in _batches() + _batches():  # second pass: the captured graphs replay, with new inputs copied in
        np.testing.assert_allclose(graph.infer(x), plain.infer(x), rtol=1e-5, atol=1e-5)
    x = _batches()[0] * 3
    step = graph.prepare_timed(x)
    for _ in range(3):
        step()
    np.testing.assert_allclose(graph._graphs[x.shape][2].numpy(), plain.infer(x), rtol=1e-5, atol=1e-5)
    graph.close()
    plain.close()
