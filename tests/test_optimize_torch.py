"""`qdeploy optimize` for the PyTorch targets (issue #22): typed candidates (precision × layout × runtime), brief timing
then the finalists, and the chosen candidate saved as a program in --out and confirmed from there in a fresh process.
torch-cpu runs the whole protocol on CI; torch-cuda's own test skips without a GPU (run it on the GPU machine)."""
import json

import numpy as np
import pytest
import torch

from qdeploy import api
from qdeploy.config import OptimizeConfig
from qdeploy.errors import ConfigError
from qdeploy.optimize.candidates import (CANDIDATE_KINDS, TARGETS, CompiledCandidate, CudaGraphCandidate,
                                         EagerCandidate, TorchFp32Reference, geomean, plan, program_settings)
from qdeploy.optimize.decide import choose
from test_optimize import _opt_config


def test_torch_cuda_plans_the_strict_fp32_reference_then_each_precision_eager():
    planned = plan(OptimizeConfig(target="torch-cuda"), TARGETS["torch-cuda"])
    assert [type(c) for c in planned] == [TorchFp32Reference, EagerCandidate, EagerCandidate, EagerCandidate]
    assert [c.variant for c in planned] == ["fp32", "fp32-tf32-eager", "fp16-eager", "bf16-eager"]
    assert planned[0].reference and "tf32" not in planned[0].spec and planned[1].spec["tf32"] is True
    assert "strict, no TF32" in planned[0].describe() and "TF32 math" in planned[1].describe()
    cpu = plan(OptimizeConfig(target="torch-cpu"), TARGETS["torch-cpu"])
    assert [c.variant for c in cpu] == ["fp32"]  # no reduced precision, no TF32 on a CPU


def test_each_runtime_is_one_kind_with_a_unique_name_and_the_settings_it_is_saved_with():
    t = TARGETS["torch-cuda"]
    cands = [k.planned(t, p, cl, tf32) for k in (EagerCandidate, CudaGraphCandidate)
             for p, tf32 in (("fp32", False), ("fp32", True), ("fp16", False), ("bf16", False)) for cl in (False, True)]
    cands += [CompiledCandidate.planned(t, "fp16", cl, False, mode, g) for cl in (False, True)
              for mode in ("default", "max-autotune-no-cudagraphs") for g in (False, True)]
    names = [c.variant for c in cands]
    assert len(set(names)) == len(names)
    assert {"torch-fp32", "torch-eager", "torch-cudagraph", "torch-compile"} <= set(CANDIDATE_KINDS)
    c = CompiledCandidate.planned(t, "fp16", True, False, "default", True)
    assert c.variant == "fp16-cl-compile-cudagraph" and c.kind == "torch-compile"
    s = program_settings(c.spec, [1, 32], (3, 64, 64))
    assert (s.device, s.precision, s.channels_last, s.compile, s.cuda_graphs, s.batch_sizes) == \
        ("cuda", "fp16", True, "default", True, (1, 32))
    assert program_settings(CudaGraphCandidate.planned(t, "fp32", False, True).spec, [1], (3, 8, 8)).tf32 is True


def test_candidates_rank_on_the_geometric_mean_over_batch_sizes_and_fp32_wins_only_when_as_fast():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0) and geomean([]) is None
    def cand(cls, name, precision, **numbers):
        return cls({"name": name, "precision": precision}, status="ok", **numbers)

    ref = cand(TorchFp32Reference, "fp32", "fp32", rank_key=2.0, latency_p50_ms=2.0, within_budget=True, margin=0.3,
               latency_p50_by_batch={"1": 1.0, "32": 4.0})
    fast = cand(CompiledCandidate, "fp16-cl-compile-cudagraph", "fp16", rank_key=0.3, latency_p50_ms=0.3,
                within_budget=True, margin=0.3)
    chosen, met, why = choose([ref, fast], measured=True)
    assert chosen is fast and met
    slow = cand(EagerCandidate, "fp16-eager", "fp16", rank_key=2.05, latency_p50_ms=2.05, within_budget=True, margin=0.3)
    chosen, met, why = choose([ref, slow], measured=True)
    assert chosen is ref and "geometric mean of p50 over batch sizes 1, 32" in why[0]
    assert "nothing runs it faster here" in why[0] and "INT8" not in why[0]


@pytest.mark.slow
def test_torch_cpu_saves_the_chosen_program_and_confirms_it_from_out_in_a_fresh_process(tmp_path):
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", compile_modes=[])
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    on_disk = json.loads((out / "optimize.json").read_text())
    assert on_disk["chosen"]["artifact"] == "model.pt2" and (out / "model.pt2").is_file()
    assert {"load_model.py", "qdeploy-program.json", "optimize.json", "optimize.html"} <= {p.name for p in out.iterdir()}
    kinds = {c["kind"] for c in on_disk["candidates"]}
    assert kinds <= {"torch-fp32", "torch-eager"} and "torch-fp32" in kinds
    assert {c["variant"] for c in on_disk["candidates"]} == {"fp32", "fp32-cl-eager"}
    # the torch targets' default time limit covers the whole optimize: the search's share is stated
    assert 0 < on_disk["stages"]["search_s"] < on_disk["time_s"]
    assert any(d.startswith("search: ") and "time_limit 300 s" in d and "the default limit covers them" in d
               for d in on_disk["decisions"])
    program = on_disk["program"]
    assert program["error"] is None and program["manifest"]["format"] == "exported"
    assert program["fresh_process"]["environment"]["imported_sources"] == []
    assert set(program["latency_p50_ms"]) == {"1", "4"} and all(v > 0 for v in program["latency_p50_ms"].values())
    # FP32 eager saved and reloaded: the confirm split's outputs are the reference's
    c = on_disk["chosen"]
    assert c["confirm_metric"] == c["reference_confirm_metric"] and c["confirm_agreement"] == 1.0
    assert on_disk["budget_met"] is True
    assert any(d.startswith("confirm split (the saved program, in a fresh process)") for d in s["decisions"])
    # every file the summary lists is in --out with its hash
    from qdeploy.utils.hashing import sha256_file
    for a in on_disk["artifacts"]:
        assert sha256_file(out / a["path"]) == a["sha256"]
    # the program runs without qdeploy: load_model.py from --out
    import importlib.util
    spec = importlib.util.spec_from_file_location("load_model_under_test", out / "load_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prog = mod.load(out)
    y = prog(np.zeros((2, 3, 16, 16), np.float32))
    assert tuple(y.shape) == (2, 3)


@pytest.mark.slow
def test_a_chosen_program_that_fails_from_out_gives_way_to_the_next_candidate(tmp_path, monkeypatch):
    """A chosen program can run in the search and fail in the fresh process (torchvision Swin's did); optimize must
    still end with an artifact. The first confirmation here is made to fail after the program was written (fault
    injection on qdeploy's own step): the next candidate within budget is saved and confirmed instead, the failed
    attempt's files are gone and optimize.json says what was replaced and why."""
    from qdeploy.optimize.steps import confirm as confirm_step

    real, calls = confirm_step.confirm_program, []

    def first_fails(s, cctx, chosen, cref):
        calls.append(chosen.variant)
        out = real(s, cctx, chosen, cref)
        if len(calls) == 1:
            (cctx.output.staging / "model.pt2").rename(cctx.output.staging / "model-left-over.pt2")
            return {"variant": chosen.variant, "error": "injected: the fresh process could not load model.pt2"}
        return out

    monkeypatch.setattr(confirm_step, "confirm_program", first_fails)
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", compile_modes=[])
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    assert len(calls) == 2 and calls[0] != calls[1] and s["chosen"]["variant"] == calls[1]
    assert s["program"]["error"] is None and s["program"]["replaces"] == [
        {"variant": calls[0], "error": "injected: the fresh process could not load model.pt2"}]
    assert (out / "model.pt2").is_file() and not (out / "model-left-over.pt2").exists()
    assert any("saving the next candidate within budget instead" in d for d in s["decisions"])
    assert s["budget_met"] is True


@pytest.mark.slow
def test_the_fastest_candidate_is_measured_even_when_the_time_limit_is_reached_before_the_finalists(tmp_path,
                                                                                                     monkeypatch):
    """The clock is made to run out once brief timing has ranked the candidates (fault injection on qdeploy's own
    session clock: a real compile that overruns its estimate is what does it on a GPU): the fastest by brief timing is
    still evaluated and can be chosen, the others are not measured."""
    from qdeploy.optimize.session import SearchSession
    from qdeploy.optimize.steps.torch_runtimes import FASTEST_MEASURED_WHY

    real_note, late = SearchSession.note, []

    def note(self, line, warning=False):
        if line.startswith("measured fully"):
            late.append(line)
        real_note(self, line, warning)

    monkeypatch.setattr(SearchSession, "note", note)
    monkeypatch.setattr(SearchSession, "out_of_time", lambda self: bool(late))
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", compile_modes=[], finalists=2)
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    finalists = late[0].split(": ", 1)[1].split(", ")
    assert finalists and finalists != ["none"]
    rows = {c["variant"]: c for c in s["candidates"]}
    assert rows[finalists[0]]["search_metric"] is not None  # evaluated past the limit
    assert f"{finalists[0]}: measured past optimize.time_limit ({FASTEST_MEASURED_WHY})" in s["decisions"]
    assert all(rows[v]["search_metric"] is None for v in finalists[1:])


@pytest.mark.slow
def test_torch_cpu_compiles_its_best_pair_and_reports_compile_time(tmp_path):
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", finalists=1, time_limit=400)
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    # a limit the user sets bounds the search alone (the default one covers saving and confirming too)
    assert any(d.startswith("search: ") and "time_limit 400 s" in d and "outside the limit" in d for d in s["decisions"])
    compiled = [c for c in s["candidates"] if c["kind"] == "torch-compile"]
    assert compiled and all(c["compile_s"] is not None and c["compile_s"] >= 0 for c in compiled)
    assert all(c["brief_p50_ms"] and set(c["brief_p50_ms"]) == {"1", "4"} for c in compiled if c["status"] != "failed")
    assert sum(1 for c in s["candidates"] if c["search_metric"] is not None) <= 2  # the reference + 1 finalist
    assert any(d.startswith("torch.compile candidates timed briefly") for d in s["decisions"])
    # on the CPU the fastest compiled program is compiled again with Inductor's freezing (facts/inductor.py)
    frozen = [c for c in s["candidates"] if c["kind"] == "torch-frozen"]
    assert len(frozen) == 1 and frozen[0]["variant"].endswith("-compile-frozen") and frozen[0]["brief_p50_ms"]
    assert any(d.startswith("Inductor freezing on ") for d in s["decisions"])
    assert (tmp_path / "out" / s["chosen"]["artifact"]).is_file()


def test_torch_targets_need_a_pytorch_model(tmp_path):
    import onnx

    cfg = _opt_config(tmp_path, budget={"max_drop": 1.0}, target="torch-cpu")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(model, (torch.zeros(1, 3, 16, 16),), str(path), input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "n"}, "output": {0: "n"}}, dynamo=False)
    onnx.checker.check_model(str(path))
    cfg["model"] = {"source": str(path), "task": "classification", "preprocess": cfg["model"]["preprocess"]}
    with pytest.raises(ConfigError, match="torch-cpu runs the PyTorch model, but model.source is an ONNX or Keras model"):
        api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_torch_cuda_chooses_a_captured_or_compiled_program_and_reloads_it(tmp_path):
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cuda", finalists=2)
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert s["program"]["error"] is None
    assert s["program"]["fresh_process"]["environment"]["imported_sources"] == []
    assert s["program"]["fresh_process"]["environment"]["gpu"]
    kinds = {c["kind"] for c in s["candidates"]}
    assert {"torch-fp32", "torch-eager", "torch-cudagraph", "torch-compile"} <= kinds


def test_torchao_candidates_are_opt_in_and_start_from_a_compiled_candidate():
    from qdeploy.facts.torchao import SCHEMES, torchao_problem
    from qdeploy.optimize.candidates import TorchaoCandidate

    assert OptimizeConfig(target="torch-cuda").torchao == []  # opt-in: see the field's description
    base = CompiledCandidate.planned(TARGETS["torch-cuda"], "bf16", True, False, "default", True)
    c = TorchaoCandidate.planned_from(base, "float8-dynamic")
    assert c.kind == "torch-ao" and c.variant == "bf16-cl-compile-cudagraph-ao-float8-dynamic"
    assert program_settings(c.spec, [1], (3, 8, 8)).torchao == "float8-dynamic"
    assert "torchao float8-dynamic on the Linear layers" in c.describe()
    assert SCHEMES["float8-dynamic"].min_capability == (8, 9)
    assert "CUDA GPU only" in torchao_problem("float8-dynamic", "cpu") or "torchao package" in torchao_problem("float8-dynamic", "cpu")


def test_a_frozen_candidate_is_its_base_compiled_with_freezing_and_the_gpu_tries_it_where_a_batchnorm_folds():
    import torch
    from torch import nn

    from qdeploy.facts.inductor import freezing_default
    from qdeploy.optimize.candidates import FrozenCandidate

    base = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", True, False, "default", True)
    c = FrozenCandidate.planned_from(base)
    assert c.kind == "torch-frozen" and c.variant == "fp16-cl-compile-cudagraph-frozen"
    settings = program_settings(c.spec, [1], (3, 8, 8))
    assert settings.freezing is True and settings.compile == "default" and settings.cuda_graphs is True
    assert program_settings(base.spec, [1], (3, 8, 8)).freezing is False
    assert "Inductor freezing" in c.describe()
    assert OptimizeConfig(target="torch-cuda").freezing is None  # the device decides, unless set
    conv_bn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    conv_ln = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(1, 8), nn.Flatten(), nn.LazyLinear(4))
    x = torch.randn(1, 3, 8, 8)
    assert freezing_default("cpu", conv_ln, x) == (True, []) and freezing_default("cpu") == (True, [])
    assert freezing_default("cuda", conv_bn, x) == (True, ["BatchNorm into the convolutions before them"])
    assert freezing_default("cuda", conv_ln, x) == (False, [])
    assert freezing_default("cuda", None) == (False, [])  # no PyTorch model to look at (an ONNX source)
    from torchvision.ops.misc import FrozenBatchNorm2d  # a detection backbone's norm: buffers, no BatchNorm class

    assert freezing_default("cuda", nn.Sequential(nn.Conv2d(3, 8, 3), FrozenBatchNorm2d(8), nn.ReLU()))[0]


def qkv_attention(bias=True, fused=False, dim=16):
    """Attention written as Hugging Face's ViT/Swin and much hand-written code write it: query, key and value as three
    Linear layers on one input (``bias``: theirs); ``fused``: timm's one qkv layer instead."""
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            if fused:
                self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
            else:
                self.query, self.key, self.value = (nn.Linear(dim, dim, bias=bias) for _ in range(3))
            self.proj = nn.Linear(dim, 10)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1) if fused else (self.query(x), self.key(x), self.value(x))
            return self.proj(torch.softmax(q @ k.transpose(-1, -2), -1) @ v).mean(1)

    return Attention().eval()


def test_the_gpu_tries_freezing_where_linear_layers_share_an_input_which_freezing_concatenates():
    import torch

    from qdeploy.facts.inductor import concatenable_linears, freezing_default

    x = torch.randn(1, 5, 16)
    for bias in (True, False):
        assert concatenable_linears(qkv_attention(bias), x) == [["query", "key", "value"]]
        tried, folds = freezing_default("cuda", qkv_attention(bias), x)
        assert tried and folds == ["1 group(s) of Linear layers on one input into one matmul each "
                                   "(e.g. query, key, value)"]
    assert freezing_default("cuda", qkv_attention(fused=True), x) == (False, [])  # timm's: one layer already
    assert freezing_default("cuda", qkv_attention(), None) == (False, [])  # no batch to run: not looked for
    assert freezing_default("cpu", qkv_attention(fused=True), x) == (True, [])  # the CPU: always

    from torch import nn

    class TwoHeads(nn.Module):  # a pair of Linear layers on one input: Inductor concatenates only an unbiased pair
        def __init__(self, bias):
            super().__init__()
            self.a, self.b = nn.Linear(8, 4, bias=bias), nn.Linear(8, 4, bias=bias)

        def forward(self, x):
            return self.a(x) + self.b(x)

    assert concatenable_linears(TwoHeads(False), torch.randn(2, 8)) == [["a", "b"]]
    assert concatenable_linears(TwoHeads(True), torch.randn(2, 8)) == []
    assert concatenable_linears(TwoHeads(False), torch.randn(2, 9)) == []  # a forward that fails says nothing

    class Twice(nn.Module):  # one layer called twice on a tensor: one matmul, nothing to concatenate
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4, bias=False)

        def forward(self, x):
            return self.a(x) * self.a(x)

    assert concatenable_linears(Twice(), torch.randn(2, 8)) == []


@pytest.mark.slow
def test_freezing_concatenates_the_linear_layers_on_one_input_into_one_matmul():
    """The fact the GPU's freezing default rests on for separate query, key and value layers: Inductor's freezing
    replaces the three matmuls by one (on the CPU only with cpp.enable_concat_linear, which a GPU graph does not need;
    counted here as the Linear layers oneDNN packs: four without, two with), and the output stays the model's."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor

    torch.manual_seed(0)
    model, x = qkv_attention(), torch.randn(2, 5, 16)
    packed = {}
    for concat in (False, True):
        counters.clear()
        torch.compiler.reset()
        with torch.no_grad(), inductor.patch({"freezing": True, "cpp.enable_concat_linear": concat}):
            want, got = model(x), torch.compile(model)(x)
        packed[concat] = counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"]
        assert torch.allclose(got, want, atol=1e-5)
    assert packed == {False: 4, True: 2}


@pytest.mark.slow
def test_freezing_folds_a_frozen_batchnorm_into_the_convolution_as_it_does_a_batchnorm():
    """The fact freezing_default rests on for a detection backbone's FrozenBatchNorm2d: Inductor's binary folding
    takes its multiply and add into the convolution's weights (counted), and the output stays the model's."""
    import torch
    from torch import nn
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(0)
    norm = FrozenBatchNorm2d(8)
    for buffer, (low, high) in ((norm.weight, (0.5, 2)), (norm.bias, (-1, 1)), (norm.running_mean, (-1, 1)),
                                (norm.running_var, (0.5, 2))):
        buffer.uniform_(low, high)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.ReLU()).eval()
    x = torch.randn(2, 3, 16, 16)
    counters.clear()
    torch.compiler.reset()
    with torch.no_grad(), inductor.patch(freezing=True):
        want, got = model(x), torch.compile(model)(x)
    assert counters["inductor"]["binary_folding_conv"] >= 2  # the multiply and the add
    assert torch.allclose(got, want, atol=1e-4)


def test_onnxruntime_cuda_plans_fp32_fp16_and_their_cuda_graphs_and_says_why_it_cannot_run_here(tmp_path):
    planned = plan(OptimizeConfig(target="onnxruntime-cuda"), TARGETS["onnxruntime-cuda"])
    assert [c.variant for c in planned] == ["fp32", "fp16", "fp32-cudagraph", "fp16-cudagraph"]
    assert all(c.spec["engine"] == "onnxruntime" and c.spec["device"] == "cuda" for c in planned)
    assert planned[2].spec["cuda_graphs"] is True and "CUDA graph replay" in planned[3].describe()
    from qdeploy.facts.onnxruntime import cuda_ep_problem

    problem = cuda_ep_problem()
    if problem is None:
        pytest.skip("this onnxruntime runs the CUDA execution provider here")
    cfg = _opt_config(tmp_path, budget={"max_drop": 1.0}, target="onnxruntime-cuda")
    with pytest.raises(ConfigError, match="optimize.target onnxruntime-cuda: .*onnxruntime-gpu"):
        api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_every_precision_within_budget_is_compiled_in_its_faster_layout():
    """Brief eager timings are launch-bound and noisy (EfficientNet's eager FP16 reads slower than its FP32 although
    compiled FP16 is faster, docs/results/gpu/gpu_reference.json), so they never prune a precision: every precision that
    reached the runtime search is compiled, each in the layout its brief timing favours."""
    from types import SimpleNamespace as C

    from qdeploy.optimize.steps.torch_runtimes import compile_pairs

    brief = [C(precision="fp32", tf32=True, channels_last=True, brief_rank=4.9),
             C(precision="fp32", tf32=True, channels_last=False, brief_rank=5.3),
             C(precision="fp16", tf32=False, channels_last=False, brief_rank=12.0),
             C(precision="fp16", tf32=False, channels_last=True, brief_rank=10.9),
             C(precision="bf16", tf32=False, channels_last=True, brief_rank=None),  # failed to time: not compiled
             C(precision="bf16", tf32=False, channels_last=False, brief_rank=11.5),
             C(precision="fp32", tf32=False, channels_last=False, brief_rank=6.0)]
    # strict FP32 is left out where TF32 is kept (torch_runtimes.TF32_DOMINATES_WHY), compiled where it is not
    assert compile_pairs(brief) == [("fp32", True, True), ("fp16", False, True), ("bf16", False, False)]
    assert compile_pairs([c for c in brief if not c.tf32]) == [("fp32", False, False), ("fp16", False, True),
                                                               ("bf16", False, False)]


def test_layouts_a_brief_timing_cannot_separate_are_both_compiled_after_the_others():
    """Two layouts within the latency tie by brief timing are a coin toss (on a ViT, contiguous ahead in one of three
    runs and channels_last in the others, docs/results/gpu/optimize_stability.json). Within the tie both layouts are
    compiled, the second ones after every precision's first (the time limit cuts them first)."""
    from types import SimpleNamespace as C

    from qdeploy.optimize.decide import LATENCY_TIE
    from qdeploy.optimize.steps.torch_runtimes import compile_pairs

    brief = [C(precision="fp16", tf32=False, channels_last=False, brief_rank=0.292),
             C(precision="fp16", tf32=False, channels_last=True, brief_rank=0.292 * (1 + LATENCY_TIE / 2)),
             C(precision="fp32", tf32=True, channels_last=False, brief_rank=0.368),
             C(precision="fp32", tf32=True, channels_last=True, brief_rank=0.368 * (1 + 2 * LATENCY_TIE)),
             C(precision="bf16", tf32=False, channels_last=True, brief_rank=0.30)]   # one layout timed only
    assert compile_pairs(brief) == [("fp16", False, False), ("bf16", False, True), ("fp32", True, False),
                                    ("fp16", False, True)]


def test_compiles_with_cuda_graphs_come_first_and_the_time_limit_cuts_the_least_promising():
    """A time-limited search on a torchvision Swin compiled fp16 without a graph (2.9 ms) before the graph variant
    (0.584 ms) and then ran out of time: every pair's graph variant is compiled first, the most promising pair first,
    so the end of the list (what a time limit cuts) is compile-only of the least promising pairs."""
    from qdeploy.optimize.steps.torch_runtimes import compile_order

    pairs = [("fp16", False, True), ("fp32", True, False)]
    order = compile_order(pairs, ["default", "max-autotune-no-cudagraphs"], cudagraph=True)
    assert order[:4] == [("fp16", False, True, "default", True), ("fp16", False, True, "max-autotune-no-cudagraphs", True),
                         ("fp32", True, False, "default", True), ("fp32", True, False, "max-autotune-no-cudagraphs", True)]
    assert all(not g for *_, g in order[4:]) and len(order) == 8 and len(set(order)) == 8
    assert order[-1] == ("fp32", True, False, "max-autotune-no-cudagraphs", False)
    assert compile_order(pairs, ["default"], cudagraph=False) == [("fp16", False, True, "default", False),
                                                                   ("fp32", True, False, "default", False)]


def test_a_program_is_compiled_alone_only_where_its_cuda_graph_could_not_be_captured():
    """GRAPH_DOMINATES_WHY: the graph replays the program's kernels without the launches, so compile-only is compiled
    only for the programs whose graph twin failed (or was not compiled), per precision, layout and mode."""
    from qdeploy.optimize.steps.torch_runtimes import graph_twin_ran

    t = TARGETS["torch-cuda"]
    ran = CompiledCandidate.planned(t, "fp16", True, False, "default", True)
    ran.brief_rank = 0.5
    failed = CompiledCandidate.planned(t, "bf16", True, False, "default", True)  # capture failed: no brief rank
    compiled = [ran, failed]
    alone = lambda p, cl, mode="default": CompiledCandidate.planned(t, p, cl, False, mode, False)  # noqa: E731
    assert graph_twin_ran(alone("fp16", True), compiled)
    assert not graph_twin_ran(alone("fp16", False), compiled)  # the other layout: another program
    assert not graph_twin_ran(alone("fp16", True, "max-autotune-no-cudagraphs"), compiled)  # another mode
    assert not graph_twin_ran(alone("bf16", True), compiled)  # its graph could not be captured


def test_the_default_time_limit_keeps_room_for_saving_and_confirming_a_user_limit_bounds_the_search():
    """A compile starts with RESERVE x its estimate left; under the PyTorch targets' default limit (the whole optimize
    in 5 minutes) also the saved program's compile (about as long) and the confirm run must fit after it."""
    from qdeploy.optimize.steps.torch_runtimes import CONFIRM_RESERVE_S, RESERVE, compile_fits

    assert compile_fits(None, 60.0, True) and compile_fits(10.0, None, True)  # no limit; nothing timed yet
    assert compile_fits(RESERVE * 60.0, 60.0, False) and not compile_fits(RESERVE * 60.0 - 1, 60.0, False)
    need = RESERVE * 60.0 + 60.0 + CONFIRM_RESERVE_S
    assert compile_fits(need, 60.0, True) and not compile_fits(need - 1, 60.0, True)


def test_the_save_is_reserved_as_a_cache_hit_only_for_a_program_compiled_from_its_exported_graph():
    """The saved program's compile hits Inductor's cache of the search's compile of the same exported program (5.8 s
    after a 36.7 s compile on an H200), but not for a frozen program (Inductor caches no frozen constants) nor for one
    compiled from the model where torch.export failed: those are reserved a whole compile."""
    from qdeploy.optimize.candidates import FrozenCandidate
    from qdeploy.optimize.steps.torch_runtimes import (CONFIRM_RESERVE_S, RESERVE, SAVE_CACHE_HIT_SHARE, compile_fits,
                                                       save_compile_estimate)

    exported = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", True, False, "default", True)
    exported.exported = True
    from_model = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", False, False, "default", True)
    from_model.exported = False
    frozen = FrozenCandidate.planned_from(exported)
    frozen.exported = True
    assert save_compile_estimate(exported, 36.7) == pytest.approx(SAVE_CACHE_HIT_SHARE * 36.7)
    assert save_compile_estimate(from_model, 36.7) == 36.7 and save_compile_estimate(frozen, 36.7) == 36.7
    assert save_compile_estimate(None, 36.7) == 36.7 and save_compile_estimate(exported, None) is None
    # ResNet-50's search on the H200: 112 s left, compiles of up to 36.7 s
    assert compile_fits(112.0, 36.7, True, save_compile_estimate(exported, 36.7))
    assert not compile_fits(112.0, 36.7, True, save_compile_estimate(frozen, 36.7))
    assert RESERVE * 36.7 + 36.7 + CONFIRM_RESERVE_S > 112.0


def test_the_patch_matmul_candidate_is_its_base_rewritten_and_tried_where_a_patch_convolution_is():
    from torch import nn

    from qdeploy.facts.patch_matmul import patch_matmul_by_default
    from qdeploy.optimize.candidates import PatchMatmulCandidate

    base = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", True, False, "default", True)
    c = PatchMatmulCandidate.planned_from(base)
    assert c.kind == "torch-patchmm" and c.variant == "fp16-cl-compile-cudagraph-patchmm"
    assert program_settings(c.spec, [1], (3, 8, 8)).patch_matmul is True
    assert program_settings(base.spec, [1], (3, 8, 8)).patch_matmul is False
    assert "patch convolutions as matmuls" in c.describe()
    assert OptimizeConfig(target="torch-cuda").patch_matmul is None
    vit = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.Flatten(), nn.LazyLinear(4))
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, 2), nn.BatchNorm2d(8))
    assert patch_matmul_by_default(vit) and not patch_matmul_by_default(cnn)
    assert not patch_matmul_by_default(None)  # no PyTorch model to look at (an ONNX source)


def test_the_depthwise_stencil_candidate_is_its_base_rewritten_and_opt_in():
    from torch import nn

    from qdeploy.facts.depthwise_stencil import DEPTHWISE_STENCIL_DEFAULT_WHY, depthwise_stencil_by_default
    from qdeploy.optimize.candidates import DepthwiseStencilCandidate

    base = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", True, False, "default", True)
    c = DepthwiseStencilCandidate.planned_from(base)
    assert c.kind == "torch-dwstencil" and c.variant == "fp16-cl-compile-cudagraph-dwstencil"
    assert program_settings(c.spec, [1], (3, 8, 8)).depthwise_stencil is True
    assert program_settings(base.spec, [1], (3, 8, 8)).depthwise_stencil is False
    assert "depthwise convolutions as fused stencils" in c.describe()
    assert OptimizeConfig(target="torch-cuda").depthwise_stencil is None
    dw = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=8))
    assert not depthwise_stencil_by_default(dw, "cuda") and not depthwise_stencil_by_default(dw, "cpu")
    assert "not tried unless optimize.depthwise_stencil is true" in DEPTHWISE_STENCIL_DEFAULT_WHY


def test_the_gelu_epilogue_candidate_is_its_base_rewritten_and_on_by_default_on_the_gpu_where_a_model_has_one():
    from torch import nn

    from qdeploy.facts.gelu_epilogue import gelu_epilogue_by_default
    from qdeploy.optimize.candidates import GeluEpilogueCandidate

    base = CompiledCandidate.planned(TARGETS["torch-cuda"], "fp16", True, False, "default", True)
    c = GeluEpilogueCandidate.planned_from(base)
    assert c.kind == "torch-geluepi" and c.variant == "fp16-cl-compile-cudagraph-geluepi"
    assert program_settings(c.spec, [1], (3, 8, 8)).gelu_epilogue is True
    assert program_settings(base.spec, [1], (3, 8, 8)).gelu_epilogue is False
    assert "GELU in the matmul's epilogue" in c.describe()
    assert OptimizeConfig(target="torch-cuda").gelu_epilogue is None
    mlp = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4))
    assert gelu_epilogue_by_default(mlp, "cuda") and not gelu_epilogue_by_default(mlp, "cpu")
    assert not gelu_epilogue_by_default(nn.Sequential(nn.Linear(4, 16), nn.ReLU()), "cuda")
    assert not gelu_epilogue_by_default(None, "cuda")  # no PyTorch model to look at (an ONNX source)


def test_the_rewrites_of_the_fastest_program_are_compiled_before_the_tied_layouts(monkeypatch):
    """A ResNet-50 search on an H200 compiled the tied layout before the frozen program and then had too little of the
    default limit left for it (112 s against 122 needed): the rewrites (freezing, patch matmul) of the fastest program
    come right after each precision's first program, and the time limit cuts the tied layouts first. The compiles are
    stood in for by a recorder (real ones take minutes); what is checked is the order the search asks for them."""
    from types import SimpleNamespace

    from torch import nn

    from qdeploy.optimize.steps import torch_runtimes

    order, rank = [], {"fp16-cl": 1.0, "bf16-cl": 1.2, "fp16": 1.02}

    def compile_briefly(s, cand):
        order.append(cand.variant)
        base = cand.variant.split("-compile")[0]
        cand.timed_briefly({"32": rank[base] * (0.9 if cand.variant != f"{base}-compile-cudagraph" else 1.0)}, 30.0)
        return cand

    monkeypatch.setattr(torch_runtimes, "_time_briefly", compile_briefly)
    model = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.BatchNorm2d(8))
    notes = []
    s = SimpleNamespace(target=TARGETS["torch-cuda"], o=OptimizeConfig(target="torch-cuda"), timed_out=False,
                        limit_covers_saving=True, time_left=lambda: 1000.0, note=notes.append, stages={}, rank_batches=[32],
                        ctx=SimpleNamespace(builder=SimpleNamespace(
                            has_torch=True, torch_model=lambda: model,
                            check_inputs=lambda: np.zeros((2, 3, 8, 8), np.float32))))
    pairs = [("fp16", False, True), ("bf16", False, True), ("fp16", False, False)]  # the last: fp16's tied layout
    compiled, rewritten, _ = torch_runtimes.compile_stage(s, pairs, primary=2)
    assert order[:4] == ["fp16-cl-compile-cudagraph", "bf16-cl-compile-cudagraph",
                         "fp16-cl-compile-cudagraph-frozen", "fp16-cl-compile-cudagraph-frozen-patchmm"]
    # the patch matmul starts from the faster of the program and its frozen one: here the frozen one, so both rewrites
    assert rewritten[1].spec["freezing"] and rewritten[1].spec["patch_matmul"]
    assert order[4] == "fp16-compile-cudagraph" and [c.variant for c in rewritten] == order[2:4]
    assert [c.variant for c in compiled] == [order[0], order[1], order[4]]
    assert any(n.startswith("patch convolutions as matmuls on fp16-cl-compile-cudagraph") and "faster" in n
               for n in notes)
    assert "Inductor freezing tried: on this model it folds BatchNorm into the convolutions before them" in notes


def test_the_gelu_epilogue_is_the_last_rewrite_and_torchao_starts_from_a_program_without_it(monkeypatch):
    """On torch-cuda a model with a Linear and a GELU gets the GELU-epilogue candidate by default, after the other
    rewrites and on the fastest program before it; torchao's schemes start from the fastest program without the
    epilogue (they replace the matmuls it is in). Compiles stood in for by a recorder, as above."""
    from types import SimpleNamespace

    from torch import nn

    from qdeploy.optimize.steps import torch_runtimes

    order = []

    def compile_briefly(s, cand):
        order.append(cand.variant)
        cand.timed_briefly({"32": 1.0 - 0.1 * cand.variant.count("-")}, 30.0)  # each rewrite a little faster
        return cand

    monkeypatch.setattr(torch_runtimes, "_time_briefly", compile_briefly)
    monkeypatch.setattr(torch_runtimes, "torchao_problem", lambda scheme, device: None)
    model = nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.Flatten(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 4))
    s = SimpleNamespace(target=TARGETS["torch-cuda"], o=OptimizeConfig(target="torch-cuda", torchao=["int8-dynamic"]),
                        timed_out=False, limit_covers_saving=True, time_left=lambda: 1000.0, note=lambda n: None,
                        stages={}, rank_batches=[32],
                        ctx=SimpleNamespace(builder=SimpleNamespace(
                            has_torch=True, torch_model=lambda: model,
                            check_inputs=lambda: np.zeros((2, 3, 8, 8), np.float32))))
    compiled, rewritten, estimate = torch_runtimes.compile_stage(s, [("fp16", False, True)], primary=1)
    assert order == ["fp16-cl-compile-cudagraph", "fp16-cl-compile-cudagraph-patchmm",
                     "fp16-cl-compile-cudagraph-patchmm-geluepi"]
    assert rewritten[-1].spec["gelu_epilogue"] and rewritten[-1].spec["patch_matmul"]
    ao = torch_runtimes._torchao_stage(s, compiled + rewritten, estimate)
    assert [c.variant for c in ao] == ["fp16-cl-compile-cudagraph-patchmm-ao-int8-dynamic"]
    assert not ao[0].spec.get("gelu_epilogue")


def test_strict_fp32_is_timed_only_as_its_reference_where_fp32_tf32_is_kept():
    """TF32_DOMINATES_WHY: beside FP32-TF32 within budget, strict FP32's CUDA graph and channels_last candidates are not
    timed (each costs cuDNN's autotuning of its own convolutions: 9-14 s an eager channels_last candidate of
    EfficientNet-B0 on an H200); where TF32 is outside the budget they are, and the CPU has no TF32 to keep."""
    from qdeploy.optimize.steps.torch_runtimes import brief_plan

    gpu = TARGETS["torch-cuda"]
    reference = EagerCandidate.planned(gpu, "fp32", False, False)
    plan, left_out = brief_plan(gpu, [("fp32", False), ("fp32", True), ("fp16", False)], reference)
    names = [c.variant for c in plan]
    assert plan[0] is reference and len(names) == 9 and not any(n.startswith("fp32-") and "tf32" not in n
                                                                for n in names[1:])
    assert sorted(left_out) == sorted(["fp32-cudagraph", "fp32-cl-eager", "fp32-cl-cudagraph"])
    assert {"fp32-tf32-cl-cudagraph", "fp16-cl-eager", "fp16-cudagraph"} <= set(names)
    plan, left_out = brief_plan(gpu, [("fp32", False), ("fp16", False)], reference)
    assert left_out == [] and "fp32-cl-cudagraph" in [c.variant for c in plan] and len(plan) == 8
    cpu = TARGETS["torch-cpu"]
    plan, left_out = brief_plan(cpu, [("fp32", False), ("bf16", False)], EagerCandidate.planned(cpu, "fp32", False,
                                                                                                 False))
    assert left_out == [] and len(plan) == 4


def test_on_a_gpu_the_fastest_tensor_core_tier_is_compiled_first_and_the_rewrites_follow_it():
    """FP16 and BF16 run at one tensor-core rate, FP32-TF32 at half of it (TENSOR_CORE_FIRST_WHY): their programs
    lead, then their tied layouts, then FP32-TF32's, whatever the brief (launch-bound) graph timings said."""
    from qdeploy.optimize.steps.torch_runtimes import tensor_core_first

    # EfficientNet-B0 at batch 1 / 8: FP32-TF32's graph timed fastest, so compile_pairs put it first
    pairs = [("fp32", True, False), ("fp16", False, False), ("bf16", False, False), ("fp16", False, True),
             ("fp32", True, True)]
    assert tensor_core_first(pairs, 3) == ([("fp16", False, False), ("bf16", False, False), ("fp16", False, True),
                                            ("fp32", True, False), ("fp32", True, True)], 2)
    # no 16-bit precision within budget: FP32-TF32 leads; strict FP32 (where TF32 is outside the budget) alone
    assert tensor_core_first([("fp32", True, True), ("fp32", True, False)], 1) == (
        [("fp32", True, True), ("fp32", True, False)], 1)
    assert tensor_core_first([("fp32", False, False)], 1) == ([("fp32", False, False)], 1)


def test_the_frozen_program_fits_the_default_limit_where_fp32_tf32_was_compiled_first(monkeypatch):
    """EfficientNet-B0 at batch 1 / 8 on an H200 (two models on two GPUs): 113 s of the 300 s limit went before the
    first compile, then FP32-TF32 (its graph the fastest), FP16 and BF16 compiled in 36.7, 33.6 and 31.5 s, and the
    frozen FP16 program no longer fit (83 s left). Compiled on the GPU's order (FP16, BF16, then the rewrites, then
    FP32-TF32), the frozen program fits and FP32-TF32 is what the limit cuts. Compiles stood in for by a recorder with
    those times on a clock the time limit reads."""
    from types import SimpleNamespace

    from torch import nn

    from qdeploy.optimize.steps import torch_runtimes

    clock, order = [113.0], []
    compile_s = {"fp32-tf32": 36.7, "fp16": 33.6, "bf16": 31.5}
    p50 = {"fp32-tf32": 0.721, "fp16": 0.628, "bf16": 0.690}

    def compile_briefly(s, cand):
        order.append(cand.variant)
        base = cand.variant.split("-compile")[0]
        frozen = "frozen" in cand.variant
        cand.timed_briefly({8: p50[base] / (1.15 if frozen else 1.0)}, compile_s[base] + (3.0 if frozen else 0.0))
        clock[0] += cand.compile_s
        return cand

    monkeypatch.setattr(torch_runtimes, "_time_briefly", compile_briefly)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())  # freezing folds the BatchNorm
    notes = []
    s = SimpleNamespace(target=TARGETS["torch-cuda"], o=OptimizeConfig(target="torch-cuda"), timed_out=False,
                        limit_covers_saving=True, time_left=lambda: 300.0 - clock[0], note=notes.append, stages={},
                        rank_batches=[8], ctx=SimpleNamespace(builder=SimpleNamespace(
                            has_torch=True, torch_model=lambda: model,
                            check_inputs=lambda: np.zeros((2, 3, 8, 8), np.float32))))
    pairs = [("fp32", True, False), ("fp16", False, False), ("bf16", False, False)]
    compiled, rewritten, _ = torch_runtimes.compile_stage(s, pairs, primary=3)
    assert order == ["fp16-compile-cudagraph", "bf16-compile-cudagraph", "fp16-compile-cudagraph-frozen"]
    assert [c.variant for c in rewritten] == ["fp16-compile-cudagraph-frozen"]
    assert s.stages["torch_compile_not_tried"][0] == "fp32-tf32-compile-cudagraph"


def test_a_precision_too_slow_as_a_cuda_graph_for_compiling_to_catch_up_is_not_compiled(monkeypatch):
    """ConvNeXt-T at 224 on an H200: FP32-TF32 ran 5.33 ms as a CUDA graph against FP16's 3.18 at batch 32, and its two
    compiles (15 s each) gave 3.98 ms against FP16's compiled 2.21. A precision whose graph, divided by the gain
    compiling gave the fastest precision plus a margin, is still slower than that compiled program is not compiled
    (OUTPACED_WHY); a precision within reach is; the compiles are stood in for by a recorder with those timings."""
    from types import SimpleNamespace

    from torch import nn

    from qdeploy.optimize.candidates import CudaGraphCandidate
    from qdeploy.optimize.steps import torch_runtimes

    target = TARGETS["torch-cuda"]
    graphs = {"fp16-cl": (3.18, 11.37), "bf16-cl": (3.20, 11.50), "fp32-tf32-cl": (5.33, 19.20)}
    compiled_p50 = {"fp16-cl": (2.21, 7.52), "bf16-cl": (2.22, 7.55), "fp32-tf32-cl": (3.98, 13.89)}

    def uncompiled(tf32_graph):
        out = []
        for (p, t), g in zip((("fp16", False), ("bf16", False), ("fp32", True)),
                             (graphs["fp16-cl"], graphs["bf16-cl"], tf32_graph)):
            c = CudaGraphCandidate.planned(target, p, True, t)
            c.timed_briefly({32: g[0], 128: g[1]}, 0.5)
            out.append(c)
        return out

    def search(tf32_graph):
        order = []

        def compile_briefly(s, cand):
            order.append(cand.variant)
            v = compiled_p50[cand.variant.split("-compile")[0]]
            cand.timed_briefly({32: v[0], 128: v[1]}, 15.0)
            return cand

        monkeypatch.setattr(torch_runtimes, "_time_briefly", compile_briefly)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())  # nothing to freeze or rewrite
        notes = []
        s = SimpleNamespace(target=target, o=OptimizeConfig(target="torch-cuda"), timed_out=False,
                            limit_covers_saving=True, time_left=lambda: 1000.0, note=notes.append, stages={},
                            rank_batches=[32, 128], ctx=SimpleNamespace(builder=SimpleNamespace(
                                has_torch=True, torch_model=lambda: model,
                                check_inputs=lambda: np.zeros((2, 3, 8, 8), np.float32))))
        pairs = [("fp16", False, True), ("bf16", False, True), ("fp32", True, True)]
        torch_runtimes.compile_stage(s, pairs, primary=3, uncompiled=uncompiled(tf32_graph))
        return order, notes, s.stages

    order, notes, stages = search(graphs["fp32-tf32-cl"])
    assert order == ["fp16-cl-compile-cudagraph", "bf16-cl-compile-cudagraph"]
    assert stages["torch_compile_outpaced"][0].startswith("fp32-tf32-cl-compile-cudagraph (its graph")
    assert any("OUTPACED_WHY" in n and "fp32-tf32-cl-compile-cudagraph" in n for n in notes)
    # within reach (its graph 1.1x the fastest's): compiled; and without graph twins (a CPU target) nothing is pruned
    order, _, stages = search((3.50, 12.50))
    assert order == ["fp16-cl-compile-cudagraph", "bf16-cl-compile-cudagraph", "fp32-tf32-cl-compile-cudagraph"]
    assert "torch_compile_outpaced" not in stages
    from qdeploy.optimize.candidates import CompiledCandidate

    cand = CompiledCandidate.planned(target, "fp32", True, True, "default", True)
    assert torch_runtimes.outpaced_by(cand, [], []) is None


PATCH_MODEL = '''
import torch
from torch import nn


class Patches(nn.Module):
    """A ViT's shape in small: a 4x4 stride-4 patch embedding, a token MLP, a mean over tokens."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.patch = nn.Conv2d(3, 32, 4, 4)
        self.mlp = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        return self.head((t + self.mlp(t)).mean(1))


def patches(num_classes=3):
    torch.manual_seed(0)
    return Patches(num_classes)
'''


@pytest.mark.slow
def test_a_torch_cpu_search_compiles_the_patch_matmul_candidate_for_a_model_with_a_patch_convolution(tmp_path):
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", finalists=1, time_limit=400,
                      freezing=False)
    (tmp_path / "patches.py").write_text(PATCH_MODEL)
    cfg["model"]["source"] = f"{tmp_path / 'patches.py'}:patches"
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    rewritten = [c for c in s["candidates"] if c["kind"] == "torch-patchmm"]
    assert len(rewritten) == 1 and rewritten[0]["variant"].endswith("-compile-patchmm"), [c["variant"] for c in s["candidates"]]
    assert rewritten[0]["brief_p50_ms"] and rewritten[0]["compiled_from_export"] is True
    assert any(d.startswith("patch convolutions as matmuls on ") for d in s["decisions"])
    assert s["program"]["error"] is None and (tmp_path / "out" / s["chosen"]["artifact"]).is_file()
    manifest = json.loads((tmp_path / "out" / "qdeploy-program.json").read_text())
    assert manifest["patch_matmul"] is (s["chosen"]["variant"] == rewritten[0]["variant"])


DEPTHWISE_MODEL = '''
import torch
from torch import nn


class Separable(nn.Module):
    """A MobileNet's block in small: a stem, a 3x3 depthwise convolution, a 1x1 projection, global pooling."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, groups=16), nn.ReLU())
        self.pw = nn.Conv2d(16, 32, 1)
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.pw(self.dw(self.stem(x))).mean((2, 3)))


def separable(num_classes=3):
    torch.manual_seed(0)
    return Separable(num_classes)
'''


@pytest.mark.slow
def test_a_torch_cpu_search_asked_for_depthwise_stencils_compiles_saves_and_reloads_them(tmp_path):
    """optimize.depthwise_stencil: true: the rewritten program is compiled and timed as a candidate of its own, and
    where it is chosen the saved program (reloaded in this process from DIR) holds the stencil; unset, the search says
    why it is not tried."""
    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", finalists=1, time_limit=400,
                      freezing=False, depthwise_stencil=True)
    (tmp_path / "separable.py").write_text(DEPTHWISE_MODEL)
    cfg["model"]["source"] = f"{tmp_path / 'separable.py'}:separable"
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    rewritten = [c for c in s["candidates"] if c["kind"] == "torch-dwstencil"]
    assert len(rewritten) == 1 and rewritten[0]["variant"].endswith("-compile-dwstencil"), \
        [c["variant"] for c in s["candidates"]]
    assert rewritten[0]["brief_p50_ms"] and rewritten[0]["compiled_from_export"] is True
    assert s["program"]["error"] is None and (tmp_path / "out" / s["chosen"]["artifact"]).is_file()
    manifest = json.loads((tmp_path / "out" / "qdeploy-program.json").read_text())
    assert manifest["depthwise_stencil"] is (s["chosen"]["variant"] == rewritten[0]["variant"])
    cfg["optimize"].pop("depthwise_stencil")
    s = api.optimize(cfg, tmp_path / "out2", cache_dir=tmp_path / "cache")
    assert not [c for c in s["candidates"] if c["kind"] == "torch-dwstencil"]
    assert any("not tried unless optimize.depthwise_stencil is true" in w
               for w in s["decisions"]), s["decisions"]


def test_the_outpaced_rule_replayed_on_the_recorded_gpu_searches_never_leaves_out_the_fastest_program():
    """bench/suites/outpaced_replay.py on every committed torch-cuda optimize.json (H100 and H200, 32-640 px): wherever
    a program the rule leaves out was compiled in the record, it was slower than the fastest compiled program."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("outpaced_replay", root / "bench/suites/outpaced_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    records = sorted(p for p in (root / "docs/results").rglob("*.json") if "optimize" in p.name)
    out = [r for r in map(mod.replay, records) if r]
    rows = [x for r in out for x in r["rows"]]
    checked = [x for x in rows if x["pruned"] and x["compiled_ms"] is not None]
    assert len(out) >= 10 and len(checked) >= 20
    assert not [x for x in rows if x["wrong"]]
    assert all(x["compiled_ms"] > r["fastest_compiled_ms"] for r in out for x in r["rows"]
               if x["pruned"] and x["compiled_ms"] is not None)


MLP_MODEL = '''
import torch
from torch import nn


class TokenMlp(nn.Module):
    """A ViT's block in small: a patch embedding, a LayerNorm and an MLP with a GELU on the tokens, a head."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.embed = nn.Conv2d(3, 16, 8, 8)
        self.norm = nn.LayerNorm(16)
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)
        self.head = nn.Linear(16, num_classes)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = t + self.fc2(self.act(self.fc1(self.norm(t))))
        return self.head(t.mean(1))


def token_mlp(num_classes=3):
    torch.manual_seed(0)
    return TokenMlp(num_classes)
'''


@pytest.mark.slow
def test_a_torch_cpu_search_asked_for_the_gelu_epilogue_compiles_saves_and_reloads_it(tmp_path):
    """optimize.gelu_epilogue: true (the default is the GPU only): the program whose Linear → GELU is one fused
    operator is compiled and timed as a candidate of its own, and where it is chosen the saved program holds it."""
    import torch

    cfg = _opt_config(tmp_path, budget={"max_drop": 100.0}, target="torch-cpu", finalists=1, time_limit=400,
                      freezing=False, patch_matmul=False, gelu_epilogue=True)
    (tmp_path / "token_mlp.py").write_text(MLP_MODEL)
    cfg["model"]["source"] = f"{tmp_path / 'token_mlp.py'}:token_mlp"
    s = api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    fused = [c for c in s["candidates"] if c["kind"] == "torch-geluepi"]
    assert len(fused) == 1 and fused[0]["variant"].endswith("-compile-geluepi"), [c["variant"] for c in s["candidates"]]
    assert fused[0]["brief_p50_ms"] and fused[0]["compiled_from_export"] is True
    assert s["program"]["error"] is None and (tmp_path / "out" / s["chosen"]["artifact"]).is_file()
    manifest = json.loads((tmp_path / "out" / "qdeploy-program.json").read_text())
    chosen_fused = s["chosen"]["variant"] == fused[0]["variant"]
    assert manifest["gelu_epilogue"] is chosen_fused
    if chosen_fused:
        ep = torch.export.load(str(tmp_path / "out" / manifest["programs"]["dynamic"]))
        assert any(n.target is torch.ops.aten._addmm_activation.default for n in ep.graph.nodes)
