"""The answer of a run: degraded INT8 variants and the recommendation, on hand-built results dicts."""
from __future__ import annotations

import pytest

from qdeploy.report import SCHEMA_VERSION, validate_results
from qdeploy.report.verdict import mark_degraded, recommend


def _lat(p50: float, noisy: bool = False) -> dict:
    cv = 0.2 if noisy else 0.02
    return {"mean": p50 * 1.02, "std": p50 * cv, "p50": p50, "p95": p50 * 1.1, "p99": p50 * 1.2, "cv": cv,
            "noisy": noisy, "repeats": 1, "repeat_p50s": [p50]}


def _v(name, precision="fp32", top1=None, p50=None, status="ok", agreement=None, engine="onnxruntime", noisy=(),
       metric="top1", **extra) -> dict:
    """A variant record; ``p50`` is {batch size: ms}."""
    p50 = p50 or {}
    v = {"name": name, "engine": engine, "precision": precision, "status": status,
         "reason": None if status == "ok" else f"{name} did not run", "metrics": {} if top1 is None else {metric: top1},
         "agreement": agreement, "latency_ms": {str(bs): _lat(ms, bs in noisy) for bs, ms in p50.items()},
         "throughput_ips": {str(bs): int(bs) * 1000 / ms for bs, ms in p50.items()}, "memory_mb": {}}
    v.update(extra)
    return v


def _results(variants, task="classification", reference="torch-fp32") -> dict:
    return {"schema": SCHEMA_VERSION, "model": {"source": "torchvision:resnet18", "task": task},
            "environment": {}, "bench": {"batch_sizes": [1, 8]}, "reference": reference, "variants": variants}


def _zoo() -> dict:
    """The reference, two accurate variants and every kind of variant the rule must pass over."""
    return _results([
        _v("torch-fp32", top1=0.9173, p50={1: 10.0, 8: 60.0}, engine="torch"),
        _v("onnxruntime-fp32", top1=0.9171, p50={1: 6.0, 8: 40.0}, agreement=0.999),
        _v("int8-entropy", "int8", top1=0.9170, p50={1: 3.0, 8: 20.0}, agreement=0.99),
        _v("int8-percentile", "int8", top1=0.9050, p50={1: 2.0, 8: 15.0}, agreement=0.97),   # faster, -1.23 pts
        _v("int8-max", "int8", top1=0.9172, p50={1: 1.5, 8: 12.0}, status="degraded", agreement=0.95),
        _v("int8-trt", "int8", top1=0.9173, p50={1: 1.0, 8: 8.0}, agreement=0.99, speed_is_deployment=False),
        _v("torch-fp16", "fp16", status="failed", engine="torch", failed_stage="build"),
    ])


# ----------------------------------------------------------------------------- recommend
def test_recommend_picks_the_fastest_within_tolerance():
    results = _zoo()
    rec = recommend(results)
    assert rec["variant"] == "int8-entropy" and rec["runner_up"] == "onnxruntime-fp32"
    assert rec["metric"] == "top1" and rec["tolerance"] == 0.5 and rec["batch_size"] == "1"
    # every other variant is accounted for, each with its own reason
    assert set(rec["excluded"]) == {"torch-fp32", "int8-percentile", "int8-max", "int8-trt", "torch-fp16"}
    assert "-1.23 points" in rec["excluded"]["int8-percentile"]
    assert rec["excluded"]["int8-max"].startswith("degraded")
    assert "deployment engine" in rec["excluded"]["int8-trt"]
    assert rec["excluded"]["torch-fp16"].startswith("failed at build")
    assert rec["excluded"]["torch-fp32"].startswith("slower")
    reason = rec["reason"]
    assert reason.startswith("int8-entropy: fastest p50")
    for part in ("on this machine", "batch 1", "3.00 ms", "3.3× torch-fp32", "among 3 variants",
                 "within 0.5 points", "91.73 %", "91.70 % (-0.03)", "Runner-up onnxruntime-fp32 (6.00 ms)"):
        assert part in reason, part
    assert "noise" not in reason  # 3 ms against 6 ms is a clear lead
    results["recommendation"] = rec
    validate_results(results)  # what recommend returns is valid results/2


def test_recommend_tolerance_and_batch_size():
    results = _zoo()
    wide = recommend(results, tolerance=2.0)  # -1.23 points is now acceptable, and it is faster
    assert wide["variant"] == "int8-percentile" and wide["runner_up"] == "int8-entropy"
    at8 = recommend(results, batch_size=8)
    assert at8["batch_size"] == "8" and at8["variant"] == "int8-entropy" and "batch 8" in at8["reason"]
    # a candidate without batch 1: the default is the smallest batch size every candidate measured
    results["variants"][1]["latency_ms"].pop("1")
    rec = recommend(results)
    assert rec["batch_size"] == "8" and rec["variant"] == "int8-entropy"
    # at an explicitly asked batch size it lacks, it is excluded, saying so
    rec1 = recommend(results, batch_size=1)
    assert rec1["excluded"]["onnxruntime-fp32"] == "no latency at batch 1"
    assert rec1["runner_up"] == "torch-fp32"


def test_recommend_flags_a_lead_within_noise():
    results = _results([
        _v("torch-fp32", top1=0.80, p50={1: 5.0}, engine="torch"),
        _v("a", top1=0.80, p50={1: 3.0}),
        _v("b", top1=0.80, p50={1: 3.1}),
    ])
    rec = recommend(results)
    assert rec["variant"] == "a" and rec["runner_up"] == "b"
    assert "within noise" in rec["reason"] and "differ by only 3.2 %" in rec["reason"]
    results["variants"][2] = _v("b", top1=0.80, p50={1: 4.0}, noisy=(1,))
    rec = recommend(results)
    assert "within noise" in rec["reason"] and "b's timing is noisy, CV 20.0 %" in rec["reason"]
    results["variants"][2] = _v("b", top1=0.80, p50={1: 4.0})
    assert "noise" not in recommend(results)["reason"]


def test_recommend_reference_can_win_and_better_accuracy_qualifies():
    results = _results([
        _v("torch-fp32", top1=0.70, p50={1: 1.0}, engine="torch"),
        _v("slow-but-better", top1=0.75, p50={1: 2.0}),
    ])
    rec = recommend(results)
    assert rec["variant"] == "torch-fp32" and "it is the reference" in rec["reason"]
    assert rec["runner_up"] == "slow-but-better"  # +5 points is within "no worse than 0.5 points"


def test_recommend_segmentation_uses_miou():
    results = _results([
        _v("torch-fp32", top1=0.52, p50={1: 40.0}, engine="torch", metric="miou"),
        _v("onnxruntime-int8", "int8", top1=0.50, p50={1: 10.0}, metric="miou", agreement=0.98),
        _v("onnxruntime-fp32", top1=0.5199, p50={1: 30.0}, metric="miou", agreement=0.999),
    ], task="segmentation")
    rec = recommend(results)
    assert rec["metric"] == "miou" and rec["variant"] == "onnxruntime-fp32"
    assert "mIoU -2.00 points" in rec["excluded"]["onnxruntime-int8"]
    assert rec["runner_up"] == "torch-fp32"


@pytest.mark.parametrize("case, expected", [
    ("no eval", "torch-fp32 has no top-1"),
    ("no bench", "has a latency at any batch size (was the bench stage run?)"),
    ("no reference", "no reference variant"),
    ("all excluded", "no variant that ran ok"),
])
def test_recommend_none_qualifies(case, expected):
    results = _zoo()
    if case == "no eval":
        for v in results["variants"]:
            v["metrics"] = {}
    elif case == "no bench":
        for v in results["variants"]:
            v["latency_ms"] = {}
    elif case == "no reference":
        results["reference"] = None
    else:
        results["variants"] = [v for v in results["variants"] if v["name"] in ("torch-fp32", "int8-percentile")]
        results["variants"][0]["status"], results["variants"][0]["reason"] = "failed", "boom"
    rec = recommend(results)
    assert rec["variant"] is None and rec["runner_up"] is None
    assert rec["reason"].startswith("No variant recommended on this machine") and expected in rec["reason"]
    assert set(rec["excluded"]) == {v["name"] for v in results["variants"]}  # each one says why
    results["recommendation"] = rec
    validate_results(results)


# ----------------------------------------------------------------------------- mark_degraded
def test_mark_degraded_by_threshold():
    variants = [
        _v("torch-fp32", top1=0.91),
        _v("onnxruntime-fp16", "fp16", top1=0.60, agreement=0.50),  # not INT8: left alone
        _v("int8-ok", "int8", top1=0.91, agreement=0.95),
        _v("int8-bad", "int8", top1=0.41, agreement=0.85),
        _v("int8-unmeasured", "int8", top1=None, agreement=None),   # no agreement: left alone
        _v("int8-skipped", "int8", status="skipped", agreement=0.10),
    ]
    mark_degraded(variants, "classification")
    status = {v["name"]: v["status"] for v in variants}
    assert status == {"torch-fp32": "ok", "onnxruntime-fp16": "ok", "int8-ok": "ok", "int8-bad": "degraded",
                      "int8-unmeasured": "ok", "int8-skipped": "skipped"}
    reason = variants[3]["reason"]
    assert "85.00 %" in reason and "90.00 % minimum" in reason and "top-1 41.00 %" in reason
    assert variants[3]["latency_ms"] == {} and variants[3]["metrics"] == {"top1": 0.41}  # numbers kept
    assert variants[2]["reason"] is None


def test_mark_degraded_by_siblings():
    def zoo():
        return [_v("int8-entropy", "int8", agreement=0.99), _v("int8-percentile", "int8", agreement=0.97),
                _v("int8-mse", "int8", agreement=0.98), _v("int8-max", "int8", agreement=0.80)]

    variants = zoo()
    mark_degraded(variants, "segmentation", min_agreement=0.5)  # 0.80 clears the threshold...
    assert [v["status"] for v in variants] == ["ok", "ok", "ok", "degraded"]  # ...but not its siblings
    reason = variants[3]["reason"]
    assert "sibling INT8 variants" in reason and "18.00 points below their median 98.00 %" in reason
    assert "int8-entropy" in reason and "pixel predictions" in reason
    # the same verdict in any order
    shuffled = zoo()[::-1]
    mark_degraded(shuffled, "segmentation", min_agreement=0.5)
    assert {v["name"]: v["status"] for v in shuffled} == {v["name"]: v["status"] for v in variants}
    # within 0.10 of the median: not degraded
    close = zoo()
    close[3]["agreement"] = 0.89
    mark_degraded(close, "segmentation", min_agreement=0.5)
    assert all(v["status"] == "ok" for v in close)
    # one sibling is not enough to tell which one is the odd one
    pair = zoo()[2:]
    mark_degraded(pair, "segmentation", min_agreement=0.5)
    assert [v["status"] for v in pair] == ["ok", "ok"]
