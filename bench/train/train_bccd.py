"""Train a BCCD detector from scratch (issue 37): bench/train/bccd_models.py's ``yolo`` (written here, YOLOv8 style) or
``ssdlite`` (torchvision's SSDlite320-MobileNetV3-Large), on BCCD's own train split (205 images), evaluated on its
test split (72 images) with qdeploy's decoders and COCOeval.

    python bench/train/train_bccd.py yolo --data ../shared/data/detection/bccd --out bench/weights/bccd_yolo.pt \
        [--epochs 300] [--time-limit 480] [--batch 16] [--device cuda]

Images are letterboxed to 320x320 (640x480 → 320x240 + 40 pixels of grey above and below), as qdeploy feeds them
(``preprocess: {input_size: [320, 320], letterbox: true}``). BCCD's two zero-size boxes are left out (``bad_boxes:
skip``, listed). Augmentation: horizontal and vertical flips, ±15 % brightness/contrast. The weights are saved rounded
to FP16 (a 1.5 M-parameter model in 2.9 MB: the committed-file limit is 5 MB) and the evaluation is of those rounded
weights in FP32; beside them OUT.json holds the training settings, time, device and the test-split mAP.

yolo's loss: FCOS-style assignment (a point inside a box and within 2.5 strides of its centre, on the level whose
range holds the box's largest distance; the smallest box wins a tie), GIoU loss on the box distances, and a quality
focal loss (Li et al. 2020, GFL) on the class scores with the predicted box's IoU as the positive target. ssdlite:
torchvision's own SSD losses (hard negative mining 3:1, smooth-L1).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "src"))

import bccd_models  # noqa: E402
from qdeploy.config import Preprocess  # noqa: E402
from qdeploy.data.transforms import _open, box_geometry, image_to_array  # noqa: E402
from qdeploy.tasks.detection_data import map_classes, read_voc, skipped_boxes  # noqa: E402
from qdeploy.tasks.detection_decode import DECODERS, postprocess  # noqa: E402
from qdeploy.tasks.detection_metrics import DetectionMetrics  # noqa: E402

SIZE = bccd_models.SIZE
NORM = {"yolo": (0.0, 1.0), "ssdlite": (0.5, 0.5)}
DECODER = {"yolo": "yolov8", "ssdlite": "xyxy-scores"}


def load_split(root: Path, split: str):
    """(uint8 images (N, 3, SIZE, SIZE), boxes per image in input pixels, classes per image, originals) of a split."""
    pre = Preprocess(input_size=[SIZE, SIZE], letterbox=True)
    samples = read_voc(root, split, bad_boxes="skip")
    index = map_classes(bccd_models.CLASSES, bccd_models.CLASSES)
    images, boxes, classes, originals = [], [], [], []
    for s in samples:
        images.append(image_to_array(_open(str(s.image)), pre, s.image))
        sx, sy, px, py = box_geometry(s.width, s.height, pre)
        boxes.append(s.boxes * np.array([sx, sy, sx, sy], np.float32) + np.array([px, py, px, py], np.float32))
        classes.append(np.array([index[bccd_models.CLASSES.index(c)] for c in s.classes], np.int64))
        originals.append((s, (sx, sy, px, py)))
    return np.stack(images), boxes, classes, originals, skipped_boxes(samples)


def augment(x: torch.Tensor, boxes: list, rng: np.random.Generator):
    """Flips (boxes follow) and brightness/contrast jitter, per image, on the device."""
    x = x.clone()
    out = []
    for i, b in enumerate(boxes):
        b = b.clone()
        if rng.random() < 0.5:
            x[i] = x[i].flip(-1)
            b[:, [0, 2]] = SIZE - b[:, [2, 0]]
        if rng.random() < 0.5:
            x[i] = x[i].flip(-2)
            b[:, [1, 3]] = SIZE - b[:, [3, 1]]
        out.append(b)
    gain = torch.tensor(rng.uniform(0.85, 1.15, (len(x), 1, 1, 1)), device=x.device, dtype=x.dtype)
    bias = torch.tensor(rng.uniform(-0.1, 0.1, (len(x), 1, 1, 1)), device=x.device, dtype=x.dtype)
    return ((x - 0.5) * gain + 0.5 + bias).clamp(0, 1), out


def _giou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lt, rb = torch.max(a[:, :2], b[:, :2]), torch.min(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(1)
    area = lambda t: (t[:, 2:] - t[:, :2]).clamp(min=0).prod(1)  # noqa: E731
    union = area(a) + area(b) - inter
    iou = inter / union.clamp(min=1e-9)
    elt, erb = torch.min(a[:, :2], b[:, :2]), torch.max(a[:, 2:], b[:, 2:])
    enclose = (erb - elt).prod(1).clamp(min=1e-9)
    return iou - (enclose - union) / enclose, iou


LEVEL_RANGES = ((0, 48), (48, 96), (96, 1e9))  # largest box distance per level at 320 input (strides 8, 16, 32)
# at another input size the boxes scale with it, and so do these ranges (yolo_loss)


def yolo_loss(model: bccd_models.BccdYolo, x: torch.Tensor, boxes: list, classes: list) -> torch.Tensor:
    dist, logits = model.raw(x)
    pts, strides = model.points, model.point_strides
    k = SIZE / 320
    ranges = {s: (lo * k, hi * k) for s, (lo, hi) in zip((8, 16, 32), LEVEL_RANGES)}
    lo = torch.tensor([ranges[int(s)][0] for s in strides.tolist()], device=x.device)
    hi = torch.tensor([ranges[int(s)][1] for s in strides.tolist()], device=x.device)
    box_losses, targets, n_pos = [], torch.zeros_like(logits), 0
    for i, (gt, gc) in enumerate(zip(boxes, classes)):
        if not len(gt):
            continue
        l_ = pts[:, None, 0] - gt[None, :, 0]
        t_ = pts[:, None, 1] - gt[None, :, 1]
        r_ = gt[None, :, 2] - pts[:, None, 0]
        b_ = gt[None, :, 3] - pts[:, None, 1]
        ltrb = torch.stack([l_, t_, r_, b_], -1)                    # (A, G, 4)
        inside = ltrb.min(-1).values > 0
        centre = (gt[:, :2] + gt[:, 2:]) / 2
        near = ((pts[:, None, :] - centre[None]).abs() < 2.5 * strides[:, None, None]).all(-1)
        m = ltrb.max(-1).values
        fits = (m >= lo[:, None]) & (m <= hi[:, None])
        ok = inside & near & fits
        area = (gt[:, 2:] - gt[:, :2]).prod(1)[None].expand_as(ok)
        area = torch.where(ok, area, torch.full_like(area, float("inf")))
        best_area, best = area.min(1)
        pos = torch.isfinite(best_area)
        if not pos.any():
            continue
        gi = best[pos]
        p_pts = pts[pos]
        pred = torch.cat([p_pts - dist[i, pos, :2], p_pts + dist[i, pos, 2:]], 1)
        giou, iou = _giou(pred, gt[gi])
        box_losses.append((1 - giou).sum())
        targets[i, pos, gc[gi]] = iou.detach().clamp(min=0.01)
        n_pos += int(pos.sum())
    p = logits.sigmoid()
    qfl = nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none") * (p - targets).abs().pow(2)
    norm = max(1, n_pos)
    box = torch.stack(box_losses).sum() / norm if box_losses else logits.sum() * 0
    return qfl.sum() / norm + 2.0 * box


def ssdlite_loss(model: bccd_models.BccdSsdlite, x: torch.Tensor, boxes: list, classes: list) -> torch.Tensor:
    targets = [{"boxes": b, "labels": c + 1} for b, c in zip(boxes, classes)]
    losses = model.detector(list(x), targets)
    return sum(losses.values())


@torch.no_grad()
def evaluate(model, kind: str, images: np.ndarray, originals: list, device: str) -> dict:
    model.eval()
    mean, std = NORM[kind]
    metrics = DetectionMetrics(bccd_models.CLASSES)
    for start in range(0, len(images), 16):
        x = torch.from_numpy(images[start:start + 16]).to(device).float().div(255).sub(mean).div(std)
        out = model(x).float().cpu().numpy()
        dets = postprocess(DECODERS[DECODER[kind]], out, (SIZE, SIZE), 0.001, 0.6, 100, len(bccd_models.CLASSES))
        for (b, s, c), (sample, (sx, sy, px, py)) in zip(dets, originals[start:start + 16]):
            b = (b - np.array([px, py, px, py])) / np.array([sx, sy, sx, sy])
            b = np.clip(b, 0, [sample.width, sample.height, sample.width, sample.height])
            gt_classes = [bccd_models.CLASSES.index(n) for n in sample.classes]
            metrics.update(sample.boxes, gt_classes, b, s, c, (sample.width, sample.height))
    r = metrics.result()
    return {k: r[k] for k in ("map", "map50", "map75", "ar100", "per_class_ap", "samples", "gt_boxes")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("yolo", "ssdlite"))
    ap.add_argument("--data", type=Path, default=HERE.parents[2] / "shared/data/detection/bccd")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--time-limit", type=float, default=480.0, help="stop training after this many seconds")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", type=int, default=bccd_models.SIZE,
                    help="the square letterboxed input (yolo; a multiple of 32): 320, or 640 as YOLO detectors deploy")
    ap.add_argument("--init", type=Path, default=None, help="start from these weights (a second cycle after a run that "
                                                             "a device call's time cut short)")
    a = ap.parse_args()
    global SIZE
    if a.size != SIZE and (a.model != "yolo" or a.size % 32):
        ap.error(f"--size {a.size}: only the yolo model takes another input size, and it must be a multiple of 32")
    SIZE = a.size
    torch.manual_seed(a.seed)
    rng = np.random.default_rng(a.seed)
    t0 = time.time()
    train_x, train_b, train_c, _, skipped = load_split(a.data, "train")
    test_x, _, _, test_orig, _ = load_split(a.data, "test")
    print(f"train {len(train_x)} images, test {len(test_x)}; skipped boxes: {skipped}; data {time.time() - t0:.1f} s",
          flush=True)
    model = bccd_models.bccd_yolo(size=SIZE) if a.model == "yolo" else bccd_models.bccd_ssdlite()
    if a.init:
        model.load_state_dict({k: v.float() if v.is_floating_point() else v
                               for k, v in torch.load(a.init, map_location="cpu").items()})
    model = model.to(a.device)
    loss_fn = yolo_loss if a.model == "yolo" else ssdlite_loss
    lr = a.lr or (2e-3 if a.model == "yolo" else 3e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = math.ceil(len(train_x) / a.batch)
    total = a.epochs * steps_per_epoch
    # One cycle (5 % warm-up, cosine down) over whichever ends first, the planned steps or --time-limit: a run cut by
    # the time limit still ends at a low learning rate instead of stopping mid-schedule.
    progress = lambda: max(step / total, (time.time() - t_train) / a.time_limit)  # noqa: E731

    def set_lr() -> float:
        p = min(1.0, progress())
        f = p / 0.05 if p < 0.05 else 0.5 * (1 + math.cos(math.pi * (p - 0.05) / 0.95))
        value = lr * max(f, 1e-3)
        for g in opt.param_groups:
            g["lr"] = value
        return value
    mean, std = NORM[a.model]
    xs = torch.from_numpy(train_x).to(a.device)
    bs = [torch.from_numpy(b).to(a.device) for b in train_b]
    cs = [torch.from_numpy(c).to(a.device) for c in train_c]
    amp = a.device.startswith("cuda")
    t_train, step, epoch = time.time(), 0, 0
    for epoch in range(a.epochs):
        model.train()
        order = rng.permutation(len(xs))
        running = 0.0
        for k in range(steps_per_epoch):
            idx = order[k * a.batch:(k + 1) * a.batch]
            cur_lr = set_lr()
            x, b = augment(xs[idx].float().div(255), [bs[i] for i in idx], rng)
            x = (x - mean) / std
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = loss_fn(model, x, b, [cs[i] for i in idx])
            opt.zero_grad(set_to_none=True)
            loss.float().backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            step += 1
            running += float(loss.detach())
        if epoch % 10 == 0 or epoch == a.epochs - 1:
            print(f"epoch {epoch + 1}/{a.epochs} loss {running / steps_per_epoch:.4f} lr {cur_lr:.2e} "
                  f"{time.time() - t_train:.0f} s", flush=True)
        if progress() >= 1.0:
            if step < total:
                print(f"time limit: the schedule ended after epoch {epoch + 1}", flush=True)
            break
    train_s = time.time() - t_train
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, a.out)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    result = evaluate(model, a.model, test_x, test_orig, a.device)
    record = {"model": a.model, "init": a.init.name if a.init else None, "epochs_run": epoch + 1,
              "epochs_planned": a.epochs, "batch": a.batch, "lr": lr,
              "train_s": round(train_s, 1), "device": torch.cuda.get_device_name() if amp else "cpu",
              "torch": torch.__version__, "weights": str(a.out.name), "weights_dtype": "float16 (loaded as FP32)",
              "skipped_boxes": skipped, "test_split": result, "input": f"{SIZE}x{SIZE} letterbox",
              "decoder": DECODER[a.model], "mean_std": NORM[a.model]}
    a.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("model", "epochs_run", "train_s", "device")} |
                     {"map": result["map"], "map50": result["map50"]}), flush=True)


if __name__ == "__main__":
    main()
