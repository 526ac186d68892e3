"""Two BCCD detectors (issue 37), as qdeploy reads them: factories that return the network up to its raw head output.

* ``bccd_yolo()`` — a small anchor-free detector written here in the YOLOv8 style (a CSP backbone, a top-down FPN,
  decoupled box / class branches at strides 8, 16, 32). ``forward`` returns Ultralytics' export layout,
  (N, 4 + 3, anchors): ``cx cy w h`` in input pixels then the class scores after the sigmoid; ``model.decode: yolov8``.
  ``raw(x)`` gives the training outputs (box distances and class logits per level).
* ``bccd_ssdlite()`` — torchvision's SSDlite320 with a MobileNetV3-Large backbone (its own code, trained from scratch:
  no downloads here). ``forward`` runs the backbone and head and decodes the boxes with the model's own anchors and box
  coder (torchvision's ``SSD.postprocess_detections`` without its NMS): (N, anchors, 4 + 3), ``xmin ymin xmax ymax``
  in input pixels then the softmax scores of the 3 classes (background dropped); ``model.decode: xyxy-scores``.
  ``detector`` is the torchvision model, trained with its own losses (``model.detector(images, targets)``).

Both take 320x320 RGB letterboxed inputs (``preprocess: {input_size: [320, 320], letterbox: true}``); mean/std:
0/1 (YOLO) and 0.5/0.5 (SSDlite: torchvision's image_mean/std for it).
"""
from __future__ import annotations

import math

import torch
from torch import nn

CLASSES = ("RBC", "WBC", "Platelets")
SIZE = 320


def _conv(c_in, c_out, k=3, s=1):
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())


class _Bottleneck(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a, self.b = _conv(c, c, 3), _conv(c, c, 3)

    def forward(self, x):
        return x + self.b(self.a(x))


class _C2f(nn.Module):
    """YOLOv8's C2f: split, n bottlenecks on one half, concatenate every intermediate, 1x1 conv."""

    def __init__(self, c_in, c_out, n=1):
        super().__init__()
        self.c = c_out // 2
        self.cv1 = _conv(c_in, 2 * self.c, 1)
        self.m = nn.ModuleList(_Bottleneck(self.c) for _ in range(n))
        self.cv2 = _conv((2 + n) * self.c, c_out, 1)

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            y.append(m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class BccdYolo(nn.Module):
    STRIDES = (8, 16, 32)

    def __init__(self, num_classes: int = len(CLASSES), width=(16, 32, 64, 96, 128), size: int = SIZE):
        super().__init__()
        w = width
        self.num_classes, self.size = num_classes, size
        self.stem = nn.Sequential(_conv(3, w[0], 3, 2), _conv(w[0], w[1], 3, 2), _C2f(w[1], w[1], 1))      # /4
        self.p3 = nn.Sequential(_conv(w[1], w[2], 3, 2), _C2f(w[2], w[2], 2))                               # /8
        self.p4 = nn.Sequential(_conv(w[2], w[3], 3, 2), _C2f(w[3], w[3], 2))                               # /16
        self.p5 = nn.Sequential(_conv(w[3], w[4], 3, 2), _C2f(w[4], w[4], 1))                               # /32
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.td4 = _C2f(w[4] + w[3], w[3], 1)
        self.td3 = _C2f(w[3] + w[2], w[2], 1)
        self.bu4 = nn.Sequential(_conv(w[2], w[2], 3, 2))
        self.n4 = _C2f(w[2] + w[3], w[3], 1)
        self.bu5 = nn.Sequential(_conv(w[3], w[3], 3, 2))
        self.n5 = _C2f(w[3] + w[4], w[4], 1)
        chans = (w[2], w[3], w[4])
        hid = max(32, w[2])
        self.box = nn.ModuleList(nn.Sequential(_conv(c, hid), _conv(hid, hid), nn.Conv2d(hid, 4, 1)) for c in chans)
        self.cls = nn.ModuleList(nn.Sequential(_conv(c, hid), _conv(hid, hid), nn.Conv2d(hid, num_classes, 1))
                                 for c in chans)
        for m in self.cls:  # focal-loss prior: start at p = 0.01
            nn.init.constant_(m[-1].bias, -math.log(99))
        grids, strides = [], []
        for s in self.STRIDES:
            n = size // s
            gy, gx = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
            grids.append(torch.stack([gx, gy], -1).reshape(-1, 2).float().add(0.5).mul(s))
            strides.append(torch.full((n * n,), float(s)))
        self.register_buffer("points", torch.cat(grids), persistent=False)    # (A, 2) anchor-point centres, pixels
        self.register_buffer("point_strides", torch.cat(strides), persistent=False)

    def raw(self, x):
        """(box distances l t r b in pixels (N, A, 4), class logits (N, A, C))."""
        c3 = self.p3(self.stem(x))
        c4 = self.p4(c3)
        c5 = self.p5(c4)
        t4 = self.td4(torch.cat([self.up(c5), c4], 1))
        t3 = self.td3(torch.cat([self.up(t4), c3], 1))
        n4 = self.n4(torch.cat([self.bu4(t3), t4], 1))
        n5 = self.n5(torch.cat([self.bu5(n4), c5], 1))
        boxes, logits = [], []
        for f, s, bh, ch in zip((t3, n4, n5), self.STRIDES, self.box, self.cls):
            boxes.append((nn.functional.softplus(bh(f)) * s).flatten(2))
            logits.append(ch(f).flatten(2))
        return torch.cat(boxes, 2).transpose(1, 2), torch.cat(logits, 2).transpose(1, 2)

    def forward(self, x):
        """Ultralytics' export layout: (N, 4 + C, A), cx cy w h in input pixels, sigmoid class scores."""
        dist, logits = self.raw(x)
        p = self.points.unsqueeze(0)
        x0y0, x1y1 = p - dist[..., :2], p + dist[..., 2:]
        xywh = torch.cat([(x0y0 + x1y1) / 2, x1y1 - x0y0], -1)
        return torch.cat([xywh, logits.sigmoid()], -1).transpose(1, 2)


def bccd_yolo(**kwargs) -> BccdYolo:
    return BccdYolo(**kwargs)


class BccdSsdlite(nn.Module):
    """torchvision's SSDlite320-MobileNetV3-Large; ``forward`` = backbone + head + the model's own box decoding."""

    def __init__(self, num_classes: int = len(CLASSES), size: int = SIZE):
        super().__init__()
        from torchvision.models.detection import ssdlite320_mobilenet_v3_large

        self.detector = ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=num_classes + 1)
        self.size = size
        was = self.detector.training
        self.detector.eval()
        with torch.no_grad():  # the anchors of a fixed input size, as the model's anchor generator makes them
            feats = list(self.detector.backbone(torch.zeros(1, 3, size, size)).values())
            from torchvision.models.detection.image_list import ImageList

            anchors = self.detector.anchor_generator(ImageList(torch.zeros(1, 3, size, size), [(size, size)]), feats)[0]
        self.detector.train(was)
        self.register_buffer("anchors", anchors, persistent=False)

    def forward(self, x):
        feats = list(self.detector.backbone(x).values())
        head = self.detector.head(feats)
        deltas, logits = head["bbox_regression"], head["cls_logits"]
        n, a = deltas.shape[:2]
        boxes = self.detector.box_coder.decode_single(deltas.reshape(-1, 4), self.anchors.repeat(n, 1)).reshape(n, a, 4)
        boxes = boxes.clamp(0, self.size)
        scores = torch.softmax(logits, -1)[..., 1:]  # background (class 0) dropped
        return torch.cat([boxes, scores], -1)


def bccd_ssdlite(**kwargs) -> BccdSsdlite:
    return BccdSsdlite(**kwargs)
