"""The PyTorch targets' artifact (issue #22): a saved program that a fresh process loads with its own load_model.py,
without qdeploy or the model's source, and that gives the model's outputs. Runs on the CPU (CI has no GPU): the eager
exported program, the static-batch fallback, and (slow) the compiled program: an AOTInductor package where one loads,
else the exported program with torch.compile's cache."""
import ast
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from qdeploy.artifacts import torch_program_loader as loader
from qdeploy.artifacts.torch_program import (LOADER_NAME, MANIFEST, AotiProbe, ProgramSettings, run_in_fresh_process,
                                             save_program)
from qdeploy.benchmark.latency import latency_stats


def small_cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 5)).eval()


class BatchGuarded(torch.nn.Module):
    """A model with a branch on the batch size: torch.export cannot keep that dimension dynamic."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 3)

    def forward(self, x):
        y = x.flatten(1)
        if x.shape[0] > 4:
            y = y * 2
        return self.fc(y)


def _images(n, shape=(3, 8, 8)):
    return np.random.default_rng(0).standard_normal((n, *shape), dtype=np.float32)


def test_the_loader_imports_torch_and_numpy_only():
    tree = ast.parse(open(loader.__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "argparse", "json", "statistics", "sys", "time", "pathlib", "numpy", "torch"}, imported


def test_the_loaders_timing_statistics_are_the_benchmarks():
    samples = list(np.random.default_rng(1).gamma(4.0, 0.1, size=300))
    assert loader.latency_stats(samples) == pytest.approx(latency_stats(samples))
    assert loader.NOISY_CV == pytest.approx(__import__("qdeploy.benchmark.latency", fromlist=["x"]).NOISY_CV)


@pytest.mark.slow  # a subprocess or a whole pipeline
def test_an_eager_program_reloads_in_a_fresh_process_with_the_models_outputs(tmp_path):
    model = small_cnn()
    images = _images(37)
    np.save(tmp_path / "images.npy", images)
    folder = tmp_path / "out"
    manifest = save_program(model, ProgramSettings("cpu", "fp32", batch_sizes=(1, 8), input_shape=(3, 8, 8)), folder)
    assert manifest["format"] == "exported" and manifest["dynamic_batch"] and manifest["programs"] == {"dynamic": "model.pt2"}
    assert {p.name for p in folder.iterdir()} == {"model.pt2", MANIFEST, LOADER_NAME}
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 8, [1, 8],
                               tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    got = np.load(tmp_path / "y.npy")  # 37 images in batches of 8: the last one padded and the padding dropped
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)
    assert res["environment"]["imported_sources"] == []
    assert any("imports torch and numpy only" in line for line in res["log"])
    assert set(res["latency_ms"]) == {"1", "8"} and all(v["p50"] > 0 and v["repeats"] == 3 for v in res["latency_ms"].values())
    # the user's module is not changed by saving (dtype, device, layout)
    assert next(model.parameters()).dtype == torch.float32


def test_argmax_outputs_and_the_model_unchanged_in_memory(tmp_path):
    model = small_cnn()
    folder = tmp_path / "out"
    save_program(model, ProgramSettings("cpu", "fp32", batch_sizes=(4,), input_shape=(3, 8, 8)), folder)
    program = loader.load(folder)
    images = _images(10)
    preds = loader.predict(program, images, 4, outputs="argmax")
    with torch.no_grad():
        assert (preds == model(torch.from_numpy(images)).argmax(1).numpy()).all()


def test_a_batch_size_torch_export_cannot_keep_dynamic_gets_one_program_per_batch_size(tmp_path):
    model = BatchGuarded().eval()
    folder = tmp_path / "out"
    manifest = save_program(model, ProgramSettings("cpu", "fp32", batch_sizes=(1, 8), input_shape=(3, 2, 2)), folder)
    assert manifest["dynamic_batch"] is False and manifest["programs"] == {"1": "model-b1.pt2", "8": "model-b8.pt2"}
    program = loader.load(folder)
    x = _images(8, (3, 2, 2))
    with torch.no_grad():
        assert np.allclose(program(x).numpy(), model(torch.from_numpy(x)).numpy(), atol=1e-5)
        assert np.allclose(program(x[:1]).numpy(), model(torch.from_numpy(x[:1])).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="saved for batch sizes"):
        program(x[:3])


def test_a_cuda_program_on_a_machine_without_a_gpu_says_so(tmp_path):
    folder = tmp_path / "out"
    save_program(small_cnn(), ProgramSettings("cpu", "fp32", batch_sizes=(1,), input_shape=(3, 8, 8)), folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "device": "cuda"}))
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal is for machines without one")
    with pytest.raises(RuntimeError, match="saved for a CUDA GPU"):
        loader.load(folder)


@pytest.mark.slow
def test_a_compiled_program_is_an_aoti_package_where_one_loads_else_the_exported_program_with_its_cache(tmp_path):
    model = small_cnn()
    images = _images(16)
    np.save(tmp_path / "images.npy", images)
    probe = AotiProbe("cpu", tmp_path / "cache")
    loads, why = probe.result()
    folder = tmp_path / "out"
    manifest = save_program(model, ProgramSettings("cpu", "fp32", compile="default", batch_sizes=(1, 8),
                                                   input_shape=(3, 8, 8)), folder, probe)
    assert manifest["format"] == ("aoti" if loads else "exported") and why in manifest["why_format"]
    if not loads:
        assert (folder / manifest["compile_cache"]).stat().st_size > 0
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 8, [1, 8],
                               tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    assert np.allclose(np.load(tmp_path / "y.npy"), want, atol=1e-4)
    assert res["environment"]["imported_sources"] == []
    # the probe's answer is kept per torch version and device: a second probe starts no process
    again = AotiProbe("cpu", tmp_path / "cache")
    assert again.proc is None and again.result() == (loads, why)


@pytest.mark.slow  # a CPU compile
def test_a_warmed_up_program_compiles_every_saved_batch_size_at_load_and_none_at_its_first_request(tmp_path):
    from torch._dynamo.utils import counters

    model = small_cnn()
    folder = tmp_path / "out"
    save_program(model, ProgramSettings("cpu", "fp32", compile="default", batch_sizes=(1, 4), input_shape=(3, 8, 8)),
                 folder)  # no AOTInductor probe: the exported program, compiled at its first call per shape
    torch.compiler.reset()
    counters.clear()
    program = loader.load(folder, warm_up=True)
    compiled_at_load = counters["stats"]["unique_graphs"]
    assert compiled_at_load >= 2  # one static program per saved batch size
    images = _images(4)
    with torch.no_grad():
        assert np.allclose(program(images).numpy(), model(torch.from_numpy(images)).numpy(), atol=1e-4)
        assert np.allclose(program(images[:1]).numpy(), model(torch.from_numpy(images[:1])).numpy(), atol=1e-4)
    assert counters["stats"]["unique_graphs"] == compiled_at_load  # the requests compiled nothing
    assert set(program.warm_up([4])) == {4}


@pytest.mark.slow
def test_the_loader_runs_as_a_script_from_the_folder_with_no_arguments(tmp_path):
    folder = tmp_path / "out"
    save_program(small_cnn(), ProgramSettings("cpu", "fp32", batch_sizes=(2,), input_shape=(3, 8, 8)), folder)
    p = subprocess.run([sys.executable, LOADER_NAME, "--iterations", "20", "--repeats", "1"], cwd=folder,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "batch 2: p50" in p.stdout and "imports torch and numpy only" in p.stdout


@pytest.mark.slow  # a subprocess or a whole pipeline
def test_a_torchao_program_says_it_needs_torchao_and_reloads_with_close_outputs(tmp_path):
    pytest.importorskip("torchao", reason="torchao is a dependency; this environment lacks it")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 5)).eval()
    images = _images(16)
    np.save(tmp_path / "images.npy", images)
    folder = tmp_path / "out"
    manifest = save_program(model, ProgramSettings("cpu", "fp32", compile="default", torchao="int8-weight-only",
                                                   batch_sizes=(8,), input_shape=(3, 8, 8)), folder)
    assert manifest["requires"] == ["torch", "numpy", "torchao"] and manifest["torchao"] == "int8-weight-only"
    # compiled (its cache and the fresh process's compile) under torchao's Inductor settings, recorded with it
    from qdeploy.facts.torchao import INDUCTOR_CONFIG

    assert manifest["inductor_config"] == INDUCTOR_CONFIG and manifest["format"] == "exported"
    assert type(model[1].weight) is torch.nn.Parameter  # the user's model is not quantized in place
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 8, [8], tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    got = np.load(tmp_path / "y.npy")
    cos = (got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos > 0.999 and not np.allclose(got, want, atol=1e-7)  # INT8 weights: close, not identical
    assert res["environment"]["imported_sources"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
@pytest.mark.parametrize("scheme", ["float8-dynamic", "int8-weight-only"])
def test_a_compiled_torchao_program_reloads_on_the_gpu(tmp_path, scheme):
    from qdeploy.facts.torchao import torchao_problem

    problem = torchao_problem(scheme, "cuda")
    if problem:
        pytest.skip(problem)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 32)).eval()
    images = _images(64)
    np.save(tmp_path / "images.npy", images)
    folder = tmp_path / "out"
    save_program(model, ProgramSettings("cuda", "bf16", channels_last=False, compile="default", cuda_graphs=True,
                                        torchao=scheme, batch_sizes=(1, 32), input_shape=(3, 8, 8)), folder,
                 AotiProbe("cuda", tmp_path / "cache"))
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 32, [1, 32],
                               tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    got = np.load(tmp_path / "y.npy")
    assert (got * want).sum() / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.99
    assert set(res["latency_ms"]) == {"1", "32"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_a_cuda_graph_program_reloads_on_the_gpu_with_the_models_outputs(tmp_path):
    model = small_cnn()
    images = _images(40)
    np.save(tmp_path / "images.npy", images)
    folder = tmp_path / "out"
    save_program(model, ProgramSettings("cuda", "fp16", channels_last=True, compile="default", cuda_graphs=True,
                                        batch_sizes=(1, 8), input_shape=(3, 8, 8)), folder,
                 AotiProbe("cuda", tmp_path / "cache"))
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 8, [1, 8],
                               tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    assert np.allclose(np.load(tmp_path / "y.npy"), want, atol=2e-2)
    assert res["environment"]["imported_sources"] == [] and res["environment"]["gpu"]


class _MaskFromScalars(torch.nn.Module):
    """Builds a constant in forward with torch.tensor, as torchvision's Swin builds its shifted-window mask."""

    def forward(self, x):
        mask = torch.zeros(x.shape[-2:])
        mask[: x.shape[-2] // 2] = torch.tensor(-100.0)
        return x + mask


def test_tensor_constants_an_export_lifts_follow_the_program_to_its_device():
    """Issue 35: torchvision Swin's saved program failed its CUDA graph capture in the fresh process, its lifted CPU
    constants being copied to the GPU on every call. The loader moves them (here to 'meta', the device-move a CPU-only
    machine can check); the values are the same on CPU."""
    from qdeploy.artifacts.torch_program_loader import constants_to_device

    x = torch.randn(2, 3, 4, 4)
    ep = torch.export.export(_MaskFromScalars(), (x,))
    module = ep.module()
    lifted = [v for sub in module.modules() for v in vars(sub).values() if isinstance(v, torch.Tensor)]
    assert lifted and all(v.device.type == "cpu" for v in lifted)  # what Module.to would leave behind
    torch.testing.assert_close(constants_to_device(module, "cpu")(x), _MaskFromScalars()(x))
    moved = constants_to_device(ep.module(), "meta")
    assert all(v.device.type == "meta" for sub in moved.modules() for v in vars(sub).values() if isinstance(v, torch.Tensor))


@pytest.mark.slow  # a subprocess and a CPU compile
@pytest.mark.parametrize("aoti", [False, True], ids=["exported", "aoti-where-it-loads"])
def test_a_frozen_program_records_freezing_and_reloads_with_the_models_outputs(tmp_path, aoti):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    with torch.no_grad():  # BatchNorm statistics that folding has to carry
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    images = _images(16)
    np.save(tmp_path / "images.npy", images)
    folder = tmp_path / "out"
    probe = AotiProbe("cpu", tmp_path / "cache") if aoti else None  # as optimize saves a compiled program
    manifest = save_program(model, ProgramSettings("cpu", "fp32", compile="default", freezing=True,
                                                   batch_sizes=(8,), input_shape=(3, 8, 8)), folder, probe)
    assert manifest["freezing"] is True and manifest["inductor_config"] == {"freezing": True}
    assert manifest["format"] == ("aoti" if aoti and probe.result()[0] else "exported")
    res = run_in_fresh_process(folder, tmp_path / "images.npy", tmp_path / "y.npy", "logits", 8, [8], tmp_path / "r.json")
    with torch.no_grad():
        want = model(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-4)
    assert res["environment"]["imported_sources"] == []
