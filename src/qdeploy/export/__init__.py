"""Export stage: PyTorch → ONNX (dynamic batch, verified against PyTorch in ONNX Runtime, cached)."""
from qdeploy.export.onnx import OnnxArtifact, export_onnx, use_onnx_file, verify_onnx, convert_fp16

__all__ = ["OnnxArtifact", "export_onnx", "use_onnx_file", "verify_onnx", "convert_fp16"]
