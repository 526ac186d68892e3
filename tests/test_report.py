"""Report stage: real files written to tmp_path from realistic results dicts."""
from __future__ import annotations

import base64
import copy
import json
import re

import numpy as np
import pytest
from rich.console import Console

from qdeploy.report import (SCHEMA_VERSION, print_table, render_html, render_markdown, validate_results,
                            write_reports)
from qdeploy.report import writer
from qdeploy.report.tables import NOISY_HINT
from qdeploy.evaluate.stats import accuracy_change
from qdeploy.report.verdict import mark_degraded, recommend, run_warnings

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FP16_REASON = "FP16 needs a CUDA GPU; none is available"
FAIL_REASON = "onnxruntime session failed: [ONNXRuntimeError] : 1 : FAIL : Type Error | <bf16> unsupported"


def _bench(rng: np.random.Generator, base_ms: float, sizes=(1, 32), n=100) -> dict:
    """Latency stats, raw samples and throughput as the benchmark stage produces them."""
    lat, raw, tput = {}, {}, {}
    for bs in sizes:
        s = base_ms * (1 + 0.6 * (bs - 1) / 31 * 10) * (1 + rng.gamma(2.0, 0.03, n))
        raw[str(bs)] = [round(float(x), 4) for x in s]
        q = np.percentile(s, [50, 90, 95, 99])
        lat[str(bs)] = {"mean": float(s.mean()), "std": float(s.std()), "p50": q[0], "p90": q[1], "p95": q[2],
                        "p99": q[3], "min": float(s.min()), "max": float(s.max())}
        tput[str(bs)] = bs / (s.mean() / 1000)
    return {"latency_ms": lat, "latency_samples_ms": raw, "throughput_ips": tput}


def _variant(name, engine, precision, status="ok", reason=None, metrics=None, agreement=None, bench=None, **extra):
    v = {"name": name, "engine": engine, "precision": precision, "status": status, "reason": reason,
         "device": "cpu", "details": {"threads": 2} if engine == "torch" else
         {"providers": ["CPUExecutionProvider"], "graph_optimization": "all"},
         "metrics": metrics or {}, "agreement": agreement, "latency_ms": {}, "latency_samples_ms": {},
         "throughput_ips": {}, "memory_mb": {}, "timings_s": {}}
    if bench:
        v.update(bench)
        v["memory_mb"] = {"rss_peak": 812.0, "rss_delta": 120.5, "gpu_allocated_peak": None,
                          "gpu_reserved_peak": None, "artifact": 44.6}
        v["timings_s"] = {"load": 0.4, "eval": 12.1, "bench": 3.2}
    v.update(extra)
    return v


def _results(task: str, variants: list[dict], **model) -> dict:
    data = {"format": "imagefolder", "root": "/data/imagenette/val", "samples": 10000, "num_classes": 10,
            "class_names": [f"class_{i}" for i in range(10)]}
    if task == "segmentation":
        data = {"format": "camvid", "root": "/data/camvid/test", "samples": 233, "num_classes": 3,
                "class_names": ["Sky", "Pole", "Road"]}
    return {
        "schema": SCHEMA_VERSION, "qdeploy_version": "0.1.0", "created": "2026-11-21T10:00:00+00:00",
        "config": {"model": {"source": "torchvision:resnet18"}},
        "model": {"source": "torchvision:resnet18", "task": task, "input_size": [224, 224],
                  "onnx": {"path": "runs/x/model.onnx", "opset": 17, "exporter": "torchscript", "size_mb": 44.6,
                           "verify": {"max_abs_diff": 2.1e-5, "cosine": 0.99999, "passed": True, "samples": 8}},
                  **model},
        "data": {"eval": data},
        "environment": {"python": "3.11.7", "platform": "Linux-6.8-x86_64", "cpu": "AMD EPYC 9654", "cpu_count": 2,
                        "gpu": None, "torch": "2.15.0", "torchvision": "0.29.2", "onnx": "1.23.2",
                        "onnxruntime": "1.31.1", "cuda": None, "cudnn": None},
        "bench": {"batch_sizes": [1, 32], "warmup": 10, "iterations": 100},
        "reference": variants[0]["name"],
        "variants": variants,
    }


def classification_results() -> dict:
    rng = np.random.default_rng(0)
    return _results("classification", [
        _variant("torch-fp32", "torch", "fp32", metrics={"top1": 0.9173, "top5": 0.9978, "samples": 10000},
                 bench=_bench(rng, 12.0)),
        _variant("onnxruntime-fp32", "onnxruntime", "fp32", metrics={"top1": 0.9171, "top5": 0.9978, "samples": 10000},
                 agreement=0.9994, bench=_bench(rng, 8.5)),
        _variant("onnxruntime-int8", "onnxruntime", "int8", metrics={"top1": 0.9102, "top5": None, "samples": 10000},
                 agreement=0.9812, bench=_bench(rng, 4.1), note="accuracy simulated in ONNX Runtime"),
        _variant("torch-fp16", "torch", "fp16", status="skipped", reason=FP16_REASON),
        _variant("onnxruntime-bf16", "onnxruntime", "bf16", status="failed", reason=FAIL_REASON,
                 metrics=None, latency_ms=None,
                 details={"traceback": "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: <boom>"}),
    ])


SHA = "3f" * 32


def v2_results() -> dict:
    """classification_results plus everything results/2 adds, decided by the real verdict functions."""
    res = classification_results()
    rng = np.random.default_rng(7)
    vs = res["variants"]
    vs.insert(3, _variant("onnxruntime-int8-trt-entropy", "onnxruntime", "int8", agreement=0.9990,
                          metrics={"top1": 0.9172, "top5": 0.9978, "samples": 10000}, bench=_bench(rng, 2.0),
                          speed_is_deployment=False))
    vs.insert(3, _variant("onnxruntime-int8-max", "onnxruntime", "int8", agreement=0.4512,
                          metrics={"top1": 0.4021, "top5": 0.71, "samples": 10000}, bench=_bench(rng, 3.9)))
    vs[2]["metrics"]["top1"] = 0.9150  # within 0.5 points: the fastest deployable variant
    noisy = vs[2]["latency_ms"]["1"]
    noisy.update(cv=0.234, noisy=True, repeats=3, repeat_p50s=[noisy["p50"], noisy["p50"] * 1.2, noisy["p50"] * 1.4])
    for v in vs:
        for stats in v["latency_ms"].values() if isinstance(v["latency_ms"], dict) else []:
            stats.setdefault("cv", 0.031)
            stats.setdefault("noisy", False)
    vs[2]["stages"] = {
        "build": {"status": "ok", "time_s": 41.5, "error": None, "cache_hit": False,
                  "memory_mb": {"rss_peak": 2345.6, "rss_delta": 1500.0}},
        "load": {"status": "ok", "time_s": 0.8, "error": None}, "eval": {"status": "ok", "time_s": 9.9, "error": None},
        "bench": {"status": "ok", "time_s": 2.5, "error": None}}
    failed = vs[-1]
    failed["failed_stage"] = "load"
    failed["stages"] = {"build": {"status": "ok", "time_s": 0.1, "error": None, "cache_hit": True, "memory_mb": None},
                        "load": {"status": "failed", "time_s": 0.3, "error": FAIL_REASON},
                        "eval": {"status": "not_run", "time_s": None, "error": None},
                        "bench": {"status": "not_run", "time_s": None, "error": None}}
    vs[-2]["failed_stage"] = "check"
    # the paired test on the same 10,000 images: 60 images right only for the reference, 37 only for the variant
    vs[2]["accuracy_change"] = accuracy_change(n=10000, reference_correct=9173, b=60, c=37)
    mark_degraded(vs, "classification")
    res["recommendation"] = recommend(res)
    res["warnings"] = run_warnings(res)
    res["bench"]["repeats"] = 3
    res["artifacts"] = [
        {"variant": "onnxruntime-int8", "kind": "onnx", "path": "artifacts/onnxruntime-int8.onnx", "sha256": SHA,
         "produced_by": "quantize.qdq (entropy)", "inputs": ["model.onnx"]},
        {"variant": "onnxruntime-int8-trt-entropy", "kind": "trt_calibration_cache",
         "path": "artifacts/onnxruntime-int8-trt-entropy.trtcache", "sha256": "0" * 64, "produced_by": "quantize",
         "inputs": []}]
    res["data"]["eval"]["skipped_files"] = [{"path": f"val/n01/broken_{i}.JPEG", "reason": "truncated JPEG"}
                                            for i in range(23)]
    res["data"]["calibration"] = {"skipped_files": [{"path": "calib/x.png", "reason": "not an image"}]}
    return res


def segmentation_results() -> dict:
    rng = np.random.default_rng(1)
    res = _results("segmentation", [
        _variant("torch-fp32", "torch", "fp32", bench=_bench(rng, 40.0, sizes=(1,)),
                 metrics={"miou": 0.5231, "pixel_acc": 0.836, "samples": 233,
                          "per_class_iou": {"Sky": 0.9, "Pole": None, "Road": 0.1462}}),
        _variant("onnxruntime-fp32", "onnxruntime", "fp32", bench=_bench(rng, 31.0, sizes=(1,)), agreement=0.99871,
                 metrics={"miou": 0.5229, "pixel_acc": 0.8359, "samples": 233,
                          "per_class_iou": {"Sky": 0.8998, "Pole": None, "Road": 0.146}}),
        _variant("torch-bf16", "torch", "bf16", status="skipped", reason="BF16 needs a CUDA GPU; none is available"),
    ], source="torchvision:deeplabv3_mobilenet_v3_large", input_size=[360, 480], onnx=None)
    res["bench"]["batch_sizes"] = [1]
    return res


def _png_images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)]


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.slow
def test_write_reports_classification(tmp_path):
    results = classification_results()
    paths = write_reports(results, tmp_path / "run")
    assert set(paths) == {"results", "markdown", "html"}
    assert all(p.is_file() and p.parent == tmp_path / "run" for p in paths.values())
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]  # no temp files left over

    with open(paths["results"], encoding="utf-8") as f:
        assert json.load(f) == json.loads(json.dumps(results))  # round-trips (int keys aside, there are none)

    md = paths["markdown"].read_text(encoding="utf-8")
    for number in ("91.73", "99.78", "91.71", "-0.02", "-0.71", "99.94", "98.12"):
        assert number in md, number
    assert "| torch-fp32 | 91.73 | 99.78 | ref | ref | 10,000 |" in md
    assert "accuracy simulated in ONNX Runtime" in md
    assert FP16_REASON in md
    assert "\\| &lt;bf16> unsupported" in md  # a "|" in a reason must not break the table
    assert "opset 17" in md and "verification passed" in md and "2.10e-05" in md
    assert "## Latency, batch size 1" in md and "## Latency, batch size 32" in md
    assert "## Memory" in md and "812.0" in md and "44.6" in md
    assert "Per-class IoU" not in md

    html = paths["html"].read_text(encoding="utf-8")
    images = _png_images(html)
    assert len(images) == 2
    assert all(img.startswith(PNG_SIGNATURE) and len(img) > 2000 for img in images)
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', html, re.I)
    assert "<script" not in html.lower()
    for v in results["variants"]:
        assert v["name"] in html
    assert FP16_REASON in html
    assert "&lt;bf16&gt; unsupported" in html and "<bf16>" not in html  # escaped
    assert "91.73" in html
    assert "<summary>Traceback of onnxruntime-bf16</summary>" in html and "RuntimeError: &lt;boom&gt;" in html
    assert "Traceback" not in md  # kept out of the Markdown tables; results.json has it


def test_write_reports_segmentation(tmp_path):
    results = segmentation_results()
    results["variants"][0]["agreement"] = 1.0  # some producers store 1.0 rather than None for the reference
    paths = write_reports(results, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    assert "mIoU %" in md and "52.31" in md and "83.60" in md and "-0.02" in md
    assert "## Per-class IoU %" in md
    assert "| torch-fp32 | 52.31 | 83.60 | ref | ref | 233 |" in md
    assert "| Sky | 90.00 | 89.98 |" in md and "| Pole | – | – |" in md
    assert "BF16 needs a CUDA GPU" in md
    assert "ONNX export" not in md  # onnx: None
    html = paths["html"].read_text(encoding="utf-8")
    assert len(_png_images(html)) == 2 and "Per-class IoU" in html


@pytest.mark.slow
def test_renderers_cope_with_missing_values():
    """Renderers must not trip over None, {} or missing keys (they may run on unvalidated data)."""
    res = classification_results()
    res["model"]["onnx"]["verify"] = None
    res["environment"] = {}
    ref = res["variants"][0]
    ref["metrics"]["top5"] = None
    ref["latency_ms"]["1"] = {"mean": None}
    del ref["memory_mb"]
    res["variants"].append({"name": "bare", "status": "skipped", "reason": "no engine"})
    md, html = render_markdown(res), render_html(res)
    assert "bare" in md and "bare" in html and "not verified" in md
    # Nothing measured anywhere: tables say so, plots are left out instead of raising.
    empty = _results("classification", [_variant("a", "torch", "fp32", status="failed", reason="boom")])
    assert "_No data._" in render_markdown(empty)
    assert "nothing to plot" in render_html(empty) and "data:image/png" not in render_html(empty)


def test_validate_results_rejects_bad_variants():
    validate_results(classification_results())  # the realistic dict is valid
    bad = classification_results()
    del bad["variants"][1]["status"]
    with pytest.raises(ValueError, match=r"variants\[1\].*onnxruntime-fp32.*'status'"):
        validate_results(bad)
    bad = classification_results()
    bad["variants"][2]["status"] = "crashed"
    with pytest.raises(ValueError, match="status must be one of ok, degraded, skipped, failed.*'crashed'"):
        validate_results(bad)
    bad = classification_results()
    bad["variants"][3]["reason"] = " "
    with pytest.raises(ValueError, match="torch-fp16.*no reason"):
        validate_results(bad)
    bad = classification_results()
    del bad["variants"]
    with pytest.raises(ValueError, match="missing top-level key.*'variants'"):
        validate_results(bad)
    bad = classification_results()
    bad["schema"] = "qdeploy.results/1"
    with pytest.raises(ValueError, match="schema"):
        validate_results(bad)
    bad = classification_results()
    bad["reference"] = "nope"
    with pytest.raises(ValueError, match="reference 'nope'"):
        validate_results(bad)
    bad = classification_results()
    bad["variants"][0]["latency_ms"]["1"]["std"] = float("nan")
    with pytest.raises(ValueError, match=r"variants\[0\]\.latency_ms\.1\.std is nan"):
        validate_results(bad)


def test_validate_results_returns_json_ready_copy():
    res = classification_results()
    res["variants"][0]["throughput_ips"] = {1: np.float32(80.5)}
    res["model"]["input_size"] = (224, 224)
    data = validate_results(res)
    assert data["variants"][0]["throughput_ips"] == {"1": 80.5}
    assert data["model"]["input_size"] == [224, 224]
    assert isinstance(res["model"]["input_size"], tuple)  # the caller's dict is left alone
    json.dumps(data, allow_nan=False)


def test_invalid_results_write_nothing(tmp_path):
    bad = classification_results()
    bad["variants"][0]["status"] = "weird"
    with pytest.raises(ValueError):
        write_reports(bad, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_failed_render_leaves_no_report_html(tmp_path, monkeypatch):
    results = classification_results()
    write_reports(results, tmp_path)  # an earlier run's reports are in the folder

    def broken(_results):
        raise RuntimeError("render exploded")

    monkeypatch.setattr(writer, "render_html", broken)
    changed = copy.deepcopy(results)
    changed["variants"][0]["metrics"]["top1"] = 0.5
    with pytest.raises(RuntimeError, match="render exploded"):
        write_reports(changed, tmp_path)
    assert not (tmp_path / "report.html").exists()  # neither partial nor stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "results.json"]
    assert json.loads((tmp_path / "results.json").read_text())["variants"][0]["metrics"]["top1"] == 0.5
    assert "50.00" in (tmp_path / "report.md").read_text()


def test_print_table():
    results = classification_results()
    console = Console(record=True, width=200)
    print_table(results, console=console)
    text = console.export_text()
    for v in results["variants"]:
        assert v["name"] in text
    assert "91.73" in text and "skipped" in text and FP16_REASON in text
    assert "[ONNXRuntimeError]" in text  # brackets shown verbatim, not eaten as rich markup
    assert "bs 32" in text and "img/s" in text
    narrow = Console(record=True, width=80)  # too narrow for one line per variant: stacked layout
    print_table(results, console=narrow)
    narrow_text = narrow.export_text()
    assert "91.73" in narrow_text and "1,048.5" in narrow_text and "…" not in narrow_text  # nothing truncated
    assert all(v["name"] in narrow_text for v in results["variants"])
    assert max(map(len, narrow_text.splitlines())) <= 80
    seg = Console(record=True, width=200)
    print_table(segmentation_results(), console=seg)
    seg_text = seg.export_text()  # export_text() empties the record buffer: read it once
    assert "mIoU" in seg_text and "52.31" in seg_text and "BF16 needs a CUDA GPU" in seg_text


# ----------------------------------------------------------------------------------------- results/2
def test_v2_results_are_valid_and_decided():
    res = v2_results()
    data = validate_results(res)
    status = {v["name"]: v["status"] for v in data["variants"]}
    assert status["onnxruntime-int8-max"] == "degraded"  # 45 % agreement
    rec = data["recommendation"]
    assert rec["variant"] == "onnxruntime-int8" and rec["runner_up"] == "onnxruntime-fp32"
    assert "speed not its deployment" in rec["excluded"]["onnxruntime-int8-trt-entropy"]  # fastest of all, but †
    assert rec["excluded"]["onnxruntime-bf16"].startswith("failed at load")
    assert "within noise" in rec["reason"]  # the winner's timing is flagged noisy


@pytest.mark.slow
def test_reports_open_with_the_recommendation(tmp_path):
    res = v2_results()
    paths = write_reports(res, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    first_table = md.index("## Accuracy")
    assert md.index("> **Recommended: onnxruntime-int8** — fastest p50 on this machine at batch 1") < md.index("- **Model:**")
    assert md.index("Tolerance: Top-1 within 0.5 points of the reference torch-fp32") < first_table
    assert md.index("> - onnxruntime-int8-max: degraded: INT8 accuracy collapsed") < first_table
    # the winner's noisy timing: marked in the latency table, with the hint right under it
    latency1 = md[md.index("## Latency, batch size 1"):md.index("## Latency, batch size 32")]
    assert "| 23.4 ⚠ |" in latency1 and f"- {NOISY_HINT}" in latency1
    assert "| onnxruntime-int8 | " in latency1
    assert "Repeat p50s ms" in latency1
    # the † variant comes after all others, with no speed-up, and the note says why
    rows = [line for line in latency1.splitlines() if line.startswith("| ") and "Variant" not in line]
    assert rows[-1].startswith("| onnxruntime-int8-trt-entropy † |") and rows[-1].split("|")[8].strip() == "–"
    assert "not in the engine it is built for" in latency1
    # degraded: in the tables with its numbers, marked, the reason under them; never recommended
    accuracy = md[first_table:md.index("## Latency, batch size 1")]
    assert "| onnxruntime-int8-max (degraded) | 40.21 |" in accuracy
    assert "- onnxruntime-int8-max: degraded: INT8 accuracy collapsed: 45.12 %" in accuracy
    assert "failed at load: onnxruntime session failed" in md
    assert "skipped at check: " + FP16_REASON in md
    # build time and memory apart from the deployed model's
    assert "| Build s | Build peak MB |" in md and "| 41.50 | 2,345.6 |" in md and "0.10 (cached)" in md
    # artifacts and skipped files
    assert "## Artifacts" in md and "| artifacts/onnxruntime-int8.onnx | 3f3f3f3f3f3f | quantize.qdq (entropy) |" in md
    assert SHA not in md  # 12 digits shown, results.json keeps all 64
    assert "**Skipped files:** 23 eval, 1 calibration image(s) unreadable" in md
    assert "| eval | val/n01/broken_0.JPEG | truncated JPEG |" in md
    assert "… 4 more (see results.json)" in md and "broken_19.JPEG" in md and "broken_20.JPEG" not in md
    assert "3 repeats (lowest median kept)" in md

    html = paths["html"].read_text(encoding="utf-8")
    assert html.index('<section class="verdict" id="recommendation">') < html.index("<h2")
    assert "<strong>Recommended: onnxruntime-int8</strong> — fastest p50" in html
    assert "Why not the others" in html and "speed not its deployment engine" in html
    assert NOISY_HINT in html and "23.4 ⚠" in html
    assert '<tr class="degraded">' in html
    assert "3f3f3f3f3f3f" in html and "… 4 more" in html
    assert "hollow markers" in html and "p50 (median) latency" in html
    images = _png_images(html)
    assert len(images) == 2 and all(img.startswith(PNG_SIGNATURE) for img in images)
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', html, re.I)  # self-contained
    assert "<script" not in html.lower() and "http://" not in html and "https://" not in html


def test_no_recommendation_is_shown_with_its_reason():
    res = classification_results()
    for v in res["variants"]:
        v["latency_ms"] = {}
    res["recommendation"] = recommend(res)
    validate_results(res)
    md = render_markdown(res)
    assert md.index("> **No variant recommended on this machine** — none of the 2 variant(s)") < md.index("## Accuracy")
    assert "was the bench stage run?" in md
    assert '<section class="verdict none"' in render_html(res)


def test_print_table_opens_with_the_recommendation():
    res = v2_results()
    console = Console(record=True, width=200)
    print_table(res, console=console)
    text = console.export_text()
    assert text.index("Recommended: onnxruntime-int8") < text.index("qdeploy report:") < text.index("Variant")
    assert "⚠" in text and " ".join(NOISY_HINT.split()) in " ".join(text.split())  # wrapped lines: any whitespace
    assert "onnxruntime-int8-trt-entropy †" in text and "degraded" in text
    assert "failed at load" in text


def _mutate(res: dict, path: str, value) -> dict:
    """Set ``value`` at a dotted path ("variants.2.stages.build.status"); DELETE removes the key."""
    *parents, last = path.split(".")
    node = res
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return res


DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    ("variants.2.failed_stage", "compile", r"variants\[2\].*failed_stage must be None or one of check, build"),
    ("variants.2.speed_is_deployment", "yes", r"speed_is_deployment must be true or false"),
    ("variants.2.stages.build.status", "done", r"variants\[2\].*stages\.build\.status must be one of ok, failed"),
    ("variants.2.stages.compile", {"status": "ok"}, r"stages: unknown stage 'compile'"),
    ("variants.2.stages.build.time_s", -1, r"stages\.build\.time_s must be a number >= 0"),
    ("variants.2.stages.build.cache_hit", "no", r"stages\.build\.cache_hit must be true, false or None"),
    ("variants.2.stages.build.memory_mb", 12, r"stages\.build\.memory_mb must be a dict"),
    ("variants.2.stages.load.error", 3, r"stages\.load\.error must be a string"),
    ("variants.2.latency_ms.1.cv", "high", r"latency_ms\.1\.cv must be a number"),
    ("variants.2.latency_ms.1.noisy", 1, r"latency_ms\.1\.noisy must be true or false"),
    ("variants.2.latency_ms.1.repeats", 0, r"latency_ms\.1\.repeats must be an integer >= 1"),
    ("variants.2.latency_ms.1.repeat_p50s", [1.0], r"repeat_p50s has 1 medians but repeats is 3"),
    ("variants.3.reason", None, r"'onnxruntime-int8-max'.*status is 'degraded' but no reason"),
    ("recommendation.variant", "onnxruntime-int8-max", r"recommendation\.variant 'onnxruntime-int8-max' has status 'degraded'"),
    ("recommendation.runner_up", "nope", r"recommendation\.runner_up 'nope' is not the name of any variant"),
    ("recommendation.tolerance", "0.5", r"recommendation\.tolerance must be a number"),
    ("recommendation.reason", "", r"recommendation\.reason must be a non-empty string"),
    ("recommendation.metric", DELETE, r"recommendation\.metric must be a non-empty string"),
    ("recommendation.batch_size", 1, r"recommendation\.batch_size must be a string or None"),
    ("recommendation.excluded", ["a"], r"recommendation\.excluded must be a dict"),
    ("recommendation", "int8", r"recommendation must be a dict"),
    ("artifacts", {}, r"results\.artifacts must be a list"),
    ("artifacts.0.path", "/abs/model.onnx", r"artifacts\[0\]\.path must be relative to the output folder"),
    ("artifacts.0.path", "../model.onnx", r"artifacts\[0\]\.path must be relative"),
    ("artifacts.0.sha256", "abc", r"artifacts\[0\]\.sha256 must be 64 lowercase hex digits"),
    ("artifacts.0.variant", "ghost", r"artifacts\[0\]\.variant 'ghost' is not the name of any variant"),
    ("artifacts.1.produced_by", DELETE, r"artifacts\[1\]\.produced_by must be a non-empty string"),
    ("artifacts.0.inputs", "model.onnx", r"artifacts\[0\]\.inputs must be a list of strings"),
    ("data.eval.skipped_files", {"a": 1}, r"data\.eval\.skipped_files must be a list"),
    ("data.eval.skipped_files.0.reason", "", r"data\.eval\.skipped_files\[0\]\.reason must be a non-empty"),
    ("data.calibration.skipped_files.0", "calib/x.png", r"data\.calibration\.skipped_files\[0\] must be a dict"),
    ("variants.2.accuracy_change", 0.23, r"variants\[2\].*accuracy_change must be a dict"),
    ("variants.2.accuracy_change.verdict", "meh", r"accuracy_change\.verdict must be one of 'no detectable change'"),
    ("variants.2.accuracy_change.p_value", 1.5, r"accuracy_change\.p_value must be a probability in \[0, 1\]"),
    ("variants.2.accuracy_change.n", 0, r"accuracy_change\.n must be an integer >= 1"),
    ("variants.2.accuracy_change.ci_low_points", 9.0, r"accuracy_change: ci_low_points 9\.0 is above ci_high_points"),
    ("recommendation.speedup.ratio", -1.0, r"recommendation\.speedup\.ratio must be a positive number"),
    ("recommendation.speedup.noisy", "yes", r"recommendation\.speedup\.noisy must be a list"),
    ("warnings", {}, r"results\.warnings must be a list"),
    ("warnings", [{"code": "", "message": "m"}], r"results\.warnings\[0\]\.code must be a non-empty string"),
])
def test_validate_rejects_malformed_v2_keys(path, value, message):
    bad = _mutate(v2_results(), path, value)
    with pytest.raises(ValueError, match=message):
        validate_results(bad)


@pytest.mark.slow
def test_accuracy_change_is_reported_beside_agreement(tmp_path):
    """A detectable drop within the tolerance: reported ("worse", with its interval and p), not degraded, still
    recommended; agreement stays in its column."""
    res = v2_results()
    int8 = res["variants"][2]
    assert int8["status"] == "ok" and int8["accuracy_change"]["verdict"] == "worse"
    assert int8["accuracy_change"]["p_value"] == pytest.approx(0.0251, abs=0.002)
    assert res["recommendation"]["variant"] == "onnxruntime-int8"
    assert "(-0.23: worse, 95 % CI -0.42 to -0.04, exact McNemar p = 0.025 on 10,000 images)" in \
        res["recommendation"]["reason"]
    paths = write_reports(res, tmp_path)
    md = paths["markdown"].read_text(encoding="utf-8")
    accuracy = md[md.index("## Accuracy"):md.index("## Latency, batch size 1")]
    assert "| Change vs reference (95 % CI, p) |" in accuracy and "exact McNemar" in accuracy
    assert "| onnxruntime-int8 | 91.50 | – | -0.23 | 98.12 | 10,000 | worse (-0.23, CI -0.42 to -0.04, p 0.025) | accuracy" \
        in accuracy
    assert "| torch-fp32 | 91.73 | 99.78 | ref | ref | 10,000 | ref |" in accuracy
    assert "| onnxruntime-fp32 | 91.71 | 99.78 | -0.02 | 99.94 | 10,000 | – |" in accuracy  # no paired test: –
    # speed-ups carry their bootstrap interval in the latency tables
    latency = md[md.index("## Latency, batch size 32"):md.index("## Memory")]
    assert re.search(r"\| onnxruntime-fp32 \|.*\| \d\.\d\d× \(\d\.\d\d–\d\.\d\d\) \|", latency), latency
    assert "worse (-0.23" in paths["html"].read_text(encoding="utf-8")
    assert json.loads(paths["results"].read_text())["warnings"] == []


def test_validate_accepts_records_without_the_v2_keys():
    """Absent new keys mean "not measured": a results/1-shaped record (schema string aside) stays valid."""
    res = v2_results()
    for key in ("recommendation", "artifacts", "warnings"):
        del res[key]
    for v in res["variants"]:
        for key in ("stages", "failed_stage", "speed_is_deployment", "accuracy_change"):
            v.pop(key, None)
    del res["data"]["eval"]["skipped_files"], res["data"]["calibration"]
    validate_results(res)
    md = render_markdown(res)
    assert "Recommended" not in md and "## Artifacts" not in md and "Skipped input files" not in md
    empty = v2_results()
    empty["artifacts"] = []
    empty["variants"][2]["stages"] = {"bench": {"status": "skipped"}}  # a subset of stages, times unknown
    validate_results(empty)


def test_the_header_states_cpu_flags_threads_and_gpu_driver_and_clocks():
    from qdeploy.report.tables import summary

    results = {"model": {"source": "m.onnx"}, "reference": "onnxruntime-fp32",
               "environment": {"python": "3.11", "platform": "Linux", "cpu": "AMD EPYC", "cpu_count": 2,
                               "cpu_flags": ["avx2", "fma"], "gpu": "NVIDIA H100", "driver": "580.159.04",
                               "cuda": "13.0", "sm_clock_mhz": 1980.0, "openvino": "2026.4.1"},
               "variants": [{"name": "a", "details": {"threads": 2}}, {"name": "b", "details": {"threads": 1}},
                            {"name": "c", "details": {}}]}
    rows = dict(summary(results))
    assert rows["CPU"] == "AMD EPYC (2 cores); flags avx2 fma; timed with 1, 2 thread(s)"
    assert rows["GPU"] == "NVIDIA H100, driver 580.159.04, cuda 13.0, SM MHz now 1980.0"
    assert "openvino 2026.4.1" in rows["Libraries"]
    results["environment"]["cpu_flags"] = []
    assert "flags: none of avx2/avx512/vnni/amx" in dict(summary(results))["CPU"]


def test_the_missed_budget_table_says_when_nncf_accuracy_control_was_not_run():
    """A skipped peer is a row that says why, not a row of dashes that reads as a run with no result."""
    from qdeploy.report.optimize_page import missed_budget_table

    summary = {"candidates": [], "stages": {
        "fallback": {"start": "openvino-int8-nncf", "float_layers": [], "within_budget": False, "trials": []},
        "nncf_accuracy_control": {"skipped": "the own placement's drop is within max_drop already", "drop": 0.2,
                                  "max_drop": 0.5}}}
    rows = missed_budget_table(summary).rows
    assert rows[1][0] == "NNCF quantize_with_accuracy_control"
    assert rows[1][3] == "not run: the own placement's drop is within max_drop already"
