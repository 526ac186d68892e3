"""``qdeploy demo``: the embedded default. Works offline, without ../shared, in about a minute on 2 cores.

1. write scikit-learn's bundled handwritten digits (1,797 real 8x8 scans) as PNG image folders,
2. train a small CNN on the training split through qdeploy's own data pipeline (cached by content),
3. run the normal comparison (torch / ONNX Runtime, FP32 / FP16) on the held-out split and write the report.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits

from qdeploy.config import DatasetSpec, Preprocess
from qdeploy.data import make_batches, normalize
from qdeploy.demo.model import digits_cnn
from qdeploy.pipeline import run
from qdeploy.utils.atomic import atomic_path
from qdeploy.utils.cache import default_cache_dir
from qdeploy.utils.log import log, progress

DEMO_VERSION = 1
SEED = 0
PREPROCESS = {"input_size": [16, 16], "resize": [16, 16], "mode": "L", "mean": [0.5], "std": [0.5]}


def _write_digits(root: Path) -> None:
    """Split the digits 80/20 (seeded, stratified by shuffling) into root/{train,test}/<digit>/<i>.png."""

    digits = load_digits()
    images = np.clip(digits.images * 16, 0, 255).astype(np.uint8)  # 0..16 → 0..255 gray levels
    order = np.random.default_rng(SEED).permutation(len(images))
    n_test = len(images) // 5
    tmp = root.with_name(root.name + ".partial")
    for rank, i in enumerate(order):
        split = "test" if rank < n_test else "train"
        folder = tmp / split / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i], mode="L").save(folder / f"{i:04d}.png")
    tmp.rename(root)  # only a complete dataset ever appears under root


def prepare_data(cache_dir: Path) -> Path:
    root = cache_dir / f"digits-v{DEMO_VERSION}"
    if not root.is_dir():
        log(f"demo: writing scikit-learn digits as PNG folders under {root}")
        _write_digits(root)
    return root


def train(data_root: Path, weights: Path, epochs: int = 30) -> dict:

    torch.manual_seed(SEED)
    pre = Preprocess(**PREPROCESS)
    batches = make_batches(DatasetSpec(root=str(data_root / "train"), batch_size=4096, workers=0), pre, "classification", desc="decode train")
    x_all, y_all = [], []
    for images, labels in batches:
        x_all.append(normalize(images, pre))
        y_all.append(labels)
    x = torch.from_numpy(np.concatenate(x_all))
    y = torch.from_numpy(np.concatenate(y_all)).long()
    model = digits_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * (-(-len(x) // 64)))
    gen = torch.Generator().manual_seed(SEED)

    model.train()
    with progress("demo: train CNN", epochs) as advance:
        for _ in range(epochs):
            perm = torch.randperm(len(x), generator=gen)
            for i in range(0, len(x), 64):
                idx = perm[i : i + 64]
                # light augmentation: random 1-pixel shifts make the tiny net generalise
                xb = torch.roll(x[idx], shifts=tuple(torch.randint(-1, 2, (2,), generator=gen).tolist()), dims=(2, 3))
                loss = torch.nn.functional.cross_entropy(model(xb), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            advance()
    model.eval()
    with torch.no_grad():
        train_acc = float((model(x).argmax(1) == y).float().mean())
    with atomic_path(weights) as tmp:
        torch.save(model.state_dict(), tmp)
    return {"train_samples": len(x), "train_top1": train_acc, "epochs": epochs}


def demo_config(data_root: Path, weights: Path) -> dict:
    return {
        "model": {"source": "qdeploy.demo.model:digits_cnn", "weights": str(weights), "task": "classification", "preprocess": PREPROCESS},
        "data": {"eval": {"format": "imagefolder", "root": str(data_root / "test"), "batch_size": 64, "workers": 0},
                 # the training split: disjoint from the evaluation images, as calibration data must be
                 "calibration": {"format": "imagefolder", "root": str(data_root / "train"), "count": 256, "seed": 0, "workers": 0}},
        "variants": [
            {"engine": "torch", "precision": "fp32"},
            {"engine": "torch", "precision": "fp32", "channels_last": True},
            {"engine": "onnxruntime", "precision": "fp32"},
            {"engine": "onnxruntime", "precision": "int8"},                                # ONNX Runtime INT8 kernels (mean-minmax)
            {"engine": "onnxruntime", "precision": "int8", "method": "percentile", "placement": "tensorrt"},  # TensorRT Q/DQ
            {"engine": "torch", "precision": "fp16"},
            {"engine": "onnxruntime", "precision": "fp16"},
        ],
        "bench": {"batch_sizes": [1, 32], "warmup": 10, "iterations": 100},
    }


def _data_and_weights(cache_dir: Optional[Path]) -> tuple[Path, Path, Path]:
    """(demo cache folder, digits image folders, trained weights): written or trained on first use, then cached."""
    cache_dir = Path(cache_dir or default_cache_dir()) / "demo"
    cache_dir.mkdir(parents=True, exist_ok=True)
    data_root = prepare_data(cache_dir)
    # the training recipe lives in this file: weights are keyed by it and by the model's code
    code = (Path(__file__).parent / "model.py").read_bytes() + json.dumps(PREPROCESS).encode() + Path(__file__).read_bytes()
    weights = cache_dir / f"digits_cnn-{hashlib.sha256(code).hexdigest()[:12]}.pt"
    if weights.is_file():
        log(f"demo: cached weights {weights}")
    else:
        info = train(data_root, weights)
        log(f"demo: trained on {info['train_samples']} images, train top-1 {100 * info['train_top1']:.2f}%")
    return cache_dir, data_root, weights


def run_demo(out_dir: str | Path = "runs/demo", cache_dir: Optional[Path] = None) -> dict:
    cache_dir, data_root, weights = _data_and_weights(cache_dir)
    return run(demo_config(data_root, weights), out_dir, cache_dir=cache_dir.parent)  # the run writes its config.yaml


# Written into a --prepare folder: a later --prepare recognises its own folder (and refreshes it), never a user's.
PREPARED_MARKER = ".qdeploy-demo-files"


def prepare_files(dest: str | Path, cache_dir: Optional[Path] = None) -> Path:
    """Write the demo's inputs as ordinary files for the example configs (examples/digits_cnn*.yaml read them from
    runs/digits): ``dest/train/<digit>/*.png``, ``dest/test/<digit>/*.png`` and the trained ``dest/digits_cnn.pt``.

    ``dest`` must be new, empty or an earlier ``--prepare`` folder (replaced); a folder holding anything else is refused
    before any work, naming one such entry, and nothing of it is deleted."""
    import shutil

    from qdeploy.errors import QDeployError

    dest = Path(dest).expanduser()
    if dest.exists() and not dest.is_dir():
        raise QDeployError(f"demo --prepare {dest}: a file, not a folder; choose a new folder")
    if dest.is_dir() and not (dest / PREPARED_MARKER).is_file():
        other = next(iter(sorted(dest.iterdir())), None)
        if other is not None:
            raise QDeployError(f"demo --prepare {dest}: the folder holds files qdeploy did not write (e.g. {other.name}); "
                               "choose a new or empty folder")
    _, data_root, weights = _data_and_weights(cache_dir)
    # a name of qdeploy's own beside dest: only a --prepare cut short leaves a folder of that name, never a user
    staging = dest.with_name(f".{dest.name}.qdeploy-demo-prepare-partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for split in ("train", "test"):
        shutil.copytree(data_root / split, staging / split)
    shutil.copy2(weights, staging / "digits_cnn.pt")
    (staging / PREPARED_MARKER).write_text(json.dumps({"demo_version": DEMO_VERSION, "weights": weights.name}) + "\n")
    if dest.is_dir():
        shutil.rmtree(dest)  # empty, or an earlier --prepare folder (checked above)
    staging.rename(dest)
    return dest
