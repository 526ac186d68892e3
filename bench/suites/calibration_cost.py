"""Calibration cost: qdeploy's range methods vs ONNX Runtime's quantize_static calibrators.

Same FP32 ONNX (exported by qdeploy), same calibration images (already decoded and normalised, held
in memory as one float32 array, so image decoding is not timed for anyone), same machine. Each
measurement runs in a fresh subprocess so its peak RSS (VmHWM) is its own; "Δ peak" is the peak minus
the RSS after the images were loaded.

    python bench/suites/calibration_cost.py --config examples/cifar10_resnet20.yaml [--count 512] [--repeats 3] [--out results.json]
    python bench/suites/calibration_cost.py --model efficientnet_b0_48 --repeats 3      # ../shared/models/cifar10-dev
    python bench/suites/calibration_cost.py --model mobilenet_v3_large_64 --repeats 3

``--model`` runs the squeeze-excitation models of ``../shared/models/cifar10-dev`` (the model class whose
activation histograms grow to millions of bins); calibration images: ``--count`` seeded images of
``../shared/data/cifar10/train``. ``--repeats`` runs every measurement that many times (fresh processes)
and reports the median time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CIFAR10_DEV = {  # file stem -> (torchvision architecture, input size)
    "efficientnet_b0_48": ("efficientnet_b0", 48),
    "mobilenet_v3_large_64": ("mobilenet_v3_large", 64),
}


def cifar10_dev_config(name: str, count: int) -> dict:
    """Config of a ../shared/models/cifar10-dev model (see its README), calibrating on cifar10/train."""
    arch, size = CIFAR10_DEV[name]
    shared = REPO.parent / "shared"
    return {
        "model": {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10},
                  "weights": str(shared / "models" / "cifar10-dev" / f"{name}.pt"),
                  "preprocess": {"input_size": [size, size], "resize": [size, size],
                                 "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
        "data": {"eval": {"root": str(shared / "data" / "cifar10" / "test")},
                 "calibration": {"root": str(shared / "data" / "cifar10" / "train"), "count": count, "seed": 0}},
        "variants": [{"engine": "onnxruntime"}],
    }


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(kind: str, onnx_path: str, data_path: str, batch: int) -> dict:
    data = np.load(data_path)
    # imports are not timed
    if kind.startswith("ort-"):
        from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static
    else:
        import onnx
        import torch  # noqa: F401  (qdeploy's process has torch loaded anyway)

        from qdeploy.quantize.collect import collect_activation_stats
        from qdeploy.quantize.qdq import tensors_to_calibrate
        from qdeploy.quantize.ranges import compute_ranges
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_mb()
    t0 = time.perf_counter()
    if kind.startswith("ort-"):

        method = {"ort-minmax": CalibrationMethod.MinMax, "ort-entropy": CalibrationMethod.Entropy,
                  "ort-percentile": CalibrationMethod.Percentile}[kind]

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.it = iter(range(0, len(data), batch))

            def get_next(self):
                i = next(self.it, None)
                return None if i is None else {"input": data[i:i + batch]}

        with tempfile.TemporaryDirectory() as d:
            quantize_static(onnx_path, f"{d}/q.onnx", Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=method)
        extra = {}
    elif kind == "qdeploy-max":
        collect_activation_stats(Path(onnx_path), (data[i:i + batch] for i in range(0, len(data), batch)), len(data), histograms=False)
        extra = {}
    elif kind == "qdeploy-mean-minmax":  # the same min/max pass + per-image extremes + depthwise inputs' per-channel extremes
        from qdeploy.quantize.equalize import depthwise_inputs

        stats = collect_activation_stats(Path(onnx_path), (data[i:i + batch] for i in range(0, len(data), batch)), len(data),
                                         histograms=False, channel_names=depthwise_inputs(onnx.load(onnx_path)))
        compute_ranges(stats, "mean-minmax")
        extra = {}
    else:
        target = kind.rpartition("-")[2]  # qdeploy-hist-tensorrt | qdeploy-hist-onnxruntime
        names = tensors_to_calibrate(onnx.load(onnx_path), target)
        stats = collect_activation_stats(Path(onnx_path), (data[i:i + batch] for i in range(0, len(data), batch)), len(data))
        t_collect = time.perf_counter() - t0
        extra = {"collect_s": t_collect, "tensors": len(names) if names else len(stats.tensors)}
        for method in ("entropy", "percentile", "mse"):
            t1 = time.perf_counter()
            compute_ranges(stats, method, names=set(names) if names else None)
            extra[f"{method}_compute_s"] = time.perf_counter() - t1
    return {"kind": kind, "time_s": time.perf_counter() - t0, "peak_mb": _hwm_mb(), "delta_peak_mb": _hwm_mb() - base, **extra}


def _median_row(runs: list) -> dict:
    """One row per measurement: the median of every timing over the repeats (peak memory: the median too)."""
    if "error" in runs[0]:
        return runs[0]
    row = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            row[key] = float(np.median([r[key] for r in runs]))
    row["runs"] = len(runs)
    row["time_s_all"] = [r["time_s"] for r in runs]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="examples/cifar10_resnet20.yaml")
    ap.add_argument("--model", choices=sorted(CIFAR10_DEV), help="a cifar10-dev model from ../shared instead of --config")
    ap.add_argument("--repeats", type=int, default=1, help="runs per measurement; the median time is reported")
    ap.add_argument("--kinds", default=None, help="comma-separated subset of the measurements")
    ap.add_argument("--count", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.worker[2], args.batch)))
        return

    from qdeploy import api
    from qdeploy.data import make_batches, normalize
    from qdeploy.artifacts import ArtifactKind, ArtifactRequest, Builder

    cfg = api.parse_config(cifar10_dev_config(args.model, args.count)) if args.model else api.load_config(args.config)
    calib_spec = cfg.data.calibration.model_copy(update={"count": args.count})
    batches = make_batches(calib_spec, cfg.model.preprocess, cfg.model.task)
    data = np.concatenate([normalize(x, cfg.model.preprocess) for x, _ in batches])
    rows = []
    kinds = args.kinds.split(",") if args.kinds else ["ort-minmax", "ort-entropy", "ort-percentile", "qdeploy-max",
                                                       "qdeploy-mean-minmax", "qdeploy-hist-tensorrt", "qdeploy-hist-onnxruntime"]
    onnx_path = Builder(cfg).build(ArtifactRequest(ArtifactKind.ONNX_FP32)).path
    with tempfile.TemporaryDirectory() as d:
        np.save(f"{d}/calib.npy", data)
        runs = {kind: [] for kind in kinds}
        for _ in range(args.repeats):  # round robin, so that a drift in machine load hits every tool alike
            for kind in kinds:
                if runs[kind] and "error" in runs[kind][0]:
                    continue
                p = subprocess.run([sys.executable, __file__, "--batch", str(args.batch), "--worker", kind, str(onnx_path), f"{d}/calib.npy"],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    runs[kind] = [{"kind": kind, "error": (p.stderr.strip().splitlines() or ["?"])[-1]}]
                    continue
                runs[kind].append(json.loads(p.stdout.strip().splitlines()[-1]))
        rows = [_median_row(runs[kind]) for kind in kinds]
    print(f"{cfg.model.source}: {len(data)} calibration images, batch {args.batch}, median of {args.repeats} run(s)")
    for r in rows:
        if "error" in r:
            print(f"  {r['kind']:<15} failed: {r['error']}")
            continue
        print(f"  {r['kind']:<15} {r['time_s']:7.2f} s   peak RSS {r['peak_mb']:7.0f} MB (Δ {r['delta_peak_mb']:6.0f} MB)")
        if r["kind"].startswith("qdeploy-hist"):
            c = r["collect_s"]
            print(f"     histograms of all activations collected in {c:.2f} s; ranges searched for {r['tensors']} tensors")
            for m in ("entropy", "percentile", "mse"):
                print(f"     {m:<11} collect {c:5.2f} s + compute {r[m + '_compute_s']:5.2f} s = {c + r[m + '_compute_s']:5.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.model or args.config, "count": len(data), "repeats": args.repeats,
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
