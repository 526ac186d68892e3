"""Object-detection annotations as users have them (Pascal VOC XML, COCO JSON, YOLO txt) → one record type.

Groundwork for the detection task (not registered yet): every reader returns a list of :class:`DetectionSample`,
one per image, in a stable order, with boxes ``xmin ymin xmax ymax`` in pixels of the original (undecoded, un-resized)
image. Nothing is dropped silently: an image whose annotation has no boxes is a valid sample with zero boxes, and
every problem below is a :class:`~qdeploy.errors.DataError` (an image that does not decode:
:class:`~qdeploy.errors.UnreadableImage`) whose one-line message names the file and the problem.

Validation rules (the same for the three formats, applied after converting to pixel ``xyxy``):

* coordinates must be finite numbers; ``xmax > xmin`` and ``ymax > ymin`` as written (a zero-width or inverted box
  is an error, never flipped; BCCD has two zero-size "point" boxes);
* a box may extend beyond the image by at most :data:`EDGE_TOLERANCE` (1 pixel) on any side, and is then clipped to
  ``[0, width] x [0, height]`` (annotation tools round the far edge up, and VOC's 1-based coordinates reach
  ``width``); more than that is an error. A box that clipping leaves with no area is an error too;
* ``bad_boxes="skip"`` leaves the boxes that break the two rules above out instead, each listed with its message in
  its sample's ``skipped`` (:func:`skipped_boxes` gathers them for a results file); nothing else is ever skipped;
* coordinates are kept as written: VOC's 1-based pixel indices are *not* shifted by -1 (the half-pixel convention is
  the evaluator's business and cancels out when ground truth and detections share it);
* with a class list (``classes=``, a YOLO ``names`` list), a class outside it is an error naming the class and the
  list; a YOLO class index outside ``names`` is an error;
* an annotation file that is empty, not XML/JSON, or lacks a required field is an error (exception: an empty YOLO
  ``.txt`` is YOLO's way of saying "no boxes" and gives a zero-box sample);
* an annotation whose image is missing is an error; an image without an annotation (flat VOC folder, YOLO) is an
  error unless ``unannotated="empty"`` (then a zero-box sample);
* every image is opened: its size comes from the file where the annotation gives none or 0 (some VOC tools write
  ``<width>0</width>``); a size that differs from the image's is an error (an annotation of another version of the
  image, or a rotated one); with ``decode=True`` (default) every image is fully decoded, so a truncated file fails
  here rather than in the middle of an evaluation.
"""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np
from PIL import Image

from qdeploy.errors import DataError, UnreadableImage
from qdeploy.utils.inputs import IMAGE_EXTENSIONS, _DECODE_ERRORS, is_image, open_image

PathLike = Union[str, Path]

EDGE_TOLERANCE = 1.0  # pixels a box may extend beyond the image before it is an error (within it: clipped)

# The 80 COCO detection classes in the order of the 0-based indices COCO-trained detectors output (torchvision's
# 91-id list without its gaps; YOLO's / Ultralytics' ``names``).
COCO80 = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)


@dataclass
class DetectionSample:
    """One image and its boxes. ``boxes``: (N, 4) float32 ``xmin ymin xmax ymax`` in pixels of the original image;
    ``classes``: N class names; ``annotation``: the file the boxes came from (for messages). N may be 0."""

    image: Path
    width: int
    height: int
    boxes: np.ndarray
    classes: list[str]
    annotation: Optional[Path] = None
    skipped: list[str] = field(default_factory=list)  # one message per box left out (bad_boxes="skip")

    def __post_init__(self):
        self.boxes = np.asarray(self.boxes, dtype=np.float32).reshape(-1, 4)
        if len(self.classes) != len(self.boxes):
            raise ValueError(f"{len(self.boxes)} boxes but {len(self.classes)} classes")


# ------------------------------------------------------------------------------------------------- shared checks
def _image_size(path: Path, decode: bool, source: Path) -> tuple[int, int]:
    """(width, height) of the image file; missing: DataError naming the annotation; undecodable: UnreadableImage."""
    if not path.is_file():
        raise DataError(f"annotation {source} refers to image {path}, which does not exist")
    if decode:
        img = open_image(path)
        return img.size
    try:
        with Image.open(path) as img:
            return img.size
    except _DECODE_ERRORS as e:
        raise UnreadableImage(f"image {path} is corrupt or not an image: {(str(e).splitlines() or [''])[0]}") from None


def _resolve_size(source: Path, image: Path, width, height, decode: bool) -> tuple[int, int]:
    actual = _image_size(image, decode, source)
    try:
        width, height = (float(width or 0), float(height or 0))
    except (TypeError, ValueError):
        raise DataError(f"annotation {source} gives image size {width!r}x{height!r}, not numbers") from None
    if width and height:  # given and non-zero: must match the file
        if (int(width), int(height)) != actual:
            raise DataError(f"annotation {source} gives image size {int(width)}x{int(height)} but image {image} is "
                            f"{actual[0]}x{actual[1]}")
    return actual


def _check_boxes(boxes: np.ndarray, width: int, height: int, source: Path, where: Sequence[str],
                 bad_boxes: str = "error") -> tuple[np.ndarray, list[int], list[str]]:
    """Validate (N, 4) pixel xyxy ``boxes`` against the image (see the module's rules): the kept boxes clipped, their
    indices, and the message of each box left out (``bad_boxes="skip"``; with "error" the first one is raised)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    kept, skipped = [], []
    for i, (x0, y0, x1, y1) in enumerate(boxes):
        box = f"{where[i]} [{x0:g} {y0:g} {x1:g} {y1:g}]"
        problem = None
        if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
            problem = f"{box} has a non-finite coordinate"
        elif x1 <= x0:
            problem = f"{box} has xmax <= xmin"
        elif y1 <= y0:
            problem = f"{box} has ymax <= ymin"
        elif (x0 < -EDGE_TOLERANCE or y0 < -EDGE_TOLERANCE
              or x1 > width + EDGE_TOLERANCE or y1 > height + EDGE_TOLERANCE):
            problem = f"{box} lies outside the {width}x{height} image by more than {EDGE_TOLERANCE:g} pixel"
        elif min(x1, width) <= max(x0, 0) or min(y1, height) <= max(y0, 0):
            problem = f"{box} has no area inside the {width}x{height} image"
        if problem is None:
            kept.append(i)
        elif bad_boxes == "error":
            raise DataError(f"annotation {source}: {problem} (to leave such boxes out, listed, set bad_boxes: skip)")
        else:
            skipped.append(f"annotation {source}: {problem}")
    clipped = boxes[kept].copy()
    clipped[:, [0, 2]] = clipped[:, [0, 2]].clip(0, width)
    clipped[:, [1, 3]] = clipped[:, [1, 3]].clip(0, height)
    return clipped.astype(np.float32), kept, skipped


def _check_classes(names: Sequence[str], classes: Optional[Sequence[str]], source: Path, where: Sequence[str]):
    if classes is None:
        return
    known = set(classes)
    for name, w in zip(names, where):
        if name not in known:
            raise DataError(f"annotation {source}: {w} has class {name!r}, which is not one of the "
                            f"{len(known)} classes {', '.join(map(repr, classes))}")


def _sample(image: Path, source: Path, width, height, boxes, names, classes, decode, bad_boxes,
            where: Optional[Sequence[str]] = None) -> DetectionSample:
    w, h = _resolve_size(source, image, width, height, decode)
    where = where or [f"box {i + 1}" for i in range(len(names))]
    _check_classes(names, classes, source, where)
    xyxy, kept, skipped = _check_boxes(boxes, w, h, source, where, bad_boxes)
    return DetectionSample(image=image, width=w, height=h, boxes=xyxy, classes=[names[i] for i in kept],
                           annotation=source, skipped=skipped)


def _number(text: Optional[str], source: Path, what: str) -> float:
    if text is None or not text.strip():
        raise DataError(f"annotation {source}: {what} is missing")
    try:
        return float(text)
    except ValueError:
        raise DataError(f"annotation {source}: {what} is {text.strip()!r}, not a number") from None


def _check_options(unannotated: str, bad_boxes: str):
    if unannotated not in ("error", "empty"):
        raise ValueError(f"unannotated must be 'error' or 'empty', not {unannotated!r}")
    if bad_boxes not in ("error", "skip"):
        raise ValueError(f"bad_boxes must be 'error' or 'skip', not {bad_boxes!r}")


# ------------------------------------------------------------------------------------------------------ Pascal VOC
def read_voc_xml(xml: PathLike, image: Optional[PathLike] = None, classes: Optional[Sequence[str]] = None,
                 decode: bool = True, bad_boxes: str = "error") -> DetectionSample:
    """One Pascal VOC XML file. ``image``: its image; by default the image of the same name beside the XML, else the
    XML's ``<filename>`` beside it (a flat folder)."""
    _check_options("error", bad_boxes)
    xml = Path(xml)
    if not xml.is_file():
        raise DataError(f"annotation {xml} does not exist")
    if xml.stat().st_size == 0:
        raise DataError(f"annotation {xml} is empty")
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:
        raise DataError(f"annotation {xml} is not valid XML: {e}") from None
    if root.tag != "annotation":
        raise DataError(f"annotation {xml} is not a Pascal VOC annotation (root element <{root.tag}>, "
                        "expected <annotation>)")
    if image is None:
        image = _voc_image_beside(xml, root.findtext("filename"))
    size = root.find("size")
    width = height = None
    if size is not None:
        width = _number(size.findtext("width"), xml, "<size><width>") if size.find("width") is not None else None
        height = _number(size.findtext("height"), xml, "<size><height>") if size.find("height") is not None else None
    boxes, names = [], []
    for i, obj in enumerate(root.findall("object")):
        name = (obj.findtext("name") or "").strip()
        if not name:
            raise DataError(f"annotation {xml}: object {i + 1} has no <name>")
        bnd = obj.find("bndbox")
        if bnd is None:
            raise DataError(f"annotation {xml}: object {i + 1} ({name}) has no <bndbox>")
        boxes.append([_number(bnd.findtext(k), xml, f"object {i + 1} ({name}) <{k}>")
                      for k in ("xmin", "ymin", "xmax", "ymax")])
        names.append(name)
    return _sample(Path(image), xml, width, height, boxes, names, classes, decode, bad_boxes)


def _voc_image_beside(xml: Path, filename: Optional[str], folder: Optional[Path] = None) -> Path:
    folder = folder or xml.parent
    for ext in sorted(IMAGE_EXTENSIONS):
        for cand in (folder / (xml.stem + ext), folder / (xml.stem + ext.upper())):
            if cand.is_file():
                return cand
    if filename and filename.strip():
        return folder / Path(filename.strip()).name
    return folder / (xml.stem + ".jpg")  # does not exist: _image_size names it


def read_voc(root: PathLike, split: Optional[str] = None, classes: Optional[Sequence[str]] = None,
             decode: bool = True, unannotated: str = "error", bad_boxes: str = "error") -> list[DetectionSample]:
    """A Pascal VOC data set: the VOC layout (``Annotations/``, ``JPEGImages/``, ``ImageSets/Main/<split>.txt``;
    without ``split`` every XML of ``Annotations/``), or a flat folder of images and XMLs of the same names.

    In the flat folder, an image without an XML is an error unless ``unannotated="empty"``."""
    _check_options(unannotated, bad_boxes)
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"VOC data folder {root} does not exist" if not root.exists() else
                        f"VOC data folder {root} is not a folder")
    ann_dir, img_dir = root / "Annotations", root / "JPEGImages"
    if ann_dir.is_dir() and img_dir.is_dir():
        if split is not None:
            split_file = root / "ImageSets" / "Main" / f"{split}.txt"
            if not split_file.is_file():
                have = sorted(p.stem for p in (root / "ImageSets" / "Main").glob("*.txt")
                              if "_" not in p.stem) if (root / "ImageSets" / "Main").is_dir() else []
                raise DataError(f"split file {split_file} does not exist"
                                + (f"; splits here: {', '.join(have)}" if have else ""))
            ids = [line.split()[0] for line in split_file.read_text().splitlines() if line.strip()]
            if not ids:
                raise DataError(f"split file {split_file} lists no images")
            xmls = [ann_dir / f"{i}.xml" for i in ids]
            for x in xmls:
                if not x.is_file():
                    raise DataError(f"split file {split_file} lists {x.stem}, but its annotation {x} does not exist")
        else:
            xmls = sorted(ann_dir.glob("*.xml"))
        samples = []
        for x in xmls:
            try:
                filename = ET.parse(x).getroot().findtext("filename") if x.stat().st_size else None
            except ET.ParseError:
                filename = None  # read_voc_xml names the parse error
            samples.append(read_voc_xml(x, _voc_image_beside(x, filename, img_dir), classes, decode, bad_boxes))
        if not samples:
            raise DataError(f"VOC folder {ann_dir} has no .xml annotations")
        return samples
    if split is not None:
        raise DataError(f"VOC data folder {root} has no Annotations/ and JPEGImages/ folders, so no split "
                        f"{split!r}: a flat folder of images and XMLs has no splits")
    xmls = sorted(p for p in root.iterdir() if p.suffix.lower() == ".xml" and not p.name.startswith("."))
    images = sorted(p for p in root.iterdir() if is_image(p))
    if not xmls:
        raise DataError(f"VOC data folder {root} has no .xml annotations")
    samples = [read_voc_xml(x, classes=classes, decode=decode, bad_boxes=bad_boxes) for x in xmls]
    used = {s.image.resolve() for s in samples}
    for img in images:
        if img.resolve() not in used:
            if unannotated == "error":
                raise DataError(f"image {img} has no annotation {img.with_suffix('.xml').name} beside it (an image "
                                "without objects needs an XML without <object>; or set unannotated: empty)")
            w, h = _image_size(img, decode, img)
            samples.append(DetectionSample(img, w, h, np.zeros((0, 4), np.float32), [], None))
    return sorted(samples, key=lambda s: s.image.name)


# ------------------------------------------------------------------------------------------------------------ COCO
def read_coco(annotations: PathLike, images: PathLike, classes: Optional[Sequence[str]] = None,
              decode: bool = True, bad_boxes: str = "error") -> list[DetectionSample]:
    """A COCO detection JSON (``images``, ``annotations``, ``categories``; ``bbox`` is ``x y w h`` in pixels) with its
    images under ``images`` (each image's ``file_name`` relative to it). Every listed image is a sample, in the
    JSON's order, those without annotations with zero boxes. ``iscrowd`` annotations are kept as boxes (the
    records have no crowd flag yet)."""
    _check_options("error", bad_boxes)
    annotations, images = Path(annotations), Path(images)
    if not annotations.is_file():
        raise DataError(f"annotation {annotations} does not exist")
    text = annotations.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise DataError(f"annotation {annotations} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"annotation {annotations} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise DataError(f"annotation {annotations} is not a COCO annotation file (a JSON object with images, "
                        "annotations, categories)")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise DataError(f"annotation {annotations} has no {key!r} list: not a COCO detection annotation file")
    cats = {}
    for c in data["categories"]:
        if not isinstance(c, dict) or "id" not in c or "name" not in c:
            raise DataError(f"annotation {annotations}: a category lacks 'id' or 'name': {c!r}")
        cats[c["id"]] = str(c["name"])
    imgs = {}
    for im in data["images"]:
        if not isinstance(im, dict) or "id" not in im or "file_name" not in im:
            raise DataError(f"annotation {annotations}: an image entry lacks 'id' or 'file_name': {im!r}")
        if im["id"] in imgs:
            raise DataError(f"annotation {annotations}: image id {im['id']} is listed twice")
        imgs[im["id"]] = im
    per_image: dict = {i: ([], []) for i in imgs}
    for n, a in enumerate(data["annotations"]):
        if not isinstance(a, dict):
            raise DataError(f"annotation {annotations}: annotation {n + 1} is not an object")
        ref = f"annotation {a.get('id', n + 1)}"
        if a.get("image_id") not in imgs:
            raise DataError(f"annotation {annotations}: {ref} refers to image id {a.get('image_id')!r}, which is "
                            "not in 'images'")
        if a.get("category_id") not in cats:
            raise DataError(f"annotation {annotations}: {ref} has category_id {a.get('category_id')!r}, which is "
                            "not in 'categories'")
        bbox = a.get("bbox")
        if (not isinstance(bbox, (list, tuple)) or len(bbox) != 4
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in bbox)):
            raise DataError(f"annotation {annotations}: {ref} has bbox {bbox!r}, expected [x, y, width, height]")
        x, y, w, h = map(float, bbox)
        boxes, names = per_image[a["image_id"]]
        boxes.append((x, y, x + w, y + h, ref))
        names.append(cats[a["category_id"]])
    samples = []
    for i, im in imgs.items():
        boxes, names = per_image[i]
        samples.append(_sample(images / im["file_name"], annotations, im.get("width"), im.get("height"),
                               np.array([b[:4] for b in boxes], np.float64).reshape(-1, 4), names, classes, decode,
                               bad_boxes, [b[4] for b in boxes]))
    if not samples:
        raise DataError(f"annotation {annotations} lists no images")
    return samples


# ------------------------------------------------------------------------------------------------------------ YOLO
def yolo_names(data_yaml: PathLike) -> list[str]:
    """The class names of a YOLO ``data.yaml`` (``names:`` a list, or a mapping index → name with indices 0..n-1)."""
    import yaml

    data_yaml = Path(data_yaml)
    if not data_yaml.is_file():
        raise DataError(f"YOLO data file {data_yaml} does not exist")
    try:
        data = yaml.safe_load(data_yaml.read_text())
    except yaml.YAMLError as e:
        raise DataError(f"YOLO data file {data_yaml} is not valid YAML: {e}") from None
    names = data.get("names") if isinstance(data, dict) else None
    if isinstance(names, Mapping):
        keys = sorted(names)
        if keys != list(range(len(keys))):
            raise DataError(f"YOLO data file {data_yaml}: 'names' keys must be 0..{len(keys) - 1}, got {keys}")
        names = [names[k] for k in keys]
    if not isinstance(names, list) or not names:
        raise DataError(f"YOLO data file {data_yaml} has no 'names' list of class names")
    return [str(n) for n in names]


def _yolo_label_file(image: Path, images_root: Path, labels_root: Optional[Path]) -> Path:
    if labels_root is not None:
        return (labels_root / image.relative_to(images_root)).with_suffix(".txt")
    parts = list(image.parts)
    if "images" in parts:  # Ultralytics' layout: .../images/<split>/x.jpg ↔ .../labels/<split>/x.txt
        k = len(parts) - 1 - parts[::-1].index("images")
        parts[k] = "labels"
        swapped = Path(*parts).with_suffix(".txt")
        if swapped.is_file() or not image.with_suffix(".txt").is_file():
            return swapped
    return image.with_suffix(".txt")


def read_yolo(images: PathLike, names: Union[Sequence[str], PathLike], labels: Optional[PathLike] = None,
              decode: bool = True, unannotated: str = "error", bad_boxes: str = "error") -> list[DetectionSample]:
    """YOLO txt labels: one ``class cx cy w h`` line per box (class a 0-based index into ``names``, the rest
    normalized to the image's width and height). ``names``: the class list or a ``data.yaml`` path. Label files
    are found under ``labels`` (mirroring ``images``), else by Ultralytics' ``images/`` → ``labels/`` swap, else
    beside each image. An empty label file is an image without boxes (YOLO's convention); a missing one is an error
    unless ``unannotated="empty"``."""
    _check_options(unannotated, bad_boxes)
    if isinstance(names, (str, Path)):
        names = yolo_names(names)
    names = [str(n) for n in names]
    images = Path(images)
    if not images.is_dir():
        raise DataError(f"YOLO image folder {images} does not exist" if not images.exists() else
                        f"YOLO image folder {images} is not a folder")
    labels_root = Path(labels) if labels is not None else None
    files = sorted(p for p in images.rglob("*") if is_image(p))
    if not files:
        raise DataError(f"YOLO image folder {images} has no images")
    samples = []
    for img in files:
        txt = _yolo_label_file(img, images, labels_root)
        if not txt.is_file():
            if unannotated == "error":
                raise DataError(f"image {img} has no label file {txt} (an image without objects needs an empty "
                                ".txt; or set unannotated: empty)")
            w, h = _image_size(img, decode, img)
            samples.append(DetectionSample(img, w, h, np.zeros((0, 4), np.float32), [], None))
            continue
        rows, cls, where = [], [], []
        for ln, line in enumerate(txt.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split()
            if len(fields) != 5:
                raise DataError(f"annotation {txt}: line {ln} has {len(fields)} fields, expected 5 "
                                "(class cx cy w h; polygons and scores are not boxes)")
            try:
                c = int(fields[0])
                cx, cy, bw, bh = map(float, fields[1:])
            except ValueError:
                raise DataError(f"annotation {txt}: line {ln} is {line.strip()!r}, not 'class cx cy w h' numbers") \
                    from None
            if not 0 <= c < len(names):
                raise DataError(f"annotation {txt}: line {ln} has class index {c}, but there are {len(names)} "
                                f"classes (0..{len(names) - 1})")
            rows.append((cx, cy, bw, bh))
            cls.append(names[c])
            where.append(f"line {ln}")
        w, h = _image_size(img, decode, txt)
        r = np.array(rows, np.float64).reshape(-1, 4)
        xyxy = np.stack([(r[:, 0] - r[:, 2] / 2) * w, (r[:, 1] - r[:, 3] / 2) * h,
                         (r[:, 0] + r[:, 2] / 2) * w, (r[:, 1] + r[:, 3] / 2) * h], axis=1)
        boxes, kept, skipped = _check_boxes(xyxy, w, h, txt, where, bad_boxes)
        samples.append(DetectionSample(img, w, h, boxes, [cls[i] for i in kept], txt, skipped))
    return samples


def skipped_boxes(samples: Iterable[DetectionSample]) -> list[str]:
    """Every box left out by ``bad_boxes="skip"``, one message each (annotation file, box, problem)."""
    return [m for s in samples for m in s.skipped]


# ------------------------------------------------------------------------------------------------- class mapping
def _normal(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def map_classes(names: Iterable[str], model_classes: Sequence[str]) -> np.ndarray:
    """The model's class index (position in ``model_classes``, e.g. :data:`COCO80`) of each annotation class name.

    A name matches exactly, else ignoring case, spaces, ``_`` and ``-`` ("Dining_Table" → "dining table") where that
    is unambiguous. Names that match no model class → one DataError listing all of them."""
    names = list(names)
    exact = {n: i for i, n in enumerate(model_classes)}
    loose: dict[str, list[int]] = {}
    for i, n in enumerate(model_classes):
        loose.setdefault(_normal(n), []).append(i)
    out, unknown = [], []
    for n in names:
        if n in exact:
            out.append(exact[n])
        elif len(loose.get(_normal(n), ())) == 1:
            out.append(loose[_normal(n)][0])
        else:
            out.append(-1)
            if n not in unknown:
                unknown.append(n)
    if unknown:
        shown = ", ".join(map(repr, model_classes[:12])) + (", ..." if len(model_classes) > 12 else "")
        raise DataError(f"{len(unknown)} annotation class name(s) are not classes of the model: "
                        f"{', '.join(map(repr, unknown))} (the model's {len(model_classes)} classes: {shown})")
    return np.array(out, dtype=np.int64)
