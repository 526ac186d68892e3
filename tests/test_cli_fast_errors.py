"""The command line's early checks (issue 33): a config typo, a missing file, a corrupt image or a refused --out is named
before torch, ONNX, ONNX Runtime, OpenVINO or ModelOpt are imported, with the same one line and exit code 2 that the
full pipeline gives for it; and `qdeploy optimize --target/--max-drop/--min-agreement/--time-limit` set the config's
optimize: section, a bad value being one line naming the flag.

Every CLI run here is a real subprocess (`python -m qdeploy`, what the console script runs). The full pipeline's
message is the QDeployError that `qdeploy.api` raises for the same config path, in this process. No timings here:
bench/suites/error_latency.py measures them.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml
from PIL import Image

from qdeploy.errors import QDeployError

pytestmark = pytest.mark.slow  # every test runs the CLI in a subprocess

HEAVY = ("torch", "onnx", "onnxruntime", "openvino", "modelopt", "torchvision")

MODEL_PY = '''
import torch
from torch import nn


def tiny(num_classes=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))
'''

BASE = {
    "model": {"source": "model.py:tiny", "weights": "weights.pt",
              "preprocess": {"input_size": [8, 8], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}},
    "data": {"eval": {"root": "data/eval", "batch_size": 4, "workers": 0},
             "calibration": {"root": "data/calib", "workers": 0}},
    "variants": [{"engine": "torch"}, {"engine": "onnxruntime", "precision": "int8", "method": "max"}],
    "bench": {"batch_sizes": [1], "warmup": 1, "iterations": 2},
}

GARBAGE_PNG = b"\x89PNG\r\n\x1a\n" + b"garbage" * 4


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A project that runs: model.py, weights.pt, 3 classes of 8x8 PNGs for evaluation and for calibration."""
    import torch

    root = tmp_path_factory.mktemp("fast-errors") / "project"
    root.mkdir()
    (root / "model.py").write_text(MODEL_PY)
    namespace: dict = {}
    exec(MODEL_PY, namespace)  # noqa: S102 - the constant above
    torch.save(namespace["tiny"]().state_dict(), root / "weights.pt")
    rng = np.random.default_rng(0)
    for folder in ("eval", "calib"):
        for c in ("a", "b", "c"):
            (root / "data" / folder / c).mkdir(parents=True)
            for i in range(4):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / "data" / folder / c / f"{i}.png")
    return root


def _project(template: Path, tmp_path: Path, cfg: dict | None = None) -> tuple[Path, Path]:
    """A copy of the project and its config.yaml (BASE unless ``cfg``)."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(template, project)
    config = project / "config.yaml"
    config.write_text(yaml.safe_dump(copy.deepcopy(cfg or BASE), sort_keys=False))
    return project, config


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qdeploy", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _heavy_modules_after(argv: list[str], cwd: Path) -> tuple[int, list[str]]:
    """cli.main(argv) in a fresh interpreter: its exit code and which heavy libraries it imported."""
    code = ("import json, sys\nfrom qdeploy.cli import main\nrc = main(json.loads(sys.argv[1]))\n"
            f"print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], cwd=cwd, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    rc, heavy = json.loads(p.stdout.strip().splitlines()[-1])
    return rc, heavy


# ---- the cases: (id, command, setup(project, cfg) -> --out or None) ---------------------------------------------------

def _set(*keys_value):
    *keys, value = keys_value

    def setup(project: Path, cfg: dict):
        d = cfg
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
    return setup


def _corrupt(rel: str):
    def setup(project: Path, cfg: dict):
        (project / rel).write_bytes(GARBAGE_PNG)
    return setup


def _onnx_source_missing(project: Path, cfg: dict):
    cfg["model"]["source"] = "gone.onnx"
    del cfg["model"]["weights"]
    cfg["variants"] = [{"engine": "onnxruntime"}]


def _unlabelled_first_image(project: Path, cfg: dict):
    cfg["data"]["eval"]["labels"] = False
    (project / "data" / "eval" / "a" / "0.png").write_bytes(GARBAGE_PNG)


def _out_user_folder(project: Path, cfg: dict):
    (project / "notes").mkdir()
    (project / "notes" / "todo.md").write_text("- deploy\n")
    return project / "notes"


def _out_inside_data(project: Path, cfg: dict):
    return project / "data" / "eval" / "runs"


def _calibration_cache_missing(project: Path, cfg: dict):
    cfg["variants"].append({"engine": "onnxruntime", "precision": "int8", "method": "max",
                            "calibration_cache": "calib.cache"})


CASES: list[tuple[str, str, Callable]] = [
    ("config-typo", "run", _set("bench", "warmpu", 5)),
    ("config-typo-optimize", "optimize", _set("optimize", "budget", {"max_drop": 1, "maxdrop": 2})),
    ("model-file-missing", "run", _set("model", "source", "gone.py:tiny")),
    ("weights-missing", "run", _set("model", "weights", "gone.pt")),
    ("weights-missing-export", "export", _set("model", "weights", "gone.pt")),
    ("weights-missing-optimize", "optimize", _set("model", "weights", "gone.pt")),
    ("weights-is-folder", "bench", _set("model", "weights", "data")),
    ("onnx-source-missing", "run", _onnx_source_missing),
    ("eval-folder-missing", "run", _set("data", "eval", "root", "data/gone")),
    ("eval-folder-missing-optimize", "optimize", _set("data", "eval", "root", "data/gone")),
    ("eval-folder-is-file", "eval", _set("data", "eval", "root", "model.py")),
    ("eval-first-image-corrupt", "run", _corrupt("data/eval/a/0.png")),
    ("eval-first-image-corrupt-optimize", "optimize", _corrupt("data/eval/a/0.png")),
    ("eval-unlabelled-first-image-corrupt", "eval", _unlabelled_first_image),
    ("calibration-folder-missing", "quantize", _set("data", "calibration", "root", "data/gone")),
    ("calibration-first-image-corrupt", "run", _corrupt("data/calib/a/0.png")),
    ("calibration-cache-missing", "build", _calibration_cache_missing),
    ("out-holds-user-files", "run", _out_user_folder),
    ("out-inside-eval-data", "optimize", _out_inside_data),
]


def _full_pipeline_message(command: str, config: Path, out: Path, cache: Path) -> str:
    """What the pipeline itself says for this config (the API the CLI calls, given the config's path)."""
    from qdeploy import api

    call = {"run": lambda: api.run(str(config), out, stages=("eval", "bench"), cache_dir=cache),
            "eval": lambda: api.run(str(config), out, stages=("eval",), cache_dir=cache),
            "bench": lambda: api.run(str(config), out, stages=("bench",), cache_dir=cache),
            "build": lambda: api.build(str(config), out, cache_dir=cache),
            "quantize": lambda: api.quantize(str(config), out, cache_dir=cache),
            "export": lambda: api.export(str(config), out, cache_dir=cache),
            "optimize": lambda: api.optimize(str(config), out, cache_dir=cache)}[command]
    with pytest.raises(QDeployError) as e:
        call()
    return f"qdeploy: error: {e.value}"


@pytest.mark.parametrize("case_id,command,setup", CASES, ids=[c[0] for c in CASES])
def test_early_error_is_the_pipelines_line_and_exit_code(case_id, command, setup, template, tmp_path):
    cfg = copy.deepcopy(BASE)
    project, config = _project(template, tmp_path)
    out = setup(project, cfg) or tmp_path / "out"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cache = tmp_path / "cache"
    argv = ["--quiet", command, str(config), "--out", str(out), "--cache-dir", str(cache)]

    p = _cli(*argv, cwd=project)
    lines = p.stderr.strip("\n").splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("qdeploy: error: "), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert lines[0] == _full_pipeline_message(command, config, out, cache)

    rc, heavy = _heavy_modules_after(argv, project)
    assert rc == 2 and heavy == [], heavy


def test_a_working_config_passes_the_early_checks(template, tmp_path):
    """The early checks refuse nothing the pipeline accepts (exit 0): folders that this command does not read
    (calibration images without an INT8 variant, QAT's training images) may be missing, as they may for the pipeline;
    and with on_error: skip a corrupt first image is not an error but left to the data stage, which lists it as
    skipped. One run covers both (each run starts torch in a subprocess)."""
    cfg = copy.deepcopy(BASE)
    cfg["variants"] = [{"engine": "torch"}]
    cfg["data"]["calibration"]["root"] = "data/not-here"
    cfg["data"]["train"] = {"root": "data/not-here-either"}
    cfg["data"]["eval"]["on_error"] = "skip"
    project, config = _project(template, tmp_path, cfg)
    (project / "data" / "eval" / "a" / "0.png").write_bytes(GARBAGE_PNG)
    p = _cli("--quiet", "eval", str(config), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
             cwd=project)
    assert p.returncode == 0, p.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "0.png" in json.dumps(results)


# ---- qdeploy optimize's flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command,flag,value,key", [
    ("optimize", "--max-drop", "-1", "optimize.budget.max_drop"),
    ("optimize", "--max-drop", "lots", "optimize.budget.max_drop"),
    ("optimize", "--min-agreement", "1.5", "optimize.budget.min_agreement"),
    ("optimize", "--time-limit", "0", "optimize.time_limit"),
    ("optimize", "--target", "gpu", "optimize.target"),
    # bench's overrides go through the same models (an invalid one was a pydantic traceback, exit 1)
    ("bench", "--iterations", "0", "bench.iterations"),
    ("bench", "--batch-sizes", "0,1", "bench.batch_sizes"),
])
def test_a_bad_override_flag_is_one_line_naming_it(command, flag, value, key, template, tmp_path):
    project, config = _project(template, tmp_path)
    argv = [command, str(config), "--out", str(tmp_path / "out"), flag, value]
    p = _cli(*argv, cwd=project)
    lines = p.stderr.strip("\n").splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith(f"qdeploy: error: {flag} {value}: {key}: "), p.stderr
    assert not (tmp_path / "out").exists()
    rc, heavy = _heavy_modules_after(argv, project)
    assert rc == 2 and heavy == []


def test_optimize_target_flag_is_accepted_with_the_checks_after_it(template, tmp_path):
    """`--target cpu` was 'unrecognized arguments'; now it parses and the run goes on to the input checks."""
    cfg = copy.deepcopy(BASE)
    cfg["data"]["eval"]["root"] = "data/gone"
    project, config = _project(template, tmp_path, cfg)
    p = _cli("optimize", str(config), "--out", str(tmp_path / "out"), "--target", "cpu", "--max-drop", "0.5", cwd=project)
    assert p.returncode == 2
    assert "unrecognized arguments" not in p.stderr and "data.eval: dataset folder" in p.stderr, p.stderr


def test_optimize_help_lists_every_exit_code_and_target():
    import re
    from typing import get_args

    from qdeploy.config import OptimizeConfig

    p = subprocess.run([sys.executable, "-m", "qdeploy", "optimize", "--help"], capture_output=True, text=True)
    text = " ".join(p.stdout.split())
    # cli.optimize_exit_code returns 0, 3 or 4; a QDeployError 2, Ctrl-C 130
    listed = re.findall(r"(?:codes:|;) (\d+) ", "codes:" + text.split("exit codes:", 1)[1])
    assert listed == ["0", "2", "3", "4", "130"], listed
    # the --target help names every value optimize.target takes (the list is written out in cli.py)
    target_help = text.rsplit("--target TARGET", 1)[1].split("--max-drop", 1)[0]  # the option's line, not the usage
    for target in get_args(OptimizeConfig.model_fields["target"].annotation):
        assert re.search(rf"(^|[ :,]){re.escape(target)}([ ,(]|$)", target_help), target
    for flag in ("--max-drop", "--min-agreement", "--time-limit"):
        assert flag in text


def _optimize_json(template: Path, tmp_path: Path, optimize: dict, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    cfg = copy.deepcopy(BASE)
    cfg["optimize"] = {"methods": ["max"], "fallback": False, **optimize}
    project, config = _project(template, tmp_path, cfg)
    out = tmp_path / "out"
    p = _cli("--quiet", "optimize", str(config), "--out", str(out), "--cache-dir", str(tmp_path / "cache"), *flags,
             cwd=project)
    assert p.returncode in (0, 3), p.stderr  # the budget met or missed on the confirm split: both wrote optimize.json
    return p, json.loads((out / "optimize.json").read_text())


def test_optimize_flags_override_the_config_section(template, tmp_path):
    """The config asks for torch-cpu, a relative budget and a 1 ms time limit (which stops the search before one
    evaluation: exit 2); the flags' target, budget (--max-drop with --min-agreement as its floor) and time limit are
    the ones optimize.json reports."""
    _, summary = _optimize_json(template, tmp_path, {"target": "torch-cpu", "budget": {"relative": 0.01},
                                                     "time_limit": 0.001},
                                "--target", "onnxruntime-cpu", "--max-drop", "50", "--min-agreement", "0.5",
                                "--time-limit", "900")
    assert summary["target"] == "onnxruntime-cpu"
    assert summary["budget"].get("max_drop") == 50 and "relative" not in summary["budget"]
    assert summary["budget"].get("min_agreement") == 0.5
    assert summary["timed_out"] is False
