"""INT8 accuracy of every range method × placement on full test sets, and CPU INT8 speed (2 threads).

    python bench/suites/int8_accuracy.py resnet20 resnet32 resnet44 camvid efficientnet --out runs/int8

Each model: FP32 ONNX Runtime reference, then {max, entropy, percentile, mse} × {onnxruntime, tensorrt}
targets, 512 seeded calibration images from a split disjoint from the evaluation split (CIFAR-10: the
train folder; CamVid: its 367 train images, all used). EfficientNet-Lite0 is not run here: the ImageNet
subset has no images outside the evaluation set to calibrate on. Speed: FP32 vs the ONNX Runtime-targeted INT8 artifact at batch 1 and 8.
Prints a Markdown table (copied into docs/int8-accuracy.md) and writes DIR/<model>/results.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CALIBRATORS = ("max", "entropy", "percentile", "mse", "mean-minmax")


def config_for(name: str):
    from qdeploy.config import load_config

    if name.startswith("resnet"):
        cfg = load_config(REPO / "examples" / "cifar10_resnet20.yaml")
        cfg.model.source = cfg.model.source.replace("resnet20", name)
        cfg.model.weights = cfg.model.weights.replace("resnet20", name)
    elif name == "lite0":  # 300 seeded calibration images of the ImageNet subset, the other 1,000 evaluated
        cfg = load_config(REPO / "examples" / "imagenet_efficientnet_lite0_int8.yaml")
    elif name == "camvid":
        cfg = load_config(REPO / "examples" / "camvid_deeplabv3.yaml")
        calib = cfg.data.eval.model_copy(update={"split": "train", "count": 512, "seed": 0, "batch_size": 4})
        cfg.data.calibration = calib
    else:
        raise SystemExit(f"unknown model {name}")
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default="runs/int8")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--groups", default="onnxruntime,tensorrt-modelopt,tensorrt-onnx",
                    help="INT8 artifact kinds: onnxruntime (ORT-targeted), tensorrt-modelopt, tensorrt-onnx")
    ap.add_argument("--methods", default=",".join(CALIBRATORS))
    args = ap.parse_args()
    methods = args.methods.split(",")
    from qdeploy import api
    from qdeploy.config import VariantSpec

    rows = []
    for name in args.models:
        cfg = config_for(name)
        groups = args.groups.split(",")
        kinds = {"onnxruntime": {"placement": "onnxruntime"}, "tensorrt-modelopt": {"placement": "tensorrt", "quantizer": "modelopt"},
                 "tensorrt-onnx": {"placement": "tensorrt", "quantizer": "onnx"}}
        cfg.variants = [VariantSpec(engine="onnxruntime", precision="fp32", threads=2)] + [
            VariantSpec(engine="onnxruntime", precision="int8", method=c, threads=2, **kinds[g])
            for g in groups for c in methods]
        cfg.bench.enabled = False
        results = api.run(cfg, Path(args.out) / name)
        speed = {}
        if not args.no_bench:
            cfg.variants = [cfg.variants[0], VariantSpec(engine="onnxruntime", precision="int8", method="entropy", threads=2)]
            cfg.bench.enabled, cfg.eval.enabled = True, False
            cfg.bench.batch_sizes, cfg.bench.iterations, cfg.bench.warmup = [1, 8], 50, 10
            b = api.run(cfg, Path(args.out) / f"{name}-speed", stages=("bench",))
            f, q = b["variants"]
            speed = {bs: f["latency_ms"][bs]["mean"] / q["latency_ms"][bs]["mean"] for bs in ("1", "8")}
            speed["ms"] = {bs: (f["latency_ms"][bs]["mean"], q["latency_ms"][bs]["mean"]) for bs in ("1", "8")}
        head = "top1" if cfg.model.task == "classification" else "miou"
        ref = results["variants"][0]["metrics"][head]
        row = {"model": name, "fp32": ref, "speedup": speed, "variants": {}}
        for v in results["variants"][1:]:
            q = v.get("quantization") or {}
            row["variants"][v["name"]] = {"metric": v["metrics"].get(head), "agreement": v["agreement"], "status": v["status"],
                                          "reason": v["reason"], "calib_s": q.get("time_s"),
                                          "structure": q.get("structure")}
        rows.append(row)
        (Path(args.out) / f"{name}-summary.json").write_text(json.dumps(row, indent=2))
    print("| model | FP32 | target | " + " | ".join(methods) + " | CPU INT8 speed-up bs1 / bs8 |")
    print("|---|---|---|" + "---|" * len(methods) + "---|")
    for row in rows:
        for t in args.groups.split(","):
            cells = []
            for c in methods:
                key = {"onnxruntime": f"onnxruntime-int8-{c}", "tensorrt-modelopt": f"onnxruntime-int8-trt-modelopt-{c}",
                       "tensorrt-onnx": f"onnxruntime-int8-trt-onnx-{c}"}[t]
                v = row["variants"].get(key, {})
                m = v.get("metric")
                cells.append("–" if m is None else f"{100 * m:.2f} ({100 * (v.get('agreement') or 0):.1f})")
            sp = row["speedup"]
            sp_s = f"{sp['1']:.2f}x / {sp['8']:.2f}x" if sp and t == "onnxruntime" else ""
            print(f"| {row['model']} | {100 * row['fp32']:.2f} | {t} | " + " | ".join(cells) + f" | {sp_s} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
