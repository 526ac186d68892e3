"""CPU INT8 speed: FP32 ONNX Runtime vs the ONNX Runtime-targeted INT8 artifact (and the TensorRT-style
Q/DQ artifact, which ONNX Runtime does not fuse), 2 threads, batch 1 and 8, on an otherwise idle machine.

    python bench/suites/int8_speed.py resnet20 resnet32 resnet44 resnet18 camvid
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--out", default="runs/int8-speed")
    args = ap.parse_args()
    from qdeploy import api
    from qdeploy.config import VariantSpec, load_config

    sys_rows = []
    for name in args.models:
        if name.startswith("resnet") and name != "resnet18":
            cfg = load_config(REPO / "examples" / "cifar10_resnet20.yaml")
            cfg.model.source = cfg.model.source.replace("resnet20", name)
            cfg.model.weights = cfg.model.weights.replace("resnet20", name)
        elif name == "resnet18":
            cfg = load_config(REPO / "bench" / "configs" / "cpu_int8_speed.yaml")
        elif name == "camvid":
            cfg = load_config(REPO / "examples" / "camvid_deeplabv3.yaml")
            cfg.data.calibration = cfg.data.eval.model_copy(update={"split": "train", "count": 512, "seed": 0, "batch_size": 4})
        cal = "max" if name == "resnet18" else "entropy"
        cfg.variants = [VariantSpec(engine="onnxruntime", threads=2),
                        VariantSpec(engine="onnxruntime", precision="int8", method=cal, threads=2),
                        VariantSpec(engine="onnxruntime", precision="int8", method=cal, placement="tensorrt", threads=2)]
        cfg.eval.enabled = False
        cfg.bench.batch_sizes, cfg.bench.iterations, cfg.bench.warmup = [1, 8], args.iterations, 10
        r = api.run(cfg, Path(args.out) / name, stages=("bench",))
        f, q, t = r["variants"]
        row = {"model": name}
        for bs in ("1", "8"):
            row[bs] = {v["name"]: v["latency_ms"][bs]["mean"] for v in (f, q, t)}
        sys_rows.append(row)
    print("| model | batch | FP32 ms | ORT-targeted INT8 ms (speed-up) | TensorRT Q/DQ in ORT ms (speed-up) |")
    print("|---|---|---|---|---|")
    for row in sys_rows:
        for bs in ("1", "8"):
            f, q, t = row[bs].values()
            print(f"| {row['model']} | {bs} | {f:.2f} | {q:.2f} ({f / q:.2f}x) | {t:.2f} ({f / t:.2f}x) |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.json").write_text(json.dumps(sys_rows, indent=2))


if __name__ == "__main__":
    main()
