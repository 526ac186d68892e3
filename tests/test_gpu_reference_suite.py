"""bench/suites/gpu_reference.py, the GPU suite's hand-written references: its real-size rows (the classifiers of
bench/train/train_realsize.py at 224 px) are configured as the CPU suite trains them. What needs a GPU runs on the
device machine (bench/device/realsize_gpu.sh); here, the rows' configs."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite():
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench/suites"))
    spec = importlib.util.spec_from_file_location("gpu_reference", ROOT / "bench/suites/gpu_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_real_size_classifiers_are_rows_at_224_with_the_trained_weights(suite, tmp_path, monkeypatch):
    from train_realsize import MODELS as REALSIZE

    from qdeploy.config import parse_config

    monkeypatch.setattr(suite, "BATCHES", (1, 8, 32, 128))
    for name, (source, kwargs, _) in REALSIZE.items():
        cfg = suite.config(name, tmp_path, 0.3)
        assert cfg["model"]["source"] == source and cfg["model"]["kwargs"] == kwargs
        assert cfg["model"]["weights"] == str(tmp_path / f"{name}.pt")
        # CIFAR-10's 32 px images resized to 224, as they were trained
        assert cfg["model"]["preprocess"]["input_size"] == [224, 224] and cfg["model"]["preprocess"]["resize"] == [224, 224]
        assert cfg["bench"]["batch_sizes"] == [1, 8, 32, 128]
        assert cfg["optimize"] == {"target": "torch-cuda", "budget": {"max_drop": 0.3}}
        assert suite.MODELS[name][3] == 224  # bench_images' size
    parse_config(suite.config("resnet50", tmp_path, 0.3))  # a valid qdeploy config



def test_optimize_set_reads_each_value_as_yaml_and_refuses_a_pair_without_a_key(suite):
    assert suite.optimize_settings(["depthwise_stencil=true", "time_limit=150", "torchao=[int8-dynamic]"]) == {
        "depthwise_stencil": True, "time_limit": 150, "torchao": ["int8-dynamic"]}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        suite.optimize_settings(["depthwise_stencil"])


def test_the_segmenter_and_the_detector_are_rows_as_the_cpu_suite_configures_them(suite, tmp_path):
    """DeepLabV3 on CamVid at 360x480 and the YOLO-style detector at 640: realsize_cpu.py's model and data sections,
    the torch-cuda target with a 1.0-point budget (mIoU, mAP), the staged data folders of realsize_gpu.sh."""
    from qdeploy.config import parse_config

    for name, task, hw in (("deeplabv3_camvid", "segmentation", (360, 480)), ("yolo_bccd640", "detection", (640, 640))):
        cfg = suite.config(name, tmp_path, None)
        assert cfg["model"]["task"] == task and suite.input_hw(name) == hw
        assert cfg["optimize"] == {"target": "torch-cuda", "budget": {"max_drop": 1.0}}
        assert cfg["variants"] == [{"engine": "torch"}] and cfg["bench"]["batch_sizes"] == list(suite.BATCHES)
        parse_config(cfg)
    seg = suite.config("deeplabv3_camvid", tmp_path, None)
    assert seg["model"]["weights"] == str(tmp_path / "seg" / "deeplabv3_fp16.pt") and seg["model"]["output"] == "out"
    assert seg["data"]["eval"]["root"] == str(tmp_path / "seg" / "camvid")
    assert suite.config("yolo_bccd640", tmp_path, None)["data"]["eval"]["root"] == str(tmp_path / "bccd")
    assert suite.config("deeplabv3_camvid", tmp_path, 0.5)["optimize"]["budget"]["max_drop"] == 0.5


@pytest.mark.slow
def test_the_detector_and_the_segmenter_are_built_as_a_user_runs_them(suite, tmp_path):
    """The hand-written references' model: the committed detector's raw head output; DeepLabV3 (../shared's CamVid
    weights, staged in FP16 as realsize_gpu.sh finds them) returning its "out" map, as qdeploy's program does."""
    import torch

    from conftest import shared_path

    det = suite.build_model("yolo_bccd640", tmp_path)
    with torch.inference_mode():
        assert det(torch.zeros(1, 3, 640, 640)).shape[0] == 1
    weights = shared_path("models", "camvid-deeplabv3", "deeplabv3_mobilenet_v3_large_camvid.pt")
    (tmp_path / "seg").mkdir()
    state = torch.load(weights, weights_only=True)
    torch.save({k: v.half() if v.is_floating_point() else v for k, v in state.items()}, tmp_path / "seg" / "deeplabv3_fp16.pt")
    seg = suite.build_model("deeplabv3_camvid", tmp_path)
    with torch.inference_mode():
        assert tuple(seg(torch.zeros(1, 3, 360, 480)).shape) == (1, 11, 360, 480)
    assert suite.bench_images("deeplabv3_camvid").shape[1:] == (3, 360, 480)

def _gpu_reference_row(model, batch, fresh, refs, **qdeploy):
    """One row as gpu_reference.py's write_rows writes it (the fields the schema reads)."""
    return {"model": model, "weights": f".realsize-weights/{model}.pt", "batch_size": batch, "gpu": "NVIDIA H200",
            "date": "2026-11-28", "references": refs, "references_not_measured": [],
            "qdeploy": {"variant": "fp16-compile-cudagraph-cl", "fresh_process_p50_ms": fresh, "budget_met": True,
                        "confirm_drop": 0.1, "optimize_time_s": 181.0, "ratio_fresh_vs_fresh": 0.99, **qdeploy}}


def _optimize_json(ao_p50s: dict, within: bool) -> dict:
    base = {"variant": "fp16-compile-cudagraph-cl", "precision": "fp16", "status": "ok", "within_budget": True,
            "brief_p50_ms": {"1": 0.9, "32": 6.0}}
    ao = {"variant": "fp16-compile-cudagraph-cl-ao-float8-dynamic", "precision": "fp16", "status": "ok",
          "within_budget": within, "search_metric": 0.56, "budget": "drop 0.10 points vs allowed 0.30", "brief_p50_ms": ao_p50s}
    return {"candidates": [base, ao], "decisions": ["torchao float8-dynamic on fp16-compile-cudagraph-cl's Linear layers: "
                                                    "1.000/7.000 ms vs 0.900/6.000 ms without: not faster here"]}


def test_the_realsize_gpu_schema_from_the_suite_rows_and_the_searches(tmp_path):
    """bench/suites/realsize_gpu.py writes the issue's schema: a row per model and batch (qdeploy's fresh-process p50
    beside every reference), the torchao candidates against their FP16 base at the same batch, and the sentence saying
    why no FP8/INT8 candidate pays, only when none does; a row measured again replaces the earlier one."""
    spec = importlib.util.spec_from_file_location("realsize_gpu", ROOT / "bench/suites/realsize_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    refs = {"eager FP32": 9.0, "torch.compile + CUDA graph FP16 channels_last": 1.0, "eager FP16": 5.0}
    rows = tmp_path / "rows.json"
    alternating = {"recipe": "torch.compile + CUDA graph FP16 channels_last", "program_p50_ms": [1.0, 1.1, 0.9],
                   "hand_p50_ms": [1.0]}
    rows.write_text(json.dumps([_gpu_reference_row("deit_small", 1, 1.02, refs, fresh_alternating=alternating),
                                _gpu_reference_row("deit_small", 32, 6.1, {k: v * 6 for k, v in refs.items()})]))
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "deit_small.optimize.json").write_text(json.dumps(_optimize_json({"1": 1.0, "32": 7.0}, within=True)))
    out = tmp_path / "realsize_gpu.json"
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "NVIDIA H200" and [(r["model"], r["batch"]) for r in doc["rows"]] == [("deit_small", 1),
                                                                                            ("deit_small", 32)]
    r1 = doc["rows"][0]
    assert {"model", "input_size", "batch", "chosen", "fresh_process_p50_ms", "references", "budget_met",
            "optimize_wall_s"} <= set(r1)
    assert r1["input_size"] == [224, 224] and r1["best_reference"] == "torch.compile + CUDA graph FP16 channels_last"
    assert r1["ratio_to_best_reference"] == 1.02 and r1["optimize_wall_s"] == 181.0
    # the spread of each side's fresh processes: (max - min) / median; one process has none
    assert r1["fresh_spread"] == {"program": 0.2, "hand": None, "processes_per_side": 3}
    assert doc["rows"][1]["fresh_spread"] == {"program": None, "hand": None, "processes_per_side": 0}
    low = {(x["batch"], x["variant"]): x for x in doc["low_precision"]}
    assert low[(32, "fp16-compile-cudagraph-cl-ao-float8-dynamic")]["fp16_p50_ms"] == 6.0
    assert "7.0000 ms vs 6.0000 ms" in doc["low_precision_why"] and "batch 32" in doc["low_precision_why"]
    # measured again: FP8 now faster at batch 32 and within budget, so no "why"; the batch-1 row stays as it was
    rows.write_text(json.dumps([_gpu_reference_row("deit_small", 32, 5.9, {k: v * 6 for k, v in refs.items()})]))
    (opt / "deit_small.optimize.json").write_text(json.dumps(_optimize_json({"1": 1.0, "32": 4.5}, within=True)))
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["rows"]) == 2 and doc["rows"][1]["fresh_process_p50_ms"] == 5.9 and "low_precision_why" not in doc
    # faster but outside the budget does not pay
    (opt / "deit_small.optimize.json").write_text(json.dumps(_optimize_json({"1": 1.0, "32": 4.5}, within=False)))
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    assert "not within budget" in json.loads(out.read_text())["low_precision_why"]
    # a search whose log shows Dynamo's recompile limit: its torchao timings were eager, set aside with that reason
    (opt / "deit_small.log").write_text("W1129 [0/8] torch._dynamo hit config.recompile_limit (8)\n")
    out.unlink()
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["low_precision"] == [] and doc["rows"][0]["search_hit_recompile_limit"] is True
    assert {x["batch"] for x in doc["low_precision_void"]} == {1, 32} and "eagerly" in doc["low_precision_void"][0]["void"]
    assert doc["low_precision_why"].startswith("no valid FP8/INT8 measurement: the 2 torchao timings (deit_small)")
    # measured again without the limit: the valid measurement replaces the void one
    (opt / "deit_small.log").write_text("no warning\n")
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["low_precision"]) == 2 and "low_precision_void" not in doc
    # a torchao candidate that failed has no timing: named with its reason, in the list and in the sentence
    summary = _optimize_json({"1": 1.0, "32": 7.0}, within=True)
    summary["candidates"].append({"variant": "fp16-compile-cudagraph-cl-ao-int8-dynamic", "status": "failed",
                                  "failed_stage": "bench", "reason": "RuntimeError: mat2.size(1) ... got 10"})
    (opt / "deit_small.optimize.json").write_text(json.dumps(summary))
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [f["variant"] for f in doc["low_precision_failed"]] == ["fp16-compile-cudagraph-cl-ao-int8-dynamic"]
    assert doc["low_precision_why"].endswith("-ao-int8-dynamic on deit_small failed (bench): RuntimeError: mat2.size(1)"
                                             " ... got 10")
    # the model searched again without the failure: the old failure goes
    (opt / "deit_small.optimize.json").write_text(json.dumps(_optimize_json({"1": 1.0, "32": 7.0}, within=True)))
    assert mod.main(["--rows", str(rows), "--optimize", str(opt), "--json", str(out)]) == 0
    assert "low_precision_failed" not in json.loads(out.read_text())
    assert mod.main(["--rows", str(tmp_path / "missing.json"), "--json", str(out)]) == 2
    assert mod.main(["--json", str(out)]) == 2
    # the docs table: a row is "met" only at <= 1.0x both ways with 3 fresh processes a side within budget
    table = tmp_path / "table.md"
    rows.write_text(json.dumps([_gpu_reference_row("deit_small", 1, 1.02, refs, fresh_alternating=alternating),
                                _gpu_reference_row("deit_small", 32, 5.9, {k: v * 6 for k, v in refs.items()})]))
    assert mod.main(["--rows", str(rows), "--json", str(tmp_path / "t.json"), "--markdown", str(table)]) == 0
    lines = table.read_text().splitlines()
    b1 = next(x for x in lines if x.startswith("| deit_small | 224x224 | 1 |"))
    b32 = next(x for x in lines if x.startswith("| deit_small | 224x224 | 32 |"))
    assert "| 1.020x |" in b1 and b1.endswith("| missed |")
    assert "| 0.983x |" in b32 and b32.endswith("| ≤ 1.0x, sides not alternated |")
    assert "0 of 2 rows meet the goal" in lines[-1]
    row = {"ratio_to_best_reference": 0.95, "ratio_fresh_vs_fresh": 0.97, "budget_met": True,
           "fresh_spread": {"processes_per_side": 3}}
    assert mod.goal_verdict(row) == "met"
    assert mod.goal_verdict({**row, "fresh_spread": {"processes_per_side": 2}}) == "≤ 1.0x, 2 processes a side"
    assert mod.goal_verdict({**row, "ratio_fresh_vs_fresh": 1.001}) == "missed"
    assert mod.goal_verdict({**row, "budget_met": False}) == "outside budget"
    # a measurement cut before its alternating processes does not displace one that ran them; it is kept beside it
    cut = {**row, "fresh_spread": {"processes_per_side": 0}, "ratio_fresh_vs_fresh": None, "date": "later"}
    kept = mod.newer_row(row, cut)
    assert kept["ratio_fresh_vs_fresh"] == 0.97 and kept["later_measurement"]["date"] == "later"
    assert mod.newer_row(cut, row) is row and mod.newer_row(None, cut) is cut
    assert mod.later_said({"chosen": "fp16", "ratio_to_best_reference": 0.872, "date": "later"}) == \
        " (later, sides not alternated: fp16 0.872x, later)"
    assert mod.later_said(None) == ""


def test_torchao_speed_rows_join_the_low_precision_measurements_without_counting_as_paying(tmp_path):
    """torchao_speed.py's lines (random weights: speed only) enter ``low_precision`` beside FP16 at the same model and
    batch, with their source and no budget verdict: a scheme faster than FP16 there still does not make the "why" go,
    and the sentence names each scheme's best; a scheme that failed is listed with its error until it runs."""
    spec = importlib.util.spec_from_file_location("realsize_gpu", ROOT / "bench/suites/realsize_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def line(scheme, batch, p50=None, error=None):
        r = {"model": "swin_t", "scheme": scheme, "batch": batch, "gpu": "NVIDIA H200", "linear_layers": 52,
             "quantized_layers": 0 if scheme == "none" else 51, "compile_s": 50.0}
        r.update({"p50_ms": p50} if error is None else {"error": error})
        return json.dumps(r)

    speed = tmp_path / "torchao_speed.jsonl"
    speed.write_text("\n".join([line("none", 32, 2.0), line("int8-dynamic", 32, 4.0), line("float8-dynamic", 32, 1.6),
                                line("none", 128, 8.0), line("int8-dynamic", 128, error="RuntimeError: no kernel"),
                                line("float8-dynamic", 256, 1.0)]) + "\n")  # no FP16 at 256: left out
    out = tmp_path / "realsize_gpu.json"
    assert mod.main(["--speed", str(speed), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["rows"] == []
    low = {(x["batch"], x["scheme"]): x for x in doc["low_precision"]}
    assert set(low) == {(32, "int8-dynamic"), (32, "float8-dynamic")}
    fp8 = low[(32, "float8-dynamic")]
    assert fp8["fp16_p50_ms"] == 2.0 and fp8["speedup_vs_base"] == 1.25 and fp8["within_budget"] is None
    assert fp8["source"].startswith("bench/suites/torchao_speed.py") and fp8["quantized_layers"] == "51 of 52 Linear"
    why = doc["low_precision_why"]
    assert "float8-dynamic (torchao_speed) on swin_t at batch 32, ran 1.6000 ms vs 2.0000 ms (1.25x), its accuracy " \
           "not measured" in why and "int8-dynamic (torchao_speed) on swin_t at batch 32, ran 4.0000 ms" in why
    assert doc["low_precision_failed"] == [{"model": "swin_t", "variant": "int8-dynamic (torchao_speed)",
                                            "failed_stage": "torchao_speed", "reason": "RuntimeError: no kernel"}]
    # the scheme runs at the next measurement: its failure goes
    speed.write_text(line("none", 128, 8.0) + "\n" + line("int8-dynamic", 128, 9.0) + "\n")
    assert mod.main(["--speed", str(speed), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "low_precision_failed" not in doc and len(doc["low_precision"]) == 3


def test_profiled_speed_rows_say_where_the_gpu_time_went_in_the_sentence(tmp_path):
    """torchao_speed.py --profile lines: the low-precision row keeps each kernel kind's time beside FP16's, and the
    sentence quotes them (the quantize kernels' cost against the matmuls' saving); a line without a profile adds none."""
    spec = importlib.util.spec_from_file_location("realsize_gpu", ROOT / "bench/suites/realsize_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fp16 = {"model": "deit_s", "scheme": "none", "batch": 128, "gpu": "NVIDIA H200", "p50_ms": 4.8,
            "profile": {"ms_per_call": {"attention": 0.55, "matmul": 2.78, "other": 1.35}}}
    fp8 = {**fp16, "scheme": "float8-dynamic", "p50_ms": 5.68,
           "profile": {"ms_per_call": {"attention": 0.54, "matmul": 3.49, "other": 0.06, "quantize": 1.52}}}
    int8 = {**fp16, "scheme": "int8-dynamic", "p50_ms": 8.26}
    int8.pop("profile")
    fp16_cl = {**fp16, "channels_last": True, "p50_ms": 4.4}  # each layout's schemes against FP16 in that layout
    fp8_cl = {**fp8, "channels_last": True, "p50_ms": 5.5}
    speed = tmp_path / "torchao_profile.jsonl"
    speed.write_text("\n".join(json.dumps(r) for r in (fp16, fp8, int8, fp16_cl, fp8_cl)) + "\n")
    out = tmp_path / "realsize_gpu.json"
    assert mod.main(["--speed", str(speed), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    low = {x["variant"].replace(" (torchao_speed)", ""): x for x in doc["low_precision"]}
    assert low["float8-dynamic channels_last"]["fp16_p50_ms"] == 4.4 and low["float8-dynamic"]["fp16_p50_ms"] == 4.8
    assert low["float8-dynamic"]["gpu_ms_by_kind"]["quantize"] == 1.52
    assert low["float8-dynamic"]["fp16_gpu_ms_by_kind"]["matmul"] == 2.78 and "gpu_ms_by_kind" not in low["int8-dynamic"]
    why = doc["low_precision_why"]
    assert ("float8-dynamic (torchao_speed) on deit_s at batch 128: attention 0.54 ms (FP16 0.55), matmul 3.49 ms "
            "(FP16 2.78), other 0.06 ms (FP16 1.35), quantize 1.52 ms (FP16 0.00)") in why
    assert "int8-dynamic (torchao_speed) on deit_s at batch 128:" not in why


def test_torchao_speed_profiles_sort_the_gpu_kernels_by_kind():
    """torchao_speed.py --profile: each kernel's time goes to one kind by its name (attention before matmul: PyTorch's
    memory-efficient attention is a CUTLASS kernel; a cuDNN convolution is its own kind; Inductor's fused pointwise
    kernels are never a matmul, whatever the matmul they feed is called), per call, with the longest kernels named."""
    spec = importlib.util.spec_from_file_location("torchao_speed", ROOT / "bench/suites/torchao_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernels = [("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_NNN", 400.0),
               ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", 200.0),
               ("triton_tem_fused__int_mm_mul_0", 300.0),
               ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", 100.0),
               ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", 100.0),
               ("triton_red_fused_abs_amax_clamp_div_0", 150.0),
               ("triton_per_fused_native_layer_norm_1", 50.0),
               ("triton_poi_fused__scaled_mm__to_copy_clamp_div_gelu_t_view_9", 80.0),  # FP8 cast of GELU's output
               ("triton_poi_fused__scaled_mm_add_2", 20.0),
               ("void implicit_convolve_sgemm<__half, __half, 128, 5, 5, 3, 3, 3, 1, false, false, true>", 70.0),
               ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", 30.0),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", 40.0)]
    got = mod.time_by_kind(kernels, calls=10)
    assert got["ms_per_call"] == {"attention": 0.024, "convolution": 0.01, "matmul": 0.09, "other": 0.007,
                                  "quantize": 0.023}
    assert [k["kind"] for k in got["longest_kernels"]] == ["matmul", "matmul", "matmul", "quantize", "attention"]
    assert got["longest_kernels"][0]["ms_per_call"] == 0.04


def test_the_dynamic_batch_recipe_compiles_one_program_for_every_batch_size(suite):
    """The "dynamic batch" reference marks the batch dimension dynamic from its first call, so a second batch size
    reuses the first program (what torch.compile's default does only from its second size on); a static compile
    compiles again. Run on the CPU: which programs Dynamo compiles does not depend on the device."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 10)).eval()
    compiles = []

    def counting_backend(gm, example_inputs):  # one call per program Dynamo compiles
        compiles.append(gm)
        return gm.forward

    def programs_compiled(dynamic) -> int:
        torch.compiler.reset()
        compiles.clear()
        fn = torch.compile(model, backend=counting_backend, dynamic=dynamic)
        fn = suite.dynamic_batch(fn) if dynamic is None else fn
        with torch.inference_mode():
            for x in (torch.randn(2, 3, 8, 8), torch.randn(4, 3, 8, 8)):  # new tensors: the mark stays on a tensor
                torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4)
        return len(compiles)

    assert programs_compiled(None) == 1  # the recipe: torch.compile's default with the batch marked dynamic
    assert programs_compiled(False) == 2
    torch.compiler.reset()


def test_the_hand_written_recipes_are_the_named_ones_and_an_unknown_skip_is_refused_before_any_work(suite,
                                                                                                     monkeypatch):
    """``HAND_RECIPES`` is the list --skip-recipes is checked against before optimize runs; references() builds exactly
    those (each on its own copy of the model; built here on the CPU, nothing run)."""
    import torch

    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(suite, "build_model", lambda name, data: torch.nn.Linear(4, 2))
    built = suite.references("resnet50", Path("."), loader=None)
    assert tuple(built) == suite.HAND_RECIPES and all(isinstance(h, suite.Hand) for h in built.values())
    assert list(suite.references("resnet50", Path("."), None, only=suite.HAND_RECIPES[-1])) == [suite.HAND_RECIPES[-1]]
    p = subprocess.run([sys.executable, str(ROOT / "bench/suites/gpu_reference.py"), "resnet50", "--data", ".",
                        "--out", ".", "--skip-recipes", "eager FP16,no such recipe"], capture_output=True, text=True)
    assert p.returncode != 0 and "--skip-recipes: ['no such recipe'] are not among" in p.stderr


def test_the_fresh_processes_alone_need_the_in_process_measurements_of_an_earlier_run(tmp_path):
    """--fresh-only (the alternating processes as a device call of their own) reads what the in-process run saved beside
    the program; without it, one message naming the file, before any GPU work."""
    p = subprocess.run([sys.executable, str(ROOT / "bench/suites/gpu_reference.py"), "resnet50", "--data", ".",
                        "--out", str(tmp_path), "--fresh-only"], capture_output=True, text=True)
    assert p.returncode != 0 and f"no {tmp_path / 'resnet50' / 'gpu_reference-in-process.json'}" in p.stderr


def test_the_patch_embedding_as_one_matmul_gives_the_convolutions_tokens():
    """patch_embed_speed.py times a stride-equals-kernel convolution against one matmul over the patches: the two
    forms must be the same arithmetic (timm's token layout), at ViT's 16x16 and Swin's 4x4, on a non-square image."""
    import torch

    spec = importlib.util.spec_from_file_location("patch_embed_speed", ROOT / "bench/suites/patch_embed_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    for k, out_channels in ((16, 24), (4, 8)):
        x = torch.randn(2, 3, 64, 96, dtype=torch.float64)
        weight, bias = torch.randn(out_channels, 3, k, k, dtype=torch.float64), torch.randn(out_channels, dtype=torch.float64)
        want = mod.conv_tokens(x, weight, bias)
        assert want.shape == (2, (64 // k) * (96 // k), out_channels)
        assert torch.allclose(mod.matmul_tokens(weight, bias)(x), want, atol=1e-10)
        assert all(torch.allclose(make(weight, bias)(x), want, atol=1e-10) for make, _ in mod.FORMS.values())
    assert set(mod.FORMS) == {"conv", "conv channels_last", "matmul"}


@pytest.mark.slow
def test_the_patch_matmul_zoo_rewrites_a_convnexts_stem_and_downsampling_and_keeps_its_output():
    """bench/suites/patch_matmul_zoo.py's row on timm's ConvNeXt-atto: the 4x4 stem and the three 2x2 stride-2
    downsampling convolutions are taken, the depthwise 7x7 ones are not, and the rewritten model (and its export with
    a dynamic batch) gives the model's output."""
    pytest.importorskip("timm")
    spec = importlib.util.spec_from_file_location("patch_matmul_zoo", ROOT / "bench/suites/patch_matmul_zoo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.row("timm convnext_atto", mod.MODELS["timm convnext_atto"])
    assert r["rewritten"] == ["stem.0", "stages.1.downsample.1", "stages.2.downsample.1", "stages.3.downsample.1"]
    assert r["ok"] and r["rel_err"] < 1e-4 and r["exported_rel_err"] < 1e-4


def test_outputs_are_compared_on_test_images_from_every_class_for_a_classifier(suite, tmp_path):
    """The program-vs-eager check of a classifier runs on decoded, normalized test images drawn across the classes
    (an image folder decodes class by class), not on random inputs; the segmenter and the detector keep random maps."""
    test = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10" / "test"
    if not test.is_dir():
        pytest.skip(f"the CIFAR-10 test images are not at {test} (../shared)")
    (tmp_path / "cifar-test").symlink_to(test)
    x, on = suite.check_images("resnet50", tmp_path, n=64)
    assert on == "64 test images" and x.shape == (64, 3, 224, 224) and x.dtype.name == "float32"
    assert abs(float(x.mean())) < 1.0 and 0.5 < float(x.std()) < 1.5  # ImageNet-normalized pixels, not raw 0-255
    assert not (x[0] == x[-1]).all()
    assert suite.check_images("resnet50", tmp_path, n=64)[0].tobytes() == x.tobytes()  # seeded: the same images
    _, on_random = suite.check_images("deeplabv3_camvid", tmp_path, n=4)
    assert on_random == "4 random inputs"


def test_a_reference_in_a_precision_the_search_found_outside_the_budget_is_named_beside_the_goal_ratio(tmp_path):
    """Where a model's search evaluated BF16 outside its budget, a hand-written BF16 recipe would not be allowed
    either: the row names it and gives the ratio to the best reference left, while the goal's ratio and verdict stay
    the ones against every reference; a row of another search of the same model (another wall time) is not marked."""
    spec = importlib.util.spec_from_file_location("realsize_gpu", ROOT / "bench/suites/realsize_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    summary = {"time_s": 231.04, "candidates": [
        {"variant": "fp16-eager", "precision": "fp16", "status": "ok", "within_budget": True},
        {"variant": "bf16-eager", "precision": "bf16", "status": "ok", "within_budget": False},
        {"variant": "fp32-cudagraph", "precision": "fp32", "status": "timed briefly only", "within_budget": False}]}
    assert mod.precisions_outside_budget(summary) == {"bf16"}
    (tmp_path / "convnext_tiny.optimize.json").write_text(json.dumps(summary))
    refs = {"eager FP32": 11.9, "torch.compile + hand CUDA graph FP16 channels_last": 2.22886,
            "torch.compile + hand CUDA graph BF16 channels_last": 2.20826}
    row = {"model": "convnext_tiny", "batch": 32, "chosen": "fp16-cl-compile-cudagraph", "input_size": [224, 224],
           "fresh_process_p50_ms": 2.22578, "references": refs, "best_reference": min(refs, key=refs.get),
           "ratio_to_best_reference": 1.0079, "ratio_fresh_vs_fresh": 1.011, "budget_met": True,
           "optimize_wall_s": 231.04, "fresh_spread": {"processes_per_side": 3}}
    other = {**row, "batch": 128, "optimize_wall_s": 175.51, "references": dict(refs)}
    assert mod.mark_rows_outside_budget([row, other], [tmp_path]) == 1
    assert row["references_outside_budget"] == ["torch.compile + hand CUDA graph BF16 channels_last"]
    assert row["best_reference_within_budget"] == "torch.compile + hand CUDA graph FP16 channels_last"
    assert row["ratio_to_best_reference_within_budget"] == 0.9986
    assert "references_outside_budget" not in other
    assert mod.goal_verdict(row) == "missed"
    table = mod.markdown_table({"gpu": "NVIDIA H200", "rows": [row]})
    assert "missed (best reference in a precision outside this model's budget; 0.999x the best within it" in table


def test_rows_measured_on_another_card_merge_each_naming_its_own(tmp_path):
    """A device session may lend an H100 where the table's rows ran on an H200: each row's ratio compares programs on
    its own card, so the rows merge, each keeps its card (rows of older merges take the document's), the document says
    both with their counts and the table notes each row's card."""
    spec = importlib.util.spec_from_file_location("realsize_gpu", ROOT / "bench/suites/realsize_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    refs = {"eager FP32": 9.0, "torch.compile + hand CUDA graph FP16 channels_last": 1.0}
    out = tmp_path / "realsize_gpu.json"
    old_rows = [mod.suite_row(_gpu_reference_row("resnet50", b, 0.9, refs)) for b in (1, 32)]
    for r in old_rows:
        del r["gpu"]  # as merges wrote rows before they named their card
    out.write_text(json.dumps({"gpu": "NVIDIA H200", "rows": old_rows, "low_precision": []}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{**_gpu_reference_row("swin_tiny", 32, 0.98, refs), "gpu": "NVIDIA H100 80GB HBM3"}]))
    table = tmp_path / "table.md"
    assert mod.main(["--rows", str(rows), "--json", str(out), "--markdown", str(table)]) == 0
    doc = json.loads(out.read_text())
    assert {(r["model"], r["batch"]): r["gpu"] for r in doc["rows"]} == {
        ("resnet50", 1): "NVIDIA H200", ("resnet50", 32): "NVIDIA H200", ("swin_tiny", 32): "NVIDIA H100 80GB HBM3"}
    assert doc["gpu"].startswith("NVIDIA H200 (2 rows); NVIDIA H100 80GB HBM3 (1 row)")
    assert "| swin_tiny (H100) | 224x224 | 32 |" in table.read_text()
