"""``qdeploy optimize``: the fastest artifact within an accuracy budget, chosen on a search split and confirmed on
another. ``search.py`` runs the steps a target lists (``steps/``: the reference and floats, PTQ methods, the CPU
engines' placements, per-layer fallback and QAT, or the PyTorch runtimes) in a search session (``session.py``)."""
from qdeploy.optimize.decide import agreement_floor, budget_check, fastest_within, metric_standard_error, resolution_warning
from qdeploy.optimize.search import optimize

__all__ = ["agreement_floor", "budget_check", "fastest_within", "metric_standard_error", "optimize", "resolution_warning"]
