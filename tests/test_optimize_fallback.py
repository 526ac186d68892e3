"""The per-layer fallback's decision logic (optimize/fallback.py) on numbers: which layer is reverted, when a revert
is undone, when the search stops. The evaluations are plain functions of the float set, so every rule is visible."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from qdeploy.optimize.fallback import FallbackHooks, run_fallback

LAYERS = ["a", "b", "c", "d"]
MACS = {"a": 10, "b": 40, "c": 25, "d": 25}


def _hooks(agreement_of, log, time_left=lambda: None, sqnr_order=LAYERS):
    """agreement_of(float set) -> full-split agreement; budget: agreement >= 0.9."""
    calls = {"full": 0, "subset": 0, "sensitivity": 0}

    def sensitivity(floated):
        calls["sensitivity"] += 1
        return [{"name": n, "quantized": n not in floated, "macs": MACS[n], "sqnr_db": float(i)} for i, n in enumerate(sqnr_order)]

    def subset_score(floated):
        calls["subset"] += 1
        return agreement_of(frozenset(floated))

    def full(floated):
        calls["full"] += 1
        a = agreement_of(frozenset(floated))
        return SimpleNamespace(variant="+".join(floated), agreement=a, within_budget=a >= 0.9, margin=a - 0.9,
                               verdict_text=f"agreement {a:.2f}")

    return FallbackHooks(sensitivity, subset_score, full, time_left, log.append), calls


def test_the_refined_ranking_not_the_sqnr_order_decides_what_is_reverted():
    log = []
    # SQNR says a first, but reverting c is what restores agreement
    hooks, calls = _hooks(lambda f: 0.95 if "c" in f else 0.5, log)
    res = run_fallback(SimpleNamespace(agreement=0.5, within_budget=False, margin=-0.4), hooks, refine_top=4, max_float_fraction=1.0)
    assert res.float_layers == ["c"] and res.within_budget and res.stop == "within budget"
    assert calls == {"full": 1, "subset": 5, "sensitivity": 1}     # 4 refined + the baseline, one full evaluation
    assert abs(res.float_fraction - 0.25) < 1e-9


def test_a_revert_that_moves_away_from_fp32_is_undone_and_the_rest_re_ranked():
    log = []
    table = {frozenset(): 0.6, frozenset("a"): 0.55, frozenset("b"): 0.7, frozenset("ab"): 0.5, frozenset("bc"): 0.92}

    def agreement_of(f):
        return table.get(f, 0.6)
    # subset scores make a look best, but on the full split a makes it worse: undone, ranked again, b then c kept
    hooks, calls = _hooks(lambda f: 0.99 if f == frozenset("a") else agreement_of(f), log)
    hooks.full = (lambda inner: (lambda floated: SimpleNamespace(**{**vars(inner(floated)), **_score(agreement_of(frozenset(floated)))})))(hooks.full)
    res = run_fallback(SimpleNamespace(agreement=0.6, within_budget=False, margin=-0.3), hooks, refine_top=2, max_float_fraction=1.0)
    assert res.float_layers == ["b", "c"] and res.within_budget
    assert any("undone, re-ranking" in line for line in log) and calls["sensitivity"] >= 2
    assert len(res.rankings) >= 2 and "a" not in [r["layer"] for r in res.rankings[-1]["refined"]]


def _score(a):
    return {"agreement": a, "within_budget": a >= 0.9, "margin": a - 0.9, "verdict_text": f"agreement {a:.2f}"}


def test_it_stops_before_leaving_more_than_max_float_fraction_in_float():
    log = []
    hooks, _ = _hooks(lambda f: 0.5 + 0.1 * len(f), log, sqnr_order=["b", "a", "c", "d"])
    res = run_fallback(SimpleNamespace(agreement=0.5, within_budget=False, margin=-0.4), hooks, refine_top=1, max_float_fraction=0.3)
    assert not res.within_budget and res.float_fraction <= 0.3
    assert "max_float_fraction 30 %" in res.stop


def test_it_stops_at_the_time_limit_with_what_it_has():
    log = []
    left = iter([5.0, -1.0])
    hooks, calls = _hooks(lambda f: 0.5 + 0.1 * len(f), log, time_left=lambda: next(left, -1.0))
    res = run_fallback(SimpleNamespace(agreement=0.5, within_budget=False, margin=-0.4), hooks, refine_top=1, max_float_fraction=1.0)
    assert res.stop == "time limit" and calls["full"] == 1 and len(res.float_layers) == 1


def test_a_fallback_for_speed_stops_once_it_is_no_faster_than_the_answer_within_budget():
    """A fallback made for speed (an INT8 outside the budget faster than the fastest answer within it) must not
    float layer after layer into a model slower than that answer (on ResNet-44 it would reach 9 float layers;
    docs/results/cpu/cpu_goals_xeon.json). Each float layer adds time (here 0.05 ms): the fallback stops at the first
    model that no longer wins."""
    log = []
    hooks, calls = _hooks(lambda f: 0.5 + 0.05 * len(f), log)
    to_beat = 0.79
    timed = hooks.full
    hooks.full = lambda floated: SimpleNamespace(**vars(timed(floated)), rank_key=0.7 + 0.05 * len(floated))
    hooks.pointless = lambda c: "no faster" if c.rank_key >= to_beat else None
    res = run_fallback(SimpleNamespace(agreement=0.5, within_budget=False, margin=-0.4, rank_key=0.7), hooks,
                       refine_top=1, max_float_fraction=1.0)
    assert res.stop == "no faster" and calls["full"] == 2 and res.float_layers == ["a", "b"]  # 0.75 ms, then 0.80 ms


def test_a_fallback_for_speed_stops_when_no_layer_gains_more_than_one_subset_sample():
    """Seen on ResNet-50 at 224 (batch 16, NNCF's INT8 as the start): every refined layer's revert changed at most one
    of 300 subset samples, each trial was a 25 s NNCF rebuild, and undo + re-rank walked layer after layer. A fallback
    for speed stops at such a ranking; a fallback that must recover the budget (no answer within it) goes on."""
    one = 1 / 300

    def agreement_of(f):
        return 0.9 - 0.01 * len(f) + (one if "a" in f else 0.0)  # a flips one sample; every revert costs on the split

    for for_speed, expect_full in ((True, 0), (False, 1)):
        log = []
        hooks, calls = _hooks(agreement_of, log)
        hooks.subset_size, hooks.for_speed = 300, for_speed
        res = run_fallback(SimpleNamespace(agreement=0.9, within_budget=False, margin=-0.01), hooks, refine_top=4,
                           max_float_fraction=0.12)
        assert calls["full"] == expect_full, (for_speed, res.stop)
        if for_speed:
            assert "no refined layer's revert moves more than one of the 300 subset samples" in res.stop
            assert res.float_layers == []


@pytest.mark.slow
def test_an_nncf_layer_reads_float_activations_in_the_proxy_its_ranking_uses(tmp_path):
    """NNCF rebuilds the whole model for every ignored scope (tens of seconds a build for Swin, several builds a
    ranking; docs/results/cpu/cpu_goals_xeon.json), so the fallback ranks an NNCF model's layers on that model with one
    layer's activation Q/DQ bypassed. Real NNCF on a model whose second conv reads an outlier channel: bypassing that conv's input brings the output back towards
    FP32, and only that consumer is rewired."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    nncf = pytest.importorskip("nncf")
    from qdeploy.optimize.sensitivity import with_float_activations

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).eval()
    with torch.no_grad():  # channel 0 of conv1's output 200x larger, conv2 reading it 200x smaller: same function
        net[0].weight[0] *= 200
        net[0].bias[0] *= 200
        net[2].weight[:, 0] /= 200
    fp32 = tmp_path / "fp32.onnx"
    torch.onnx.export(net, torch.randn(1, 3, 8, 8), str(fp32), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, dynamo=False)
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(16)]
    q = nncf.quantize(onnx.load(str(fp32)), nncf.Dataset(data), subset_size=16)
    qdq, edited = tmp_path / "nncf.onnx", tmp_path / "proxy.onnx"
    onnx.save(q, str(qdq))
    conv2 = [n for n in q.graph.node if n.op_type == "Conv"][1].name
    assert with_float_activations(qdq, {conv2}, edited) == 1
    node = next(n for n in onnx.load(str(edited)).graph.node if n.name == conv2)
    assert node.input[0] == "/1/Relu_output_0" and node.input[1].startswith("dq_")  # weights stay as NNCF made them

    x = np.concatenate([d["x"] for d in data])
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]  # noqa: E731
    ref = run(fp32)
    err_int8, err_proxy = float(np.mean((run(qdq) - ref) ** 2)), float(np.mean((run(edited) - ref) ** 2))
    assert err_proxy < err_int8 / 3, (err_proxy, err_int8)  # 2.9e-4 vs 1.6e-3 (seeded)


_ACCURACY_CONTROL_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, ".")
from test_optimize import _fragile_config
from test_optimize_fallback import _labelled_by_fp32
from qdeploy import api
tmp_path = Path(sys.argv[1])
# always: on a model this small every candidate is bound by the cost of a call, so whether NNCF's start leads the
# answer within budget by more than the timing noise (auto's rule) is a coin toss; the peer run is what is tested
cfg = _fragile_config(tmp_path, target="cpu", budget={"max_drop": 5.0}, max_float_fraction=1.0, qat="off",
                      accuracy_control="always")
# an outlier 100x the fixture's: NNCF's mean-minmax range (the per-image maxima averaged) also drowns conv2's inputs
fragile = tmp_path / "fragile.py"
fragile.write_text(fragile.read_text().replace("1000.0", "100000.0"))
_labelled_by_fp32(cfg, tmp_path / "eval-by-fp32")
api.optimize(cfg, tmp_path / "out", cache_dir=tmp_path / "cache")
"""


def _labelled_by_fp32(cfg: dict, root: Path) -> None:
    """Point data.eval at a copy of its images filed under the class the FP32 model predicts (FP32: 100 % top-1), so
    that an INT8 that changes predictions loses accuracy by as much."""
    import importlib.util
    import shutil

    import numpy as np
    import torch

    from qdeploy.api import normalize
    from qdeploy.config import Preprocess
    from qdeploy.data.transforms import _open, image_to_array

    path, fn = cfg["model"]["source"].rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("fragile_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    net, pre = getattr(mod, fn)().eval(), Preprocess(**cfg["model"]["preprocess"])
    src = Path(cfg["data"]["eval"]["root"])
    classes = sorted(d.name for d in src.iterdir() if d.is_dir())
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
    for f in sorted(src.glob("*/*.png")):
        x = normalize(image_to_array(_open(str(f)), pre, f)[None], pre).astype(np.float32)
        with torch.no_grad():
            k = int(net(torch.from_numpy(x)).argmax(1))
        shutil.copy(f, root / classes[k] / f"{f.parent.name}-{f.name}")
    cfg["data"]["eval"]["root"] = str(root)


@pytest.mark.slow
def test_nncf_accuracy_control_runs_beside_the_fallback_as_a_peer(tmp_path):
    """Target cpu on the fragile model, where plain PTQ (qdeploy's and NNCF's) breaks: NNCF's
    quantize_with_accuracy_control on the OpenVINO model with qdeploy's metric and budget; its cost (passes over the
    split, per-image evaluations, layers left float) is recorded and its INT8 IR is measured as a candidate. The labels
    are FP32's own predictions, so the broken INT8 is far outside max_drop by NNCF's own test (a drop of points given
    to NNCF as a fraction of the metric: with points, 5.0 would allow any drop) and its loop has to restore it."""
    import json
    import subprocess
    import sys

    # optimize runs in a process of its own, as the CLI runs it: inside the whole test session's process (torch,
    # TensorFlow, ModelOpt and many OpenVINO models loaded by earlier tests) NNCF's accuracy-control loop ended the
    # process with a segmentation fault once; alone it passes (cause not found yet)
    subprocess.run([sys.executable, "-c", _ACCURACY_CONTROL_RUN, str(tmp_path)], check=True, timeout=900,
                   cwd=Path(__file__).parent)
    s = json.loads((tmp_path / "out" / "optimize.json").read_text())
    rows = {c["variant"]: c for c in s["candidates"]}
    assert rows["fp32"]["search_metric"] == 1.0
    own = rows["openvino-int8-mean-minmax-nncf"]
    assert 100 * (1.0 - own["search_metric"]) > 5.0  # the start is outside max_drop by NNCF's own test
    ac = s["stages"]["nncf_accuracy_control"]
    assert "error" not in ac and "skipped" not in ac, ac
    assert ac["evaluations_full_split"] >= 3 and ac["max_drop"] == 5.0  # FP32, the first INT8 and a revert at least
    assert ac["compute_ops"] >= 4 and ac["compute_ops_int8"] < ac["compute_ops"] and ac["float_compute_ops"]
    row = rows["openvino-int8-nncf-accuracy-control"]
    assert row["status"] == "ok" and ac["result"]["variant"] == row["variant"]
    assert row["latency_p50_ms"] is not None and row["search_metric"] is not None
    assert 100 * (1.0 - row["search_metric"]) <= 5.0 + 1e-9  # NNCF restored its drop within max_drop
    page = (tmp_path / "out" / "optimize.html").read_text()
    assert "NNCF quantize_with_accuracy_control" in page and "qdeploy&#x27;s fallback" in page
