"""Why an INT8 ONNX is slower than its FP32 in ONNX Runtime, per op class (issue #23 item 1).

    python bench/diagnose/ort_op_profile.py mobilevit deit resnet20 --batch 1 32 --out runs/op-profile [--int8 KEY=VALUE ...]

For each model (bench/suites/goal_models.py's names): qdeploy builds the FP32 ONNX and the INT8 ONNX (ONNX Runtime
placement, mean-minmax, 256 calibration images; ``--int8 split_activations=true`` and the like change the INT8
variant), both run in ONNX Runtime (qdeploy's session settings, threads = all cores) with its profiler on, and
``qdeploy.benchmark.op_profile`` sums the kernel time per op class (QLinearConv and NchwcConv are both Conv; unfused
Q/DQ and NCHWc reorders are classes of their own). Prints the classes whose INT8 form costs more than their float
form, and writes DIR/<model>-b<N>.json. The CPU's flags are printed with every figure.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "suites"))
from goal_models import GOAL_MODELS, config, input_size, missing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=GOAL_MODELS)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--int8", nargs="*", default=[], help="extra INT8 variant fields, KEY=VALUE (YAML values)")
    ap.add_argument("--out", type=Path, default=Path("runs/op-profile"))
    args = ap.parse_args()
    from qdeploy import api
    from qdeploy.benchmark.op_profile import int8_cost_by_op_class, summary_line
    from qdeploy.sysinfo import cpu_flags

    flags = [f for f in cpu_flags() if f.startswith(("avx", "amx")) or "vnni" in f]
    print(f"# {platform.processor() or platform.machine()}, onnxruntime {ort.__version__}, flags: {' '.join(flags)}")
    args.out.mkdir(parents=True, exist_ok=True)
    extra = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.int8)}
    tag = "".join(f"-{k}={v}" for k, v in extra.items())
    for name in args.models:
        why = missing(name)
        if why:
            print(f"## {name}: skipped: {why}")
            continue
        cfg = config(name, 64, 256)
        cfg["bench"] = {"enabled": False}
        cfg["variants"] = [{"engine": "onnxruntime"},
                           {"engine": "onnxruntime", "precision": "int8", "method": "mean-minmax",
                            "placement": "onnxruntime", **extra}]
        r = api.run(cfg, args.out / f"{name}{tag}", cache_dir=args.out / "cache")
        paths = {}
        for v in r["variants"]:
            onnx = next(a for a in r["artifacts"] if a["variant"] == v["name"] and a["path"].endswith(".onnx"))
            paths[v["precision"]] = args.out / f"{name}{tag}" / onnx["path"]
            if v.get("metrics"):
                print(f"{name} {v['name']}: {v['metrics']}")
        for b in args.batch:
            x = np.random.default_rng(0).standard_normal((b, 3, *input_size(name)), dtype=np.float32)
            cmp = int8_cost_by_op_class(paths["fp32"], paths["int8"], x, args.runs)
            (args.out / f"{name}{tag}-b{b}.json").write_text(json.dumps(cmp, indent=1))
            print(f"\n## {name}{tag} batch {b}: FP32 {cmp['fp32_p50_ms']:.3f} ms, INT8 {cmp['int8_p50_ms']:.3f} ms "
                  f"({cmp['int8_p50_ms'] / cmp['fp32_p50_ms']:.2f}x FP32's time)")
            print(summary_line(cmp))
            for row in cmp["classes"][:12]:
                print(f"  {row['op_class']:<18} FP32 {row['fp32_us'] / 1e3:8.3f} ms  INT8 {row['int8_us'] / 1e3:8.3f} ms"
                      f"  ({', '.join(row['int8_ops'])})")


if __name__ == "__main__":
    main()
