"""Which OpenVINO CPU-plugin settings compile and run a Q/DQ ONNX (a diagnosis tool for the zoo's OpenVINO failures).

    python bench/diagnose/ov_probe.py FILE.onnx [FILE.onnx ...]     # one line per file x setting, each in its own child process

Settings: ``base`` (the file as qdeploy's openvino engine reads it, ``readable_onnx``'s rewrites, with the config it
passes for INT8: f32 precision hint), ``unfolded`` (without ``constant_dequantize_folded``), ``nosnippets`` (+ SNIPPETS_MODE
DISABLE: no Snippets subgraph tokenization), ``no-amx`` (env ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI), ``raw`` (the file
without qdeploy's signed-int8 -> uint8 activation rewrite). Finding (2026-11-26): the zoo's "index '0' out of range"
failures on the device were not the Xeon's (AMX) doing but ONNX Runtime 1.30's quantizer output (the device's ONNX
Runtime; this host had 1.32): ``Mul/Add(DQ(Q(x)), DQ(Q(float constant)))``. Settings did not matter; the fold did.
Print `lscpu` flags beside any result (bench/device/ov_probe_device.sh does)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

CHILD = r"""
import json, sys, traceback
import numpy as np, openvino as ov
core = ov.Core()
try:
    model = core.read_model(sys.argv[1])
    compiled = core.compile_model(model, "CPU", json.loads(sys.argv[2]))
    shape = [1 if d.is_dynamic else d.get_length() for d in model.inputs[0].get_partial_shape()]
    compiled(np.zeros(shape, np.float32))
except Exception as e:
    print("ERROR", " ".join(str(e).split())[:1500], file=sys.stderr)
    sys.exit(1)
"""

SETTINGS = {
    "base": ({}, {}),
    "nosnippets": ({"SNIPPETS_MODE": "DISABLE"}, {}),
    "no-amx": ({}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}),
}


def one(path: Path, config: dict, env: dict) -> str:
    r = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(config)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **env})
    if r.returncode == 0:
        return "ok"
    if r.returncode < 0:
        return f"crash signal {-r.returncode}"
    err = [l for l in r.stderr.splitlines() if l.startswith("ERROR")]
    return (err[-1] if err else r.stderr.strip()[-600:])


def main() -> int:
    import onnx

    from qdeploy.engines.openvino_engine import constant_dequantize_folded, signed_activations_as_uint8

    base = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 2}
    for f in map(Path, sys.argv[1:]):
        with tempfile.TemporaryDirectory() as tmp:
            m = onnx.load(str(f))
            n = signed_activations_as_uint8(m)
            unfolded = Path(tmp) / f"unfolded-{f.name}"
            onnx.save(m, str(unfolded))
            folds = constant_dequantize_folded(m)
            rewritten = Path(tmp) / f.name
            onnx.save(m, str(rewritten))
            for name, (cfg, env) in SETTINGS.items():
                print(json.dumps({"file": str(f), "setting": name, "rewrites": n, "folds": folds,
                                  "result": one(rewritten, {**base, **cfg}, env)}), flush=True)
            if folds:
                print(json.dumps({"file": str(f), "setting": "unfolded", "result": one(unfolded, base, {})}), flush=True)
            if n:
                print(json.dumps({"file": str(f), "setting": "raw", "result": one(f, base, {})}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
