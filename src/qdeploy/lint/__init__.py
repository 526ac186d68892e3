"""Lint stage: why a Q/DQ ONNX will or will not run fast in TensorRT (rules, findings, safe fixes)."""
