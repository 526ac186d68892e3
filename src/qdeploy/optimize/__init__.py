"""``qdeploy optimize``: the fastest artifact within an accuracy budget, chosen on a search split and confirmed on
another (issue #11): FP32 / FP16, PTQ methods, per-layer fallback, then QAT."""
from qdeploy.optimize.decide import agreement_floor, budget_check, fastest_within, metric_standard_error, resolution_warning
from qdeploy.optimize.search import optimize

__all__ = ["agreement_floor", "budget_check", "fastest_within", "metric_standard_error", "optimize", "resolution_warning"]
