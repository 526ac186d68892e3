"""Model intake: turn a :class:`~qdeploy.config.ModelSpec` into a ready PyTorch module (or an ONNX path)."""
from qdeploy.models.loader import build_torch_model, is_onnx_source, load_state_dict_checked, resolve_factory
from qdeploy.models.artifacts import ModelArtifacts

__all__ = ["build_torch_model", "is_onnx_source", "load_state_dict_checked", "resolve_factory", "ModelArtifacts"]
