"""Issue #24's accuracy goals for the Keras models of bench/train/keras_train.py, on the full CIFAR-10 test set (10,000).

    python bench/suites/keras_goals.py resnet20 [efficientnet_b0] --out runs/keras-goals [--models-dir ../keras-models]

Per model: (1) Keras' own ``model.evaluate`` (TensorFlow backend, in a child process: TensorFlow never shares a
process with PyTorch) on the very images qdeploy decodes (qdeploy's data pipeline → uint8 RGB, the model's
keras.applications preprocessing applied by Keras' own ``preprocess_input``), (2) qdeploy's FP32 top-1 of the
converted ONNX (``qdeploy eval``, ONNX Runtime), and their difference (goal: within 0.05 point). Writes
DIR/keras_goals.json. The optimize goal runs through bench/configs/keras_*_optimize.yaml (see docs/keras.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
# name: (file, input size, qdeploy preset, keras.applications preprocess_input mode or None, Keras output is logits)
MODELS = {
    "resnet20": ("resnet20_cifar.keras", 32, "keras-caffe", "caffe"),
    "efficientnet_b0": ("efficientnet_b0_64.keras", 64, "keras-none", None),
}

CHILD = r'''
import os, sys, json
os.environ.update(TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow", CUDA_VISIBLE_DEVICES="-1")
import numpy as np, keras
x, y = np.load(sys.argv[2]), np.load(sys.argv[3])
mode = sys.argv[4]
x = x.astype("float32")
if mode != "none":
    x = keras.applications.imagenet_utils.preprocess_input(x, mode=mode)
model = keras.models.load_model(sys.argv[1], compile=False)  # its training compile config is not needed
model.compile(metrics=["sparse_categorical_accuracy"], loss="sparse_categorical_crossentropy")  # loss unused
res = model.evaluate(x, y, batch_size=250, verbose=0, return_dict=True)
print(json.dumps({"keras_top1": float(res["sparse_categorical_accuracy"]), "keras": keras.__version__}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", choices=list(MODELS))
    ap.add_argument("--out", default="runs/keras-goals")
    ap.add_argument("--models-dir", default=str(REPO.parent / "keras-models"))
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    from qdeploy import api
    from qdeploy.data import make_batches

    test = SHARED / "data" / "cifar10" / "test"
    if not test.is_dir():
        sys.exit(f"{test} not present: the goals need ../shared/data/cifar10/test")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.models:
        file, size, preset, mode = MODELS[name]
        model = Path(args.models_dir) / file
        if not model.is_file():
            rows[name] = {"status": "not run", "reason": f"{model} not present: bench/train/keras_train.py trains it"}
            print(f"{name}: {rows[name]['reason']}")
            continue
        cfg = {"model": {"source": str(model), "preprocess": {"input_size": [size, size], "preset": preset}},
               "data": {"eval": {"root": str(test), "batch_size": 500}},
               "variants": [{"engine": "onnxruntime"}], "bench": {"enabled": False}}
        rc = api.parse_config(cfg)
        xs, ys = zip(*make_batches(rc.data.eval, rc.model.preprocess, "classification"))
        x = np.concatenate(xs)  # uint8 NCHW, in the preset's channel order
        if rc.model.preprocess.channel_order == "BGR":
            x = x[:, ::-1]  # Keras' preprocess_input flips RGB → BGR itself: give it RGB
        np.save(out / f"{name}-x.npy", np.ascontiguousarray(x.transpose(0, 2, 3, 1)))
        np.save(out / f"{name}-y.npy", np.concatenate(ys))
        proc = subprocess.run([sys.executable, "-c", CHILD, str(model), str(out / f"{name}-x.npy"),
                               str(out / f"{name}-y.npy"), mode or "none"], capture_output=True, text=True,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            rows[name] = {"status": "failed", "reason": (proc.stderr.strip().splitlines() or ["?"])[-1]}
            print(f"{name}: Keras evaluate failed: {rows[name]['reason']}")
            continue
        keras_top1 = json.loads(lines[-1])["keras_top1"]
        results = api.run(cfg, out / name, cache_dir=out / "cache")
        v = results["variants"][0]
        ours = v["metrics"]["top1"]
        rows[name] = {"images": int(len(x)), "keras_evaluate_top1": round(100 * keras_top1, 3),
                      "qdeploy_fp32_top1": round(100 * ours, 3), "difference_points": round(100 * (ours - keras_top1), 3),
                      "within_0.05": abs(100 * (ours - keras_top1)) <= 0.05, "verify": results["model"]["onnx"]["verify"]}
        for f in (f"{name}-x.npy", f"{name}-y.npy"):
            (out / f).unlink()
        print(json.dumps({name: rows[name]}, indent=1), flush=True)
    (out / "keras_goals.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
