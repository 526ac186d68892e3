"""ModelOpt's ONNX PTQ (``modelopt.onnx.quantization.quantize``, INT8) as a peer: the worker bench/suites/peer_ptq.py runs.

    python bench/suites/modelopt_onnx_peer.py FP32.onnx CALIB.npy OUT.onnx [--high-precision fp32|fp16] [--method entropy|max]

It runs in a child process of its own because ``modelopt.onnx.quantization`` patches ONNX Runtime's quantization
modules in place (its QDQ registry loses Relu/Transpose/Softmax..., the calibrators' ``collect_data`` are replaced):
qdeploy's ``onnx`` quantizer, run later in the same process, would otherwise quantize with ModelOpt's patched ORT.

What it is given: the FP32 ONNX qdeploy exported, and CALIB.npy, the calibration images as one float32 array
N x 3 x H x W, already resized and normalised exactly as qdeploy feeds them (ModelOpt's ``calibration_data``:
a numpy array for a one-input model; its ``CalibrationDataProvider`` splits it into batches of the model's input
batch size, a dynamic dimension counting as 1). Arguments given to ModelOpt beyond its defaults:

  calibration_eps=["cpu"]     the default ["cpu", "cuda:0", "trt"] would try CUDA/TensorRT EPs this CPU-only
                              onnxruntime build does not have (ModelOpt only warns and skips them, but "cpu" alone
                              says what was used)
  high_precision_dtype        ModelOpt's default, "fp16", converts the non-quantized part of the model to FP16
                              (I/O stays FP32); "fp32" keeps it FP32 like qdeploy's TensorRT-placement artifacts.
  log_level="WARNING"         less noise

Calibration method: ModelOpt's default for INT8, entropy (ORT's entropy calibrator with ModelOpt's patches), unless
--method says otherwise. Prints one JSON line: {"seconds", "rss_peak_mb", "rss_delta_mb"} or {"error": one line}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _package_of(tb) -> str:
    """The installed package the innermost frame of a traceback belongs to (``site-packages/<pkg>/...``)."""
    for frame in reversed(traceback.extract_tb(tb)):
        parts = Path(frame.filename).parts
        if "site-packages" in parts:
            i = parts.index("site-packages")
            if i + 1 < len(parts):
                return parts[i + 1].removesuffix(".py")
    return "bench"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("fp32")
    ap.add_argument("calib")
    ap.add_argument("out")
    ap.add_argument("--high-precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--method", default=None, help="ModelOpt's calibration_method (default: its own, entropy)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    import numpy as np

    from qdeploy.utils.memory import MemoryProbe

    X = np.load(args.calib)
    try:
        from modelopt.onnx.quantization import quantize

        kw = {} if args.method is None else {"calibration_method": args.method}
        with MemoryProbe() as m:
            t0 = time.perf_counter()
            quantize(args.fp32, quantize_mode="int8", calibration_data=X, calibration_eps=["cpu"],
                     high_precision_dtype=args.high_precision, output_path=args.out, log_level="WARNING", **kw)
            seconds = time.perf_counter() - t0
        if not Path(args.out).is_file():
            raise RuntimeError(f"modelopt.onnx.quantization.quantize returned without writing {args.out}")
        mem = m.result()
        print(json.dumps({"seconds": round(seconds, 2), "rss_peak_mb": mem["rss_peak"], "rss_delta_mb": mem["rss_delta"]}))
    except Exception as e:  # one line for the table, the traceback on stderr
        traceback.print_exc()
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(json.dumps({"error": f"{type(e).__name__} in {_package_of(e.__traceback__)}: {msg}"[:300]}))


if __name__ == "__main__":
    main()
