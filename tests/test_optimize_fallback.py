"""The per-layer fallback's decision logic (optimize/fallback.py) on numbers: which layer is reverted, when a revert
is undone, when the search stops. The evaluations are plain functions of the float set, so every rule is visible."""
from types import SimpleNamespace

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
                               budget=f"agreement {a:.2f}")

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
    return {"agreement": a, "within_budget": a >= 0.9, "margin": a - 0.9, "budget": f"agreement {a:.2f}"}


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
