"""Export stage: PyTorch → ONNX (dynamic batch, verified against PyTorch in ONNX Runtime, cached)."""
from qdeploy.export.onnx import INPUT_NAME, OUTPUT_NAME, OnnxArtifact, convert_fp16, export_onnx, use_onnx_file, verify_onnx

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "OnnxArtifact", "convert_fp16", "export_onnx", "use_onnx_file", "verify_onnx"]
