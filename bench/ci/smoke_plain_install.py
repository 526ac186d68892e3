"""INT8 smoke test for a plain ``pip install .`` (no extras): every range method (config.RANGE_METHODS, the default
mean-minmax included) on a tiny model, both placements.

.ci/run runs this from a fresh virtualenv before the test suite, so a dependency that only an extra
brings in (as ``huggingface_hub``, which ModelOpt's init imports, once did through timm) fails CI.
Runs in seconds; it must not be run from the source tree (the installed package is what is tested).

    python bench/ci/smoke_plain_install.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y) + y)
        return self.fc(y.mean((2, 3)))


def net():
    torch.manual_seed(0)
    return Net()
'''


def main() -> int:
    import qdeploy
    from qdeploy import api
    from qdeploy.config import RANGE_METHODS

    if Path(qdeploy.__file__).resolve().is_relative_to(Path(__file__).resolve().parents[2] / "src"):
        print("smoke: qdeploy is imported from the source tree, not from the installed package", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "net.py").write_text(MODEL)
        rng = np.random.default_rng(0)
        for split, n in (("eval", 6), ("calib", 10)):
            for cls in ("a", "b"):
                (tmp / split / cls).mkdir(parents=True)
                for i in range(n):
                    Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(tmp / split / cls / f"{i}.png")
        variants = [{"engine": "onnxruntime"}]
        for method in RANGE_METHODS:
            variants.append({"engine": "onnxruntime", "precision": "int8", "method": method})
            variants.append({"engine": "onnxruntime", "precision": "int8", "method": method, "placement": "tensorrt"})
        config = {
            "model": {"source": f"{tmp / 'net.py'}:net", "preprocess": {"input_size": [12, 12]}},
            "data": {"eval": {"root": str(tmp / "eval"), "workers": 0}, "calibration": {"root": str(tmp / "calib"), "workers": 0}},
            "variants": variants, "bench": {"batch_sizes": [1], "iterations": 5, "warmup": 1},
        }
        results = api.run(config, tmp / "out", cache_dir=tmp / "cache")
        bad = [(v["name"], v["status"], v["reason"]) for v in results["variants"] if v["status"] not in ("ok", "degraded")]
        quantizers = sorted({v["quantization"]["quantizer"] for v in results["variants"] if v.get("quantization")})
        print(f"smoke: {len(results['variants'])} variants, quantizers {quantizers}, artifacts {len(results['artifacts'])}")
        if bad or quantizers != ["modelopt", "onnx"]:
            print(f"smoke: FAILED {bad}", file=sys.stderr)
            return 1
        # `qdeploy lint` on a TensorRT-placement artifact (and its confirmation step, static without TensorRT)
        trt = next(v for v in results["variants"] if (v.get("quantization") or {}).get("placement") == "tensorrt")
        report = api.lint(tmp / "out" / trt["details"]["artifact"])
        if report["schema"] != "qdeploy.lint/1" or not report["by"].startswith(("static analysis", "TensorRT")):
            print(f"smoke: FAILED lint {report['verdict']} {report['by']}", file=sys.stderr)
            return 1
    print("smoke: plain install runs every INT8 method on both placements, and lints the TensorRT artifact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
