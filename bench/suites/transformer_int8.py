"""INT8 placements on the cifar10-modern dev models (issue #21): top-1, agreement with FP32 and INT8 compute ops.

    python bench/suites/transformer_int8.py deit --count 2000 --calibration 256 --out runs/transformer-int8
    python bench/suites/transformer_int8.py deit swin convnext mobilevit --count 0 --calibration 512 \
        --ort-methods mean-minmax,max,entropy,percentile,mse --out runs/transformer-ort   # ONNX Runtime placement table

For each model: ONNX Runtime FP32, then the TensorRT placement with the ONNX Q/DQ quantizer and with ModelOpt (both
evaluated with exact Q/DQ in ONNX Runtime; TensorRT is not installed here), and the ONNX Runtime placement, all with
``--method``. Models, kwargs and inputs as ../shared/models/cifar10-modern/README.md gives them. Prints a Markdown
table (copied into docs/int8-accuracy.md) and writes DIR/<model>/results.json.
"""
from __future__ import annotations

import argparse
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
MODELS = {  # ../shared/models/cifar10-modern/README.md
    "deit": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4}, "deit_tiny_p4_32.pt", 32),
    "swin": ("swin_tiny_patch4_window7_224", {"img_size": 32, "patch_size": 2, "window_size": 4, "embed_dim": 48,
                                              "depths": [2, 2, 4, 2], "num_heads": [2, 4, 8, 16]}, "swin_mini_32.pt", 32),
    "convnext": ("convnext_atto", {"conv_mlp": False}, "convnext_atto_64.pt", 64),
    "mobilevit": ("mobilevit_xxs", {}, "mobilevit_xxs_64.pt", 64),
}


def ort_methods_config(name: str, count, calibration: int, methods: list[str]) -> dict:
    """FP32 and the ONNX Runtime placement with each range method (issue #21's per-method table)."""
    cfg = config(name, count or 10_000, calibration, methods[0])
    if count is None:  # the whole test set
        cfg["data"]["eval"].pop("count")
        cfg["data"]["eval"].pop("seed")
    cfg["data"]["eval"]["batch_size"] = 250
    cfg["variants"] = [{"engine": "onnxruntime"}] + [
        {"engine": "onnxruntime", "precision": "int8", "method": m, "placement": "onnxruntime"} for m in methods]
    return cfg


def config(name: str, count: int, calibration: int, method: str) -> dict:
    timm_name, kwargs, weights, size = MODELS[name]
    pre = {"input_size": [size, size], **IMAGENET, **({"resize": [size, size]} if size != 32 else {})}
    data = SHARED / "data" / "cifar10"
    return {"model": {"source": f"timm:{timm_name}", "kwargs": {"num_classes": 10, **kwargs},
                      "weights": str(SHARED / "models" / "cifar10-modern" / weights), "task": "classification",
                      "preprocess": pre},
            "data": {"eval": {"format": "imagefolder", "root": str(data / "test"), "count": count, "seed": 0,
                              "batch_size": 64, "workers": 0},
                     "calibration": {"format": "imagefolder", "root": str(data / "train"), "count": calibration,
                                     "seed": 0, "batch_size": 64, "workers": 0}},
            "variants": [{"engine": "onnxruntime"},
                         {"engine": "onnxruntime", "precision": "int8", "method": method, "placement": "tensorrt",
                          "quantizer": "onnx"},
                         {"engine": "onnxruntime", "precision": "int8", "method": method, "placement": "tensorrt",
                          "quantizer": "modelopt"},
                         {"engine": "onnxruntime", "precision": "int8", "method": method, "placement": "onnxruntime"}],
            "bench": {"enabled": False}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--calibration", type=int, default=256)
    ap.add_argument("--method", default="mean-minmax")
    ap.add_argument("--out", default="runs/transformer-int8")
    ap.add_argument("--ort-methods", default=None,
                    help="comma-separated methods: FP32 and the ONNX Runtime placement with each, instead of the "
                         "four placements with --method (--count 0: the whole test set)")
    args = ap.parse_args()
    if not (SHARED / "models" / "cifar10-modern").is_dir():
        raise SystemExit(f"{SHARED / 'models' / 'cifar10-modern'} not present: this benchmark needs ../shared")
    from qdeploy import api

    rows = ["| model | variant | top-1 | agreement | compute ops INT8 | status |", "|---|---|---|---|---|---|"]
    for name in args.models:
        cfg = (ort_methods_config(name, args.count or None, args.calibration, args.ort_methods.split(","))
               if args.ort_methods else config(name, args.count, args.calibration, args.method))
        r = api.run(cfg, Path(args.out) / name, cache_dir=Path(args.out) / "cache")
        for v in r["variants"]:
            st = (v.get("quantization") or {}).get("structure") or {}
            ops = f"{st['compute_ops_int8']}/{st['compute_ops']}" if st.get("compute_ops") else "–"
            top1, agree = v["metrics"].get("top1"), v.get("agreement")
            top1 = "–" if top1 is None else f"{100 * top1:.2f}"
            agree = "–" if agree is None else f"{100 * agree:.2f} %"
            why = f": {v['reason']}" if v.get("reason") else ""
            rows.append(f"| {name} | {v['name']} | {top1} | {agree} | {ops} | {v['status']}{why} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
