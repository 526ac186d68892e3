"""The real-size suite's classifiers, trained from scratch on a GPU: CIFAR-10 resized to 224x224 (no pretrained weights
can be downloaded on the device machine; every table that shows these models says "CIFAR-10 resized to 224").

    python bench/train/train_realsize.py --data DIR --out DIR [--models resnet50 deit_small ...] [--seconds 75]

DIR (--data) holds CIFAR-10 as image folders: train/<class>/*.png (any number per class) and test/<class>/*.png; the
device call (bench/device/realsize_cpu.sh) unpacks bench/device/stage_realsize.sh's tars there. Per model:

- the images live on the GPU as uint8 32x32; a batch is augmented there (reflect-pad 4 + random 32x32 crop, horizontal
  flip), scaled to [0, 1], resized bilinearly to 224x224 and normalised with ImageNet's mean/std: the same input
  protocol as the shared CIFAR models, so qdeploy's preprocess (resize 224, bilinear, ImageNet mean/std) reproduces it;
- AdamW (weight decay 0.05), label smoothing 0.1, bf16 autocast, channels-last, a cosine schedule over a fixed
  wall-clock budget (``--seconds``, counted from step 20, after cuDNN's benchmark; warm-up 5 %), batch 128: the same
  budget for every model, so a call's length is known;
- top-1 on the whole test folder (FP32 on the GPU) is written beside the weights.

Writes OUT/<name>.pt (a plain state_dict in FP16, loaded into an FP32 model by qdeploy's ``model.weights``) and
OUT/<name>.json (source, kwargs, top-1, epochs, seconds, images/s). Training here is only a way to get trained weights at
the deployed size; its accuracy is stated, not a goal.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

# name → (qdeploy model source, kwargs, peak learning rate). The sources are what bench/suites/realsize_cpu.py passes to
# qdeploy (``torchvision:<fn>`` / ``timm:<name>``): the module trained here is the module exported there.
MODELS = {
    "resnet50": ("torchvision:resnet50", {"num_classes": 10}, 2e-3),
    "mobilenet_v3_large": ("torchvision:mobilenet_v3_large", {"num_classes": 10}, 2e-3),
    "efficientnet_b0": ("torchvision:efficientnet_b0", {"num_classes": 10}, 2e-3),
    "convnext_tiny": ("timm:convnext_tiny", {"num_classes": 10}, 1e-3),
    "swin_tiny": ("timm:swin_tiny_patch4_window7_224", {"num_classes": 10}, 1e-3),
    "deit_small": ("timm:deit_small_patch16_224", {"num_classes": 10}, 5e-4),
}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224
WARM_STEPS = 20  # cuDNN's benchmark of each convolution (forward and backward) happens in these, before the clock


def build(name: str):
    source, kwargs, _ = MODELS[name]
    lib, fn = source.split(":", 1)
    if lib == "torchvision":
        import torchvision

        return getattr(torchvision.models, fn)(weights=None, **kwargs)
    import timm

    return timm.create_model(fn, pretrained=False, **kwargs)


def load_split(root: Path, device):
    """(uint8 N x 3 x 32 x 32 on ``device``, labels, class names) of an image-folder split."""
    import torch
    from PIL import Image

    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    xs, ys = [], []
    for i, c in enumerate(classes):
        for f in sorted((root / c).glob("*.png")):
            xs.append(np.asarray(Image.open(f).convert("RGB")))
            ys.append(i)
    if not xs:
        raise SystemExit(f"{root} has no <class>/*.png images")
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous().to(device)
    return x, torch.tensor(ys, device=device), classes


def train_one(name: str, x, y, xt, yt, seconds: float, out: Path, batch: int = 128) -> dict:
    import torch
    import torch.nn.functional as F

    dev = x.device
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)

    def prep(xb, train: bool):
        xb = xb.float() / 255
        if train:
            xb = F.pad(xb, (4, 4, 4, 4), mode="reflect")
            i, j = np.random.randint(0, 9, 2)
            xb = xb[:, :, i:i + 32, j:j + 32]
            flip = torch.rand(xb.shape[0], device=dev) < 0.5
            xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(3), xb)
        xb = F.interpolate(xb, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        return ((xb - mean) / std).contiguous(memory_format=torch.channels_last)

    torch.manual_seed(0)
    np.random.seed(0)
    lr = MODELS[name][2]
    # fixed shapes: cuDNN picks its fastest kernels per convolution. Its benchmark runs in the first steps and is not
    # counted in the model's seconds: it took ~44 s of EfficientNet-B0's 50 (one epoch, 16 % top-1; 2,719 images/s
    # after it, 356 over the whole budget), a few for the others. The clock starts at step WARM_STEPS, the steps
    # before it train at the warm-up's zero learning rate, and the rate over steps 20-70 is printed so that a slow run
    # shows before its weights are used.
    torch.backends.cudnn.benchmark = True
    m = build(name).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.05)
    t_start, epochs, seen, steps, window = time.time(), 0, 0, 0, None
    t0, warm_s = None, 0.0
    done = False
    while not done:
        m.train()
        perm = torch.randperm(len(x), device=dev)
        for s in range(0, len(x) - batch + 1, batch):
            if t0 is None and steps >= WARM_STEPS:
                torch.cuda.synchronize()
                t0 = time.time()
                warm_s = t0 - t_start
            prog = 0.0 if t0 is None else (time.time() - t0) / seconds
            if prog >= 1:
                done = True
                break
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, prog / 0.05) * 0.5 * (1 + math.cos(math.pi * prog))
            idx = perm[s:s + batch]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(m(prep(x[idx], True)), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0)
            opt.step()
            seen, steps = seen + len(idx), steps + 1
            if steps in (20, 70):
                torch.cuda.synchronize()
                if steps == 20:
                    window = (time.time(), seen)
                else:
                    print(f"{name}: {(seen - window[1]) / (time.time() - window[0]):.0f} images/s over steps 20-70 "
                          f"(batch {batch}, after cuDNN's benchmark)", flush=True)
        else:
            epochs += 1
    train_s = time.time() - t0
    seen_timed = seen - WARM_STEPS * batch
    m.eval()
    correct = 0
    with torch.no_grad():  # FP32: the accuracy qdeploy's FP32 export should reproduce
        for s in range(0, len(xt), 250):
            correct += (m(prep(xt[s:s + 250], False)).argmax(1) == yt[s:s + 250]).sum().item()
    top1 = 100.0 * correct / len(xt)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: (v.half() if v.is_floating_point() else v).cpu() for k, v in m.state_dict().items()},
               out / f"{name}.pt")
    source, kwargs, _ = MODELS[name]
    info = {"model": name, "source": source, "kwargs": kwargs, "input_size": SIZE, "data": "CIFAR-10 resized to 224",
            "train_images": len(x), "test_images": len(xt), "test_top1_fp32": round(top1, 2),
            "epochs_completed": epochs, "images_seen": seen, "train_seconds": round(train_s, 1),
            "warm_up_seconds": round(warm_s, 1), "warm_up_steps": WARM_STEPS,
            "images_per_s": round(seen_timed / train_s, 1), "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__}
    (out / f"{name}.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info), flush=True)
    del m, opt
    torch.cuda.empty_cache()
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="CIFAR-10 image folders: train/ and test/")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--seconds", type=float, default=75.0, help="wall-clock training budget per model")
    ap.add_argument("--skip-existing", action="store_true", help="keep a model whose OUT/<name>.pt exists")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("train_realsize.py trains on a GPU (none is visible)")
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    x, y, classes = load_split(a.data / "train", "cuda")
    xt, yt, _ = load_split(a.data / "test", "cuda")
    print(f"train {len(x)} / test {len(xt)} images, classes {classes}", flush=True)
    for name in a.models:
        if a.skip_existing and (a.out / f"{name}.pt").exists():
            print(f"{name}: kept {a.out / (name + '.pt')}", flush=True)
            continue
        train_one(name, x, y, xt, yt, a.seconds, a.out)


if __name__ == "__main__":
    main()
