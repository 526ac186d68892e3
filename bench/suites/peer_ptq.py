"""qdeploy's PTQ next to NNCF's and ModelOpt's ONNX PTQ on the same exported FP32 ONNX, calibration and evaluation images.

    pip install nncf            # a bench dependency, not a runtime one (without it the NNCF rows say "not run")
    python bench/suites/peer_ptq.py efficientnet_b0_48 mobilenet_v3_large_64 --out runs/peer_ptq [--eval-count 10000]
        [--nncf default[,global-minmax,no-bias-correction]] [--methods mean-minmax,max,entropy,percentile,mse]
        [--placements onnxruntime,onnxruntime-split,tensorrt,tensorrt-modelopt] [--accuracy-control]
        [--modelopt-onnx fp32[,fp16]] [--modelopt-onnx-method entropy|max]
    python bench/suites/peer_ptq.py deit swin convnext mobilevit --out runs/peer --nncf "" --methods entropy \
        --placements tensorrt-modelopt,tensorrt --modelopt-onnx fp32,fp16
    python bench/suites/peer_ptq.py keras-resnet20 keras-efficientnet_b0_64 --out runs/peer-keras --methods entropy,mse \
        --placements tensorrt,onnxruntime --modelopt-onnx ""      # issue #24: Keras models (bench/train/keras_train.py)

Models: the ../shared/models/cifar10-dev checkpoints (torchvision architectures, 10 classes), or the
../shared/models/cifar10-modern ones by bench/suites/transformer_int8.py's names (deit, swin, convnext, mobilevit: timm
architectures, kwargs, input sizes and ImageNet normalisation from that folder's README, through
transformer_int8.config). Calibration: 512 seeded cifar10/train images; evaluation: cifar10/test (all 10,000 by
default). Each row: top-1, agreement with FP32, wall time and peak RSS of the quantization call, ONNX Runtime CPU
latency (batch 1, 2 threads: median of 5 sessions' medians of 200 runs; not for TensorRT-placement artifacts, which
run as an exact Q/DQ simulation), and for every Q/DQ output qdeploy's structure report and static lint
(``qdeploy.api.lint(path, confirm=False)``): compute ops with INT8 input and INT8 weights of all compute ops, the
verdict, and the findings counted per rule id and severity. NNCF variants (its ONNX backend):

  default             ``nncf.quantize`` defaults (per-tensor activations: mean over samples of the per-sample min/max)
  global-minmax       activations' range = the global min/max over all samples (RangeEstimatorParametersSet.MINMAX)
  no-bias-correction  defaults without bias correction
  accuracy-control    ``nncf.quantize_with_accuracy_control`` (max drop 1 point on 1,000 held-out train images)

ModelOpt ONNX PTQ rows (``modelopt.onnx.quantization.quantize``, quantize_mode int8, its default calibration method,
entropy, on the same 512 calibration images as one N x 3 x H x W float32 array, normalised as qdeploy feeds them),
one per ``--modelopt-onnx`` value of ``high_precision_dtype``: fp32 keeps the non-quantized part FP32 (as qdeploy's
TensorRT-placement artifacts), fp16 is ModelOpt's default (the float part cast to FP16, I/O kept FP32). It runs
with the plain CPU onnxruntime build (no [onnx] extra needed here) given ``calibration_eps=["cpu"]``; workarounds,
all in bench/suites/modelopt_onnx_peer.py, the worker it runs in: (1) a child process, because ModelOpt patches
ONNX Runtime's quantization modules in place (QDQ registry, calibrators), which would leak into qdeploy's ``onnx``
quantizer run later in this process; (2) ModelOpt is given a copy of the FP32 ONNX, because it rewrites its input
file in place (``onnx.shape_inference.infer_shapes_path`` in ``modelopt.onnx.trt_utils.load_onnx_model``), which
qdeploy's export folder refuses as a foreign change. Its output is evaluated in ONNX Runtime CPU with exact Q/DQ
semantics (``qdeploy.utils.ort_options.exact_qdq``), like qdeploy's TensorRT-placement artifacts. Its peak RSS is the
child process's own (Python + ModelOpt + the calibration array), not this process's. A failure becomes the row's
one-line reason (exception, package); the traceback is in DIR/<model>/modelopt-onnx-<dtype>/modelopt.log.

qdeploy rows: each range method × placement (onnxruntime; onnxruntime-split = split_activations: true; tensorrt via
the onnx quantizer; tensorrt-modelopt via ModelOpt), quantized by
``qdeploy.api.quantize``; TensorRT-placement artifacts are evaluated with exact Q/DQ semantics.
Prints Markdown and writes DIR/<model>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_int8 import MODELS as MODERN  # noqa: E402
from transformer_int8 import config as modern_config  # noqa: E402


# issue #24: the Keras models of bench/train/keras_train.py (not in the repository: it recreates them into ../keras-models,
# or QDEPLOY_KERAS_MODELS names the folder), converted by qdeploy's Keras source (tf2onnx) like any Keras user's
KERAS_DIR = Path(os.environ.get("QDEPLOY_KERAS_MODELS", REPO.parent / "keras-models"))
KERAS = {"keras-resnet20": ("resnet20_cifar.keras", 32, "keras-caffe"),
         "keras-efficientnet_b0_64": ("efficientnet_b0_64.keras", 64, "keras-none")}


def config(name: str, eval_count: int) -> dict:
    if name in KERAS:
        file, size, preset = KERAS[name]
        if not (KERAS_DIR / file).is_file():
            sys.exit(f"{KERAS_DIR / file} not present: bench/train/keras_train.py trains it (see docs/keras.md)")
        return {"model": {"source": str(KERAS_DIR / file), "preprocess": {"input_size": [size, size], "preset": preset}},
                "data": {"eval": {"root": str(SHARED / "data" / "cifar10" / "test"), "count": eval_count, "seed": 0,
                                  "batch_size": 500},
                         "calibration": {"root": str(SHARED / "data" / "cifar10" / "train"), "count": 512, "seed": 0,
                                         "batch_size": 64}},
                "bench": {"enabled": False}}
    if name in MODERN:  # ../shared/models/cifar10-modern (timm): bench/suites/transformer_int8.py's table and config
        cfg = modern_config(name, eval_count, 512, "max")
        cfg.pop("variants")
        cfg["data"]["eval"]["batch_size"] = 500
        return cfg
    arch, size = name.rsplit("_", 1)
    return {"model": {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10},
                      "weights": str(SHARED / "models" / "cifar10-dev" / f"{name}.pt"),
                      "preprocess": {"input_size": [int(size)] * 2, "resize": [int(size)] * 2, **NORM}},
            "data": {"eval": {"root": str(SHARED / "data" / "cifar10" / "test"), "count": eval_count, "seed": 0, "batch_size": 500},
                     "calibration": {"root": str(SHARED / "data" / "cifar10" / "train"), "count": 512, "seed": 0, "batch_size": 64}},
            "bench": {"enabled": False}}


def arrays(spec, pre, task):
    from qdeploy.data import make_batches, normalize

    xs, ys = [], []
    for x, y in make_batches(spec, pre, task):
        xs.append(normalize(x, pre))
        ys.append(y)
    return np.ascontiguousarray(np.concatenate(xs)), np.concatenate(ys)


def session(path, exact: bool = False, threads: int = 2):
    import onnxruntime as ort

    from qdeploy.utils.ort_options import exact_qdq

    opts = ort.SessionOptions()
    opts.log_severity_level, opts.intra_op_num_threads = 3, threads
    if exact:
        exact_qdq(opts)
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def predict(path, X, exact=False):
    s = session(path, exact)
    name = s.get_inputs()[0].name
    return np.concatenate([s.run(None, {name: X[i:i + 500]})[0].argmax(1) for i in range(0, len(X), 500)])


def latency_ms(path, x1, exact=False, repeats=5):
    """Median over ``repeats`` fresh sessions of each session's median of 200 runs (after 20 warm-up runs)."""
    medians = []
    for _ in range(repeats):
        s = session(path, exact)
        name = s.get_inputs()[0].name
        for _ in range(20):
            s.run(None, {name: x1})
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            s.run(None, {name: x1})
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return 1000 * statistics.median(medians)


def lint_summary(path) -> dict:
    """qdeploy's structure report and static lint of a Q/DQ ONNX: compute ops with INT8 input and weights (of all
    compute ops), the verdict, and the findings counted per "rule severity". A lint that fails says so in one line."""
    from qdeploy import api

    try:
        rep = api.lint(path, confirm=False)  # static analysis (TensorRT is not installed here)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"lint_error": f"lint failed: {type(e).__name__}: {msg}"[:200]}
    st = rep["structure"]
    return {"compute_ops": st["compute_ops"], "compute_ops_int8": st["compute_ops_int8"],
            "int8_ops": f"{st['compute_ops_int8']}/{st['compute_ops']}",
            "compute_ops_float": st.get("compute_ops_float", []), "compute_ops_partly": st.get("compute_ops_partly_quantized", []),
            "residual_add_forms": st.get("residual_add_forms", {}), "lint_verdict": rep["verdict"],
            "lint_findings": dict(Counter(f"{f['rule']} {f['severity']}" for f in rep["findings"]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default="runs/peer_ptq")
    ap.add_argument("--eval-count", type=int, default=10000)
    ap.add_argument("--nncf", default="default")
    ap.add_argument("--methods", default="mean-minmax,max,entropy,percentile,mse")
    ap.add_argument("--placements", default="onnxruntime,tensorrt,tensorrt-modelopt")
    ap.add_argument("--accuracy-control", action="store_true")
    ap.add_argument("--ort-static", action=argparse.BooleanOptionalAction, default=True,
                    help="a row for ONNX Runtime's quantize_static (issue #24's peer)")
    ap.add_argument("--modelopt-onnx", default="fp32",
                    help="ModelOpt ONNX PTQ rows, comma-separated high_precision_dtype values (fp32: the float part "
                         "stays FP32; fp16: ModelOpt's default); empty: none")
    ap.add_argument("--modelopt-onnx-method", default=None,
                    help="calibration_method for ModelOpt ONNX PTQ (default: ModelOpt's own, entropy)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    import onnx

    from qdeploy import api
    from qdeploy.utils.memory import MemoryProbe

    nncf_variants = [v for v in args.nncf.split(",") if v]
    nncf_missing = None
    if nncf_variants or args.accuracy_control:
        try:
            import nncf
            from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters
            from nncf.quantization.range_estimator import RangeEstimatorParametersSet
        except ImportError as e:  # its rows say so; the other peers still run
            nncf_missing = f"not run: NNCF is not installed (pip install nncf; {type(e).__name__}: {e})"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        cfg = config(name, args.eval_count)
        rc = api.parse_config(cfg)
        pre, task = rc.model.preprocess, rc.model.task
        fp32 = Path(api.export(cfg, out / name / "export", cache_dir=out / "cache")["copied_to"])
        X_cal, _ = arrays(rc.data.calibration, pre, task)
        X, Y = arrays(rc.data.eval, pre, task)
        ref = predict(fp32, X)
        rows = [{"tool": "FP32 (ONNX Runtime)", "top1": float((ref == Y).mean()), "agreement": 1.0,
                 "latency_ms": latency_ms(fp32, X[:1])}]
        print(f"{name}: FP32 top-1 {100 * rows[0]['top1']:.2f} on {len(Y)} images", flush=True)

        def record(tool, path, seconds, mem, exact=False):
            try:
                pred = predict(path, X, exact)
            except Exception as e:  # e.g. a kernel this ONNX Runtime build lacks
                msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
                rows.append({"tool": tool, "status": "failed", "time_s": round(seconds, 2),
                             "reason": f"evaluation in ONNX Runtime CPU: {type(e).__name__}: {msg}"[:300]})
                print(f"  {tool}: {rows[-1]['reason']}", flush=True)
                return
            rows.append({"tool": tool, "top1": float((pred == Y).mean()), "agreement": float((pred == ref).mean()),
                         "time_s": round(seconds, 2), "rss_peak_mb": mem["rss_peak"], "rss_delta_mb": mem["rss_delta"],
                         # a TensorRT-placement artifact is run with exact Q/DQ semantics, a simulation: its CPU time means nothing
                         "latency_ms": None if exact else latency_ms(path, X[:1]), **lint_summary(path)})
            r = rows[-1]
            print(f"  {tool}: top-1 {100 * r['top1']:.2f} (agreement {100 * r['agreement']:.1f}), {r['time_s']} s, "
                  f"+{r['rss_delta_mb']:.0f} MB, {r['latency_ms']} ms, INT8 ops {r.get('int8_ops', '–')}, "
                  f"lint {r.get('lint_verdict', r.get('lint_error'))} {r.get('lint_findings', '')}", flush=True)

        for hp in [v for v in args.modelopt_onnx.split(",") if v]:
            # ModelOpt's ONNX PTQ in a child process (it patches ONNX Runtime's quantization modules in place)
            calib_npy = out / name / "calibration.npy"
            if not calib_npy.is_file():
                np.save(calib_npy, X_cal)
            work = out / name / f"modelopt-onnx-{hp}"
            if work.exists():
                shutil.rmtree(work)
            work.mkdir(parents=True)
            src = work / "fp32.onnx"  # a copy: ModelOpt rewrites its input file in place (onnx.shape_inference.infer_shapes_path)
            shutil.copyfile(fp32, src)
            path = work / "model.quant.onnx"
            tool = f"ModelOpt ONNX PTQ ({args.modelopt_onnx_method or 'entropy'}, {hp})"
            cmd = [sys.executable, str(REPO / "bench" / "suites" / "modelopt_onnx_peer.py"), str(src), str(calib_npy), str(path),
                   "--high-precision", hp] + (["--method", args.modelopt_onnx_method] if args.modelopt_onnx_method else [])
            log = work / "modelopt.log"
            with open(log, "w") as err:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            res = json.loads(lines[-1]) if lines else {"error": f"worker exited {proc.returncode} without a result (see {log})"}
            if "error" in res:
                rows.append({"tool": tool, "status": "failed", "reason": res["error"]})
                print(f"  {tool}: failed: {res['error']} (traceback in {log})", flush=True)
                continue
            record(tool, path, res["seconds"], {"rss_peak": res["rss_peak_mb"], "rss_delta": res["rss_delta_mb"]}, exact=True)

        if args.ort_static:
            # ONNX Runtime's own post-training quantization, as its documentation shows it: quant_pre_process, then
            # quantize_static (QDQ format, MinMax calibration, int8 activations and per-channel int8 weights)
            from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
            from onnxruntime.quantization.shape_inference import quant_pre_process

            class Reader(CalibrationDataReader):
                def __init__(self):
                    self.items = iter([{onnx.load(str(fp32)).graph.input[0].name: X_cal[i:i + 64]}
                                       for i in range(0, len(X_cal), 64)])

                def get_next(self):
                    return next(self.items, None)

            work = out / name / "ort-quantize-static"
            work.mkdir(parents=True, exist_ok=True)
            pre_path, path = work / "fp32.pre.onnx", work / "model.int8.onnx"
            with MemoryProbe() as m:
                t0 = time.perf_counter()
                quant_pre_process(str(fp32), str(pre_path))
                quantize_static(str(pre_path), str(path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
                seconds = time.perf_counter() - t0
            record("ONNX Runtime quantize_static (QDQ, MinMax, per-channel)", path, seconds, m.result())

        if nncf_missing:
            rows += [{"tool": f"NNCF {v}", "status": "not run", "reason": nncf_missing}
                     for v in nncf_variants + (["accuracy-control"] if args.accuracy_control else [])]
            nncf_variants, accuracy_control = [], False
        else:
            accuracy_control = args.accuracy_control
        calib = nncf.Dataset([X_cal[i:i + 1] for i in range(len(X_cal))], lambda x: {"input": x}) if nncf_variants else None
        variants = {} if not nncf_variants else {
            "default": {},
            "global-minmax": {"advanced_parameters": AdvancedQuantizationParameters(
                activations_range_estimator_params=RangeEstimatorParametersSet.MINMAX)},
            "no-bias-correction": {"advanced_parameters": AdvancedQuantizationParameters(disable_bias_correction=True)},
        }
        for v in nncf_variants:
            model = onnx.load(str(fp32))
            with MemoryProbe() as m:
                t0 = time.perf_counter()
                q = nncf.quantize(model, calib, subset_size=len(X_cal), **variants[v])
                seconds = time.perf_counter() - t0
            path = out / name / f"nncf-{v}.onnx"
            onnx.save(q, str(path))
            record(f"NNCF {v}", path, seconds, m.result())
        if accuracy_control:
            # held-out validation images for NNCF's search: train images the calibration did not use
            val_spec = rc.data.calibration.model_copy(update={"count": 1000, "seed": 1})
            X_val, Y_val = arrays(val_spec, pre, task)

            def validate(model, items):
                import onnxruntime as ort

                s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                return float(np.mean([s.run(None, {"input": x})[0].argmax(1)[0] == y for x, y in items]))
            val = nncf.Dataset([(X_val[i:i + 1], Y_val[i]) for i in range(len(X_val))], lambda item: {"input": item[0]})
            model = onnx.load(str(fp32))
            with MemoryProbe() as m:
                t0 = time.perf_counter()
                q = nncf.quantize_with_accuracy_control(model, calib, val, validation_fn=lambda mdl, items: validate(mdl, items),
                                                        max_drop=0.01, subset_size=len(X_cal))
                seconds = time.perf_counter() - t0
            path = out / name / "nncf-accuracy-control.onnx"
            onnx.save(q, str(path))
            record("NNCF accuracy-control", path, seconds, m.result())
        for placement in [p for p in args.placements.split(",") if p]:
            for method in [m for m in args.methods.split(",") if m]:
                variant = {"engine": "onnxruntime", "precision": "int8", "method": method,
                           "placement": "tensorrt" if placement.startswith("tensorrt") else "onnxruntime",
                           "threads": 2, "name": f"{placement}-{method}"}
                if placement == "onnxruntime-split":  # SiLU/hardswish quantized piecewise, for ONNX Runtime's int8 kernels
                    variant["split_activations"] = True
                if placement.startswith("tensorrt"):  # tensorrt = the ONNX route, tensorrt-modelopt = ModelOpt
                    variant["quantizer"] = "modelopt" if placement == "tensorrt-modelopt" else "onnx"
                run_cfg = dict(cfg, variants=[variant])
                with MemoryProbe() as m:
                    t0 = time.perf_counter()
                    summary = api.quantize(run_cfg, out / name / f"qdeploy-{placement}-{method}",
                                           cache_dir=out / "cache" / f"{placement}-{method}")
                    seconds = time.perf_counter() - t0
                info = summary["variants"][variant["name"]]
                if info["status"] != "ok":
                    rows.append({"tool": f"qdeploy {placement} {method}", "status": info["status"], "reason": info["reason"]})
                    continue
                record(f"qdeploy {placement} {method}", Path(summary["out"]) / info["artifact"], seconds, m.result(),
                       exact=placement.startswith("tensorrt"))
        (out / f"{name}.json").write_text(json.dumps(rows, indent=2))
        print(f"\n{name} ({len(Y)} cifar10/test images, 512 calibration images)\n")
        print("| tool | top-1 % | Δ vs FP32 | agreement % | quantize s | peak RSS MB (+Δ) | ORT CPU bs1 ms "
              "| compute ops INT8 | qdeploy lint |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "top1" not in r:
                print(f"| {r['tool']} | {r.get('status')}: {r.get('reason', '')[:160]} | | | | | | | |")
                continue
            d = 100 * (r["top1"] - rows[0]["top1"])
            t = f"{r['time_s']:.1f}" if "time_s" in r else "–"
            mem = f"{r['rss_peak_mb']:.0f} (+{r['rss_delta_mb']:.0f})" if "rss_peak_mb" in r else "–"
            lat = "simulated" if r.get("latency_ms") is None else f"{r['latency_ms']:.3f}"
            ops = "–"
            if r.get("compute_ops"):
                ops = f"{r['compute_ops_int8']}/{r['compute_ops']} ({100 * r['compute_ops_int8'] / r['compute_ops']:.0f} %)"
            if "lint_verdict" in r:
                lint = f"{r['lint_verdict']}: " + (", ".join(f"{k} ×{v}" for k, v in r["lint_findings"].items()) or "no findings")
            else:
                lint = r.get("lint_error", "–")
            print(f"| {r['tool']} | {100 * r['top1']:.2f} | {d:+.2f} | {100 * r['agreement']:.1f} | {t} | {mem} | {lat} "
                  f"| {ops} | {lint} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
