"""Issue #23's goals: `qdeploy optimize --target cpu` on the dev models at batch 1 and 32, against the best FP32 of
ONNX Runtime and OpenVINO, with NNCF's PTQ in OpenVINO side by side (it is one of the target's candidates).

    python bench/cpu_goals.py resnet20 resnet44 efficientnet_b0_48 mobilenet_v3_large_64 deeplabv3 \
        deit swin convnext mobilevit --batch 1 32 --count 2000 --out runs/cpu-goals [--json docs/results/cpu_goals.json]

Per model and batch size, one `api.optimize` (target cpu; budget max_drop 0.3, 0.5 for the cifar10-modern models;
`optimize.batch_size` = the batch ranked on; methods mean-minmax, max, percentile; fallback on, QAT off; every other
setting at its default; threads = all cores) on `--count` test images (half search, half confirm; DeepLabV3: the
CamVid test split, and batch 8 instead of 32: 32 frames of 360x480 are 66 MB per call). Every candidate's p50 comes
from the same process and run, so every ratio below is within one run:
- chosen / best FP32 (the faster of ONNX Runtime's and OpenVINO's FP32 at that batch size): the goal is >= 1.0x
  speed (never slower) and a median >= 1.5x over the models;
- the confirm-split drop of the chosen artifact (goal: within the budget);
- ONNX Runtime INT8 (the fastest ONNX Runtime INT8 candidate) / ONNX Runtime FP32 (MobileViT's goal: <= 1.0 at 32);
- NNCF's PTQ in OpenVINO (candidate openvino-int8-mean-minmax-nncf) next to qdeploy's best INT8 (accuracy, speed).
The CPU's name, flags (`lscpu`) and the versions are printed and stored with the rows.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goal_models import GOAL_MODELS, TRANSFORMERS, config, missing  # noqa: E402


def optimize_config(name: str, batch: int, count: int, methods: list[str]) -> dict:
    cfg = config(name, count)
    cfg["variants"] = [{"engine": "onnxruntime"}]
    many = batch > 8
    cfg["bench"] = {"batch_sizes": [batch], "warmup": 3 if many else 10, "iterations": 20 if many else 100}
    cfg["optimize"] = {"target": "cpu", "budget": {"max_drop": 0.5 if name in TRANSFORMERS else 0.3},
                       "batch_size": batch, "methods": methods, "qat": "off"}
    return cfg


def _p50(rows: dict, pred) -> tuple:
    got = [(x["latency_p50_ms"], x["variant"]) for x in rows.values() if pred(x) and x.get("latency_p50_ms")]
    return min(got) if got else (None, None)


def summarize(name: str, batch: int, s: dict) -> dict:
    rows = {x["variant"]: x for x in s["candidates"]}
    c = s["chosen"]
    best_fp32, best_fp32_name = _p50(rows, lambda x: x["precision"] == "fp32")
    ort_fp32 = rows.get("fp32", {}).get("latency_p50_ms")
    ort_int8, ort_int8_name = _p50(rows, lambda x: x["precision"] == "int8" and x.get("engine", "onnxruntime") == "onnxruntime"
                                   and x["kind"] != "engine" and x["status"] == "ok")
    nncf = next((x for x in rows.values() if x["variant"].endswith("-nncf")), None)
    ref, got = c.get("reference_confirm_metric"), c.get("confirm_metric")
    chosen_p50 = c.get("latency_p50_ms")
    return {
        "model": name, "batch": batch, "chosen": c.get("variant"), "kind": c.get("kind"),
        "chosen_p50_ms": chosen_p50, "best_fp32": best_fp32_name, "best_fp32_p50_ms": best_fp32,
        "speedup_vs_best_fp32": round(best_fp32 / chosen_p50, 3) if best_fp32 and chosen_p50 else None,
        "confirm_drop_points": round(100 * (ref - got), 3) if ref is not None and got is not None else None,
        "budget": s["budget"], "budget_met": s["budget_met"],
        "ort_fp32_p50_ms": ort_fp32, "ort_int8": ort_int8_name, "ort_int8_p50_ms": ort_int8,
        "ort_int8_over_fp32_time": round(ort_int8 / ort_fp32, 3) if ort_int8 and ort_fp32 else None,
        "nncf": None if nncf is None else {k: nncf.get(k) for k in ("variant", "status", "search_metric", "agreement",
                                                                       "latency_p50_ms", "budget", "reason")},
        "candidates": [{k: x.get(k) for k in ("variant", "kind", "precision", "status", "search_metric", "agreement",
                                              "latency_p50_ms", "noisy", "within_budget", "budget", "int8_share",
                                              "reason")} for x in s["candidates"]],
        "int8_op_profile": {k: (s.get("int8_op_profile") or {}).get(k) for k in ("candidate", "slower", "fp32_kernel_us",
                                                                               "int8_kernel_us")},
        "decisions": s["decisions"], "time_s": s["time_s"],
    }


def fmt(v, d=3):
    return "–" if v is None else f"{v:.{d}f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=GOAL_MODELS)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--methods", default="mean-minmax,max,percentile")
    ap.add_argument("--out", type=Path, default=Path("runs/cpu-goals"))
    ap.add_argument("--json", type=Path, default=None, help="also write every row here (docs/results/cpu_goals.json)")
    args = ap.parse_args()
    import onnxruntime
    import openvino

    from qdeploy import __version__, api
    from qdeploy.sysinfo import cpu_flags, environment

    env = environment()
    flags = cpu_flags()
    head = (f"# {env.get('cpu')} ({env.get('cpu_count')} cores), flags: {' '.join(flags) or 'none of avx2/avx512/vnni/amx'}; "
            f"qdeploy {__version__}, onnxruntime {onnxruntime.__version__}, openvino {openvino.__version__}, "
            f"Python {platform.python_version()}")
    print(head, flush=True)
    out_rows = []
    for name in args.models:
        why = missing(name)
        if why:
            print(f"## {name}: skipped: {why}", flush=True)
            continue
        for b in args.batch:
            b = min(b, 8) if name == "deeplabv3" else b
            t0 = time.perf_counter()
            s = api.optimize(optimize_config(name, b, args.count, args.methods.split(",")),
                             args.out / f"{name}-b{b}", cache_dir=args.out / "cache")
            r = summarize(name, b, s)
            out_rows.append(r)
            print(f"| {name} | {b} | {r['chosen']} | {fmt(r['chosen_p50_ms'])} | {r['best_fp32']} {fmt(r['best_fp32_p50_ms'])} | "
                  f"**{fmt(r['speedup_vs_best_fp32'], 2)}x** | {fmt(r['confirm_drop_points'], 2)} "
                  f"({'met' if r['budget_met'] else 'MISSED'}) | {r['ort_int8'] or '–'} {fmt(r['ort_int8_over_fp32_time'], 2)}x | "
                  f"{(r['nncf'] or {}).get('status', '–')} {fmt(100 * (r['nncf'] or {}).get('agreement') if (r['nncf'] or {}).get('agreement') is not None else None, 2)} % "
                  f"{fmt((r['nncf'] or {}).get('latency_p50_ms'))} | {(time.perf_counter() - t0) / 60:.1f} min |", flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"machine": head, "cpu_flags": flags, "environment": env,
                                                 "command": " ".join(sys.argv), "rows": out_rows}, indent=1))
    speedups = [r["speedup_vs_best_fp32"] for r in out_rows if r["speedup_vs_best_fp32"]]
    if speedups:
        print(f"\nmedian speed-up over the best FP32: {statistics.median(speedups):.2f}x over {len(speedups)} rows; "
              f"slower than the best FP32: {sum(v < 0.97 for v in speedups)} rows")


if __name__ == "__main__":
    main()
