"""ModelOpt-path calibration time per method, on whatever device torch sees (GPU on the lent machine).

    python bench/suites/gpu_calibration.py --data DIR --count 512     (DIR: CIFAR-10 train-style image folder)

Uses the CIFAR-10 ResNet-20 weights given by --weights/--model-file; times quantize_torch_model
(statistics forward passes + range search) for each method, after one warm-up run.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model-file", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--count", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from qdeploy.config import DatasetSpec, ModelSpec
    from qdeploy.data import make_batches, normalize
    from qdeploy.models import build_torch_model
    from qdeploy.quantize.modelopt_torch import quantize_torch_model

    spec = ModelSpec(source=f"{args.model_file}:resnet20", weights=args.weights,
                     preprocess={"input_size": [32, 32], "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})
    model = build_torch_model(spec)
    batches = make_batches(DatasetSpec(root=args.data, count=args.count, seed=0, batch_size=args.batch), spec.preprocess, "classification")
    data = [normalize(x, spec.preprocess) for x, _ in batches]
    quantize_torch_model(model, iter(data), args.count, "max")  # warm-up: imports, CUDA context, kernels
    rows = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "count": args.count}
    for method in ("max", "entropy", "percentile", "mse"):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        quantize_torch_model(model, iter(data), args.count, method)
        rows[method] = time.perf_counter() - t0
        print(f"{rows['device']}: ModelOpt-path calibration, {method:<10} {rows[method]:.2f} s for {args.count} images")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
