"""The plain ceiling harness (realsize_ceiling.py) over real-size PyTorch models and rows, without qdeploy at all.

    python bench/suites/realsize_ceiling_sweep.py --images DIR --models resnet50 deit_small --rows 1:16 16:16 \\
        --json runs/realsize/ceiling_sweep.json [--weights DIR] [--calib 64] [--evals 64]

Per model (bench/train/train_realsize.py's table: torchvision/timm sources with 10 classes; --weights DIR: its
trained <name>.pt, else seeded random initialisation, which the row says) the module is exported here with
``torch.onnx.export`` (opset 17, dynamic batch) and the images of DIR (any depth, sorted; the first --calib for
calibration, the next --evals for the outputs) are decoded with PIL: RGB, bilinear resize to 224x224, /255, ImageNet
mean/std. Then measure_ceiling at each row (BATCH:THREADS). Each row: every variant's p50, the fastest
(``ceiling_variant``) and its speed-up over the best FP32 (ONNX Runtime's or OpenVINO's f32), NNCF's default INT8's, and
ONNX Runtime INT8 (S8S8 and U8S8) over ONNX Runtime FP32 in time.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "train"))
from realsize_ceiling import cpu_info, measure_ceiling, to_json, versions  # noqa: E402
from train_realsize import MODELS, build  # noqa: E402

TRANSFORMERS = {"deit_small", "swin_tiny"}
MEAN, STD = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)


def decode(files: list[Path], size: int = 224) -> np.ndarray:
    from PIL import Image

    out = []
    for f in files:
        im = np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR), np.float32) / 255
        out.append(((im - MEAN) / STD).transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(out), dtype=np.float32)


def export(name: str, weights: Path | None, path: Path) -> str:
    import torch

    torch.manual_seed(0)
    model = build(name).eval()
    how = "random init (seed 0)"
    if weights is not None and (weights / f"{name}.pt").exists():
        sd = torch.load(weights / f"{name}.pt", map_location="cpu", weights_only=True)
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()})
        how = f"trained ({weights / (name + '.pt')})"
    torch.onnx.export(model, torch.randn(1, 3, 224, 224), str(path), opset_version=17, dynamo=False,
                      input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "batch"}})
    return how


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rows", nargs="+", default=["1:16", "16:16"], help="BATCH:THREADS")
    ap.add_argument("--weights", type=Path, default=None)
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--evals", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    files = sorted(p for p in a.images.rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if len(files) < a.calib + a.evals:
        raise SystemExit(f"{a.images} has {len(files)} images; --calib {a.calib} + --evals {a.evals} are needed")
    calib, evals = decode(files[:a.calib]), decode(files[a.calib:a.calib + a.evals])
    rows = []
    doc = {"schema": "realsize_ceiling_sweep/1", "command": "python " + " ".join(sys.argv), "cpu": cpu_info(),
           "versions": versions(), "rows": rows}
    with tempfile.TemporaryDirectory(prefix="ceiling-sweep-") as tmp:
        for name in a.models:
            onnx_path = Path(tmp) / f"{name}.onnx"
            how = export(name, a.weights, onnx_path)
            for part in a.rows:
                batch, threads = (int(v) for v in part.split(":"))
                t0 = time.perf_counter()
                m = to_json(measure_ceiling(onnx_path, calib, evals, batch, threads, name in TRANSFORMERS,
                                            Path(tmp) / f"{name}-b{batch}-t{threads}", repeats=a.repeats,
                                            log=lambda s: print(s, file=sys.stderr, flush=True)))
                v = m["variants"]
                p50 = {n: r["p50_ms"] for n, r in v.items() if r["status"] == "ok"}
                best_fp32 = m["best_fp32"]
                ratio = (lambda n: round(best_fp32 / p50[n], 3) if n in p50 and best_fp32 else None)
                ort_over = (lambda n: round(p50[n] / p50["ort-fp32"], 3) if n in p50 and "ort-fp32" in p50 else None)
                row = {"model": name, "weights": how, "input_size": 224, "batch": batch, "threads": threads,
                       "ceiling_variant": m["fastest"], "ceiling_speedup": ratio(m["fastest"]) if m["fastest"] else None,
                       "nncf_default_speedup": ratio("nncf-default"),
                       "speedup_by_variant": {n: ratio(n) for n in p50},
                       "ort_int8_over_fp32_time": {n: ort_over(n) for n in ("ort-int8-s8s8", "ort-int8-u8s8")},
                       "wall_s": round(time.perf_counter() - t0, 1), **m}
                rows.append(row)
                print(f"| {name} | {batch} | {threads} | {row['ceiling_variant']} {row['ceiling_speedup']}x | "
                      f"nncf-default {row['nncf_default_speedup']}x | ORT INT8/FP32 time {row['ort_int8_over_fp32_time']} | "
                      + ", ".join(f"{n} {p:.3f}" for n, p in sorted(p50.items(), key=lambda t: t[1])), flush=True)
                a.json.parent.mkdir(parents=True, exist_ok=True)
                a.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
