"""The models issue #23's goals name, as qdeploy configs (../shared only; a missing folder is a clear skip).

    from goal_models import GOAL_MODELS, config, missing
    cfg = config("mobilevit", eval_count=1000)          # model + data (eval, calibration); no variants

ResNet-20/44 (../shared/models/cifar10-resnet and its module file), EfficientNet-B0@48 and MobileNetV3@64
(cifar10-dev, torchvision), the four cifar10-modern timm models (bench/suites/transformer_int8.py's table) and DeepLabV3
(CamVid, 360x480, examples/camvid_deeplabv3.yaml). Calibration: 512 seeded train images (CamVid: 64 train frames).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("QDEPLOY_SHARED") or REPO.parent / "shared")  # QDEPLOY_SHARED: a copy elsewhere (the device)
NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
sys.path.insert(0, str(Path(__file__).resolve().parent))
from transformer_int8 import MODELS as MODERN  # noqa: E402
from transformer_int8 import config as modern_config  # noqa: E402
import transformer_int8  # noqa: E402

transformer_int8.SHARED = SHARED  # its config() reads the weights and data from there: the same override

GOAL_MODELS = ["resnet20", "resnet44", "efficientnet_b0_48", "mobilenet_v3_large_64", "deeplabv3",
               "deit", "swin", "convnext", "mobilevit"]
TRANSFORMERS = {"deit", "swin", "convnext", "mobilevit"}  # the 0.5-point budget (cifar10-modern)


def input_size(name: str) -> tuple[int, int]:
    if name == "deeplabv3":
        return (360, 480)
    if name in MODERN:
        return (MODERN[name][3],) * 2
    if name.startswith("resnet"):
        return (32, 32)
    s = int(name.rsplit("_", 1)[1])
    return (s, s)


def missing(name: str) -> Optional[str]:
    """Why ``name`` cannot run here (None: it can)."""
    need = {"deeplabv3": [SHARED / "models" / "camvid-deeplabv3", SHARED / "data" / "camvid"]}.get(
        name, [SHARED / "data" / "cifar10" / "test"])
    for p in need:
        if not p.exists():
            return f"{p} is absent (../shared holds the real data and weights; nothing is copied into the repo)"
    return None


def config(name: str, eval_count: Optional[int] = 1000, calibration: int = 512) -> dict:
    cifar = SHARED / "data" / "cifar10"
    if name in MODERN:
        cfg = modern_config(name, eval_count, calibration, "max")
        cfg.pop("variants")
        return cfg
    if name == "deeplabv3":
        camvid = SHARED / "data" / "camvid"
        ev = {"format": "segnet", "root": str(camvid), "split": "test", "ignore_index": 11, "batch_size": 8,
              "class_names": ["Sky", "Building", "Pole", "Road", "Pavement", "Tree", "SignSymbol", "Fence", "Car",
                              "Pedestrian", "Bicyclist"]}
        return {"model": {"source": "torchvision:deeplabv3_mobilenet_v3_large",
                          "kwargs": {"num_classes": 11, "aux_loss": False, "weights": None, "weights_backbone": None},
                          "weights": str(SHARED / "models" / "camvid-deeplabv3" / "deeplabv3_mobilenet_v3_large_camvid.pt"),
                          "task": "segmentation", "output": "out", "preprocess": {"input_size": [360, 480], **NORM}},
                "data": {"eval": {**ev, **({"count": eval_count, "seed": 0} if eval_count else {})},
                         "calibration": {**ev, "split": "train", "count": min(calibration, 64), "seed": 0, "batch_size": 4}}}
    data = {"eval": {"format": "imagefolder", "root": str(cifar / "test"), "batch_size": 250,
                     **({"count": eval_count, "seed": 0} if eval_count else {})},
            "calibration": {"format": "imagefolder", "root": str(cifar / "train"), "count": calibration, "seed": 0,
                            "batch_size": 64}}
    if name.startswith("resnet"):
        res = SHARED / "models" / "cifar10-resnet"
        return {"model": {"source": f"{res / 'cifar_resnet.py'}:{name}", "weights": str(res / f"{name}.pt"),
                          "task": "classification", "preprocess": {"input_size": [32, 32], **NORM}}, "data": data}
    arch, size = name.rsplit("_", 1)
    return {"model": {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10},
                      "weights": str(SHARED / "models" / "cifar10-dev" / f"{name}.pt"), "task": "classification",
                      "preprocess": {"input_size": [int(size)] * 2, "resize": [int(size)] * 2, **NORM}},
            "data": data}
