"""bench/suites/realsize_ceiling.py, the plain CPU ceiling harness (no qdeploy inside), on a tiny convnet: every
engine × precision builds, runs and is timed, INT8 agrees with FP32, a bad path says which, and an ignored ONNX node
stays float."""
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("realsize_ceiling", ROOT / "bench/suites/realsize_ceiling.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ceiling = _harness()


def _images(rng: np.random.Generator, n: int) -> np.ndarray:
    """Image-like inputs: smooth colour fields (4×4 upsampled to 32×32) plus a little noise, roughly unit-normalized,
    so that the convnet's features and its argmax differ from image to image."""
    low = rng.normal(size=(n, 3, 4, 4))
    smooth = low.repeat(8, axis=2).repeat(8, axis=3)
    return (smooth + 0.3 * rng.normal(size=smooth.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A seeded convnet (three convs, a linear head, 10 classes) exported with a dynamic batch at opset 17, and its
    calibration (16) and eval (8) images."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(32, 10)).eval()
    with torch.no_grad():
        net[-1].weight.mul_(4.0)  # logits a few units apart: argmax is not decided by rounding noise
    folder = tmp_path_factory.mktemp("ceiling")
    path = folder / "tiny.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 32, 32),), str(path), dynamo=False, opset_version=17,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    rng = np.random.default_rng(0)
    return {"onnx": path, "calib": _images(rng, 16), "evals": _images(rng, 8), "folder": folder}


MEASURE_IN_A_FRESH_PROCESS = """
import importlib.util, pickle, sys
import numpy as np
from pathlib import Path
spec = importlib.util.spec_from_file_location("realsize_ceiling", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
folder = Path(sys.argv[2])
arrays = np.load(folder / "arrays.npz")
doc = mod.measure_ceiling(folder / "tiny.onnx", arrays["calib"], arrays["evals"], batch=2, threads=2,
                          transformer=False, work=folder / "work", repeats=2, min_time=0.02, log=lambda m: None)
(folder / "measured.pkl").write_bytes(pickle.dumps(doc))
"""


@pytest.fixture(scope="module")
def measured(tiny):
    """The harness in a process of its own, as it runs on the device: ModelOpt, imported by other tests of this
    session, patches ONNX Runtime's quantizer in-process (then quantize_static finds no range for the input)."""
    import pickle
    import subprocess

    np.savez(tiny["folder"] / "arrays.npz", calib=tiny["calib"], evals=tiny["evals"])
    subprocess.run([sys.executable, "-c", MEASURE_IN_A_FRESH_PROCESS, str(ROOT / "bench/suites/realsize_ceiling.py"),
                    str(tiny["folder"])], check=True, timeout=600)
    return pickle.loads((tiny["folder"] / "measured.pkl").read_bytes())


def test_a_process_whose_onnxruntime_quantizer_modelopt_patched_is_refused(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "modelopt.onnx.quantization.ort_patching", object())
    with pytest.raises(RuntimeError, match="patched by ModelOpt"):
        ceiling.ort_int8(tiny["onnx"], tiny["calib"], tiny["folder"] / "q.onnx", "u8")


@pytest.mark.slow
def test_every_variant_runs_or_says_why_not(measured):
    res = measured["variants"]
    assert list(res) == list(ceiling.VARIANTS)
    for name, r in res.items():
        assert r["status"] in ("ok", "skipped"), (name, r["reason"])
        if r["status"] == "skipped":
            assert r["reason"] and "BF16" in r["reason"] and name.endswith("bf16")
            continue
        assert r["p50_ms"] > 0 and len(r["repeat_medians_ms"]) == 2, name
        assert r["outputs"].shape == (8, 10), name
        assert r["build_s"] >= 0
        if name.startswith(("ov-", "nncf-")):
            assert r["precision"] in ("f32", "bf16") and r["runtime_precisions"], name
    if "BF16" in measured["cpu"]["openvino_capabilities"]:
        assert res["ov-bf16"]["precision"] == "bf16" and res["nncf-default"]["precision"] == "bf16"
    assert res["ov-fp32"]["runtime_precisions"]["Convolution"] == {"f32": 3}
    assert set(res["ov-int8-f32"]["runtime_precisions"]["Convolution"]) <= {"u8", "i8"}  # all three convs INT8
    assert "QuantizeLinear" in res["ort-int8-u8s8"]["note"]
    ok = [n for n, r in res.items() if r["status"] == "ok"]
    assert measured["fastest"] in ok
    assert measured["variants"][measured["fastest"]]["p50_ms"] == min(res[n]["p50_ms"] for n in ok)
    assert measured["best_fp32"] == min(res["ort-fp32"]["p50_ms"], res["ov-fp32"]["p50_ms"])
    assert measured["cpu"]["lscpu_flags"] and measured["versions"]["openvino"]


@pytest.mark.slow
def test_int8_agrees_with_fp32(measured):
    res = measured["variants"]
    ref = res["ort-fp32"]["outputs"]
    assert ceiling.agreement(res["ov-fp32"]["outputs"], ref) == 1.0
    for name in ("ort-int8-s8s8", "ort-int8-u8s8", "ov-int8-f32", "ov-int8-bf16", "nncf-default"):
        if res[name]["status"] == "ok":
            assert ceiling.agreement(res[name]["outputs"], ref) >= 0.5, name


@pytest.mark.slow
def test_an_ignored_onnx_node_is_matched_and_stays_float(tiny):
    import onnx

    first_conv = next(n.name for n in onnx.load(str(tiny["onnx"])).graph.node if n.op_type == "Conv")
    doc = ceiling.measure_ceiling(tiny["onnx"], tiny["calib"], tiny["evals"], batch=1, threads=2, transformer=False,
                                  work=tiny["folder"] / "scope", ignored_scope_names=[first_conv, "/not/a/node"],
                                  variants=["ov-int8-f32"], repeats=1, min_time=0.01, log=lambda m: None)
    scope = doc["ignored_scope"]
    assert scope["given"] == 2 and scope["matched"] == [first_conv] and scope["unmatched"] == ["/not/a/node"]
    r = doc["variants"]["ov-int8-f32"]
    assert r["status"] == "ok" and "1 of 2 names matched" in r["note"]
    # the frontend splits a biased Conv into NAME/WithoutBiases + an Add named NAME: the Convolution itself stays f32
    assert r["runtime_precisions"]["Convolution"].get("f32") == 1


@pytest.mark.slow
def test_command_writes_json_without_outputs(tiny, capsys):
    np.save(tiny["folder"] / "calib.npy", tiny["calib"])
    np.save(tiny["folder"] / "evals.npy", tiny["evals"])
    out = tiny["folder"] / "out.json"
    assert ceiling.main(["--onnx", str(tiny["onnx"]), "--calib", str(tiny["folder"] / "calib.npy"), "--evals",
                         str(tiny["folder"] / "evals.npy"), "--batch", "1", "--threads", "2", "--repeats", "1",
                         "--min-time", "0.01", "--variants", "ort-fp32", "ov-fp32", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["variants"]) == {"ort-fp32", "ov-fp32"} and doc["agreement_reference"] == "ort-fp32"
    for r in doc["variants"].values():
        assert "outputs" not in r and r["agreement_with_fp32"] == 1.0 and r["p50_ms"] > 0
    assert "fastest:" in capsys.readouterr().out


def test_a_missing_model_is_a_clear_error(tmp_path):
    images = np.zeros((2, 3, 8, 8), np.float32)
    with pytest.raises(FileNotFoundError, match=re.escape("nowhere.onnx")):
        ceiling.measure_ceiling(tmp_path / "nowhere.onnx", images, images, batch=1, threads=1, transformer=False,
                                work=tmp_path)
    (tmp_path / "garbage.onnx").write_bytes(b"\x00not a model\xff" * 8)
    with pytest.raises(ValueError, match=re.escape("garbage.onnx")):
        ceiling.measure_ceiling(tmp_path / "garbage.onnx", images, images, 1, 1, False, tmp_path)
    with pytest.raises(ValueError, match="unknown variants"):
        ceiling.measure_ceiling(tmp_path / "garbage.onnx", images, images, 1, 1, False, tmp_path, variants=["trt-fp8"])


def test_agreement_is_top1_over_axis_1():
    a = np.array([[0.0, 1.0], [2.0, 1.0], [0.0, 3.0], [1.0, 0.0]])
    b = np.array([[0.0, 2.0], [0.0, 1.0], [0.0, 3.0], [0.0, 1.0]])
    assert ceiling.agreement(a, b) == 0.5
    with pytest.raises(ValueError, match="different shapes"):
        ceiling.agreement(a, b[:3])


def _suite():
    sys.path.insert(0, str(ROOT / "bench/suites"))
    spec = importlib.util.spec_from_file_location("realsize_cpu", ROOT / "bench/suites/realsize_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_suite_loads_qdeploys_artifact_as_its_deploy_line_says(tiny, tmp_path):
    """bench/suites/realsize_cpu.py times qdeploy's chosen artifact by reading its deploy line (engine openvino) or as
    an ONNX Runtime session: the line qdeploy writes must stay one the suite can run, paths relative to --out."""
    import shutil

    import openvino as ov

    from qdeploy.engines.openvino_engine import deploy_line

    suite = _suite()
    out = tmp_path / "out"
    ov.save_model(ov.convert_model(str(tiny["onnx"])), str(out / "openvino-ir" / "model.xml"), compress_to_fp16=False)
    shutil.copy(tiny["onnx"], out / "model.onnx")
    x = np.ascontiguousarray(tiny["evals"][:2])
    line = deploy_line("openvino-ir/model.xml", "fp32", 2, "f32")
    built = suite.chosen_maker({"artifact": "openvino-ir", "deploy": line}, 2, out)(x)
    assert built.precision == "f32" and built.note == line
    assert (out / "openvino-ir" / "compile-cache").is_dir() or "CACHE_DIR" not in line
    plain = suite.chosen_maker({"artifact": "model.onnx"}, 2, out)(x)
    np.testing.assert_allclose(built.run(x), plain.run(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no plain loader"):
        suite.chosen_maker({"artifact": "program.pt2"}, 2, out)(x)


def test_outputs_are_computed_at_a_larger_batch_only_where_the_batch_is_dynamic(tiny, tmp_path):
    """A batch-1 row evaluates its eval images 16 at a time where the ONNX's batch is dynamic; an ONNX with a fixed
    batch is evaluated at that batch (another one would not run)."""
    import onnx

    assert ceiling.evaluation_batch(tiny["onnx"], 1) == 16 and ceiling.evaluation_batch(tiny["onnx"], 32) == 32
    m = onnx.load(str(tiny["onnx"]))
    for v in (*m.graph.input, *m.graph.output):
        v.type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(m, str(tmp_path / "static.onnx"))
    assert ceiling.evaluation_batch(tmp_path / "static.onnx", 1) == 1


def test_argmax_maps_are_kept_and_compared_as_class_maps():
    """A segmenter's logits over a test set are gigabytes a variant: the harness keeps their argmax (keep_argmax), and
    agreement then compares class maps entry by entry."""
    logits = np.zeros((3, 4, 2, 2), np.float32)
    logits[:, 2] = 1.0
    logits[0, 3, 0, 0] = 5.0
    built = ceiling.Built(lambda: None, lambda b: logits[:len(b)], "f32", None, None)
    maps = ceiling.outputs_of(built, np.zeros((3, 1, 2, 2), np.float32), 2, keep_argmax=True)
    assert maps.dtype == np.uint16 and maps.shape == (3, 2, 2) and maps[0, 0, 0] == 3 and maps[1, 1, 1] == 2
    other = maps.copy()
    other[2] = 0
    assert ceiling.agreement(maps, other) == pytest.approx(8 / 12)


def test_the_suites_miou_counts_only_labelled_pixels_and_present_classes():
    suite = _suite()
    labels = np.array([[[0, 0, 1, 11]]])   # 11 = CamVid's void: never counted
    pred = np.array([[[0, 1, 1, 5]]])
    # class 0: 1 / 2, class 1: 1 / 2; class 5 appears only in a void pixel, so it is not a class of this image
    assert suite.miou(pred, labels) == pytest.approx(50.0)
    assert suite.metric_of("deeplabv3_camvid", pred, labels) == pytest.approx(50.0)
    assert suite.BUDGET[suite.task_of("deeplabv3_camvid")] == 1.0 and suite.task_of("resnet50") == "classification"


@pytest.mark.slow
def test_the_suites_detector_map_replays_outputs_through_qdeploys_evaluation():
    """The suite scores each harness variant of a detector row by replaying its raw outputs through qdeploy's own
    decoding, NMS and COCO evaluation: on the committed 320 px BCCD detector's PyTorch outputs it must give the mAP
    its training record states (52.06 on the 72 test images), and a replay that runs out of outputs must say so."""
    import torch

    from conftest import shared_path

    suite = _suite()
    bccd = shared_path("data", "detection", "bccd")
    cfg = suite.config("yolo_bccd640", SimpleNamespace(bccd=bccd, time_limit=None, confidence=0.5), 1, 2)
    cfg["model"].update(kwargs={"size": 320}, weights=str(ROOT / "bench/weights/bccd_yolo.pt"))
    cfg["model"]["preprocess"]["input_size"] = [320, 320]
    x, _ = suite.arrays(cfg["data"]["eval"], cfg, labels=False)
    sys.path.insert(0, str(ROOT / "bench/train"))
    import bccd_models

    net = bccd_models.bccd_yolo(size=320).eval()
    net.load_state_dict({k: v.float() for k, v in torch.load(cfg["model"]["weights"], map_location="cpu").items()})
    with torch.no_grad():
        out = torch.cat([net(torch.from_numpy(x[i:i + 8])) for i in range(0, len(x), 8)]).numpy()
    assert len(x) == 72
    recorded = 100 * json.loads((ROOT / "bench/weights/bccd_yolo.json").read_text())["test_split"]["map"]
    assert suite.detection_map(cfg, out) == pytest.approx(recorded, abs=0.5)
    with pytest.raises(ValueError, match="replay: 8 images asked at 64"):
        suite.detection_map(cfg, out[:70])


@pytest.mark.slow
def test_another_row_of_the_same_model_reuses_its_quantized_models(tiny, tmp_path):
    """Quantization depends on the ONNX, the calibration images and NNCF's settings, not on the batch or threads of a
    row: the harness keeps each quantized model in a reuse folder keyed by those, and another row times it again
    without quantizing (what a row of the real-size suite costs on the device is mostly NNCF and quantize_static)."""
    run = lambda calib, variants: ceiling.measure_ceiling(  # noqa: E731
        tiny["onnx"], calib, tiny["evals"], batch=1, threads=2, transformer=False, work=tmp_path / "work",
        variants=variants, repeats=1, min_time=0.01, log=lambda m: None, reuse=tmp_path / "reuse")
    first = run(tiny["calib"], ["ov-int8-f32", "nncf-default"])
    assert all("nncf.quantize" in first["variants"][n]["note"] for n in ("ov-int8-f32", "nncf-default"))
    again = run(tiny["calib"], ["ov-int8-f32", "nncf-default"])
    for n in ("ov-int8-f32", "nncf-default"):
        assert ceiling.REUSED in again["variants"][n]["note"], again["variants"][n]["note"]
        assert again["variants"][n].get("outputs_reused") and not first["variants"][n].get("outputs_reused")
        np.testing.assert_allclose(again["variants"][n]["outputs"], first["variants"][n]["outputs"], atol=1e-4)
    other_images = ceiling.measure_ceiling(  # other eval images: their outputs are computed, not read back
        tiny["onnx"], tiny["calib"], tiny["evals"][::-1].copy(), batch=1, threads=2, transformer=False,
        work=tmp_path / "work", variants=["ov-int8-f32"], repeats=1, min_time=0.01, log=lambda m: None,
        reuse=tmp_path / "reuse")["variants"]["ov-int8-f32"]
    assert not other_images.get("outputs_reused")
    np.testing.assert_allclose(other_images["outputs"], first["variants"]["ov-int8-f32"]["outputs"][::-1], atol=1e-4)
    other_calib = run(tiny["calib"][::-1].copy(), ["ov-int8-f32"])  # other calibration images: quantized anew
    assert "nncf.quantize" in other_calib["variants"]["ov-int8-f32"]["note"]
    # an ONNX Runtime INT8 file kept there is loaded, not made again (the kept file here is the FP32 ONNX itself)
    import shutil

    folder = ceiling.reuse_folder(tmp_path / "reuse", tiny["onnx"], tiny["calib"], False, [])
    shutil.copy(tiny["onnx"], folder / "ort-int8-u8s8.onnx")
    kept = run(tiny["calib"], ["ort-int8-u8s8"])["variants"]["ort-int8-u8s8"]
    assert kept["status"] == "ok" and ceiling.REUSED in kept["note"] and "0 QuantizeLinear" in kept["note"]


def test_a_rows_finished_optimize_is_read_back_by_the_next_call_with_the_same_config(tmp_path):
    """A row's optimize and its harness need not fit one device call: the next run of the suite on the same machine
    reads back the answer and wall time optimize left in --out, and runs optimize again when the config differs."""
    suite = _suite()
    calls = []

    def optimize(cfg, out, cache_dir):  # what api.optimize leaves: optimize.json in out, its summary returned
        calls.append(cfg["optimize"]["threads"])
        out.mkdir(parents=True, exist_ok=True)
        summary = {"chosen": {"variant": f"int8-t{cfg['optimize']['threads']}"}}
        (out / "optimize.json").write_text(json.dumps(summary))
        return summary

    api = SimpleNamespace(optimize=optimize)
    cfg = {"model": {"source": "m.py:net"}, "optimize": {"threads": 16, "batch_size": 1}}
    s, wall = suite.optimized(api, cfg, tmp_path / "row", tmp_path / "cache")
    again, wall_again = suite.optimized(api, json.loads(json.dumps(cfg)), tmp_path / "row", tmp_path / "cache")
    assert calls == [16] and again == s and wall_again == pytest.approx(wall, abs=0.05)
    cfg["optimize"]["threads"] = 4
    other, _ = suite.optimized(api, cfg, tmp_path / "row", tmp_path / "cache")
    assert calls == [16, 4] and other["chosen"]["variant"] == "int8-t4"


def test_onnx_runtime_calibrates_on_the_images_its_calibrator_can_hold(tiny, monkeypatch):
    """ONNX Runtime's MinMax calibrator keeps every calibration image's activations to the end (320 Swin-T images at
    224 px: about 146 GiB): the harness gives quantize_static the first images that fit in a quarter of the available
    memory, and says so in the variant's note; all of them where they fit."""
    import types

    import psutil

    calib = tiny["calib"]
    per = ceiling.activation_bytes_per_image(tiny["onnx"], calib)
    assert per > calib[0].nbytes  # the input and every float tensor after it
    kept, note = ceiling.ort_calibration_images(tiny["onnx"], calib)
    assert len(kept) == len(calib) and note is None
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=4 * 5 * per + 1))
    kept, note = ceiling.ort_calibration_images(tiny["onnx"], calib)
    assert len(kept) == 5 and note.startswith(f"calibrated on the first 5 of {len(calib)} images")


def test_the_activation_byte_count_skips_value_info_of_tensors_no_node_produces(tiny, tmp_path):
    """quant_pre_process's optimizer fuses nodes and can keep their old value_info entries (a timm ConvNeXt's layer
    scale Mul): asking ONNX Runtime for such a tensor as an output makes the model invalid, so only tensors that a node
    produces are counted."""
    import onnx

    model = onnx.load(str(tiny["onnx"]))
    model.graph.value_info.append(onnx.helper.make_tensor_value_info("fused_away", onnx.TensorProto.FLOAT, [1, 16]))
    stale = tmp_path / "stale.onnx"
    onnx.save(model, str(stale))
    calib = tiny["calib"]
    assert ceiling.activation_bytes_per_image(stale, calib) == ceiling.activation_bytes_per_image(tiny["onnx"], calib)


def test_a_row_measured_again_replaces_the_earlier_one_which_is_kept_as_superseded(tmp_path):
    suite = _suite()

    def row(speedup):
        return {"model": "resnet50", "batch": 1, "threads": 16, "chosen": "openvino-int8", "chosen_p50_ms": 3.0,
                "speedup_vs_best_fp32": speedup, "ceiling_variant": "ov-int8-bf16", "ceiling_speedup": 3.5,
                "ceiling_within_budget_variant": "ov-int8-bf16", "ceiling_within_budget_speedup": 3.5,
                "nncf_default_speedup": 3.4, "confirm_drop_points": 0.1, "budget_met": True, "optimize_wall_s": 200.0,
                "vs_ceiling": speedup / 3.5}

    parts = []
    for i, speedup in enumerate((2.6, 3.4)):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({"cpu_flags": ["amx_int8"], "machine": "xeon", "command": f"run {i}",
                                         "rows": [row(speedup)]}))
    out = tmp_path / "merged.json"
    suite.merge(parts, out)
    suite.merge([parts[1]], out)  # the same measurement merged again is not a new supersession
    merged = json.loads(out.read_text())
    assert [r["speedup_vs_best_fp32"] for r in merged["rows"]] == [3.4]
    assert merged["rows"][0]["measured_by"] == "run 1"
    assert [r["speedup_vs_best_fp32"] for r in merged["superseded"]] == [2.6]


def test_every_rows_optimize_decides_on_the_suites_confidence(tmp_path):
    """The goal (within budget on the confirm split) and the ceiling within budget are point estimates; every kind of
    row (CIFAR-10 classifier, Lite0, segmenter, detector) hands the suite's --confidence to optimize, and the row says
    which bound optimize decided on."""
    from qdeploy.config import OptimizeConfig

    suite = _suite()
    a = SimpleNamespace(weights=tmp_path, cifar=tmp_path, count=2000, time_limit=None, confidence=0.5,
                        imagenet=tmp_path, lite0_weights=tmp_path / "lite0.pt", camvid=tmp_path, bccd=tmp_path,
                        deeplabv3_weights=tmp_path / "dlv3.pt")
    for name in ("resnet50", "efficientnet_lite0", "deeplabv3_camvid", "yolo_bccd640"):
        cfg = suite.config(name, a, 1, 16)
        assert cfg["optimize"]["confidence"] == 0.5, name
        assert OptimizeConfig(**cfg["optimize"]).confidence == 0.5
