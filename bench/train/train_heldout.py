"""Held-out (non-timm) classifiers, trained from scratch on CIFAR-10 (20k train images) exactly in the spirit of ../shared/models/cifar10-modern/train.py:
GPU-resident data, AdamW (wd 0.05), time-based cosine schedule with 5 % warm-up, label smoothing 0.1, reflect-pad-4
random crop + horizontal flip, bf16 autocast, grad-clip 5, RGB/255 then ImageNet mean/std, batch 256.

Factories (also the qdeploy model sources; importing this file trains nothing):
  bench/train/train_heldout.py:tv_swin   torchvision.models.swin_transformer.SwinTransformer, small widths, 32x32
  bench/train/train_heldout.py:hf_vit    transformers ViTForImageClassification (eager attention), wrapped to return logits
  issue 35 (the GPU search's table; trained the same way):
  bench/train/train_heldout.py:tv_vit    torchvision VisionTransformer, ViT-tiny widths (192 wide, 3 heads), 5 layers, 32x32
  bench/train/train_heldout.py:tv_convnext_femto   torchvision ConvNeXt, timm's femto widths (48-384, depths 2-2-6-2), 64x64
  bench/train/train_heldout.py:tv_effnet_b0       torchvision efficientnet_b0, 64x64
  The 64x64 models see the 32x32 CIFAR images upsampled bilinearly (qdeploy's preprocess: resize [64, 64]). The weights
  (FP16, 4.5-9.7 MB each) are not committed: re-train them with this file; bench/ and its configs read them from .devheld/
  (git-ignored); bench/weights/NAME.json keeps each training run's record.

Training (on a GPU; one process per model, side by side):
  python3 bench/train/train_heldout.py NAME SECONDS DATA.npz   -> $OUT/NAME.pt (FP16 state_dict) and $OUT/NAME.json
DATA.npz: {data: concatenated PNG bytes, off: offsets, y: labels, classes} (see bench/device/heldout_call.sh).
CPU evaluation of the FP32 model on the full test set (fills top1 into the json):
  python bench/train/train_heldout.py --eval NAME .devheld/NAME.pt ../shared/data/cifar10/test
"""
from __future__ import annotations

import torch
from torch import nn

SWIN_KW = dict(patch_size=[2, 2], embed_dim=32, depths=[2, 2, 2, 2], num_heads=[2, 4, 8, 16], window_size=[4, 4],
               num_classes=10)
VIT_KW = dict(image_size=32, patch_size=4, num_channels=3, hidden_size=192, num_hidden_layers=5, num_attention_heads=3,
              intermediate_size=768, num_labels=10)


def tv_swin(**overrides) -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(**{**SWIN_KW, **overrides})


class Logits(nn.Module):
    """transformers returns an ImageClassifierOutput; the wrapper returns the logits tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def hf_vit(**overrides) -> nn.Module:
    import transformers
    cfg = transformers.ViTConfig(**{**VIT_KW, **overrides})
    cfg._attn_implementation = "eager"
    m = transformers.ViTForImageClassification(cfg)
    m.config._attn_implementation = "eager"
    return Logits(m)


TV_VIT_KW = dict(image_size=32, patch_size=4, num_layers=5, num_heads=3, hidden_dim=192, mlp_dim=768, num_classes=10)


def tv_vit(**overrides) -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(**{**TV_VIT_KW, **overrides})


FEMTO = ((48, 96, 2), (96, 192, 2), (192, 384, 6), (384, None, 2))


def tv_convnext_femto(num_classes: int = 10) -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(*c) for c in FEMTO], num_classes=num_classes)


def tv_effnet_b0(num_classes: int = 10) -> nn.Module:
    import torchvision
    return torchvision.models.efficientnet_b0(num_classes=num_classes)


# name -> (factory, kwargs recorded, input size)
FACTORIES = {"tv_swin": (tv_swin, SWIN_KW, 32), "hf_vit": (hf_vit, VIT_KW, 32), "tv_vit": (tv_vit, TV_VIT_KW, 32),
             "tv_convnext_femto": (tv_convnext_femto, {"widths": [48, 96, 192, 384], "depths": [2, 2, 6, 2]}, 64),
             "tv_effnet_b0": (tv_effnet_b0, {"num_classes": 10}, 64)}
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def train(name: str, budget: float, npz: str) -> None:
    import io, json, math, os, time
    import numpy as np, torch.nn.functional as F
    from PIL import Image

    out = os.environ.get("OUT", "/tmp"); dev = os.environ.get("DEV", "cuda")
    d = np.load(npz)
    buf, off = d["data"].tobytes(), d["off"]
    xs = np.stack([np.asarray(Image.open(io.BytesIO(buf[off[i]:off[i + 1]])).convert("RGB")) for i in range(len(off) - 1)])
    x = torch.from_numpy(xs).permute(0, 3, 1, 2).contiguous().to(dev); y = torch.from_numpy(d["y"].astype(np.int64)).to(dev)
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1); std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)

    fac, kw, size = FACTORIES[name]

    def prep(xb, train):
        xb = xb.float() / 255
        if train:
            xb = F.pad(xb, (4, 4, 4, 4), mode="reflect"); i, j = np.random.randint(0, 9, 2); xb = xb[:, :, i:i + 32, j:j + 32]
            flip = torch.rand(xb.shape[0], device=dev) < 0.5; xb = torch.where(flip.view(-1, 1, 1, 1), xb.flip(3), xb)
        if size != 32:  # bilinear, half-pixel centres: what PIL's resize does when upsampling
            xb = F.interpolate(xb, size=(size, size), mode="bilinear", align_corners=False)
        return (xb - mean) / std

    torch.manual_seed(0); np.random.seed(0)
    m = fac().to(dev)
    lr = 1e-3
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.05)
    bs, t0, ep, step = 256, time.time(), 0, 0
    while True:
        prog = (time.time() - t0) / budget
        if prog >= 1: break
        m.train(); perm = torch.randperm(len(x), device=dev)
        for s in range(0, len(x) - bs + 1, bs):
            prog = (time.time() - t0) / budget
            if prog >= 1: break
            cur = lr * min(1.0, prog / 0.05) * 0.5 * (1 + math.cos(math.pi * prog))
            for g in opt.param_groups: g["lr"] = cur
            idx = perm[s:s + bs]
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = F.cross_entropy(m(prep(x[idx], True)), y[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 5.0); opt.step(); step += 1
        ep += 1
        if ep % 10 == 0: print(name, "epoch", ep, "loss", round(loss.item(), 3), "t", round(time.time() - t0), flush=True)
    train_s = round(time.time() - t0)
    # train-set accuracy of the FP32 model (eval mode, no augmentation), a sanity number only
    m.eval(); correct = 0
    with torch.no_grad():
        for s in range(0, len(x), 1000):
            correct += (m(prep(x[s:s + 1000], False)).argmax(1) == y[s:s + 1000]).sum().item()
    sd = {k: v.detach().half().cpu() for k, v in m.state_dict().items()}
    torch.save(sd, f"{out}/{name}.pt")
    import torchvision
    res = {"name": name, "factory": f"bench/train/train_heldout.py:{name}", "kwargs": kw, "input": size,
           "epochs": ep, "steps": step, "train_s": train_s, "batch_size": bs, "peak_lr": lr, "weight_decay": 0.05,
           "params": sum(p.numel() for p in m.parameters()), "train_images": len(x),
           "train_top1_fp32_gpu": round(100 * correct / len(x), 2), "torch": torch.__version__,
           "torchvision": torchvision.__version__, "gpu": torch.cuda.get_device_name() if dev == "cuda" else dev,
           "pt_bytes": os.path.getsize(f"{out}/{name}.pt"), "saved_dtype": "float16"}
    if name == "hf_vit":
        import transformers
        res["transformers"] = transformers.__version__; res["attn_implementation"] = m.model.config._attn_implementation
    print("RESULT", json.dumps(res), flush=True)
    json.dump(res, open(f"{out}/{name}.json", "w"), indent=1)


def evaluate(name: str, weights: str, root: str) -> float:
    """FP32 top-1 of the model built from the FP16 state_dict (cast into the FP32 model), on CPU."""
    import glob, json, os
    import numpy as np
    from PIL import Image
    fac, _, size = FACTORIES[name]
    m = fac(); m.load_state_dict(torch.load(weights, weights_only=True)); m.float().eval()
    classes = sorted(os.listdir(root)); xs, ys = [], []
    for i, c in enumerate(classes):
        for f in sorted(glob.glob(os.path.join(root, c, "*.png"))):
            xs.append(np.asarray(Image.open(f).convert("RGB"))); ys.append(i)
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).float() / 255; y = torch.tensor(ys)
    if size != 32:
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    correct = 0
    with torch.no_grad():
        for s in range(0, len(x), 500):
            correct += (m(x[s:s + 500]).argmax(1) == y[s:s + 500]).sum().item()
    top1 = round(100 * correct / len(x), 2)
    jp = os.path.splitext(weights)[0] + ".json"
    if os.path.exists(jp):
        res = json.load(open(jp))
        res.update({"fp32_top1_test": top1, "test_images": len(x), "fp32_top1_measured_on": "CPU, torch "
                    + torch.__version__ + (", transformers " + __import__("transformers").__version__ if name == "hf_vit" else "")})
        json.dump(res, open(jp, "w"), indent=1)
    print(name, "FP32 top-1", top1, "on", len(x))
    return top1


if __name__ == "__main__":
    import sys
    if sys.argv[1] == "--eval":
        evaluate(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        train(sys.argv[1], float(sys.argv[2]), sys.argv[3])
