"""bench/suites/gpu_reference.py, the GPU suite's hand-written references: its real-size rows (the classifiers of
bench/train/train_realsize.py at 224 px) are configured as the CPU suite trains them. What needs a GPU runs on the
device machine (bench/device/realsize_gpu.sh); here, the rows' configs."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite():
    pytest.importorskip("torch")
    sys.path.insert(0, str(ROOT / "bench/suites"))
    spec = importlib.util.spec_from_file_location("gpu_reference", ROOT / "bench/suites/gpu_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_real_size_classifiers_are_rows_at_224_with_the_trained_weights(suite, tmp_path, monkeypatch):
    from train_realsize import MODELS as REALSIZE

    from qdeploy.config import parse_config

    monkeypatch.setattr(suite, "BATCHES", (1, 8, 32, 128))
    for name, (source, kwargs, _) in REALSIZE.items():
        cfg = suite.config(name, tmp_path, 0.3)
        assert cfg["model"]["source"] == source and cfg["model"]["kwargs"] == kwargs
        assert cfg["model"]["weights"] == str(tmp_path / f"{name}.pt")
        # CIFAR-10's 32 px images resized to 224, as they were trained
        assert cfg["model"]["preprocess"]["input_size"] == [224, 224] and cfg["model"]["preprocess"]["resize"] == [224, 224]
        assert cfg["bench"]["batch_sizes"] == [1, 8, 32, 128]
        assert cfg["optimize"] == {"target": "torch-cuda", "budget": {"max_drop": 0.3}}
        assert suite.MODELS[name][3] == 224  # bench_images' size
    parse_config(suite.config("resnet50", tmp_path, 0.3))  # a valid qdeploy config
