"""Issue 36: why OpenVINO's INT8 twin of an ONNX Runtime-placement Q/DQ DeiT collapses (top-1 60.2 % in OpenVINO vs
75.5 % in ONNX Runtime on the same file; found on the AMX Xeon and on the AMD host).

    python bench/openvino_qdq_diag.py INT8.onnx [--keep-only OP,OP...] [--float-inputs OP,OP...]

Runs the Q/DQ ONNX in ONNX Runtime and OpenVINO (CPU, f32 precision hint) on 16 seeded random images and prints the
agreement of their argmax and the cosine of their outputs; then, one variant per named op type:
- ``--keep-only OP``: every activation Q/DQ pair bypassed except those feeding OP (the consumer reads the Q's float
  input): which op type's Q/DQ alone makes the engines disagree;
- ``--float-inputs OP``: the Q/DQ pairs feeding OP bypassed, the rest kept: does removing them make the engines agree.
Each op type runs in its own process (OpenVINO has crashed with SIGFPE on some of these graphs: reported, not fatal).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np


def _load(path: str):
    import onnx

    return onnx.load(path)


def _run(model, x: np.ndarray, engine: str) -> np.ndarray:
    name = model.graph.input[0].name
    if engine == "ort":
        import onnxruntime as ort

        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {name: x})[0]
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled(x)[0]


def _compare(a: np.ndarray, b: np.ndarray) -> str:
    agree = float((a.argmax(1) == b.argmax(1)).mean())
    cos = float((a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)))
    return f"argmax agreement {agree:.3f}, cosine {cos:.4f}"


def bypassed(model, keep_only=None, float_inputs=None):
    """A copy whose consumers read the float input of their QuantizeLinear → DequantizeLinear pair: all consumers but
    ``keep_only``'s op type, or only ``float_inputs``'s."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    producer = {o: n for n in m.graph.node for o in n.output}
    for node in m.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if keep_only is not None and node.op_type == keep_only:
            continue
        if float_inputs is not None and node.op_type != float_inputs:
            continue
        for k, name in enumerate(node.input):
            dq = producer.get(name)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[k] = q.input[0]
    return m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("onnx")
    ap.add_argument("--keep-only", default=None)
    ap.add_argument("--float-inputs", default=None)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "OP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = _load(args.onnx)
    x = np.random.default_rng(0).standard_normal((16, *[d.dim_value for d in model.graph.input[0].type.tensor_type
                                                          .shape.dim][1:]), dtype=np.float32)
    if args.one:
        mode, op = args.one
        m = bypassed(model, keep_only=op) if mode == "keep-only" else bypassed(model, float_inputs=op)
        print(f"{mode} {op}: ONNX Runtime vs OpenVINO {_compare(_run(m, x, 'ort'), _run(m, x, 'ov'))}; ONNX Runtime vs "
              f"the full Q/DQ in ONNX Runtime {_compare(_run(m, x, 'ort'), _run(model, x, 'ort'))}", flush=True)
        return
    print(f"full Q/DQ: ONNX Runtime vs OpenVINO {_compare(_run(model, x, 'ort'), _run(model, x, 'ov'))}", flush=True)
    for mode, ops in (("keep-only", args.keep_only), ("float-inputs", args.float_inputs)):
        for op in (ops.split(",") if ops else []):
            p = subprocess.run([sys.executable, __file__, args.onnx, "--one", mode, op], capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith(mode)), None)
            print(line or f"{mode} {op}: OpenVINO or ONNX Runtime died (exit {p.returncode})", flush=True)


if __name__ == "__main__":
    main()
