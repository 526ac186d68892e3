"""Model intake: turn a :class:`~qdeploy.config.ModelSpec` into a ready PyTorch module (or an ONNX path)."""
from qdeploy.models.loader import (
    SelectOutput, build_torch_model, is_keras_source, is_onnx_source, load_state_dict_checked, model_fingerprint, resolve_factory, resolve_weights_path,
)

__all__ = ["SelectOutput", "build_torch_model", "is_keras_source", "is_onnx_source", "load_state_dict_checked", "model_fingerprint", "resolve_factory",
           "resolve_weights_path"]
