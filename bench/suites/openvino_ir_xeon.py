"""qdeploy's OpenVINO IR variants against a plain OpenVINO + NNCF script, on one CPU with one timer.

    python bench/suites/openvino_ir_xeon.py --images DIR --json OUT.json                  # the four models at 224
    python bench/suites/openvino_ir_xeon.py --models resnet18 --size 64 --images DIR --threads 2 --count 8 --json OUT.json
    python bench/suites/openvino_ir_xeon.py --merge A.json B.json --json OUT.json         # parts of several calls, one file

Per model (random init: ``torch.manual_seed(0)``, ``--num-classes`` outputs; torchvision resnet50, timm convnext_tiny,
deit_small_patch16_224 and swin_tiny_patch4_window7_224 by default):

qdeploy    ``qdeploy.api.run`` of a config with ``weights: random``, preprocess resize 256/crop 224 (the size scaled with
           ``--size``), data.calibration = the first ``--count`` images of ``--images`` (unlabelled), data.eval = the next
           ``--eval`` images, ``threads: --threads``, bench at batch 1 and 16, and three variants: openvino fp32 (the FP32 IR),
           openvino int8 placement openvino (the INT8 IR NNCF makes on the ov.Model; float layers f32) and the same with
           ``float_precision: bf16`` (where the CPU lists BF16). Read back from results.json: each variant's p50, its
           precision hint and compute-layer precisions, the IR route.
plain      what a user's own script does with the same FP32 ONNX (the file qdeploy exported; ``--plain-route pytorch``:
           ``ov.convert_model`` of the torch module instead): ``ov.convert_model`` → ``nncf.quantize(model,
           nncf.Dataset(the same calibration images, decoded by qdeploy's loader so that both sides calibrate on identical
           arrays), subset_size=count, model_type=TRANSFORMER for DeiT/Swin)`` → ``core.compile_model(q, "CPU",
           {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"})``: once with OpenVINO's default inference
           precision (bf16 on a CPU with AMX/AVX512-BF16) and once with ``INFERENCE_PRECISION_HINT: f32``; and the FP32
           model compiled with f32.
timing     one timer for both sides, in this process: qdeploy's IRs are loaded from its --out with the compile properties
           its deploy line names (not its compile cache); one infer request each, the input tensor set once, both warmed
           up, then ``--repeats`` rounds of n timed ``infer()`` calls per side (n: ``--iters``, more where those take
           under ``--min-time``), the two sides alternating which goes first. Per side: the median of each repeat, their
           minimum (qdeploy's own rule for p50) and their median. Pairs: int8 (f32 float layers) vs plain int8 f32;
           int8 bf16 vs plain int8 default; fp32 vs plain fp32 (f32).

The goal it checks: qdeploy's INT8 latency within 5 % of the plain script's (``ratio`` = qdeploy / plain of the minimum
repeat medians, ``within_5pct``), and the FP32 variant's read-back inference precision is f32. Rows are written to --json
after each model (a time limit, ``--budget``, skips the models that would start after it).
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
from pathlib import Path

import numpy as np

# short name → (model source, transformer: NNCF's model_type TRANSFORMER on the plain side, as qdeploy picks it)
MODELS = {"resnet50": ("torchvision:resnet50", False), "convnext_tiny": ("timm:convnext_tiny", False),
          "deit_small": ("timm:deit_small_patch16_224", True), "swin_tiny": ("timm:swin_tiny_patch4_window7_224", True),
          "resnet18": ("torchvision:resnet18", False), "deit_tiny": ("timm:deit_tiny_patch16_224", True)}
DEFAULT_MODELS = ["resnet50", "convnext_tiny", "deit_small", "swin_tiny"]
NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
WITHIN = 0.05
# qdeploy_config's variants, in order
VARIANT_KEYS = ("fp32", "int8", "int8_bf16")


def model_kwargs(name: str, size: int, classes: int) -> dict:
    """The builder's kwargs: the class count, and for a transformer at another size than its 224 the image size (Swin:
    a window that tiles the smaller token grid)."""
    kw = {"num_classes": classes}
    if size != 224 and MODELS[name][1]:
        kw["img_size"] = size
        if name.startswith("swin"):
            kw["window_size"] = max(1, size // 32)
    return kw


def stage_images(src: Path, work: Path, count: int, n_eval: int) -> tuple[Path, Path]:
    """The first ``count`` images under ``src`` (sorted, any depth) copied flat into work/calib, the next ``n_eval`` into
    work/eval (both read as unlabelled)."""
    files = sorted(p for p in src.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if len(files) < count + n_eval:
        raise SystemExit(f"{src} has {len(files)} images; --count {count} + --eval {n_eval} are needed")
    calib, evals = work / "calib", work / "eval"
    for d, chosen in ((calib, files[:count]), (evals, files[count:count + n_eval])):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for i, f in enumerate(chosen):
            shutil.copyfile(f, d / f"{i:04d}{f.suffix.lower()}")
    return calib, evals


def qdeploy_config(name: str, a, calib: Path, evals: Path, bf16: bool) -> dict:
    source = MODELS[name][0]
    resize = round(a.size * 256 / 224)
    int8 = {"engine": "openvino", "precision": "int8", "placement": "openvino", "threads": a.threads}
    variants = [{"engine": "openvino", "precision": "fp32", "threads": a.threads}, dict(int8)]
    if bf16:
        variants.append({**int8, "float_precision": "bf16"})
    return {"model": {"source": source, "kwargs": model_kwargs(name, a.size, a.num_classes), "weights": "random",
                      "preprocess": {"input_size": [a.size, a.size], "resize": resize, "crop": a.size, **NORM}},
            "data": {"eval": {"root": str(evals), "labels": False},
                     "calibration": {"root": str(calib), "labels": False}},
            "variants": variants,
            "bench": {"batch_sizes": list(a.batch), "warmup": a.warmup, "iterations": a.iters, "repeats": a.repeats},
            "report": {}}


def qdeploy_side(results: dict, out: Path) -> dict:
    """Per variant of a qdeploy run (keyed fp32, int8, int8_bf16: qdeploy_config's order): status, p50 per batch size,
    the precision hint read back, the compute layers' precisions, the IR in --out and its deploy line."""
    side = {}
    for key, v in zip(VARIANT_KEYS, results["variants"]):
        d = v.get("details") or {}
        side[key] = {"label": v["name"], "status": v["status"], "reason": v.get("reason"),
                     "p50_ms": {bs: s.get("p50") for bs, s in (v.get("latency_ms") or {}).items()},
                     "precision_hint": d.get("precision_hint"), "compute_layer_precisions": d.get("compute_layer_precisions"),
                     "threads": d.get("threads"), "ir": str(out / d["artifact"]) if d.get("artifact") else None,
                     "ir_route": d.get("ir_route"), "deploy": d.get("deploy"), "agreement": v.get("agreement")}
    return side


def exported_onnx(cache: Path, results: dict) -> Path:
    """The FP32 ONNX qdeploy exported (its cache keeps it under exports/, named after its fingerprint)."""
    fingerprint = results["model"]["onnx"]["fingerprint"][:16]
    found = sorted((cache / "exports").glob(f"*-{fingerprint}.onnx"))
    if not found:
        raise FileNotFoundError(f"no exported ONNX with fingerprint {fingerprint} in {cache / 'exports'}")
    return found[0]


def calibration_arrays(calib: Path, cfg: dict) -> list:
    """The calibration images as qdeploy decodes and normalizes them (float32 NCHW, one image per item)."""
    from qdeploy.api import make_batches, normalize
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.tasks import get_task

    pre = Preprocess(**cfg["model"]["preprocess"])
    batches = make_batches(DatasetSpec(root=str(calib), labels=False), pre, get_task("classification"), progress=False)
    return [normalize(images, pre)[i:i + 1] for images, _ in batches for i in range(len(images))]


def plain_models(name: str, a, onnx_path: Path, images: list) -> dict:
    """The plain script: convert, nncf.quantize (timed), and the FP32 model; ov.Model objects, not compiled yet."""
    import nncf
    import openvino as ov

    if a.plain_route == "pytorch":
        import torch

        from qdeploy.api import build_torch_model
        from qdeploy.config import ModelSpec

        torch.manual_seed(0)
        spec = ModelSpec(source=MODELS[name][0], kwargs=model_kwargs(name, a.size, a.num_classes), weights="random")
        module = build_torch_model(spec).eval()
        fp32 = ov.convert_model(module, example_input=torch.from_numpy(images[0]))
    else:
        fp32 = ov.convert_model(str(onnx_path))
    t0 = time.perf_counter()
    q = nncf.quantize(fp32, nncf.Dataset(images), subset_size=len(images),
                      model_type=nncf.ModelType.TRANSFORMER if MODELS[name][1] else None)
    return {"fp32": fp32, "int8": q, "quantize_s": round(time.perf_counter() - t0, 2), "route": a.plain_route}


def compile_on_cpu(model, threads: int, hint: str | None):
    """compile_model on the CPU with one latency stream of ``threads`` threads; ``hint`` None: OpenVINO's default
    inference precision. Returns (compiled, the hint read back)."""
    from qdeploy.engines.openvino_engine import core

    config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
    if hint:
        config["INFERENCE_PRECISION_HINT"] = hint
    compiled = core().compile_model(model, "CPU", config)
    got = compiled.get_property("INFERENCE_PRECISION_HINT")
    return compiled, got.get_type_name() if hasattr(got, "get_type_name") else str(got)


def _warm(request, calls: int, seconds: float) -> float:
    """Run ``request`` at least ``calls`` times and ``seconds`` long; the median latency (ms) of those calls."""
    ts, t_end = [], time.perf_counter() + seconds
    while len(ts) < calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        request.infer()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def time_pair(a_compiled, b_compiled, x: np.ndarray, a) -> tuple[dict, dict]:
    """The same timer for two compiled models on the input ``x``: one infer request each whose input tensor is set once;
    both warmed up (``--warmup`` calls and 0.2 s); then ``--repeats`` rounds, the two sides alternating which goes first,
    each timing n infer() calls, n the same for both: ``--iters``, or more where that takes under ``--min-time`` s."""
    import openvino as ov

    requests = []
    for c in (a_compiled, b_compiled):
        r = c.create_infer_request()
        r.set_input_tensor(ov.Tensor(x, shared_memory=True))
        requests.append(r)
    warm = [_warm(r, a.warmup, 0.2) for r in requests]
    n = max(a.iters, int(np.ceil(a.min_time * 1e3 / max(warm))))
    medians: list[list[float]] = [[], []]
    for rep in range(a.repeats):
        for k in ((0, 1) if rep % 2 == 0 else (1, 0)):  # neither side always runs first (turbo, caches)
            r = requests[k]
            r.infer()
            ts = []
            for _ in range(n):
                t0 = time.perf_counter()
                r.infer()
                ts.append((time.perf_counter() - t0) * 1e3)
            medians[k].append(statistics.median(ts))
    return tuple({"min_median_ms": round(min(m), 4), "median_median_ms": round(statistics.median(m), 4),
                  "repeat_medians_ms": [round(t, 4) for t in m], "calls_per_repeat": n} for m in medians)


def compare(q_side: dict, plain: dict, images: list, a) -> dict:
    """Each pair at each batch size: qdeploy's IR (compiled with its deploy line's properties, less the compile cache, so
    that both sides compile fresh) vs the plain script's model."""
    pairs = {"int8": ("int8", "int8", "f32", "f32"), "int8_bf16": ("int8_bf16", "int8", "bf16", None),
             "fp32": ("fp32", "fp32", "f32", "f32")}
    out = {}
    for pair, (qkey, pkey, qhint, phint) in pairs.items():
        q = q_side.get(qkey)
        # a degraded variant (its agreement with FP32 under the floor: random weights' near-tied logits) still ran
        if q is None or q["status"] in ("failed", "skipped") or not q["ir"]:
            out[pair] = {"skipped": f"qdeploy variant {qkey}: " + ("not in the run" if q is None else
                                                                    str(q.get("reason") or "no IR in --out"))}
            continue
        qc, q_got = compile_on_cpu(q["ir"], a.threads, qhint)
        pc, p_got = compile_on_cpu(plain[pkey], a.threads, phint)
        row = {"qdeploy_hint": q_got, "plain_hint": p_got, "plain_hint_asked": phint or "default"}
        for bs in a.batch:
            x = np.ascontiguousarray(np.concatenate([images[i % len(images)] for i in range(bs)]), dtype=np.float32)
            qt, pt = time_pair(qc, pc, x, a)
            row[str(bs)] = {"qdeploy_ms": qt, "plain_ms": pt, "ratio": round(qt["min_median_ms"] / pt["min_median_ms"], 4),
                            "ratio_of_median_medians": round(qt["median_median_ms"] / pt["median_median_ms"], 4),
                            "within_5pct": qt["min_median_ms"] <= (1 + WITHIN) * pt["min_median_ms"],
                            "qdeploy_reported_p50_ms": q["p50_ms"].get(str(bs))}
        out[pair] = row
        del qc, pc
    return out


def measure(name: str, a, work: Path, calib: Path, evals: Path, bf16: bool) -> dict:
    """One model: the qdeploy run, the plain script, the timed pairs; a failure ends this model's row only."""
    import torch

    from qdeploy import api

    t0 = time.perf_counter()
    torch.manual_seed(0)  # qdeploy's weights: random draws from torch's generator
    row = {"model": name, "source": MODELS[name][0], "input_size": a.size, "num_classes": a.num_classes,
           "transformer": MODELS[name][1]}
    try:
        cfg = qdeploy_config(name, a, calib, evals, bf16)
        out = work / f"run-{name}"
        t = time.perf_counter()
        results = api.run(cfg, out, cache_dir=work / "cache")
        row["qdeploy_run_s"] = round(time.perf_counter() - t, 1)
        q_side = row["qdeploy"] = qdeploy_side(results, out)
        fp32 = q_side.get("fp32") or {}
        row["fp32_readback_precision"] = fp32.get("precision_hint")
        row["fp32_readback_f32"] = fp32.get("precision_hint") == "f32"
        images = calibration_arrays(calib, cfg)
        t = time.perf_counter()
        plain = plain_models(name, a, exported_onnx(work / "cache", results), images)
        row["plain"] = {"quantize_s": plain["quantize_s"], "route": plain["route"],
                        "convert_and_quantize_s": round(time.perf_counter() - t, 1)}
        row["pairs"] = compare(q_side, plain, images, a)
        ok = [v["within_5pct"] for p in ("int8", "int8_bf16") for bs, v in row["pairs"].get(p, {}).items()
              if isinstance(v, dict) and "within_5pct" in v]
        row["int8_within_5pct"] = all(ok) if ok else None
    except Exception as ex:  # noqa: BLE001 - the row says why; the other models still run
        row["error"] = f"{type(ex).__name__}: {' '.join(str(ex).split())[:500]}"
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def environment(threads: int) -> dict:
    import openvino as ov

    import qdeploy
    from qdeploy.engines.openvino_engine import cpu_capabilities, core

    def version(dist: str):
        try:
            from importlib.metadata import version as v
            return v(dist)
        except Exception:  # noqa: BLE001
            return None

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    fields = dict(ln.split(":", 1) for ln in lscpu.splitlines() if ":" in ln)
    return {"cpu": fields.get("Model name", platform.processor()).strip(), "cpus": os.cpu_count(),
            "flags": sorted(fields.get("Flags", "").split()), "threads": threads,
            "openvino_device": core().get_property("CPU", "FULL_DEVICE_NAME"),
            "optimization_capabilities": cpu_capabilities(), "python": platform.python_version(),
            "versions": {"qdeploy": qdeploy.__version__, **{d: version(d) for d in (
                "openvino", "nncf", "torch", "torchvision", "timm", "onnx", "onnxruntime", "numpy")}},
            "openvino_build": ov.__version__}


def merge(parts: list[Path], dest: Path) -> None:
    """Rows of several calls (one JSON each) in one file: a later part's row of a model replaces an earlier one's."""
    docs = [json.loads(p.read_text()) for p in parts]
    rows = {}
    for d in docs:
        rows.update({r["model"]: r for r in d["rows"]})
    order = {m: i for i, m in enumerate(MODELS)}
    doc = {**docs[-1], "parts": [{"file": p.name, "command": d.get("command"), "wall_s": d.get("wall_s")}
                                 for p, d in zip(parts, docs)],
           "rows": sorted(rows.values(), key=lambda r: order.get(r["model"], 99))}
    doc["summary"] = summary(doc["rows"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1) + "\n")


def summary(rows: list[dict]) -> dict:
    """Per model × pair × batch: qdeploy ms, plain ms, ratio; the two goals' verdicts."""
    table = []
    for r in rows:
        for pair, v in (r.get("pairs") or {}).items():
            for bs, t in v.items():
                if isinstance(t, dict) and "ratio" in t:
                    table.append({"model": r["model"], "pair": pair, "batch": int(bs),
                                  "qdeploy_ms": t["qdeploy_ms"]["min_median_ms"], "plain_ms": t["plain_ms"]["min_median_ms"],
                                  "ratio": t["ratio"], "within_5pct": t["within_5pct"]})
    int8 = [t["within_5pct"] for t in table if t["pair"] != "fp32"]
    return {"table": table, "int8_within_5pct": all(int8) if int8 else None,
            "fp32_readback_f32": all(r.get("fp32_readback_f32") for r in rows) if rows else None,
            "errors": {r["model"]: r["error"] for r in rows if r.get("error")}}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=sorted(MODELS))
    ap.add_argument("--images", type=Path, help="a folder of images (any depth): calibration and eval images")
    ap.add_argument("--count", type=int, default=64, help="calibration images (default 64)")
    ap.add_argument("--eval", type=int, default=16, help="eval images after them (default 16)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--num-classes", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20, help="timed calls per repeat (default 20)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per side, alternating (default 5)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds: the pair timer's shortest repeat (default 0.3)")
    ap.add_argument("--plain-route", choices=["onnx", "pytorch"], default="onnx")
    ap.add_argument("--budget", type=float, default=0, help="seconds: start no model after this (0: no limit)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ov-ir-xeon"), help="qdeploy's --out folders and cache")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--merge", type=Path, nargs="+", help="merge these parts' rows into --json and exit")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.merge:
        merge(a.merge, a.json)
        return 0
    if a.images is None:
        raise SystemExit("--images DIR is needed (calibration and eval images)")
    from qdeploy.engines.openvino_engine import precision_problem

    t0 = time.perf_counter()
    a.work.mkdir(parents=True, exist_ok=True)
    calib, evals = stage_images(a.images, a.work, a.count, a.eval)
    bf16 = precision_problem("bf16") is None
    doc = {"schema": "qdeploy.openvino_ir_xeon/1", "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
           "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "environment": environment(a.threads),
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("merge",)},
           "bf16_variant": bf16 or f"not run: {precision_problem('bf16')}", "rows": []}
    for name in a.models:
        if a.budget and time.perf_counter() - t0 > a.budget:
            doc["rows"].append({"model": name, "error": f"not run: past --budget {a.budget:g} s"})
            continue
        print(f"## {name}", flush=True)
        row = measure(name, a, a.work, calib, evals, bf16)
        doc["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("model", "wall_s", "fp32_readback_precision", "int8_within_5pct",
                                                   "error")}), flush=True)
        doc["wall_s"] = round(time.perf_counter() - t0, 1)
        doc["summary"] = summary(doc["rows"])
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")  # after each model: a stopped call keeps what it measured
    for t in doc.get("summary", {}).get("table", []):
        print(f"{t['model']:14s} {t['pair']:10s} b{t['batch']:<3d} qdeploy {t['qdeploy_ms']:9.3f} ms  plain "
              f"{t['plain_ms']:9.3f} ms  ratio {t['ratio']:.3f}{'' if t['within_5pct'] else '  (> 5 %)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
