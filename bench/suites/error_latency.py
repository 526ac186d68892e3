"""How long a user error takes to appear (issue 33): the qdeploy CLI run as a subprocess on a small project broken
one way per case, N times each; the median wall time and the error line per case, with ``--help`` as the floor.

Goal: every user error in at most 2 s on a 2-core machine (it took 8.5-9.8 s when torch, onnx, onnxruntime,
openvino and modelopt were imported before the first check).

    .venv/bin/python bench/suites/error_latency.py --label after     # run and optimize, 5 runs each: a table on stdout and
                                                              # docs/results/first-run/error_latency.json
    .venv/bin/python bench/suites/error_latency.py --label quick --repeat 2 --commands run --out /tmp/el.json

Each --label is stored in the JSON beside the labels already there (``runs[label]``), so a before/after pair stays in
one file. The project (a tiny CNN in model.py, its state_dict weights.pt, 3 classes of 8x8 PNGs
for evaluation and for calibration) is written to a
temporary folder; making weights.pt is the only step that imports torch, in this process, before any timing.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "docs" / "results" / "first-run" / "error_latency.json"
GOAL_S = 2.0

MODEL_PY = '''
import torch
from torch import nn


def tiny(num_classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))
'''

BASE_CONFIG = {
    "model": {"source": "model.py:tiny", "weights": "weights.pt",
              "preprocess": {"input_size": [8, 8], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}},
    # calibration images too: optimize's default target (onnxruntime-cpu) plans INT8 candidates, which need them
    "data": {"eval": {"root": "data/eval", "batch_size": 4, "workers": 0}, "calibration": {"root": "data/calib", "workers": 0}},
    "variants": [{"engine": "torch"}],
    "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 2},
}


def _write_project(root: Path) -> None:
    import torch  # only here: the weights file of the working project

    root.mkdir(parents=True)
    (root / "model.py").write_text(MODEL_PY)
    namespace: dict = {}
    exec(MODEL_PY, namespace)  # noqa: S102 - our own constant
    torch.save(namespace["tiny"]().state_dict(), root / "weights.pt")
    rng = np.random.default_rng(0)
    for folder in ("eval", "calib"):
        for c in ("a", "b", "c"):
            (root / "data" / folder / c).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / "data" / folder / c / f"{i}.png")


# case id → (what it breaks, a function (project folder, config dict) → None that breaks it)
def _typo(project: Path, cfg: dict) -> None:
    cfg["bench"]["warmpu"] = 5


def _missing_weights(project: Path, cfg: dict) -> None:
    cfg["model"]["weights"] = "gone.pt"


def _missing_data(project: Path, cfg: dict) -> None:
    cfg["data"]["eval"]["root"] = "data/gone"


def _corrupt_image(project: Path, cfg: dict) -> None:
    # the first image of the first class: any check that decodes one image per folder meets it
    (project / "data" / "eval" / "a" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 4)


CASES = {
    "config-typo": ("bench: {warmpu: 5} (unknown key)", _typo),
    "missing-weights": ("model.weights: gone.pt does not exist", _missing_weights),
    "missing-data-folder": ("data.eval.root: data/gone does not exist", _missing_data),
    "corrupt-image": ("data/eval/a/0.png is not an image", _corrupt_image),
}


def _qdeploy_command() -> list[str]:
    """The installed console script next to this interpreter (what a user types), else ``python -m qdeploy``."""
    script = Path(sys.executable).with_name("qdeploy")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "qdeploy"]


def _time(argv: list[str], cwd: Path, repeat: int) -> dict:
    times, last = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        last = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
    err = [line for line in last.stderr.splitlines() if line.strip()]
    return {"median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3), "max_s": round(max(times), 3),
            "times_s": [round(t, 3) for t in times], "exit_code": last.returncode,
            "stderr_lines": len(err), "error_line": err[-1] if err else ""}


def _machine() -> dict:
    def version(name: str):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "load_average_1_5_15": [round(x, 2) for x in load] if load else None,
            "python": platform.python_version(), "platform": platform.platform(),
            "torch": version("torch"), "onnx": version("onnx"), "onnxruntime": version("onnxruntime"),
            "openvino": version("openvino"), "qdeploy": version("qdeploy"), "git_commit": commit, "src_modified": dirty}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="runs per case (the median is reported)")
    ap.add_argument("--commands", default="run,optimize", help="qdeploy commands the error cases run through, e.g. run,optimize")
    ap.add_argument("--label", default="current", help="name of this measurement in the JSON (e.g. before, after)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON file (runs of other labels are kept)")
    args = ap.parse_args()

    qdeploy = _qdeploy_command()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdeploy-error-latency-") as tmp:
        tmp = Path(tmp)
        template = tmp / "template"
        _write_project(template)
        help_argv = qdeploy + ["--help"]
        rows.append({"case": "--help (floor)", "command": "--help", "argv": " ".join(help_argv),
                     **_time(help_argv, tmp, args.repeat)})
        for command in args.commands.split(","):
            for case, (what, breaks) in CASES.items():
                project = tmp / f"{command}-{case}"
                shutil.copytree(template, project)
                cfg = copy.deepcopy(BASE_CONFIG)
                breaks(project, cfg)
                (project / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
                argv = qdeploy + ["--quiet", command, "config.yaml", "--out", "out", "--cache-dir", str(tmp / "cache")]
                r = _time(argv, project, args.repeat)
                rows.append({"case": case, "breaks": what, "command": command, "argv": " ".join(argv),
                             **r, "within_goal": r["median_s"] <= GOAL_S})

    machine = _machine()
    print(f"qdeploy error latency ({args.label}): {machine['cpu']}, {machine['cores']} cores, python {machine['python']}, "
          f"torch {machine['torch']}; median of {args.repeat} runs; goal <= {GOAL_S:g} s")
    print(f"{'case':<22} {'command':<9} {'median s':>8} {'min s':>6} {'max s':>6} {'exit':>4}  error line")
    for r in rows:
        print(f"{r['case']:<22} {r['command']:<9} {r['median_s']:>8.2f} {r['min_s']:>6.2f} {r['max_s']:>6.2f} "
              f"{r['exit_code']:>4}  {r['error_line'][:110] if r['command'] != '--help' else ''}")

    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    data.setdefault("what", "median wall time of a qdeploy CLI user error (subprocess), per case; bench/suites/error_latency.py")
    data["goal_s"] = GOAL_S
    data.setdefault("runs", {})[args.label] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeat": args.repeat,
        "command": " ".join([Path(sys.executable).name, "bench/suites/error_latency.py", *sys.argv[1:]]),
        "qdeploy_command": " ".join(qdeploy), "machine": machine, "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
