"""`qdeploy optimize` (issue #11, first slice): decisions as plain functions, and the whole protocol on a tiny real
model (real exports, real quantization, real ONNX Runtime sessions): search split decides, confirm split checks."""
import json

import pytest
import yaml

from qdeploy import api
from qdeploy.config import BudgetSpec
from qdeploy.errors import ConfigError
from qdeploy.optimize.decide import best_effort, budget_check, fastest_within, metric_standard_error, resolution_warning
from test_qat import _config

# ---------------------------------------------------------------------------- decisions


def test_budget_check_in_points_relative_and_agreement():
    assert budget_check(BudgetSpec(max_drop=0.3), 0.9173, 0.9150, None).within          # 0.23 points
    assert not budget_check(BudgetSpec(max_drop=0.3), 0.9173, 0.9140, None).within      # 0.33 points
    assert budget_check(BudgetSpec(relative=0.01), 0.80, 0.7925, None).within           # 0.75 of 0.80 allowed
    assert not budget_check(BudgetSpec(relative=0.01), 0.80, 0.7900, None).within
    assert budget_check(BudgetSpec(min_agreement=0.98), None, None, 0.981).within
    v = budget_check(BudgetSpec(max_drop=0.3), None, None, 0.99)
    assert not v.within and "use budget.min_agreement" in v.why


def test_exactly_one_budget_kind():
    with pytest.raises(ValueError, match="exactly one of max_drop, relative, min_agreement"):
        BudgetSpec(max_drop=0.3, min_agreement=0.98)
    with pytest.raises(ValueError, match="got none"):
        BudgetSpec()


def test_standard_error_and_the_resolution_warning():
    assert abs(metric_standard_error(0.9, 10_000) - 0.3) < 1e-9
    assert resolution_warning(BudgetSpec(max_drop=0.3), 0.9, 100, "classification").startswith("the budget (0.30 points) is below the standard error")
    assert resolution_warning(BudgetSpec(max_drop=0.3), 0.9, 50_000, "classification") is None


def test_fastest_within_and_best_effort():
    cands = [{"variant": "fp32", "within_budget": True, "rank_key": 5.0, "search_metric": 0.9, "margin": 0.3},
             {"variant": "int8-max", "within_budget": True, "rank_key": 2.0, "search_metric": 0.89, "margin": 0.1},
             {"variant": "int8-mse", "within_budget": False, "rank_key": 1.0, "search_metric": 0.5, "margin": -40}]
    assert fastest_within(cands)["variant"] == "int8-max"
    assert best_effort([c for c in cands if not c["within_budget"]])["variant"] == "int8-mse"
    assert fastest_within([cands[2]]) is None
    # near-equal latencies (within 3 %) are a tie that the more accurate candidate wins
    tied = [{"variant": "a", "within_budget": True, "rank_key": 3.92, "margin": 0.20},
            {"variant": "b", "within_budget": True, "rank_key": 3.96, "margin": 0.24},
            {"variant": "c", "within_budget": True, "rank_key": 7.80, "margin": 0.30}]
    assert fastest_within(tied)["variant"] == "b"
    assert fastest_within(tied, tie=0.0)["variant"] == "a"

# ---------------------------------------------------------------------------- the protocol, end to end


def _opt_config(tmp_path, **optimize):
    cfg = _config(tmp_path, "distill")
    cfg.pop("qat")
    cfg["data"]["eval"]["batch_size"] = 4
    cfg["bench"] = {"batch_sizes": [1, 4], "warmup": 1, "iterations": 3}
    cfg["optimize"] = {"target": "onnxruntime-cpu", "methods": ["max", "mean-minmax"], **optimize}
    return cfg


def test_optimize_chooses_on_search_and_confirms_on_the_rest(tmp_path):
    s = api.optimize(_opt_config(tmp_path, budget={"max_drop": 100.0}), tmp_path / "out", cache_dir=tmp_path / "cache")
    on_disk = json.loads((tmp_path / "out" / "optimize.json").read_text())
    c = on_disk["chosen"]
    assert set(c) >= {"variant", "artifact", "search_metric", "confirm_metric", "reference_confirm_metric",
                      "latency_p50_ms", "reference_latency_p50_ms", "float_layers"}
    assert on_disk["budget_met"] is True and on_disk["splits"] == {"search": 12, "confirm": 12, "seed": 0}
    assert [x["variant"] for x in on_disk["candidates"]] == ["fp32", "int8-max", "int8-mean-minmax"]
    assert all(x["latency_p50_ms"] > 0 for x in on_disk["candidates"])
    # chosen = the fastest candidate within the (loose) budget on the search split, near ties (3 %) to the more accurate
    fastest = min(x["latency_p50_ms"] for x in on_disk["candidates"])
    assert c["latency_p50_ms"] <= fastest * 1.03
    assert (tmp_path / "out" / c["artifact"]).is_file()
    assert on_disk["evaluations"] == {"full": 3 + (2 if c["variant"] != "fp32" else 1), "subset": 0}
    assert s["decisions"][0].startswith("target onnxruntime-cpu: candidates fp32, int8-max, int8-mean-minmax")
    page = (tmp_path / "out" / "optimize.html").read_text()
    assert "Pareto front" in page and page.count("data:image/png;base64,") == 1 and "Decision log" in page
    assert f"Chosen: {c['variant']} (budget met on the confirm split)" in page


def test_pareto_front():
    from qdeploy.report.optimize_page import pareto_front

    pts = [("fp32", 6.0, 91.7), ("a", 3.4, 91.6), ("b", 3.5, 91.5), ("c", 3.3, 90.0), ("d", 7.0, 91.7)]
    assert pareto_front(pts) == ["fp32", "a", "c"]


def test_cli_optimize_prints_the_choice_and_exits_0_when_the_budget_is_met(tmp_path, capsys):
    """FP32 is always a candidate, so the search split always has one within budget; a miss (exit 3) can only show on
    the confirm split. That path is not reproduced deterministically here yet (see the issue #11 note)."""
    from qdeploy.cli import main

    cfg = _opt_config(tmp_path, budget={"min_agreement": 0.5}, methods=["max"])
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["optimize", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache")])
    s = json.loads((tmp_path / "out" / "optimize.json").read_text())
    assert code == 0 and s["budget_met"] is True and s["chosen"]["variant"] in ("fp32", "int8-max")
    assert "budget met on the confirm split" in capsys.readouterr().out


def test_bad_optimize_inputs_are_refused_before_work(tmp_path):
    cfg = _opt_config(tmp_path, budget={"max_drop": 1.0})
    cfg["data"]["eval"]["count"] = 10
    with pytest.raises(ConfigError, match="remove count/complement from data.eval"):
        api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
    cfg = _opt_config(tmp_path, budget={"max_drop": 1.0}, time_limit=0.001)
    with pytest.raises(ConfigError, match="shorter than one evaluation"):
        api.optimize(cfg, tmp_path / "out2", cache_dir=tmp_path / "cache")
    cfg = _opt_config(tmp_path, target="torch-cuda")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            api.optimize(cfg, tmp_path / "out3", cache_dir=tmp_path / "cache")


def test_tensorrt_target_without_tensorrt_ranks_by_int8_share_and_says_so(tmp_path):
    from qdeploy.lint.tensorrt_confirm import tensorrt_version

    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed")
    s = api.optimize(_opt_config(tmp_path, target="tensorrt", budget={"max_drop": 100.0}), tmp_path / "out",
                     cache_dir=tmp_path / "cache")
    assert s["latency_measured"] is False and s["chosen"]["latency_p50_ms"] is None
    assert any("TensorRT latency was not measured" in d for d in s["decisions"])
    assert s["chosen"]["int8_share"] == 1.0 and s["chosen"]["variant"].startswith("int8-")
