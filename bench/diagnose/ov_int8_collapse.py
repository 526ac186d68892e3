"""Where does an OpenVINO INT8 IR part from its FP32 model? Bisects the activation FakeQuantize ops (in topological
order) for the first one whose quantization turns the output wrong, then shows that FakeQuantize alone (every other one
bypassed, weights float too) and what its consumers compute in the compiled model against FP32.

    python bench/diagnose/ov_int8_collapse.py --ir INT8/model.xml --onnx FP32.onnx [--shape 4,3,96,96] [--tol 0.1]

The input is seeded uniform(-1, 1) noise of --shape (the FP32 ONNX's own shape with batch 4 by default); "wrong" is a
max |output difference| from ONNX Runtime's FP32 output above --tol. With the FakeQuantize found, the script prints
its range, the relative error of its input (the quantized tensor itself) and of each consumer's output, and the
compiled model's runtime precision of those layers: when the quantized tensor is right and the consumer is not, the
runtime's kernel for that consumer, not the quantization ranges, is what differs.
"""
from __future__ import annotations

import argparse

import numpy as np


def activation_fqs(model) -> list:
    return [op for op in model.get_ordered_ops() if op.get_type_name() == "FakeQuantize"
            and op.input_value(0).get_node().get_type_name() != "Constant"
            and "fq_weights" not in op.get_friendly_name()]


def bypass(model, keep: set[str], weights_too: bool = False) -> None:
    """Every activation FakeQuantize not named in ``keep`` (and, with weights_too, every weight one) bypassed."""
    for op in model.get_ordered_ops():
        if op.get_type_name() != "FakeQuantize" or op.get_friendly_name() in keep:
            continue
        is_weight = "fq_weights" in op.get_friendly_name() or op.input_value(0).get_node().get_type_name() == "Constant"
        if is_weight and not weights_too:
            continue
        for t in list(op.output(0).get_target_inputs()):
            t.replace_source_output(op.input_value(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ir", required=True)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--tol", type=float, default=0.1)
    a = ap.parse_args()
    import onnxruntime as ort
    import openvino as ov

    core = ov.Core()
    sess = ort.InferenceSession(a.onnx, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    shape = [int(v) for v in a.shape.split(",")] if a.shape else [4] + [d if isinstance(d, int) else 1
                                                                        for d in inp.shape[1:]]
    x = np.random.default_rng(0).uniform(-1, 1, size=shape).astype(np.float32)
    ref = sess.run(None, {inp.name: x})[0]
    names = [op.get_friendly_name() for op in activation_fqs(core.read_model(a.ir))]

    def error(keep: set[str], weights_too: bool = False) -> float:
        m = core.read_model(a.ir)
        bypass(m, keep, weights_too)
        out = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({0: x})[0]
        return float(np.abs(out - ref).max())

    whole, none = error(set(names)), error(set())
    print(f"{len(names)} activation FakeQuantize ops; max |diff| from FP32: all quantized {whole:.4g}, "
          f"none (weights only) {none:.4g}")
    if whole <= a.tol:
        print(f"the INT8 IR is within --tol {a.tol} on this input")
        return
    lo, hi = 0, len(names)  # error(first lo) <= tol < error(first hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e = error(set(names[:mid]))
        print(f"  first {mid} quantized: {e:.4g}", flush=True)
        lo, hi = (lo, mid) if e > a.tol else (mid, hi)
    culprit = names[hi - 1]
    alone = error({culprit}, weights_too=True)
    print(f"first FakeQuantize that turns the output wrong: {culprit} (#{hi}); it alone, weights float: {alone:.4g}")
    m = core.read_model(a.ir)
    fq = next(op for op in m.get_ops() if op.get_friendly_name() == culprit)
    lo_hi = [np.asarray(fq.input_value(k).get_node().get_data()).ravel() for k in (1, 2)]
    src = fq.input_value(0).get_node()
    consumers = [t.get_node() for t in fq.output(0).get_target_inputs()]
    print(f"  range [{lo_hi[0].min():.4g}, {lo_hi[1].max():.4g}], levels {fq.get_attributes()['levels']}; input "
          f"{src.get_type_name()} {src.get_friendly_name()}; consumers "
          + ", ".join(f"{c.get_type_name()} {c.get_friendly_name()}" for c in consumers))
    watch = [src.get_friendly_name()] + [c.get_friendly_name() for c in consumers]

    def watched(model, keep):
        bypass(model, keep, weights_too=True)
        by = {o.get_friendly_name(): o for o in model.get_ops()}
        model.add_outputs([by[n].output(0) for n in watch])
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        return list(compiled({0: x}).values())[-len(watch):], compiled

    f32, _ = watched(ov.convert_model(a.onnx), set())
    q, compiled = watched(core.read_model(a.ir), {culprit})
    for n, u, v in zip(watch, f32, q):
        print(f"  {n}: relative error {np.linalg.norm(u - v) / max(np.linalg.norm(u), 1e-12):.4g} "
              f"(max |FP32| {np.abs(u).max():.4g}, max |INT8| {np.abs(v).max():.4g})")
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        if any(n in op.get_friendly_name() for n in watch[1:]) and rt["layerType"].astype(str) == "Convolution":
            print(f"  runtime: {op.get_friendly_name()} {rt['layerType'].astype(str)} "
                  f"runtimePrecision {rt['runtimePrecision'].astype(str)}")


if __name__ == "__main__":
    main()
