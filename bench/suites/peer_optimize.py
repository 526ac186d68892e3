"""``qdeploy optimize`` next to NNCF's ``quantize_with_accuracy_control`` (ONNX backend), side by side in one run
(issue #11): same models, same budget, same search split to decide on and the same confirm split to check on.

    pip install nncf            # a bench dependency, not a runtime one
    python bench/suites/peer_optimize.py resnet20 resnet44 efficientnet_b0_48 --max-drop 0.3 --out runs/peer_optimize
        [--eval-count N] [--cache-dir D]

Models: resnet20 / resnet44 (../shared/models/cifar10-resnet, CIFAR ResNets at 32x32) and efficientnet_b0_48 /
mobilenet_v3_large_64 (../shared/models/cifar10-dev, torchvision architectures, 10 classes, as in peer_ptq.py).
Data: data.eval = cifar10/test (all 10,000 unless --eval-count N: a seeded N), data.calibration = 512 seeded
cifar10/train images.

Per model:
1. qdeploy: ``api.optimize`` with ``optimize: {target: onnxruntime-cpu, budget: {max_drop: X}}``, bench at batch 1,
   a fresh cache folder (so its wall time includes the export, the calibration and the data decoding).
   Its ONNX Runtime candidates run with ONNX Runtime's default intra-op threads (one per core: os.cpu_count()).
2. NNCF: the FP32 ONNX qdeploy exported (taken from qdeploy's export cache), calibrated on the same 512 images
   (``subset_size=512``), validated on qdeploy's *search* split (data.eval + subsplit {count: n_search, seed: 0},
   n_search = round(0.5 N), the exact DatasetSpec ``optimize`` builds), ``max_drop = X / 100``, absolute drop.
   validation_fn runs an ONNX Runtime session (2 threads, batches of 500) and returns (top-1, per-item correctness):
   the per-item values NNCF would otherwise collect one image per call. Each call is counted: full (all search
   items), subset (fewer: the ranking subsets) or probe (NNCF's one-item call that decides its metric mode).
3. Both results, and FP32, are evaluated on the *confirm* split (subsplit complement: images neither tool saw)
   and on the search split; ONNX Runtime CPU latency at batch 1, 2 threads, is measured in this process after
   both runs, interleaved: each round takes a fresh session per model (20 warm-up runs, median of 200), rounds
   rotate the model order, and the median of the rounds is reported. A 1-thread measurement (5 rounds) is kept next
   to it as a check: at batch 1 on a 2-vCPU machine two intra-op threads can be slower than one.

Prints a Markdown table per model and writes DIR/<model>.json (all numbers, qdeploy's summary, NNCF's calls, the
machine and the command line).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_ptq import NORM, REPO, SHARED, arrays, latency_ms, predict  # noqa: E402
from peer_ptq import config as dev_config  # noqa: E402

RESNETS = ("resnet20", "resnet32", "resnet44", "resnet56")
DEV = ("efficientnet_b0_48", "mobilenet_v3_large_64")
LATENCY_ROUNDS = 7


def base_config(name: str, eval_count: int | None) -> dict:
    """model + data (+ bench at batch 1): the resnets as bench/configs/optimize_resnet20_cpu.yaml, the cifar10-dev
    models as peer_ptq.config()."""
    if name in RESNETS:
        folder = SHARED / "models" / "cifar10-resnet"
        cfg = {"model": {"source": f"{folder / 'cifar_resnet.py'}:{name}", "weights": str(folder / f"{name}.pt"),
                         "task": "classification", "preprocess": {"input_size": [32, 32], **NORM}},
               "data": {"eval": {"format": "imagefolder", "root": str(SHARED / "data" / "cifar10" / "test"), "batch_size": 500},
                        "calibration": {"format": "imagefolder", "root": str(SHARED / "data" / "cifar10" / "train"),
                                        "count": 512, "seed": 0, "batch_size": 64}}}
    elif name in DEV:
        cfg = dev_config(name, 10000)
        cfg.pop("bench", None)
        cfg["data"]["eval"].pop("count", None)
        cfg["data"]["eval"].pop("seed", None)
    else:
        raise SystemExit(f"unknown model {name}: one of {', '.join(RESNETS + DEV)}")
    if eval_count is not None:
        cfg["data"]["eval"].update(count=eval_count, seed=0)
    return cfg


def machine_info() -> dict:
    import onnx
    import onnxruntime
    import torch

    import nncf
    import qdeploy

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import modelopt
        modelopt_version = modelopt.__version__
    except Exception:  # noqa: BLE001 - optional
        modelopt_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        # uncommitted changes to the code under test (read-only query)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "bench"], cwd=REPO, capture_output=True,
                               text=True).stdout.splitlines()
    except OSError:
        commit, dirty = None, None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "nncf": nncf.__version__, "modelopt": modelopt_version, "numpy": np.__version__,
            "qdeploy": qdeploy.__version__, "git_commit": commit, "git_uncommitted": dirty,
            "command": " ".join([Path(sys.executable).name] + sys.argv)}


def ort_session_from_model(model, threads: int = 2):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level, opts.intra_op_num_threads = 3, threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def top1(pred: np.ndarray, y: np.ndarray) -> float:
    return float((pred == y).mean())


def interleaved_latency(paths: dict, x1: np.ndarray, rounds: int = LATENCY_ROUNDS, threads: int = 2) -> dict:
    """Per model: median over ``rounds`` of one fresh session's median of 200 runs (peer_ptq.latency_ms with one
    repeat); the rounds interleave the models and rotate their order."""
    import peer_ptq

    labels = list(paths)
    per = {k: [] for k in labels}
    base = peer_ptq.session
    peer_ptq.session = lambda path, exact=False, threads_=threads: base(path, exact, threads_)
    try:
        for r in range(rounds):
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for k in order:
                per[k].append(latency_ms(paths[k], x1, repeats=1))
    finally:
        peer_ptq.session = base
    return {k: {"p50_ms": statistics.median(v), "rounds_ms": v} for k, v in per.items()}


def run_model(name: str, args, out: Path) -> dict:
    import onnx

    import nncf
    from qdeploy import api
    from qdeploy.config import Subsplit
    from qdeploy.data import make_batches
    from qdeploy.lint import structure_of
    from qdeploy.optimize.decide import budget_check

    X_DROP = args.max_drop
    mdir = out / name
    cache = (Path(args.cache_dir) / name) if args.cache_dir else (mdir / "cache")
    for d in (cache, mdir / "qdeploy", mdir / "export"):
        if d.exists():
            shutil.rmtree(d)  # a fresh cache per model: qdeploy's wall time includes export and calibration
    mdir.mkdir(parents=True, exist_ok=True)
    cfg = base_config(name, args.eval_count)
    cfg["bench"] = {"batch_sizes": [1], "warmup": 10, "iterations": 100, "repeats": 3}
    cfg["optimize"] = {"target": "onnxruntime-cpu", "budget": {"max_drop": X_DROP}}
    result: dict = {"model": name, "max_drop_points": X_DROP, "config": cfg, "cache_dir": str(cache)}

    # ---------------------------------------------------------------- qdeploy optimize
    print(f"\n=== {name}: qdeploy optimize (max_drop {X_DROP} points) ===", flush=True)
    t0 = time.perf_counter()
    summary = api.optimize(cfg, mdir / "qdeploy", cache_dir=cache)
    q_wall = time.perf_counter() - t0
    print(f"{name}: qdeploy optimize {q_wall:.1f} s, chosen {summary['chosen']['variant']}", flush=True)
    result["qdeploy"] = {"wall_s": round(q_wall, 2), "summary": summary}

    # ---------------------------------------------------------------- data: the same splits
    t0 = time.perf_counter()
    rc = api.parse_config(cfg)
    pre, task = rc.model.preprocess, rc.model.task
    exp = api.export({k: v for k, v in cfg.items() if k != "optimize"}, mdir / "export", cache_dir=cache)
    fp32 = Path(exp["copied_to"])
    n = make_batches(rc.data.eval, pre, task, progress=False).num_samples
    n_search = max(1, round(0.5 * n))
    if n_search != summary["splits"]["search"]:
        raise SystemExit(f"search split mismatch: {n_search} here, {summary['splits']['search']} in qdeploy's summary")
    search_spec = rc.data.eval.model_copy(update={"subsplit": Subsplit(count=n_search, seed=0)})
    confirm_spec = rc.data.eval.model_copy(update={"subsplit": Subsplit(count=n_search, seed=0, complement=True)})
    X_cal, _ = arrays(rc.data.calibration, pre, task)
    X_s, Y_s = arrays(search_spec, pre, task)
    X_c, Y_c = arrays(confirm_spec, pre, task)
    prep_s = time.perf_counter() - t0
    result["data"] = {"eval_images": n, "search": len(Y_s), "confirm": len(Y_c), "calibration": len(X_cal),
                      "fp32_export_cache_hit": exp.get("cache_hit"), "prep_s": round(prep_s, 2), "fp32_onnx": str(fp32)}
    print(f"{name}: {n} eval images -> search {len(Y_s)}, confirm {len(Y_c)}; calibration {len(X_cal)} "
          f"(export cache hit: {exp.get('cache_hit')}, {prep_s:.1f} s)", flush=True)

    # ---------------------------------------------------------------- NNCF quantize_with_accuracy_control
    print(f"\n=== {name}: NNCF quantize_with_accuracy_control (max_drop {X_DROP / 100:g}, ABSOLUTE) ===", flush=True)
    fp32_model = onnx.load(str(fp32))
    inp = fp32_model.graph.input[0].name
    calls: list[dict] = []

    def validate(model, items):
        t = time.perf_counter()
        xs, ys = [], []
        for x, y in items:
            xs.append(x)
            ys.append(y)
        X = np.concatenate(xs)
        s = ort_session_from_model(model)
        pred = np.concatenate([s.run(None, {inp: X[i:i + 500]})[0].argmax(1) for i in range(0, len(X), 500)])
        correct = (pred == np.asarray(ys)).astype(np.float64)
        metric = float(correct.mean())
        calls.append({"items": len(ys), "metric": metric, "s": round(time.perf_counter() - t, 3)})
        return metric, correct.tolist()

    calib = nncf.Dataset([X_cal[i:i + 1] for i in range(len(X_cal))], lambda x: {inp: x})
    val = nncf.Dataset([(X_s[i:i + 1], int(Y_s[i])) for i in range(len(X_s))], lambda item: {inp: item[0]})
    nncf_path = mdir / "nncf-accuracy-control.onnx"
    nn: dict = {"status": "ok", "path": str(nncf_path), "call": {"max_drop": X_DROP / 100, "drop_type": "ABSOLUTE",
                                                              "subset_size": len(X_cal)}}
    t0 = time.perf_counter()
    try:
        q = nncf.quantize_with_accuracy_control(onnx.load(str(fp32)), calib, val, validate, max_drop=X_DROP / 100,
                                                drop_type=nncf.DropType.ABSOLUTE, subset_size=len(X_cal))
        nn["wall_s"] = round(time.perf_counter() - t0, 2)
        onnx.save(q, str(nncf_path))
    except Exception as e:  # noqa: BLE001 - report NNCF's failure, keep the qdeploy side
        nn.update(status="error", wall_s=round(time.perf_counter() - t0, 2), error=f"{type(e).__name__}: {e}",
                  traceback=traceback.format_exc())
        print(f"{name}: NNCF failed: {nn['error']}", flush=True)
    probe = [c for i, c in enumerate(calls) if i == 0 and c["items"] == 1]
    rest = calls[len(probe):]
    nn["calls"] = calls
    nn["evaluations"] = {"full": sum(c["items"] == len(Y_s) for c in rest),
                         "subset": sum(c["items"] < len(Y_s) for c in rest), "probe": len(probe),
                         "subset_sizes": sorted({c["items"] for c in rest if c["items"] < len(Y_s)}),
                         "validation_s": round(sum(c["s"] for c in calls), 2)}
    print(f"{name}: NNCF {nn['wall_s']} s, {nn['evaluations']}", flush=True)
    result["nncf"] = nn

    # ---------------------------------------------------------------- both on both splits, the same way
    chosen = summary["chosen"]
    q_path = Path(summary["out"]) / chosen["artifact"] if chosen.get("artifact") else None
    paths = {"fp32": fp32}
    if q_path is not None and chosen["variant"] != "fp32":
        paths["qdeploy"] = q_path
    if nn["status"] == "ok":
        paths["nncf"] = nncf_path
    preds_c = {k: predict(p, X_c) for k, p in paths.items()}
    preds_s = {k: predict(p, X_s) for k, p in paths.items()}
    if "qdeploy" not in paths and chosen["variant"] == "fp32" and q_path is not None:
        preds_c["qdeploy"], preds_s["qdeploy"] = predict(q_path, X_c), predict(q_path, X_s)
    budget = rc.optimize.budget
    ref_c, ref_s = top1(preds_c["fp32"], Y_c), top1(preds_s["fp32"], Y_s)
    evals = {}
    for k in preds_c:
        c, s_ = top1(preds_c[k], Y_c), top1(preds_s[k], Y_s)
        v = budget_check(budget, ref_c, c, None)
        evals[k] = {"search_top1": s_, "search_drop_points": 100 * (ref_s - s_), "confirm_top1": c,
                    "confirm_drop_points": 100 * (ref_c - c), "confirm_agreement": float((preds_c[k] == preds_c["fp32"]).mean()),
                    "within_budget_confirm": bool(v.within), "confirm_verdict": v.why}
    result["evaluated_here"] = evals
    # cross-check against qdeploy's own numbers (same images, same ONNX Runtime)
    if "qdeploy" in evals:
        result["crosscheck"] = {"qdeploy_confirm_metric": chosen["confirm_metric"],
                                "here_confirm_top1": evals["qdeploy"]["confirm_top1"],
                                "qdeploy_reference_confirm_metric": chosen["reference_confirm_metric"],
                                "here_fp32_confirm_top1": ref_c,
                                "qdeploy_search_metric": chosen["search_metric"],
                                "here_search_top1": evals["qdeploy"]["search_top1"],
                                "qdeploy_reference_search_metric": summary["candidates"][0]["search_metric"],
                                "here_fp32_search_top1": ref_s,
                                "nncf_initial_metric": rest[0]["metric"] if rest else None}
    structures = {}
    for k, p in paths.items():
        if k == "fp32":
            continue
        st = structure_of(p)
        structures[k] = {"compute_ops": st["compute_ops"], "compute_ops_int8": st["compute_ops_int8"],
                         "compute_ops_float": st["compute_ops_float"],
                         "compute_ops_partly_quantized": st["compute_ops_partly_quantized"],
                         "float_layers": len(st["compute_ops_float"]) + len(st["compute_ops_partly_quantized"])}
    result["structure"] = structures

    # ---------------------------------------------------------------- latency, interleaved, this process
    print(f"{name}: latency, batch 1, 2 threads, {LATENCY_ROUNDS} interleaved rounds ...", flush=True)
    lat = interleaved_latency(paths, X_c[:1])
    for k in lat:
        lat[k]["speedup_vs_fp32"] = lat["fp32"]["p50_ms"] / lat[k]["p50_ms"]
    result["latency"] = lat
    # a check, not the reported number: at batch 1 on 2 vCPUs, two intra-op threads can be slower than one
    lat1 = interleaved_latency(paths, X_c[:1], rounds=5, threads=1)
    for k in lat1:
        lat1[k]["speedup_vs_fp32"] = lat1["fp32"]["p50_ms"] / lat1[k]["p50_ms"]
    result["latency_1thread"] = lat1
    result["table"] = table(name, result)
    print("\n" + result["table"], flush=True)
    return result


def table(name: str, r: dict) -> str:
    ev, lat, st = r["evaluated_here"], r["latency"], r["structure"]
    fp = ev["fp32"]
    s = r["qdeploy"]["summary"]
    q_ev = s["evaluations"]
    n_confirm_evals = 1 if s["chosen"]["variant"] == "fp32" else 2
    lines = [f"### {name}: max_drop {r['max_drop_points']} points, search {r['data']['search']} / confirm "
             f"{r['data']['confirm']} cifar10/test images",
             "",
             f"FP32 (ONNX Runtime): search top-1 {100 * fp['search_top1']:.2f} %, confirm top-1 {100 * fp['confirm_top1']:.2f} %, "
             f"p50 {lat['fp32']['p50_ms']:.3f} ms (batch 1, 2 threads; 1 thread: "
             + ", ".join(f"{k} {v['p50_ms']:.3f} ms" for k, v in r.get("latency_1thread", {}).items()) + ")",
             "",
             "| tool | result | search-split drop | confirm top-1 % | confirm drop vs FP32 | within budget on confirm? "
             "| p50 ms (speed-up vs FP32) | wall s | full evaluations | subset evaluations | layers left in float |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(tool, key, result, wall, full, subset):
        e = ev.get(key)
        if e is None:
            return f"| {tool} | {result} | – | – | – | – | – | {wall} | {full} | {subset} | – |"
        lt = lat.get(key)
        lts = f"{lt['p50_ms']:.3f} ({lt['speedup_vs_fp32']:.2f}x)" if lt else "–"
        fl = st.get(key)
        fls = f"{fl['float_layers']} of {fl['compute_ops']}" if fl else "all (FP32)"
        return (f"| {tool} | {result} | {e['search_drop_points']:+.2f} | {100 * e['confirm_top1']:.2f} | "
                f"{e['confirm_drop_points']:+.2f} | {'yes' if e['within_budget_confirm'] else '**no**'} | {lts} | {wall} | "
                f"{full} | {subset} | {fls} |")

    q_sub = f"{q_ev['subset']}" + (f" (+{q_ev['sensitivity']} SQNR passes)" if q_ev.get("sensitivity") else "")
    lines.append(row("qdeploy optimize", "qdeploy", s["chosen"]["variant"], f"{r['qdeploy']['wall_s']:.1f}",
                     f"{q_ev['full'] - n_confirm_evals} (+{n_confirm_evals} confirm)", q_sub))
    nn = r["nncf"]
    ne = nn["evaluations"]
    n_sub = f"{ne['subset']}" + (f" (+{ne['probe']} one-image probe)" if ne["probe"] else "")
    lines.append(row("NNCF accuracy-control", "nncf", "INT8 Q/DQ" if nn["status"] == "ok" else f"error: {nn.get('error', '')[:80]}",
                     f"{nn['wall_s']:.1f}", f"{ne['full']}", n_sub))
    lines += ["",
              "Drops are FP32 minus the model in points of top-1 (positive = worse), each against FP32 on the same split. "
              f"qdeploy's wall time includes its export, calibration and image decoding (fresh cache); NNCF's is the "
              f"quantize_with_accuracy_control call alone on pre-decoded arrays (data preparation here took "
              f"{r['data']['prep_s']:.1f} s, export reused from qdeploy's cache). NNCF's validation calls took "
              f"{ne['validation_s']:.1f} s of its {nn['wall_s']:.1f} s."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--max-drop", type=float, default=0.3, help="points of top-1 (0.3 = 0.3 points)")
    ap.add_argument("--out", default="runs/peer_optimize")
    ap.add_argument("--eval-count", type=int, default=None, help="a seeded subset of cifar10/test (default: all)")
    ap.add_argument("--cache-dir", default=None, help="parent of the per-model fresh cache folders (default: DIR/MODEL/cache)")
    args = ap.parse_args()
    if not (SHARED / "models").is_dir() or not (SHARED / "data" / "cifar10").is_dir():
        print(f"skipped: {SHARED} (models and cifar10 data) is not present on this machine")
        return
    sys.path.insert(0, str(REPO / "src"))
    try:
        import nncf  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs NNCF: pip install nncf (a bench dependency only)") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    print(f"machine: {info}", flush=True)
    tables = []
    for name in args.models:
        r = run_model(name, args, out)
        r["machine"] = info
        (out / f"{name}.json").write_text(json.dumps(r, indent=2, default=str))
        tables.append(r["table"])
    (out / "tables.md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
