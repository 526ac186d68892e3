"""Issue #23's goals: `qdeploy optimize --target cpu` on the dev models at batch 1 and 32, against the best FP32 of
ONNX Runtime and OpenVINO, with NNCF's PTQ in OpenVINO side by side (it is one of the target's candidates).

    python bench/suites/cpu_goals.py resnet20 resnet44 efficientnet_b0_48 mobilenet_v3_large_64 deeplabv3 \
        deit swin convnext mobilevit --batch 1 32 --count 2000 --out runs/cpu-goals [--json docs/results/cpu/cpu_goals.json]
        [--threads 1:1,4,16 32:16]    # issue 36: per batch size, the thread counts to run optimize with (default: all
                                      # cores only); each (model, batch, threads) is one optimize, one row

Per model and batch size, one `api.optimize` (target cpu; budget max_drop 0.3, 0.5 for the cifar10-modern models;
`optimize.batch_size` = the batch ranked on; methods mean-minmax, max, percentile; fallback on, QAT off; every other
setting at its default; threads = all cores) on `--count` test images (half search, half confirm; DeepLabV3: the
CamVid test split, and batch 8 instead of 32: 32 frames of 360x480 are 66 MB per call). Every candidate's p50 comes
from the same process and run, so every ratio below is within one run:
- chosen / best FP32 (the faster of ONNX Runtime's and OpenVINO's FP32 at that batch size): the goal is >= 1.0x
  speed (never slower) and a median >= 1.5x over the models;
- the confirm-split drop of the chosen artifact (goal: within the budget);
- ONNX Runtime INT8 (the fastest ONNX Runtime INT8 candidate) / ONNX Runtime FP32 (MobileViT's goal: <= 1.0 at 32);
- NNCF's PTQ in OpenVINO (candidate openvino-int8-mean-minmax-nncf) next to qdeploy's best INT8 (accuracy, speed);
- the ceiling: the fastest candidate measured whatever its accuracy, over the best FP32 (`ceiling_speedup_vs_best_fp32`):
  what choosing among these candidates could give at most; a goal above it needs faster candidates, not another choice.
The CPU's name, flags (`lscpu`) and the versions are printed and stored with the rows.

On the device machine's Xeon the models travel a few per call (bench/device/stage_cpu_device.sh); the calls' JSONs become one
file by this script, not by hand (every part must name the same machine and versions):

    python bench/suites/cpu_goals.py --merge /work/.device/1/cpu_goals.json ... --json docs/results/cpu/cpu_goals_xeon.json

A re-run against an earlier file, row by row (chosen p50 and within-run speed-up, before and now):

    python bench/suites/cpu_goals.py --compare docs/results/cpu/cpu_goals.json NEW.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goal_models import GOAL_MODELS, TRANSFORMERS, config, missing  # noqa: E402


def optimize_config(name: str, batch: int, count: int, methods: list[str], threads: Optional[int] = None) -> dict:
    cfg = config(name, count)
    cfg["variants"] = [{"engine": "onnxruntime"}]
    many = batch > 8
    cfg["bench"] = {"batch_sizes": [batch], "warmup": 3 if many else 10, "iterations": 20 if many else 100}
    cfg["optimize"] = {"target": "cpu", "budget": {"max_drop": 0.5 if name in TRANSFORMERS else 0.3},
                       "batch_size": batch, "methods": methods, "qat": "off",
                       **({"threads": threads} if threads else {})}
    return cfg


def thread_plan(text: Optional[str]) -> dict:
    """'1:1,4,16 32:16' -> {1: [1, 4, 16], 32: [16]}; a batch size not named runs with every core (None)."""
    plan: dict = {}
    for part in (text or "").split():
        batch, counts = part.split(":")
        plan[int(batch)] = [int(c) for c in counts.split(",")]
    return plan


def _p50(rows: dict, pred) -> tuple:
    got = [(x["latency_p50_ms"], x["variant"]) for x in rows.values() if pred(x) and x.get("latency_p50_ms")]
    return min(got) if got else (None, None)


def ort_int8_of(rows: dict) -> tuple:
    """(p50, variant) of the fastest INT8 candidate ONNX Runtime ran. optimize.json's rows carry no engine: OpenVINO's
    are named openvino-* (their fallback trials too, which an earlier version of this test counted as ONNX Runtime's)."""
    return _p50(rows, lambda x: x["precision"] == "int8" and x["status"] == "ok"
                and not x["variant"].startswith("openvino-"))


def ceiling_of(rows: dict, best_fp32: Optional[float]) -> dict:
    """The fastest candidate the search measured, whatever its accuracy or precision, and its speed-up over the best
    FP32: the most the engines offered in this row. A goal above it cannot be met by choosing among these candidates;
    only a faster candidate (another engine, kernel or graph) would raise it."""
    p50, name = _p50(rows, lambda x: x["status"] == "ok")
    return {"fastest_any": name, "fastest_any_p50_ms": p50,
            "ceiling_speedup_vs_best_fp32": round(best_fp32 / p50, 3) if best_fp32 and p50 else None}


def summarize(name: str, batch: int, s: dict) -> dict:
    rows = {x["variant"]: x for x in s["candidates"]}
    c = s["chosen"]
    best_fp32, best_fp32_name = _p50(rows, lambda x: x["precision"] == "fp32")
    # issue 36: BF16 (OpenVINO's bf16 hint, where the CPU runs it natively) is a float answer of its own: the goal's
    # speed-up is over FP32, and DeiT/Swin's INT8 must beat BF16 too
    bf16, bf16_name = _p50(rows, lambda x: x["precision"] == "bf16" and x["status"] == "ok")
    best_int8, best_int8_name = _p50(rows, lambda x: x["precision"] == "int8" and x["status"] == "ok"
                                     and x.get("within_budget"))
    ort_fp32 = rows.get("fp32", {}).get("latency_p50_ms")
    ort_int8, ort_int8_name = ort_int8_of(rows)
    nncf = next((x for x in rows.values() if x["variant"].endswith("-nncf")), None)
    ref, got = c.get("reference_confirm_metric"), c.get("confirm_metric")
    chosen_p50 = c.get("latency_p50_ms")
    return {
        "model": name, "batch": batch, "threads": s.get("threads"), "chosen": c.get("variant"), "kind": c.get("kind"),
        "chosen_precision": (c.get("setting") or {}).get("precision"),
        "bf16": bf16_name, "bf16_p50_ms": bf16, "best_int8_within_budget": best_int8_name,
        "best_int8_within_budget_p50_ms": best_int8,
        "int8_faster_than_fp32_and_bf16": None if best_int8 is None else bool(
            best_int8 < best_fp32 and (bf16 is None or best_int8 < bf16)),
        "chosen_p50_ms": chosen_p50, "best_fp32": best_fp32_name, "best_fp32_p50_ms": best_fp32,
        "speedup_vs_best_fp32": round(best_fp32 / chosen_p50, 3) if best_fp32 and chosen_p50 else None,
        **ceiling_of(rows, best_fp32),
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


def merge(parts: list[Path], json_out: Optional[Path]) -> None:
    """One file from the JSONs of several runs on one machine (the device machine's calls each carry a few models):
    every part must name the same machine (CPU, flags, versions); each keeps its command; a (model, batch, threads)
    row of a later part replaces an earlier one's. A part may itself be a merged file (its commands are kept)."""
    docs = [json.loads(p.read_text()) for p in parts]
    machines = {d["machine"] for d in docs}
    if len(machines) != 1:
        raise SystemExit("cpu_goals --merge: the parts were measured on different machines or versions:\n  "
                         + "\n  ".join(sorted(machines)))
    rows: dict = {}
    for d in docs:
        for r in d["rows"]:
            r = {**r, "measured_by": r.get("measured_by") or d.get("command")}
            if r.get("candidates"):  # recomputed from the row's candidates (see ort_int8_of, ceiling_of)
                r.update(ceiling_of({x["variant"]: x for x in r["candidates"]}, r.get("best_fp32_p50_ms")))
                r["ort_int8_p50_ms"], r["ort_int8"] = ort_int8_of({x["variant"]: x for x in r["candidates"]})
                fp32 = r.get("ort_fp32_p50_ms")
                r["ort_int8_over_fp32_time"] = round(r["ort_int8_p50_ms"] / fp32, 3) if r["ort_int8_p50_ms"] and fp32 else None
            rows[(r["model"], r["batch"], r["threads"])] = r
    order = {m: i for i, m in enumerate(GOAL_MODELS)}
    merged = sorted(rows.values(), key=lambda r: (order.get(r["model"], 99), r["batch"], r["threads"] or 0))
    print(docs[0]["machine"])
    for r in merged:
        print(f"| {r['model']} | {r['batch']} | {r['threads']} | {r['chosen']} | {fmt(r['chosen_p50_ms'])} | "
              f"{r['best_fp32']} {fmt(r['best_fp32_p50_ms'])} | **{fmt(r['speedup_vs_best_fp32'], 2)}x** |")
    print_summary(merged)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"machine": docs[0]["machine"], "cpu_flags": docs[0]["cpu_flags"],
                                        "environment": docs[0]["environment"],
                                        "commands": [c for d in docs for c in d.get("commands", [d.get("command")])],
                                        "merged_by": [m for d in docs for m in ([d["merged_by"]] if isinstance(
                                            d.get("merged_by"), str) else d.get("merged_by", []))]
                                        + ["python bench/suites/cpu_goals.py --merge " + " ".join(map(str, parts))],
                                        "rows": merged}, indent=1))


def compare(before: Path, after: Path) -> None:
    """Row by row, a re-run against an earlier file (issue 36: the AVX2 table of issue 23 re-run with the final code):
    the chosen answer's p50 and its speed-up over the best FP32 of its own run. Two runs on two lent hosts of one kind
    differ in absolute speed, so the within-run speed-up is the figure to hold against the noise; both are printed."""
    old, new = (json.loads(p.read_text()) for p in (before, after))
    print(f"before: {old['machine']}\nafter:  {new['machine']}")
    rows = {(r["model"], r["batch"]): r for r in old["rows"]}
    print("| model | batch | chosen before | p50 ms | speed-up | chosen now | p50 ms | speed-up | now / before (p50) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in new["rows"]:
        o = rows.get((r["model"], r["batch"]))
        if o is None:
            continue
        ratio = r["chosen_p50_ms"] / o["chosen_p50_ms"] if r["chosen_p50_ms"] and o["chosen_p50_ms"] else None
        print(f"| {r['model']} | {r['batch']} | {o['chosen']} | {fmt(o['chosen_p50_ms'])} | {fmt(o['speedup_vs_best_fp32'], 2)}x "
              f"| {r['chosen']} | {fmt(r['chosen_p50_ms'])} | {fmt(r['speedup_vs_best_fp32'], 2)}x | {fmt(ratio, 2)} |")


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        return compare(Path(sys.argv[2]), Path(sys.argv[3]))
    if sys.argv[1:2] == ["--merge"]:
        ap = argparse.ArgumentParser(prog="cpu_goals.py --merge")
        ap.add_argument("parts", nargs="+", type=Path)
        ap.add_argument("--json", type=Path, default=None)
        a = ap.parse_args(sys.argv[2:])
        return merge(a.parts, a.json)
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=GOAL_MODELS)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--methods", default="mean-minmax,max,percentile")
    ap.add_argument("--out", type=Path, default=Path("runs/cpu-goals"))
    ap.add_argument("--json", type=Path, default=None, help="also write every row here (docs/results/cpu/cpu_goals.json)")
    ap.add_argument("--threads", default=None, help="per batch size, the thread counts: '1:1,4,16 32:16' (default: all "
                    "cores)")
    args = ap.parse_args()
    threads_for = thread_plan(args.threads)
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
        for b, threads in [(b, t) for b in args.batch for t in threads_for.get(b, [None])]:
            b = min(b, 8) if name == "deeplabv3" else b
            t0 = time.perf_counter()
            s = api.optimize(optimize_config(name, b, args.count, args.methods.split(","), threads),
                             args.out / f"{name}-b{b}-t{threads or 'all'}", cache_dir=args.out / "cache")
            r = summarize(name, b, s)
            out_rows.append(r)
            print(f"| {name} | {b} | {r['threads']} | {r['chosen']} | {fmt(r['chosen_p50_ms'])} | "
                  f"{r['best_fp32']} {fmt(r['best_fp32_p50_ms'])} | {r['bf16'] or '–'} {fmt(r['bf16_p50_ms'])} | "
                  f"**{fmt(r['speedup_vs_best_fp32'], 2)}x** | {fmt(r['confirm_drop_points'], 2)} "
                  f"({'met' if r['budget_met'] else 'MISSED'}) | {r['ort_int8'] or '–'} {fmt(r['ort_int8_over_fp32_time'], 2)}x | "
                  f"{(r['nncf'] or {}).get('status', '–')} {fmt(100 * (r['nncf'] or {}).get('agreement') if (r['nncf'] or {}).get('agreement') is not None else None, 2)} % "
                  f"{fmt((r['nncf'] or {}).get('latency_p50_ms'))} | {(time.perf_counter() - t0) / 60:.1f} min |", flush=True)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"machine": head, "cpu_flags": flags, "environment": env,
                                                 "command": " ".join(sys.argv), "rows": out_rows}, indent=1))
    print_summary(out_rows)


def print_summary(out_rows: list) -> None:
    speedups = [r["speedup_vs_best_fp32"] for r in out_rows if r["speedup_vs_best_fp32"]]
    if speedups:
        print(f"\nmedian speed-up over the best FP32: {statistics.median(speedups):.2f}x over {len(speedups)} rows; "
              f"slower than the best FP32: {sum(v < 0.97 for v in speedups)} rows")
        ceilings = [r["ceiling_speedup_vs_best_fp32"] for r in out_rows if r.get("ceiling_speedup_vs_best_fp32")]
        if ceilings:
            print(f"ceiling (the fastest candidate measured, any accuracy): median {statistics.median(ceilings):.2f}x "
                  f"over {len(ceilings)} rows; rows whose ceiling is below 2.0x: {sum(v < 2.0 for v in ceilings)}")
        # NNCF's PTQ in OpenVINO beside qdeploy's answer: at least as fast (within 3 %, the timer's noise between
        # candidates of one run), and whether NNCF's own answer was within the budget at all
        vs = [(r["model"], r["chosen_p50_ms"], (r.get("nncf") or {}).get("latency_p50_ms"),
               next((c.get("within_budget") for c in r.get("candidates") or [] if c["variant"] == (r.get("nncf") or {})
                     .get("variant")), None)) for r in out_rows]
        vs = [v for v in vs if v[1] and v[2]]
        if vs:
            fast = {m for m in {v[0] for v in vs} if all(c <= 1.03 * n or not ok for mm, c, n, ok in vs if mm == m)}
            print(f"qdeploy's answer at least as fast as NNCF's INT8 (<= 1.03x its time) in "
                  f"{sum(c <= 1.03 * n for _, c, n, _ in vs)} of {len(vs)} rows; NNCF's INT8 within budget in "
                  f"{sum(bool(ok) for *_, ok in vs)} rows; models where every row is at least as fast or NNCF's answer "
                  f"is outside the budget: {len(fast)} of {len({v[0] for v in vs})}")
        reduced = {r["model"] for r in out_rows if r["chosen_precision"] in ("int8", "bf16") and r["budget_met"]}
        print(f"INT8 or BF16 chosen within budget (any row) on {len(reduced)} of {len({r['model'] for r in out_rows})} "
              f"models; DeiT/Swin at batch 32, INT8 faster than FP32 and BF16: "
              + ", ".join(f"{r['model']} t{r['threads']} {r['int8_faster_than_fp32_and_bf16']}" for r in out_rows
                          if r["model"] in ("deit", "swin") and r["batch"] >= 32))


if __name__ == "__main__":
    main()
