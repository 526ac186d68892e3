"""Python API mirroring the CLI: ``qdeploy.api.run(config, out_dir)`` does what ``qdeploy run`` does.

Each stage is also usable on its own: ``build_torch_model``, ``export_onnx``, ``make_batches``,
``quantize`` (with an ``Int8Config``), ``Builder``, ``create_engine``, ``evaluate``, ``benchmark``,
``write_reports``, ``lint``; ``open_run`` + ``run_variant`` run single variants programmatically.
"""
from qdeploy.benchmark import benchmark
from qdeploy.artifacts import Artifact, ArtifactKind, ArtifactRequest, Builder
from qdeploy.config import Int8Config, RunConfig, VariantSpec, load_config, parse_config
from qdeploy.data import make_batches, normalize
from qdeploy.engines import ENGINES, create_engine, engine_table, resolve_variants
from qdeploy.evaluate import evaluate
from qdeploy.export import export_onnx
from qdeploy.models import build_torch_model
from qdeploy.pipeline import build, build_variant, export, open_run, qat, quantize, run, run_variant
from qdeploy.quantize import QUANTIZERS, QuantizeInputs
from qdeploy.quantize import quantize as quantize_onnx_model
from qdeploy.optimize import optimize
from qdeploy.report import recommend, write_reports


def lint(onnx_path, fix_to=None, confirm: bool = True) -> dict:
    """What ``qdeploy lint`` does: the TensorRT lint report of a Q/DQ ONNX (``qdeploy.lint/1`` dict); with
    ``fix_to``, the safe fixes are applied to a copy written there and the copy's report is returned."""
    from qdeploy.lint import fix_onnx, lint_onnx

    report = fix_onnx(onnx_path, fix_to) if fix_to else lint_onnx(onnx_path, confirm=confirm)
    return report.to_dict(with_ops=True)

__all__ = [
    "build", "optimize",
    "ENGINES", "QUANTIZERS", "Artifact", "ArtifactKind", "ArtifactRequest", "Builder", "Int8Config", "QuantizeInputs", "RunConfig",
    "VariantSpec", "benchmark", "build_torch_model", "build_variant", "create_engine", "engine_table", "evaluate", "export",
    "export_onnx", "lint", "load_config", "make_batches", "normalize", "open_run", "parse_config", "qat", "quantize", "quantize_onnx_model",
    "recommend", "resolve_variants", "run", "run_variant", "write_reports",
]
