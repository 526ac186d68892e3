"""NNCF's model_type on models whose blocks normalize with LayerNorm but have no attention: does NNCF's default INT8
scheme hold, or does it need model_type TRANSFORMER (which keeps Add, MVN and the other normalization ops float)?

    python bench/diagnose/nncf_model_type.py --cifar ../shared/data/cifar10 --json docs/results/nncf_model_type.json

Models: ../shared's ConvNeXt-atto (timm, trained, 64 px) and two trained here on CIFAR-10 at 32 px (seeded, a few
minutes on 2 cores): torchvision's ConvNeXt (another implementation: nn.LayerNorm on permuted tensors, its own layer
scale) at a small width, and timm's MLP-Mixer (LayerNorm, token- and channel-mixing MLPs, no attention). Each one's
OpenVINO model is quantized by NNCF 3.x (300 calibration images) with model_type default, TRANSFORMER, and default
with every Add float, and each INT8 IR is scored against the FP32 IR on 1,000 other test images (top-1, agreement of
the argmax). Prints the CPU's flags. ``--speed`` also times timm's ConvNeXt-T at 224 (random weights, batch 1, every
core, 32 noise images calibrating): OpenVINO FP32, BF16 and NNCF's INT8 IR with each of the three schemes
(float layers f32 and BF16), 5 interleaved rounds of 15 calls, median of the round medians. ``--attention`` measures
the same three schemes on ../shared's trained ViT and Swin (accuracy) and times timm's DeiT-S at 224 at batch 1 and 16
(random weights), added to --json as ``attention_rows`` / ``attention_speed``: optimize's second scheme on an attention
model (lint/placement.nncf_schemes).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

MEAN = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
STD = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]


def images(root: Path, split: str, per_class: int, size: int, seed: int):
    from PIL import Image

    classes = sorted(p.name for p in (root / split).iterdir() if p.is_dir())
    files = [(f, i) for i, c in enumerate(classes) for f in sorted(glob.glob(str(root / split / c / "*.png")))[:per_class]]
    random.Random(seed).shuffle(files)

    def load(f):
        im = Image.open(f).convert("RGB")
        if im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        return (np.asarray(im, np.float32).transpose(2, 0, 1) / 255 - MEAN) / STD

    return np.stack([load(f) for f, _ in files]).astype(np.float32), np.array([y for _, y in files])


def torchvision_convnext_mini() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    cfg = [CNBlockConfig(32, 64, 2), CNBlockConfig(64, 128, 2), CNBlockConfig(128, 256, 2), CNBlockConfig(256, None, 2)]
    net = ConvNeXt(cfg, stochastic_depth_prob=0.0, layer_scale=1e-6, num_classes=10)
    net.features[0][0] = nn.Conv2d(3, 32, kernel_size=2, stride=2)  # a 2x2 stem for 32 px inputs (16x16 after it)
    return net


def timm_mixer_mini() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=6, embed_dim=128)


def train(net: nn.Module, x: np.ndarray, y: np.ndarray, seconds: float, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=0.05)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    net.train()
    t0, steps, epochs = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < seconds:
        perm = torch.randperm(len(xt))
        for i in range(0, len(xt) - 63, 64):
            idx = perm[i:i + 64]
            xb = xt[idx]
            flip = torch.rand(len(xb)) < 0.5
            xb[flip] = xb[flip].flip(-1)
            loss = nn.functional.cross_entropy(net(xb), yt[idx], label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if time.perf_counter() - t0 >= seconds:
                break
        epochs += 1
    net.eval()
    return {"train_seconds": round(time.perf_counter() - t0, 1), "steps": steps, "epochs_started": epochs}


def measure(name: str, net: nn.Module, calib: np.ndarray, ev: np.ndarray, yev: np.ndarray) -> dict:
    import nncf
    import openvino as ov

    core = ov.Core()
    model = ov.convert_model(net, example_input=torch.from_numpy(calib[:1]))

    def predict(m):
        compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        return np.concatenate([compiled(ev[i:i + 50])[0] for i in range(0, len(ev), 50)]).argmax(1)

    ref = predict(model)
    row = {"model": name, "fp32_top1": round(float((ref == yev).mean()) * 100, 2), "eval_images": len(ev),
           "calibration_images": len(calib)}
    data = nncf.Dataset([calib[i:i + 1] for i in range(len(calib))])
    # the third: NNCF's default scheme with every Add left float (what TRANSFORMER's ignored types start with): whether
    # the Adds (the residual sums, a conv's bias) are what the default scheme breaks
    for label, kwargs in (("default", {}), ("transformer", {"model_type": nncf.ModelType.TRANSFORMER}),
                          ("default_add_float", {"ignored_scope": nncf.IgnoredScope(types=["Add"], validate=False)})):
        t0 = time.perf_counter()
        q = nncf.quantize(model, data, subset_size=len(calib), **kwargs)
        pred = predict(q)
        row[label] = {"top1": round(float((pred == yev).mean()) * 100, 2),
                      "agreement": round(float((pred == ref).mean()) * 100, 2),
                      "quantize_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(row), flush=True)
    return row


def speed(threads: int, name: str = "convnext_tiny", batch: int = 1) -> dict:
    import nncf
    import openvino as ov
    import timm

    torch.manual_seed(0)
    net = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = np.random.default_rng(0).standard_normal((max(32, batch), 3, 224, 224)).astype(np.float32)
    model = ov.convert_model(net, example_input=torch.from_numpy(x[:1]))
    data = nncf.Dataset([x[i:i + 1] for i in range(len(x))])
    default = nncf.quantize(model, data, subset_size=len(x))
    transformer = nncf.quantize(model, data, subset_size=len(x), model_type=nncf.ModelType.TRANSFORMER)
    # optimize's second scheme on a LayerNorm model without attention (lint/placement.nncf_schemes)
    add_float = nncf.quantize(model, data, subset_size=len(x),
                              ignored_scope=nncf.IgnoredScope(types=["Add"], validate=False))
    core = ov.Core()

    def compiled(m, hint):
        return core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY",
                                             "INFERENCE_NUM_THREADS": threads})

    variants = {"ov-fp32": compiled(model, "f32"), "ov-bf16": compiled(model, "bf16"),
                "int8-default-f32": compiled(default, "f32"), "int8-default-bf16": compiled(default, "bf16"),
                "int8-transformer-f32": compiled(transformer, "f32"),
                "int8-transformer-bf16": compiled(transformer, "bf16"),
                "int8-default-add-float-f32": compiled(add_float, "f32"),
                "int8-default-add-float-bf16": compiled(add_float, "bf16")}
    b = x[:batch]
    for c in variants.values():
        for _ in range(5):
            c(b)
    rounds = {k: [] for k in variants}
    items = list(variants.items())
    for r in range(5):
        for k, c in items[r:] + items[:r]:
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                c(b)
                ts.append(time.perf_counter() - t0)
            rounds[k].append(float(np.median(ts)) * 1e3)
    out = {k: {"p50_ms": round(float(np.median(v)), 3), "round_medians_ms": [round(t, 3) for t in v]}
           for k, v in rounds.items()}
    print(json.dumps({f"{name}_b{batch}_speed": out}), flush=True)
    return {"model": f"timm {name}, random weights, 224 px, batch {batch}", "threads": threads, "variants": out}


SHARED_ATTENTION = (  # ../shared/models/cifar10-modern's trained attention models at 32 px (README there: name, kwargs)
    ("deit_tiny_p4_32.pt", "vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4}),
    ("swin_mini_32.pt", "swin_tiny_patch4_window7_224", {"img_size": 32, "patch_size": 2, "window_size": 4,
                                                         "embed_dim": 48, "depths": [2, 2, 4, 2],
                                                         "num_heads": [2, 4, 8, 16]}))


def attention_rows(cifar: Path, shared: Path) -> list[dict]:
    """The three schemes on ../shared's trained attention models (a ViT and a Swin): whether NNCF's default scheme,
    which also quantizes the attention MatMuls' inputs and the residual Adds, holds there."""
    import timm

    rows = []
    x, y = images(cifar, "test", 130, 32, 0)
    for file, name, kwargs in SHARED_ATTENTION:
        path = shared / "cifar10-modern" / file
        if not path.is_file():
            print(f"skipped {file}: {path} is absent")
            continue
        net = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        net.load_state_dict({k: v.float() for k, v in torch.load(path, weights_only=True).items()})
        rows.append({**measure(f"timm {name} {kwargs} (../shared {file})", net.eval(), x[:300], x[300:], y[300:]),
                     "weights": str(path)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cifar", type=Path, required=True)
    ap.add_argument("--shared-models", type=Path, default=None, help="../shared/models (ConvNeXt-atto); default: beside --cifar")
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--speed", action="store_true", help="also time ConvNeXt-T at 224 with each scheme")
    ap.add_argument("--only-speed", action="store_true", help="only the timing (keeps the rows of an existing --json)")
    ap.add_argument("--attention", action="store_true",
                    help="only ../shared's trained ViT and Swin (accuracy) and DeiT-S at 224 at batch 1 and 16 (speed), "
                         "added to an existing --json as attention_rows / attention_speed")
    a = ap.parse_args()
    import platform

    import nncf
    import openvino as ov
    import timm

    flags = sorted(f for f in open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
                   if f.startswith(("avx", "amx")))
    print("# cpu", platform.processor() or platform.machine(), "flags:", " ".join(flags))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if a.attention:
        doc = json.loads(a.json.read_text()) if a.json and a.json.is_file() else {"rows": []}
        doc["attention_rows"] = attention_rows(a.cifar, a.shared_models or a.cifar.parents[1] / "models")
        doc["attention_speed"] = [speed(os.cpu_count() or 1, "deit_small_patch16_224", b) for b in (1, 16)]
        doc["attention_command"] = ("python bench/diagnose/nncf_model_type.py --cifar ../shared/data/cifar10 --attention "
                                    "--json docs/results/nncf_model_type.json")
        doc["attention_cpu_flags"] = flags
        if a.json:
            a.json.write_text(json.dumps(doc, indent=1))
        return
    if a.only_speed:
        doc = json.loads(a.json.read_text()) if a.json and a.json.is_file() else {"rows": []}
        doc.update(cpu_flags=flags, speed=speed(os.cpu_count() or 1))
        if a.json:
            a.json.write_text(json.dumps(doc, indent=1))
        return
    rows = []
    shared = a.shared_models or a.cifar.parents[1] / "models"
    atto = shared / "cifar10-modern" / "convnext_atto_64.pt"
    if atto.is_file():
        net = timm.create_model("convnext_atto", pretrained=False, num_classes=10, conv_mlp=False)
        net.load_state_dict({k: v.float() for k, v in torch.load(atto, weights_only=True).items()})
        x, y = images(a.cifar, "test", 130, 64, 0)
        rows.append({**measure("timm convnext_atto (../shared, 64 px)", net.eval(), x[:300], x[300:], y[300:]),
                     "weights": str(atto)})
    else:
        print(f"skipped ConvNeXt-atto: {atto} is absent")
    xtr, ytr = images(a.cifar, "train", 1000, 32, 1)
    x, y = images(a.cifar, "test", 130, 32, 0)
    for name, make in (("torchvision ConvNeXt (4 stages, widths 32-256, 32 px)", torchvision_convnext_mini),
                       ("timm MLP-Mixer (6 blocks, width 128, patch 4, 32 px)", timm_mixer_mini)):
        torch.manual_seed(0)
        net = make()
        rec = train(net, xtr, ytr, a.train_seconds)
        rows.append({**measure(name, net, x[:300], x[300:], y[300:]), "training": {**rec, "train_images": len(xtr)}})
    doc = {"cpu_flags": flags, "versions": {"nncf": nncf.__version__, "openvino": ov.__version__, "torch": torch.__version__,
                                            "timm": timm.__version__}, "rows": rows,
           "command": "python bench/diagnose/nncf_model_type.py --cifar ../shared/data/cifar10 --json docs/results/nncf_model_type.json"}
    if a.speed:
        doc["speed"] = speed(os.cpu_count() or 1)
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
