"""Shared fixtures: a tiny real model file, real image folders, and the ../shared locator."""
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

TINY_MODEL = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


def tiny(num_classes=3):
    torch.manual_seed(0)
    return Tiny(num_classes)


class TinySeg(nn.Module):
    def __init__(self, num_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(3, num_classes, 3, padding=1)

    def forward(self, x):
        return {"out": self.conv(x), "aux": self.conv(x) * 0}


def tiny_seg(num_classes=3):
    torch.manual_seed(0)
    return TinySeg(num_classes)


class TinyRes(nn.Module):
    """conv → relu → conv + skip (a residual Add of two activations) → pool → fc; channel 0 of conv1 is dead."""

    def __init__(self, num_classes=3, dead_channel=True, nan=False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, num_classes)
        self.nan = nan
        if dead_channel:
            with torch.no_grad():
                self.conv1.weight[0].zero_()
                self.conv1.bias[0] = -1.0  # relu(−1) = 0 everywhere: an all-zero channel

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        if self.nan:
            z = torch.sqrt(y - 10.0)  # negative → NaN inside the graph on any normal input...
            y = y + torch.where(torch.isnan(z), torch.zeros_like(z), z)  # ...but finite outputs
        y = torch.relu(self.conv2(y) + y)
        return self.fc(y.mean((2, 3)))


def tiny_res(num_classes=3, nan=False):
    torch.manual_seed(0)
    return TinyRes(num_classes, nan=nan)


class Branchy(nn.Module):
    """Data-dependent control flow: ONNX export (tracing) works, torch.fx symbolic tracing does not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        if y.mean() > -1e9:
            y = torch.relu(y)
        return y.mean((2, 3))


def branchy():
    torch.manual_seed(0)
    return Branchy()


NOT_CALLABLE = 42
'''


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the test with the reason when it is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present: real-data test needs ../shared beside the repository")
    return path


@pytest.fixture
def tiny_model_file(tmp_path) -> Path:
    path = tmp_path / "tiny_model.py"
    path.write_text(TINY_MODEL)
    return path


@pytest.fixture
def tiny_weights(tiny_model_file, tmp_path) -> Path:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("tiny_for_weights", tiny_model_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "tiny.pt"
    torch.save(mod.tiny().state_dict(), path)
    return path


@pytest.fixture(autouse=True)
def _loud_log():
    """``cli.main(["--quiet", ...])`` sets the log's quiet flag for the whole process: every test starts with it off,
    so a test that reads qdeploy's log lines (capsys) does not depend on which test ran before it."""
    from qdeploy.utils import log

    log.set_quiet(False)
    yield


def write_image_folder(root: Path, classes=("a", "b", "c"), per_class=6, size=(12, 10), seed=0) -> Path:
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i}.png")
    return root


def cpu_optimize_config(tmp_path: Path, source: str, size: int, batch: int = 4, per_class: int = 6, **model) -> dict:
    """A small `optimize --target cpu` config on random-weight images: four classes of ``per_class`` images at
    ``size`` px in tmp_path/calib and tmp_path/eval, one thread, mean-minmax only, no fallback, any accuracy drop."""
    for seed, name in enumerate(("calib", "eval")):
        write_image_folder(tmp_path / name, classes=("a", "b", "c", "d"), per_class=per_class, size=(size, size),
                           seed=seed)
    return {"model": {"source": source, "weights": "random", **model,
                      "preprocess": {"input_size": [size, size], "mean": [0.5] * 3, "std": [0.25] * 3}},
            "data": {"eval": {"root": str(tmp_path / "eval"), "batch_size": 4, "workers": 0},
                     "calibration": {"root": str(tmp_path / "calib"), "batch_size": 4, "workers": 0}},
            "bench": {"batch_sizes": [batch], "warmup": 1, "iterations": 3},
            "optimize": {"target": "cpu", "methods": ["mean-minmax"], "threads": 1, "fallback": False,
                         "budget": {"max_drop": 100.0}}}


@pytest.fixture
def image_folder(tmp_path) -> Path:
    return write_image_folder(tmp_path / "images")


@pytest.fixture
def tiny_config(tiny_model_file, tiny_weights, image_folder) -> dict:
    return {
        "model": {
            "source": f"{tiny_model_file}:tiny",
            "weights": str(tiny_weights),
            "task": "classification",
            "preprocess": {"input_size": [8, 8], "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
        },
        "data": {"eval": {"format": "imagefolder", "root": str(image_folder), "batch_size": 4, "workers": 0}},
        "variants": [{"engine": "torch"}, {"engine": "onnxruntime"}, {"engine": "torch", "precision": "fp16"}],
        "bench": {"batch_sizes": [1, 4], "warmup": 2, "iterations": 5},
    }


# ---------------------------------------------------------------------------------------------------- the fast subset
# `pytest -m fast` runs the unit tests: every test not marked `slow` (whole pipelines, training, subprocesses, more than
# about 0.4 s on 2 cores) or `realdata` (../shared). A test file marks its slow tests itself; this hook only adds the
# complement, so a new test is fast until someone marks it slow. The split was set from `pytest --durations=0` of the
# whole suite (the fast subset: 634 tests in 43-57 s on a 2-core host); rerun it when the subset nears a minute.
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("realdata") is None:
            item.add_marker(pytest.mark.fast)
