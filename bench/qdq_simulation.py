"""TensorRT-placement INT8 artifacts evaluated two ways in ONNX Runtime: exact Q/DQ semantics
(``session.disable_quant_qdq``, what qdeploy uses) and ONNX Runtime's fused int8 kernels (its default).

    python bench/int8_accuracy.py resnet20 --groups tensorrt-modelopt,tensorrt-onnx --no-bench --out runs/int8
    python bench/qdq_simulation.py runs/int8/resnet20

Reads DIR/config.yaml (the run's resolved config), DIR/model.onnx and DIR/*-int8-trt-*.onnx; prints top-1 and
agreement with FP32 for both modes, and how often the two modes agree.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--batch", type=int, default=500)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from qdeploy.config import load_config
    from qdeploy.data import make_batches, normalize
    from qdeploy.utils.ort_options import exact_qdq

    cfg = load_config(args.run_dir / "config.yaml")
    pre, task = cfg.model.preprocess, cfg.model.task
    xs, ys = [], []
    for x, y in make_batches(cfg.data.eval, pre, task, batch_size=args.batch):
        xs.append(normalize(x, pre))
        ys.append(y)
    X, Y = np.concatenate(xs), np.concatenate(ys)

    def predict(path: Path, exact: bool) -> np.ndarray:
        opts = ort.SessionOptions()
        opts.log_severity_level, opts.intra_op_num_threads = 3, 2
        if exact:
            exact_qdq(opts)
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        return np.concatenate([sess.run(None, {name: X[i:i + args.batch]})[0].argmax(1) for i in range(0, len(X), args.batch)])

    ref = predict(args.run_dir / "model.onnx", False)
    print(f"FP32 top-1 {100 * (ref == Y).mean():.2f} on {len(Y)} images")
    print("| artifact | exact Q/DQ top-1 (agreement) | fused int8 top-1 (agreement) | exact vs fused agree |")
    print("|---|---|---|---|")
    for path in sorted(args.run_dir.glob("*-int8-trt-*.onnx")):
        a, b = predict(path, True), predict(path, False)
        print(f"| {path.stem} | {100 * (a == Y).mean():.2f} ({100 * (a == ref).mean():.1f}) | "
              f"{100 * (b == Y).mean():.2f} ({100 * (b == ref).mean():.1f}) | {100 * (a == b).mean():.1f} |", flush=True)


if __name__ == "__main__":
    main()
