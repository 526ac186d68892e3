"""Train a small YOLOv8 on BCCD with Ultralytics itself and export it with Ultralytics' own exporter: an ONNX exactly as
a YOLOv8 user's (DFL conv, the three strides' Concat, dynamic batch, output (batch, 4 + classes, anchors)), for
qdeploy's tests and zoo.

Ultralytics is AGPL-3.0, so it is never a dependency of qdeploy: run this with the python of a separate, throwaway
virtual environment, from the repository root:

    python3 -m venv /work/yolovenv && /work/yolovenv/bin/pip install ultralytics onnx onnxslim onnxruntime
    /work/yolovenv/bin/python bench/train/train_yolov8_ultralytics.py --data ../shared/data/detection/bccd \
        --out bench/weights/bccd_yolov8_ultralytics.onnx [--minutes 25] [--imgsz 320] [--width 0.125]

(onnx, onnxslim and onnxruntime are what the exporter asks for with its default simplify=True; installed up front
so that its requirement check has nothing to pip-install.) The data set is converted from Pascal VOC to Ultralytics'
layout in a temporary folder (images symlinked, one label file per image, data.yaml), BCCD's own train/val/test
split kept; zero-size boxes are left out and listed. The model is yolov8.yaml at a custom scale (depth 0.33, width
0.125: 0.9 M parameters, a 3.5 MB FP32 ONNX; a committed file stays under 5 MB), trained from the yaml, never from a
downloaded .pt, for --minutes of wall time (Ultralytics' ``time`` argument: the epoch count and the LR schedule are
fitted to it). Nothing is downloaded: YOLO_OFFLINE, a settings file of its own with sync off, plots off (the plots
fetch a font). Beside the ONNX, OUT.json records the versions, scale, settings, train time, Ultralytics' own val
mAP on BCCD's val and test splits, the class order and the exact export call; OUT's stem + .results.csv is
Ultralytics' per-epoch log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CLASSES = ["RBC", "WBC", "Platelets"]  # data.yaml's order = the ONNX's score rows after the 4 box rows
SPLITS = ("train", "val", "test")
EXPORT_KW = {"format": "onnx", "opset": 17, "dynamic": True}  # simplify left at Ultralytics' default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("../shared/data/detection/bccd"), help="BCCD in Pascal VOC")
    p.add_argument("--out", type=Path, default=Path("bench/weights/bccd_yolov8_ultralytics.onnx"))
    p.add_argument("--work", type=Path, default=None, help="data set and run folder (default: a new temporary one)")
    p.add_argument("--minutes", type=float, default=25.0, help="training wall time (Ultralytics' time=, in hours)")
    p.add_argument("--epochs", type=int, default=300, help="upper bound; --minutes refits it after the first epoch")
    p.add_argument("--imgsz", type=int, default=320)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--depth", type=float, default=0.33)
    p.add_argument("--width", type=float, default=0.125)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def voc_boxes(xml: Path) -> tuple[list, list]:
    """(YOLO label lines ``class cx cy w h`` normalised to the image, boxes left out) of one VOC annotation."""
    root = ET.parse(xml).getroot()
    w, h = (float(root.findtext(f"size/{k}")) for k in ("width", "height"))
    lines, skipped = [], []
    for i, obj in enumerate(root.iter("object")):
        name = obj.findtext("name").strip()
        x0, y0, x1, y1 = (float(obj.findtext(f"bndbox/{k}")) for k in ("xmin", "ymin", "xmax", "ymax"))
        x0, x1 = max(0.0, x0), min(w, x1)  # a few boxes reach past the border: clipped, as Ultralytics would
        y0, y1 = max(0.0, y0), min(h, y1)
        if name not in CLASSES or x1 <= x0 or y1 <= y0:
            skipped.append(f"{xml.name}: object {i} {name} [{x0:g} {y0:g} {x1:g} {y1:g}]")
            continue
        cx, cy, bw, bh = (x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h
        lines.append(f"{CLASSES.index(name)} {cx:.6f} {cy:.6f} {bw:.6f} {bh:.6f}")
    return lines, skipped


def build_dataset(voc: Path, work: Path) -> tuple[Path, dict]:
    """Ultralytics' layout under work/bccd: images/<split>/*.jpg (symlinks), labels/<split>/*.txt, data.yaml."""
    root = work / "bccd"
    record = {"skipped_boxes": [], "images": {}, "boxes": {}}
    for split in SPLITS:
        ids = (voc / "ImageSets/Main" / f"{split}.txt").read_text().split()
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        n_boxes = 0
        for i in ids:
            image = root / "images" / split / f"{i}.jpg"
            if not image.exists():
                image.symlink_to((voc / "JPEGImages" / f"{i}.jpg").resolve())
            lines, skipped = voc_boxes(voc / "Annotations" / f"{i}.xml")
            (root / "labels" / split / f"{i}.txt").write_text("".join(x + "\n" for x in lines))
            record["skipped_boxes"] += skipped
            n_boxes += len(lines)
        record["images"][split], record["boxes"][split] = len(ids), n_boxes
    names = "".join(f"  {k}: {n}\n" for k, n in enumerate(CLASSES))
    data_yaml = root / "data.yaml"
    data_yaml.write_text(f"path: {root}\ntrain: images/train\nval: images/val\ntest: images/test\nnames:\n{names}")
    record["data_yaml"] = data_yaml.read_text()
    return data_yaml, record


def model_yaml(work: Path, depth: float, width: float, nc: int) -> Path:
    """yolov8.yaml's layers at a custom scale. depth_multiple/width_multiple instead of a ``scales`` table: a scale
    letter outside n/s/m/l/x is not read from a file name, and one table row would only draw a warning."""
    import yaml
    from ultralytics.utils import ROOT

    d = yaml.safe_load((ROOT / "cfg/models/v8/yolov8.yaml").read_text())
    d.pop("scales")
    d.update(nc=nc, depth_multiple=depth, width_multiple=width)
    path = work / "yolov8-bccd.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def offline(work: Path) -> None:
    """Nothing leaves the machine: no online checks or downloads, no telemetry, no integrations (settings kept in
    the work folder, not the user's ~/.config)."""
    os.environ["YOLO_OFFLINE"] = "1"
    os.environ["YOLO_CONFIG_DIR"] = str(work / "config")
    from ultralytics import settings

    settings.update({k: False for k in ("sync", "hub", "clearml", "comet", "dvc", "mlflow", "neptune", "raytune",
                                        "tensorboard", "wandb", "vscode_msg", "openvino_msg") if k in settings})


def val_metrics(model, data_yaml: Path, split: str, args) -> dict:
    """Ultralytics' own val (its defaults: conf 0.001, IoU 0.7, max_det 300, rectangular batches) on a split."""
    m = model.val(data=str(data_yaml), split=split, imgsz=args.imgsz, batch=args.batch, device="cpu", plots=False,
                  workers=args.workers, project=str(args.work / "runs"), name=f"val-{split}", exist_ok=True)
    per_class = {CLASSES[c]: float(m.box.maps[c]) for c in range(len(CLASSES))}
    return {"map50": float(m.box.map50), "map50_95": float(m.box.map), "per_class_map50_95": per_class,
            "conf": model.overrides.get("conf", 0.001), "iou": 0.7, "max_det": 300}


def train(data_yaml: Path, cfg: Path, args):
    from ultralytics import YOLO

    model = YOLO(str(cfg), task="detect")
    t0 = time.time()
    model.train(data=str(data_yaml), epochs=args.epochs, time=args.minutes / 60, imgsz=args.imgsz, batch=args.batch,
                device="cpu", workers=args.workers, pretrained=False, plots=False, seed=args.seed, cache="ram",
                project=str(args.work / "runs"), name="train", exist_ok=True, verbose=False)
    train_s = time.time() - t0
    run = Path(model.trainer.save_dir)
    best = YOLO(str(run / "weights/best.pt"))  # what a user deploys: the best-fitness checkpoint
    return best, run, train_s, model.trainer.epoch + 1


def export(model, out: Path, imgsz: int) -> str:
    written = Path(model.export(imgsz=imgsz, **EXPORT_KW))
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(written, out)
    return "model.export(" + ", ".join(f"{k}={v!r}" for k, v in {**EXPORT_KW, "imgsz": imgsz}.items()) + ")"


def main(argv=None) -> None:
    args = parse_args(argv)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="bccd_yolov8_"))
    args.work.mkdir(parents=True, exist_ok=True)
    offline(args.work)
    import torch
    import ultralytics

    data_yaml, data_record = build_dataset(args.data, args.work)
    cfg = model_yaml(args.work, args.depth, args.width, len(CLASSES))
    model, run, train_s, epochs = train(data_yaml, cfg, args)
    metrics = {split: val_metrics(model, data_yaml, split, args) for split in ("val", "test")}
    call = export(model, args.out, args.imgsz)
    shutil.copyfile(run / "results.csv", args.out.with_suffix(".results.csv"))
    record = {
        "ultralytics": ultralytics.__version__, "torch": torch.__version__, "python": sys.version.split()[0],
        "model_yaml": "ultralytics/cfg/models/v8/yolov8.yaml", "scale": {"depth_multiple": args.depth,
                                                                         "width_multiple": args.width},
        "parameters": sum(p.numel() for p in model.model.parameters()), "imgsz": args.imgsz, "batch": args.batch,
        "epochs_run": epochs, "time_limit_min": args.minutes, "train_s": round(train_s, 1), "device": "cpu",
        # Ultralytics trains on cpu_count - 1 torch threads (utils/torch_utils.py select_device); its data loader
        # workers have the rest
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "seed": args.seed, "pretrained": False,
        "ultralytics_val": metrics, "classes": CLASSES, "output": f"(batch, {4 + len(CLASSES)}, anchors): cx cy w h "
        "in input pixels, then one sigmoid score per class in this order", "export_call": call,
        "onnx": args.out.name, "onnx_bytes": args.out.stat().st_size, **data_record,
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("train_s", "epochs_run", "ultralytics_val", "onnx_bytes")}, indent=1))


if __name__ == "__main__":
    main()
