"""`qdeploy optimize`, target tensorrt, on the cifar10-modern dev models (issue #21's goal).

    python bench/suites/transformer_optimize.py deit swin convnext mobilevit --max-drop 0.5 --out runs/transformer-opt

The full CIFAR-10 test set (10,000 images) split search/confirm by optimize's seeded `search_fraction` (0.5), 512
calibration images from the training set, every PTQ method, fallback on (QAT off unless `--qat`). TensorRT is not
installed here, so the TensorRT-placement candidates are evaluated in ONNX Runtime with exact Q/DQ and ranked by their
INT8 share of the MACs (attention's matmuls counted). Prints a Markdown row per model (copied into
docs/int8-accuracy.md) and keeps DIR/<model>-<drop>/optimize.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_int8 import MODELS, SHARED, config  # noqa: E402


def optimize_config(name: str, max_drop: float, calibration: int, qat: str, count) -> dict:
    cfg = config(name, count or 10_000, calibration, "mean-minmax")
    if count is None:
        cfg["data"]["eval"].pop("count")
        cfg["data"]["eval"].pop("seed")
    cfg["data"]["eval"]["batch_size"] = 250
    cfg["variants"] = [{"engine": "onnxruntime"}]
    cfg["optimize"] = {"target": "tensorrt", "budget": {"max_drop": max_drop}, "qat": qat}
    if qat != "off":
        cfg["qat"] = {"epochs": 1, "optimizer": "adamw", "lr": 1e-5,
                      "data": {"format": "imagefolder", "root": str(SHARED / "data" / "cifar10" / "train"),
                               "count": 5000, "seed": 1, "batch_size": 64, "workers": 0, "labels": False}}
    return cfg


def row(name: str, s: dict) -> str:
    c = s["chosen"]
    ref, got = c.get("reference_confirm_metric"), c.get("confirm_metric")
    drop = "–" if ref is None or got is None else f"{100 * (ref - got):+.2f}".replace("+", "−", 1) if ref > got \
        else f"+{100 * (got - ref):.2f}"
    share = c.get("int8_share")
    share = "–" if share is None else f"{100 * share:.2f} % ({c.get('int8_share_basis')})"
    floats = c.get("float_layers") or []
    failed = [f"{x['variant']} ({x.get('failed_stage')})" for x in s["candidates"] if x.get("status") == "failed"]
    return (f"| {name} | {s['budget'].get('max_drop')} | {c.get('variant')} | "
            f"{'–' if ref is None else f'{100 * ref:.2f}'} | {'–' if got is None else f'{100 * got:.2f}'} | {drop} | "
            f"{'yes' if s['budget_met'] else 'NO'} | {share} | {len(floats)} | {', '.join(failed) or '–'} | "
            f"{s['time_s'] / 60:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--max-drop", type=float, default=0.5)
    ap.add_argument("--calibration", type=int, default=512)
    ap.add_argument("--qat", default="off", choices=["off", "distill", "supervised", "both"])
    ap.add_argument("--count", type=int, default=None, help="test images (default: all 10,000)")
    ap.add_argument("--out", default="runs/transformer-opt")
    args = ap.parse_args()
    if not (SHARED / "models" / "cifar10-modern").is_dir():
        raise SystemExit(f"{SHARED / 'models' / 'cifar10-modern'} not present: this benchmark needs ../shared")
    from qdeploy import api

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}", flush=True)
    rows = ["| model | max_drop | chosen | FP32 top-1 (confirm) | chosen top-1 (confirm) | change | within budget | "
            "INT8 share of MACs | float layers | failed candidates | minutes |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models:
        out = Path(args.out) / f"{name}-{args.max_drop}"
        t = time.perf_counter()
        s = api.optimize(optimize_config(name, args.max_drop, args.calibration, args.qat, args.count), out,
                         cache_dir=Path(args.out) / "cache")
        rows.append(row(name, s))
        print(rows[-1], f"({time.perf_counter() - t:.0f} s)", flush=True)
        (Path(args.out) / f"{name}-{args.max_drop}.row.json").write_text(json.dumps({"row": rows[-1]}))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
