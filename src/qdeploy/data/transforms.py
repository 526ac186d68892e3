"""Decode an image (or a label map) and apply the configured geometry; normalise batches.

Geometry follows torchvision's PIL path exactly (``Resize`` then ``CenterCrop``) so that accuracy
measured here matches the numbers a model was published with. Decoding yields ``uint8`` arrays:
they are 4x smaller than float32 (cheap to cache) and
normalisation is one vectorised step per batch (:func:`normalize`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import numpy as np
from PIL import Image

from qdeploy.config import Preprocess
from qdeploy.errors import DataError
from qdeploy.utils.inputs import open_image as _open  # decoding and its messages: utils.inputs (the CLI checks with it)

PathLike = Union[str, Path]

# "cv2-linear": OpenCV's own cv2.resize INTER_LINEAR, what YOLO's and FastestDet's pipelines feed their models: bilinear
# with half-pixel centres and *no* antialiasing when shrinking (PIL's and torchvision's bilinear average over the shrunk
# footprint instead: a different image for a detector trained on cv2's). OpenCV itself, not a re-implementation: its
# 11-bit fixed-point weights round differently (±1 level on ~8 % of pixels with torch's interpolate), which moved
# FastestDet's mAP on fruit-test by 0.3 points. Needs opencv-python(-headless) (extra "opencv"; config checks it).
CV2_LINEAR = "cv2-linear"
_RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST, CV2_LINEAR: CV2_LINEAR}


def _resize(img: Image.Image, size_wh: tuple[int, int], resample) -> Image.Image:
    if resample != CV2_LINEAR:
        return img.resize(size_wh, resample)
    import cv2

    out = cv2.resize(np.asarray(img), (int(size_wh[0]), int(size_wh[1])), interpolation=cv2.INTER_LINEAR)
    return Image.fromarray(out, img.mode)


def _resized_hw(size_hw: tuple[int, int], resize: Union[int, tuple[int, int]]) -> tuple[int, int]:
    """torchvision ``Resize`` output size: an int sets the shorter side, the longer one is truncated."""
    if not isinstance(resize, int):
        return int(resize[0]), int(resize[1])
    h, w = size_hw
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(resize * long / short)  # int(), not round(): what torchvision does
    return (new_long, resize) if w <= h else (resize, new_long)


def _center_crop(img: Image.Image, crop_hw: tuple[int, int], fill: int) -> Image.Image:
    """torchvision ``CenterCrop``: pad (with ``fill``) where the crop is larger than the image."""
    ch, cw = crop_hw
    w, h = img.size
    # Same offsets as torchvision: round() when cropping, floor-half padding when padding.
    left = round((w - cw) / 2.0) if cw <= w else -((cw - w) // 2)
    top = round((h - ch) / 2.0) if ch <= h else -((ch - h) // 2)
    if left >= 0 and top >= 0:
        return img.crop((left, top, left + cw, top + ch))
    out = Image.new(img.mode, (cw, ch), fill)  # PIL's own crop would pad with 0, not ``fill``
    out.paste(img.crop((max(left, 0), max(top, 0), min(left + cw, w), min(top + ch, h))), (max(-left, 0), max(-top, 0)))
    return out


LETTERBOX_FILL = 114  # Ultralytics' grey


def letterbox_geometry(width: int, height: int, input_hw) -> tuple[int, int, int, int]:
    """(new width, new height, left, top) of Ultralytics' ``LetterBox`` (centred, ``auto=False``): the image scaled by
    ``min(H / height, W / width)``, rounded, padded to ``input_hw``."""
    ih, iw = int(input_hw[0]), int(input_hw[1])
    r = min(ih / height, iw / width)
    nw, nh = int(round(width * r)), int(round(height * r))
    left, top = int(round((iw - nw) / 2 - 0.1)), int(round((ih - nh) / 2 - 0.1))
    return nw, nh, left, top


def box_geometry(width: int, height: int, pre: Preprocess) -> tuple[float, float, float, float]:
    """(scale_x, scale_y, pad_x, pad_y) taking a pixel of a ``width`` x ``height`` image to the model's input under
    ``pre``'s geometry (``x_in = x * scale_x + pad_x``): a letterbox or an exact resize (a detector's two; crops cut
    boxes and are refused by the config)."""
    if pre.letterbox:
        nw, nh, left, top = letterbox_geometry(width, height, pre.input_size)
        return nw / width, nh / height, float(left), float(top)
    if pre.resize is not None or pre.crop is not None:
        raise ValueError("box geometry is defined for letterbox or an exact resize to input_size")
    return pre.input_size[1] / width, pre.input_size[0] / height, 0.0, 0.0


def _geometry(img: Image.Image, pre: Preprocess, resample: int, fill: int = 0) -> Image.Image:
    """resize → centre crop, or an exact resize to ``input_size`` when neither is configured; or a letterbox."""
    if pre.letterbox:
        nw, nh, left, top = letterbox_geometry(img.width, img.height, pre.input_size)
        canvas = Image.new(img.mode, (pre.input_size[1], pre.input_size[0]),
                           (LETTERBOX_FILL,) * len(img.getbands()) if img.mode in ("RGB", "RGBA") else LETTERBOX_FILL)
        canvas.paste(_resize(img, (nw, nh), resample) if (nw, nh) != img.size else img, (left, top))
        return canvas
    if pre.resize is not None:
        h, w = _resized_hw((img.height, img.width), pre.resize)
        img = _resize(img, (w, h), resample)
    if pre.crop is not None:
        crop = (pre.crop, pre.crop) if isinstance(pre.crop, int) else tuple(pre.crop)
        img = _center_crop(img, crop, fill)
    if pre.resize is None and pre.crop is None and (img.height, img.width) != tuple(pre.input_size):
        img = _resize(img, (pre.input_size[1], pre.input_size[0]), resample)
    return img


def _check_size(arr_hw: tuple[int, int], pre: Preprocess, path: PathLike) -> None:
    if tuple(arr_hw) != tuple(pre.input_size):
        raise DataError(
            f"image {path} is {arr_hw[0]}x{arr_hw[1]} (HxW) after resize/crop but input_size is "
            f"{pre.input_size[0]}x{pre.input_size[1]}: set preprocess.crop, or resize as [H, W]"
        )


def image_to_array(img: Image.Image, pre: Preprocess, path: PathLike) -> np.ndarray:
    """Convert mode, apply geometry, return ``uint8 (C, H, W)`` (``path`` is for messages)."""
    if img.mode != pre.mode:
        img = img.convert(pre.mode)
    img = _geometry(img, pre, _RESAMPLE[pre.interpolation])
    arr = np.asarray(img, dtype=np.uint8)
    arr = arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
    if pre.channel_order == "BGR":  # at decoding, so every consumer (normalize, QAT's GPU normalisation) sees BGR
        arr = arr[::-1]
    _check_size(arr.shape[1:], pre, path)
    return np.ascontiguousarray(arr)


def load_image(path: PathLike, preprocess: Preprocess) -> np.ndarray:
    """Decode ``path`` to ``uint8 (C, H, W)`` in ``preprocess.mode`` with the geometry applied."""
    return image_to_array(_open(path), preprocess, path)


def load_label(
    path: PathLike,
    image_size_hw: tuple[int, int],
    preprocess: Preprocess,
    *,
    image_path: Optional[PathLike] = None,
    fill: int = 0,
) -> np.ndarray:
    """Decode a label map to ``int64 (H, W)`` with the image's geometry, NEAREST interpolation.

    ``image_size_hw`` is the image's size *before* geometry: a label of another size would be
    silently misaligned after resizing, so it is an error. ``fill`` is used where a centre crop
    pads (pass the ignore index so padding is not scored as a class).
    """
    img = _open(path, "label")
    if img.mode in ("RGB", "RGBA", "LA", "CMYK", "YCbCr"):
        raise DataError(f"label {path} is a {img.mode} image: expected a single-channel label map (mode L, P or I)")
    if (img.height, img.width) != tuple(image_size_hw):
        raise DataError(
            f"label {path} is {img.width}x{img.height} but image {image_path or '(its image)'} is "
            f"{image_size_hw[1]}x{image_size_hw[0]} (WxH)"
        )
    # Via numpy, not img.convert(): converting mode P would map palette colours, but the palette
    # *indices* are the class ids. int32 (mode I) also lets padding use any fill, e.g. -1.
    img = _geometry(Image.fromarray(np.asarray(img).astype(np.int32)), preprocess, Image.NEAREST, fill)
    arr = np.asarray(img).astype(np.int64)
    _check_size(arr.shape, preprocess, path)
    return arr


def normalize(batch: np.ndarray, preprocess: Preprocess) -> np.ndarray:
    """``uint8 (N, C, H, W)`` → ``float32``: ``(x / 255 - mean) / std`` per channel.

    Folded into one multiply-add (``x * 1/(255 std) - mean/std``) in float32; it differs from the
    two-step formula by at most a few float32 ulps.
    """
    batch = np.asarray(batch)
    c = batch.shape[-3]
    if c != len(preprocess.mean):
        raise ValueError(f"batch has {c} channels but preprocess has {len(preprocess.mean)} (mode {preprocess.mode})")
    mean = np.asarray(preprocess.mean, dtype=np.float64)
    std = np.asarray(preprocess.std, dtype=np.float64)
    scale = (1.0 / (255.0 * std)).astype(np.float32).reshape(c, 1, 1)
    shift = (mean / std).astype(np.float32).reshape(c, 1, 1)
    out = batch.astype(np.float32)
    out *= scale
    out -= shift
    return out
