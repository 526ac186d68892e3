"""Issue #9's GPU measurements: QAT on the hard models, CamVid, seed 002's ResNet-50 table, throughput, scaling.

Everything reads the data and weights staged on the device under --data (bench/device/stage_gpu_data.sh copies them from
../shared into .devdata/ here; the device command moves them to /tmp/dd, since one call carries at most 64 MiB).
Each experiment runs ``qdeploy.api.qat`` (or plain PyTorch training for the from-scratch ResNet-50) and merges
a compact record into --json (one file: the device returns at most 8).

    python bench/suites/qat_gpu.py effb0-distill effb0-sup --data /tmp/dd --json $OUT/qat_gpu.json
    python bench/suites/qat_gpu.py --emit-config effb0-sup --data /tmp/dd > /tmp/effb0.yaml   # for torchrun scaling runs

Experiments: r50-train, r50-table, {effb0,mnv3}-{distill,sup}, camvid-{distill,sup}[-lr3],
camvid-distill-lr3-{e40,learned}, camvid-distill-adamw[-lr1e-4], throughput-{effb0,r50},
keras-effb0-distill[-pct] (issue #24: the Keras EfficientNet's converted ONNX, bench/device/stage_keras_gpu.sh).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

CIFAR_NORM = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
CAMVID_CLASSES = ["Sky", "Building", "Pole", "Road", "Pavement", "Tree", "SignSymbol", "Fence", "Car", "Pedestrian", "Bicyclist"]


def cifar_model(dd: Path, name: str) -> dict:
    arch, size, weights = {"effb0": ("efficientnet_b0", 48, "efficientnet_b0_48.pt"),
                           "mnv3": ("mobilenet_v3_large", 64, "mobilenet_v3_large_64.pt"),
                           "r50": ("resnet50", 64, "r50_cifar64.pt")}[name]
    return {"source": f"torchvision:{arch}", "kwargs": {"num_classes": 10}, "weights": str(dd / weights),
            "task": "classification", "preprocess": {"input_size": [size, size], "resize": [size, size], **CIFAR_NORM}}


def cifar_config(dd: Path, name: str, objective: str, **qat) -> dict:
    train = {"format": "imagefolder", "root": str(dd / "cifar-train")}
    test = dd / "cifar-test"
    # scaling runs carry no test set: speed only, measured on a slice of the training images
    evaluation = {"format": "imagefolder", "root": str(test), "batch_size": 500} if test.is_dir() else \
        {**train, "count": 1000, "seed": 1, "batch_size": 500}
    return {"model": cifar_model(dd, name),
            "data": {"eval": evaluation, "calibration": {**train, "count": 512, "seed": 0}, "train": train},
            "qat": {"objective": objective, "data": train, "device": "cuda", "batch_size": 128, **qat}}


def keras_effb0_config(dd: Path, objective: str, **qat) -> dict:
    """Issue #24: the Keras EfficientNetB0 at 64x64 (bench/train/keras_train.py) as the ONNX that qdeploy's Keras source
    converted and verified against Keras on the CPU machine (TensorFlow is not on the device; a Keras source's QAT
    starts from that ONNX, as its onnx2torch twin, in any case). Staged by bench/device/stage_keras_gpu.sh (calls k0, k1)."""
    train = {"format": "imagefolder", "root": str(dd / "cifar-train")}
    return {"model": {"source": str(dd / "keras_efficientnet_b0_64.onnx"), "task": "classification",
                      "preprocess": {"input_size": [64, 64], "preset": "keras-none"}},
            "data": {"eval": {"format": "imagefolder", "root": str(dd / "cifar-test"), "batch_size": 500},
                     "calibration": {**train, "count": 512, "seed": 0}, "train": train},
            "bench": {"enabled": False},
            "qat": {"objective": objective, "data": train, "device": "cuda", "batch_size": 128, **qat}}


def camvid_config(dd: Path, objective: str, **qat) -> dict:
    seg = {"format": "segnet", "root": str(dd / "camvid"), "ignore_index": 11, "class_names": CAMVID_CLASSES}
    return {"model": {"source": "torchvision:deeplabv3_mobilenet_v3_large",
                      "kwargs": {"num_classes": 11, "aux_loss": False, "weights": None, "weights_backbone": None},
                      "weights": str(dd / "deeplabv3_mobilenet_v3_large_camvid.pt"), "task": "segmentation", "output": "out",
                      "preprocess": {"input_size": [360, 480], **CIFAR_NORM}},
            "data": {"eval": {**seg, "split": "test", "batch_size": 8}, "calibration": {**seg, "split": "train", "batch_size": 8},
                     "train": {**seg, "split": "train"}},
            # the starting point: the max calibration PTQ leaves at 51.37 mIoU
            "qat": {"objective": objective, "method": "max", "device": "cuda", "batch_size": 8,
                    "data": {**seg, "split": "train"}, **qat}}  # distill reads the images only


def experiments(dd: Path) -> dict:
    """name -> config dict for api.qat (QAT defaults otherwise: sgd, lr 1e-4, cosine, ranges frozen, mean-minmax)."""
    exps = {}
    for m in ("effb0", "mnv3"):
        exps[f"{m}-distill"] = cifar_config(dd, m, "distill", epochs=4)
        exps[f"{m}-sup"] = cifar_config(dd, m, "supervised", epochs=4)
    exps["keras-effb0-distill"] = keras_effb0_config(dd, "distill", epochs=4)  # mean-minmax, as effb0-distill
    exps["keras-effb0-distill-pct"] = keras_effb0_config(dd, "distill", epochs=4, method="percentile")  # optimize's pick
    for obj, short in (("distill", "distill"), ("supervised", "sup")):
        exps[f"camvid-{short}"] = camvid_config(dd, obj, epochs=20)
        exps[f"camvid-{short}-lr3"] = camvid_config(dd, obj, epochs=20, lr=1e-3)
    # second round (label-free missed 52.31 by 0.07-0.21): longer, and with learned ranges
    exps["camvid-distill-lr3-e40"] = camvid_config(dd, "distill", epochs=40, lr=1e-3)
    exps["camvid-distill-lr3-learned"] = camvid_config(dd, "distill", epochs=20, lr=1e-3, ranges="learned")
    # the DeepLabV3 was trained with AdamW at 2e-3: pytorch-quantization's "~1 % of the original LR", same optimizer
    exps["camvid-distill-adamw"] = camvid_config(dd, "distill", epochs=20, optimizer="adamw", lr=2e-5)
    exps["camvid-distill-adamw-lr1e-4"] = camvid_config(dd, "distill", epochs=20, optimizer="adamw", lr=1e-4)
    # seed 002's table: QAT supervised, 1 % of the from-scratch peak LR (0.1) for 10 % of its 40 epochs
    r50 = dict(epochs=4, lr=1e-3, batch_size=256)
    exps["r50-qat-max"] = cifar_config(dd, "r50", "supervised", method="max", **r50)
    exps["r50-qat-max-noresq"] = cifar_config(dd, "r50", "supervised", method="max", residual_quantizers=False, **r50)
    exps["r50-qat-mse"] = cifar_config(dd, "r50", "supervised", method="mse", **r50)
    return exps


def run_qat(name: str, cfg: dict, runs: Path) -> dict:
    from qdeploy import api

    out = runs / name
    t0 = time.perf_counter()
    r = api.qat(cfg, out)
    keep = ("fp32", "before", "after", "after_onnx", "onnxruntime", "agreement", "metric", "epochs", "images_per_s", "objective",
            "method", "train_images", "processes", "time_s", "structure", "learned_ranges")
    rec = {k: r.get(k) for k in keep}
    rec["log"] = [{k: e.get(k) for k in ("epoch", "loss", "metric", "images_per_s", "seconds")} for e in r["log"]]
    rec["qat"] = r["qat"]
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec


def train_r50(dd: Path, epochs: int = 40, batch: int = 256, lr: float = 0.1) -> dict:
    """torchvision resnet50(num_classes=10) from scratch on cifar10/train (20k images) at 64x64: seed 002's model."""
    import torchvision
    from torch.nn import functional as F

    from qdeploy.config import DatasetSpec, Preprocess
    from qdeploy.data import make_batches

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pre = Preprocess(**cifar_model(dd, "r50")["preprocess"])
    batches = make_batches(DatasetSpec(format="imagefolder", root=str(dd / "cifar-train")), pre, "classification", batch_size=1000)
    xs, ys = zip(*batches)
    x_all = torch.from_numpy(np.concatenate(xs)).to(dev)
    y_all = torch.from_numpy(np.concatenate(ys)).long().to(dev)
    mean = torch.tensor(pre.mean, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(pre.std, device=dev).view(1, 3, 1, 1) * 255
    model = torchvision.models.resnet50(num_classes=10, zero_init_residual=True).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    n = len(x_all)
    steps = epochs * math.ceil(n / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.15)
    t0, hist = time.perf_counter(), []
    for ep in range(epochs):
        model.train()
        perm = torch.randperm(n, device=dev)
        losses = []
        for i in range(0, n, batch):
            idx = perm[i:i + batch]
            x = x_all[idx].float()
            flip = torch.rand(len(idx), device=dev) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            x = F.pad(x, (8, 8, 8, 8), mode="reflect")
            dy, dx = np.random.randint(0, 17, 2)
            x = ((x[:, :, dy:dy + 64, dx:dx + 64] - mean) / std).contiguous(memory_format=torch.channels_last)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                loss = F.cross_entropy(model(x), y_all[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.detach())
        hist.append({"epoch": ep + 1, "loss": round(float(torch.stack(losses).mean()), 4), "t": round(time.perf_counter() - t0, 1)})
        print(f"r50-train: epoch {ep + 1}/{epochs} loss {hist[-1]['loss']:.4f} ({hist[-1]['t']:.0f} s)", flush=True)
    seconds = time.perf_counter() - t0
    torch.save({k: v.float().cpu() for k, v in model.state_dict().items()}, dd / "r50_cifar64.pt")
    return {"epochs": epochs, "batch_size": batch, "lr": lr, "train_images": n, "seconds": round(seconds, 1),
            "images_per_s": round(epochs * n / seconds, 1), "history": hist,
            "recipe": "SGD nesterov 0.9, wd 5e-4, one-cycle max 0.1, zero-init residual BN, label smoothing 0.1, flip + reflect-pad-8 crop, bf16, channels_last"}


def train_throughput(dd: Path, name: str, batch: int = 128, epochs: float = 1.0) -> dict:
    """Images/s of FP32 training vs QAT training of the same model, same batch, same loop (QatTrainer), supervised."""
    from qdeploy.config import QatConfig
    from qdeploy.pipeline import as_config
    from qdeploy.data import make_batches
    from qdeploy.models import build_torch_model
    from qdeploy.quantize.qat import QatTrainer, TrainingSet

    cfg = as_config(cifar_config(dd, name, "supervised", epochs=epochs, batch_size=batch))
    pre = cfg.model.preprocess
    b = make_batches(cfg.data.train, pre, "classification", batch_size=1000)
    xs, ys = zip(*b)
    data = TrainingSet(np.concatenate(xs), np.concatenate(ys), np.asarray(pre.mean, np.float32) * 255, np.asarray(pre.std, np.float32) * 255)
    out = {}
    model = build_torch_model(cfg.model).cuda()
    q = QatConfig(objective="supervised", epochs=epochs, batch_size=batch, freeze_bn_after=None, device="cuda")
    log = QatTrainer(model, None, q, data, "classification", -100, Path(f"/tmp/qat-runs/fp32-{name}"), "fp32", "cuda").fit()
    out["fp32_images_per_s"] = log[-1]["images_per_s"]
    rec = run_qat(f"tput-{name}", cifar_config(dd, name, "supervised", epochs=epochs, batch_size=batch), Path("/tmp/qat-runs"))
    out["qat_images_per_s"] = rec["images_per_s"]
    out["ratio"] = round(out["qat_images_per_s"] / out["fp32_images_per_s"], 3)
    out["batch_size"] = batch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*")
    ap.add_argument("--data", type=Path, default=Path("/tmp/dd"))
    ap.add_argument("--json", type=Path, default=Path("qat_gpu.json"))
    ap.add_argument("--runs", type=Path, default=Path("/tmp/qat-runs"))
    ap.add_argument("--r50-epochs", type=int, default=40)
    ap.add_argument("--emit-config", metavar="NAME", help="print the YAML config of an experiment and exit")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a qat: key (YAML value)")
    args = ap.parse_args()
    exps = experiments(args.data)
    for cfg in exps.values():
        for kv in args.set:
            k, v = kv.split("=", 1)
            cfg["qat"][k] = yaml.safe_load(v)
    if args.emit_config:
        print(yaml.safe_dump(exps[args.emit_config], sort_keys=False))
        return
    results = json.loads(args.json.read_text()) if args.json.is_file() else {}
    results.setdefault("_env", {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                "torch": torch.__version__})
    for name in args.names:
        print(f"=== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            if name == "r50-train":
                rec = train_r50(args.data, epochs=args.r50_epochs)
            elif name.startswith("throughput-"):
                rec = train_throughput(args.data, name.split("-", 1)[1])
            elif name == "r50-table":
                rec = {n: run_qat(n, copy.deepcopy(exps[n]), args.runs) for n in ("r50-qat-max", "r50-qat-max-noresq", "r50-qat-mse")}
            else:
                rec = run_qat(name, copy.deepcopy(exps[name]), args.runs)
        except Exception as e:  # keep the other experiments' results
            import traceback

            traceback.print_exc()
            rec = {"error": f"{type(e).__name__}: {e}"}
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        results[name] = rec
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str))
        short = {k: rec.get(k) for k in ("fp32", "before", "after", "after_onnx", "images_per_s", "error", "wall_s") if k in rec}
        print(f"=== {name}: {json.dumps(short, default=str)}", flush=True)


if __name__ == "__main__":
    main()
