"""Python API mirroring the CLI: ``qdeploy.api.run(config, out_dir)`` does what ``qdeploy run`` does.

Each stage is also usable on its own: ``build_torch_model``, ``export_onnx``, ``make_batches``,
``create_engine``, ``evaluate``, ``benchmark``, ``write_reports``.
"""
from qdeploy.benchmark import benchmark
from qdeploy.config import RunConfig, load_config, parse_config
from qdeploy.data import make_batches, normalize
from qdeploy.engines import create_engine
from qdeploy.evaluate import evaluate
from qdeploy.export import export_onnx
from qdeploy.models import ModelArtifacts, build_torch_model
from qdeploy.pipeline import export, quantize, run
from qdeploy.report import write_reports

__all__ = [
    "RunConfig", "load_config", "parse_config", "run", "export", "quantize", "build_torch_model", "export_onnx", "ModelArtifacts",
    "make_batches", "normalize", "create_engine", "evaluate", "benchmark", "write_reports",
]
