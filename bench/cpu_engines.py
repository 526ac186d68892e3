"""ONNX Runtime and OpenVINO side by side on the same artifacts (issue #23), one cifar10-modern model per call.

    python bench/cpu_engines.py mobilevit --count 500 --out /tmp/exp
    python bench/cpu_engines.py mobilevit --count 1000 --keep-conv-output --ort-only --out /tmp/exp   # the experiment

Variants: FP32 and INT8 (mean-minmax, 256 calibration images) in both engines, plus OpenVINO on the TensorRT placement
(refused since this run: it lost 11.6 points). ``--keep-conv-output`` is an experiment, not a qdeploy option: it keeps
the Q/DQ on a conv's output that the ONNX Runtime placement drops when a SiLU follows (fix QD007), so that ONNX Runtime
fuses QLinearConv (docs/benchmarks.md, issue #23 first findings). Latency: 3 repeats × 50 at batch 1 and 32.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_int8 import MODELS, config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("runs/cpu-engines"))
    ap.add_argument("--keep-conv-output", action="store_true")
    ap.add_argument("--ort-only", action="store_true")
    args = ap.parse_args()
    from qdeploy import api

    tag = "keep-conv-output" if args.keep_conv_output else "current"
    if args.keep_conv_output:
        import qdeploy.quantize.qdq as qdq

        orig = qdq.apply_fixes
        qdq.apply_fixes = lambda model, ids: {} if ids == {"QD007"} else orig(model, ids)
    cfg = config(args.model, args.count, 256, "mean-minmax")
    i8 = {"precision": "int8", "method": "mean-minmax"}
    cfg["variants"] = [{"engine": "onnxruntime"}, {"engine": "onnxruntime", **i8, "placement": "onnxruntime"}]
    if not args.ort_only:
        cfg["variants"] += [{"engine": "openvino"}, {"engine": "openvino", **i8, "placement": "onnxruntime"}]
    cfg["bench"] = {"batch_sizes": [1, 32], "warmup": 10, "iterations": 50, "repeats": 3}
    cfg["data"]["eval"]["batch_size"] = 250
    # the experiment's artifacts must not share a cache with the real placement (same code fingerprint)
    r = api.run(cfg, args.out / f"{tag}-{args.model}", cache_dir=args.out / f"cache-{tag}")
    for v in r["variants"]:
        lat = v.get("latency_ms") or {}
        top1 = (v.get("metrics") or {}).get("top1")
        print(f"| {args.model} | {tag} | {v['name']} | {v['status']} | {'–' if top1 is None else f'{100 * top1:.2f}'} | "
              f"{v.get('agreement')} | " + " / ".join(f"{x['p50']:.3f}" for x in lat.values()) + " |")


if __name__ == "__main__":
    main()
