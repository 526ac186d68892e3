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
    with pytest.raises(ValueError, match="status must be one of ok, skipped, failed.*'crashed'"):
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
    bad["schema"] = "qdeploy.results/2"
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
