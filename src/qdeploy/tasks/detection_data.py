"""Object-detection annotations as users have them (Pascal VOC XML, COCO JSON, YOLO txt) → one record type.

The detection task's data (``data.datasets.DetectionDataset``): every reader returns a list of
:class:`DetectionSample`, one per image, in a stable order, with boxes ``xmin ymin xmax ymax`` in pixels of the original (undecoded, un-resized)
image. Nothing is dropped silently: an image whose annotation has no boxes is a valid sample with zero boxes, and
every problem below is a :class:`~qdeploy.errors.DataError` (an image that does not decode:
:class:`~qdeploy.errors.UnreadableImage`) whose one-line message names the file and the problem.

Layouts read: Pascal VOC in the devkit's ``Annotations/`` + ``JPEGImages/`` (+ ``ImageSets/Main`` split files), as
``annotations/`` + ``images/`` side by side (Kaggle, Roboflow; any case), or as one folder of images and XMLs, each
XML's image found by its ``<filename>`` and ``<folder>``, else by the XML's name (:func:`voc_image`); COCO JSON;
YOLO txt under an image folder or the ``train``/``val``/``test`` entries of Ultralytics' ``data.yaml``, whose
``names`` (a list or ``{index: name}``) are the classes.

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
* an annotation whose image is missing is an error (VOC: all of them in one message, with the folders looked in);
  an image without an annotation (VOC outside the devkit layout, YOLO) is an error unless ``unannotated="empty"``
  (then a zero-box sample);
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
# Folder names (compared in lower case) that hold a VOC data set's XMLs and its images as data sets are published: the
# VOC devkit's Annotations/ + JPEGImages/, and the annotations/ + images/ pair of Kaggle and Roboflow exports.
VOC_ANNOTATION_FOLDERS = ("annotations", "annotation", "xmls", "xml")
VOC_IMAGE_FOLDERS = ("jpegimages", "images", "image", "imgs", "img")
VOC_LAYOUTS = ("Annotations/ + JPEGImages/ (+ ImageSets/Main/<split>.txt)", "annotations/ + images/ side by side",
               "images and their XMLs in one folder")
_SHOWN = 3  # examples a message names when many files share one problem


def _load_voc(xml: Path) -> ET.Element:
    """The parsed ``<annotation>`` of a VOC XML file; a missing, empty, unparsable or foreign file is a DataError."""
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
    return root


def _voc_sample(xml: Path, root: ET.Element, image: Path, classes, decode: bool, bad_boxes: str) -> DetectionSample:
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
    return _sample(image, xml, width, height, boxes, names, classes, decode, bad_boxes)


def read_voc_xml(xml: PathLike, image: Optional[PathLike] = None, classes: Optional[Sequence[str]] = None,
                 decode: bool = True, bad_boxes: str = "error") -> DetectionSample:
    """One Pascal VOC XML file. ``image``: its image; by default the one its ``<filename>`` (in ``<folder>``) names,
    else the image of the XML's name, looked for beside the XML and in an images folder beside the XML's folder
    (:func:`voc_image`)."""
    _check_options("error", bad_boxes)
    xml = Path(xml)
    root = _load_voc(xml)
    if image is None:
        found, tried = voc_image(xml, root)
        if found is None:
            raise DataError(_missing_image_message([(xml, root, tried)]))
        image = found
    return _voc_sample(xml, root, Path(image), classes, decode, bad_boxes)


class _ImageIndex:
    """The image files of folders, each folder listed once (a data set of 17,000 XMLs looks in the same few
    folders for each): by lower-case name and by lower-case stem, so ``IMG_1.JPG`` is found for ``img_1.jpg``."""

    def __init__(self):
        self._folders: dict[Path, tuple[dict, dict]] = {}

    def _of(self, folder: Path) -> tuple[dict, dict]:
        if folder not in self._folders:
            names: dict[str, list[Path]] = {}
            stems: dict[str, list[Path]] = {}
            files = sorted(p for p in folder.iterdir() if is_image(p)) if folder.is_dir() else []
            for p in files:
                names.setdefault(p.name.lower(), []).append(p)
                stems.setdefault(p.stem.lower(), []).append(p)
            self._folders[folder] = (names, stems)
        return self._folders[folder]

    @staticmethod
    def _pick(found: list[Path], exact: str, attr: str) -> Optional[Path]:
        if not found:
            return None
        return next((p for p in found if getattr(p, attr) == exact), found[0])  # the exact spelling first

    def by_name(self, folder: Path, name: str) -> Optional[Path]:
        return self._pick(self._of(folder)[0].get(name.lower(), []), name, "name")

    def by_stem(self, folder: Path, stem: str) -> Optional[Path]:
        return self._pick(self._of(folder)[1].get(stem.lower(), []), stem, "stem")


def _child_folder(parent: Path, names: Sequence[str]) -> Optional[Path]:
    """The first sub-folder of ``parent`` whose lower-case name is in ``names`` (in the order of ``names``)."""
    if not parent.is_dir():
        return None
    by_name = {p.name.lower(): p for p in sorted(parent.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    return next((by_name[n] for n in names if n in by_name), None)


def _voc_search_folders(xml: Path, folder: Optional[str], data_root: Optional[Path],
                        images_dir: Optional[Path]) -> list[Path]:
    """Where an XML's image may be, most specific first: its ``<folder>`` (relative to the data root, then to the
    root's parent, as annotation tools write it), the layout's images folder, the XML's own folder, an images folder
    beside the XML's folder (root pointed at ``annotations/``)."""
    base = data_root or xml.parent
    out: list[Path] = []
    if folder and folder.strip():
        f = Path(folder.strip().replace("\\", "/"))
        out += [f] if f.is_absolute() else [base / f, base.parent / f]
    if images_dir is not None:
        out.append(images_dir)
    out.append(xml.parent)
    sibling = _child_folder(xml.parent.parent, VOC_IMAGE_FOLDERS)
    if sibling is not None:
        out.append(sibling)
    return list(dict.fromkeys(out))


def voc_image(xml: Path, root: ET.Element, data_root: Optional[Path] = None, images_dir: Optional[Path] = None,
              index: Optional[_ImageIndex] = None) -> tuple[Optional[Path], list[Path]]:
    """The image of one VOC annotation and the folders looked in: the file ``<filename>`` names (its name only: the
    path an annotation tool wrote is of another machine; without an extension, any image of that stem), in the
    folders of :func:`_voc_search_folders`; else the image of the XML's own name there. Names match regardless of
    case (an XML says ``.jpg`` of a ``.JPG``)."""
    index = index or _ImageIndex()
    folders = _voc_search_folders(xml, root.findtext("folder"), data_root, images_dir)
    filename = Path((root.findtext("filename") or "").strip().replace("\\", "/")).name
    for folder in folders:
        if filename:
            found = (index.by_name(folder, filename) if Path(filename).suffix.lower() in IMAGE_EXTENSIONS
                     else index.by_stem(folder, filename))
            if found is not None:
                return found, folders
    for folder in folders:
        found = index.by_stem(folder, xml.stem)
        if found is not None:
            return found, folders
    return None, folders


def _missing_image_message(missing: list[tuple[Path, ET.Element, list[Path]]]) -> str:
    """One line for every annotation whose image was not found: the XML, the image it names, the folders looked in
    (once when all share them)."""
    def wanted(xml: Path, root: ET.Element) -> str:
        filename = (root.findtext("filename") or "").strip()
        return f"refers to image {filename!r} (<filename>)" if filename else "has no <filename>"

    def where(tried: list[Path]) -> str:
        return ", ".join(f"{f}" + ("" if f.is_dir() else " (no such folder)") for f in tried)

    how = (" (a VOC annotation's image: the file its <filename> names, in its <folder>, the images folder or beside "
           "the XML; else an image of the XML's own name there)")
    if len(missing) == 1:
        xml, root, tried = missing[0]
        return f"annotation {xml} {wanted(xml, root)}: no such image in {where(tried)}, nor an image named {xml.stem}.*" \
            + how
    shown = ", ".join(f"{xml} {wanted(xml, root)}" for xml, root, _ in missing[:_SHOWN])
    folders = {tuple(tried) for _, _, tried in missing}
    looked = (f"looked in {where(missing[0][2])}" if len(folders) == 1 else
              f"{missing[0][0].name} looked in {where(missing[0][2])}")
    return f"{len(missing)} annotations have no image: {shown}" + (", ..." if len(missing) > _SHOWN else "") \
        + f"; {looked}" + how


def _voc_layout(root: Path) -> tuple[Optional[Path], Optional[Path]]:
    """(folder of the XMLs, folder of the images) of a VOC data set; the XMLs' folder None: a flat folder, or none."""
    ann_dir = _child_folder(root, VOC_ANNOTATION_FOLDERS)
    img_dir = _child_folder(root, VOC_IMAGE_FOLDERS)
    if ann_dir is not None and not _xml_files(ann_dir) and _xml_files(root):
        ann_dir = None  # an unrelated annotations/ folder beside a flat folder's XMLs
    if ann_dir is None and img_dir is not None and not _xml_files(root) and _xml_files(img_dir):
        ann_dir = img_dir  # labelImg saves each XML beside its image: images/ holds both
    return ann_dir, img_dir


def _xml_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() == ".xml" and not p.name.startswith(".")
                  and p.is_file())


def voc_split_files(root: PathLike) -> Optional[Path]:
    """``ImageSets/Main`` of a VOC data set when it has one (then ``split`` selects images), else None."""
    main = Path(root) / "ImageSets" / "Main"
    return main if main.is_dir() else None


def _voc_split_xmls(root: Path, ann_dir: Optional[Path], split: str) -> list[Path]:
    main = voc_split_files(root)
    if main is None:
        raise DataError(f"VOC data folder {root} has no split files ({root / 'ImageSets' / 'Main' / f'{split}.txt'}"
                        f" does not exist), so no split {split!r}: leave split out to read every annotation")
    split_file = main / f"{split}.txt"
    if not split_file.is_file():
        have = sorted(p.stem for p in main.glob("*.txt") if "_" not in p.stem)
        raise DataError(f"split file {split_file} does not exist" + (f"; splits here: {', '.join(have)}" if have else ""))
    ids = [line.split()[0] for line in split_file.read_text().splitlines() if line.strip()]
    if not ids:
        raise DataError(f"split file {split_file} lists no images")
    xmls = [(ann_dir or root) / f"{i}.xml" for i in ids]
    for x in xmls:
        if not x.is_file():
            raise DataError(f"split file {split_file} lists {x.stem}, but its annotation {x} does not exist")
    return xmls


def _no_voc_xmls(root: Path, searched: list[Path]) -> DataError:
    """No XML where a VOC layout keeps them: what was searched, the layouts, and where XMLs (or another format's
    annotations) were seen instead."""
    nested = sorted({p.parent for p in root.rglob("*.xml") if not p.name.startswith(".")} - set(searched))
    others = {".txt": "YOLO labels? set format: yolo", ".json": "a COCO JSON? set format: coco"}
    seen = [f"{s} files ({why})" for s, why in others.items()
            if any(p.suffix.lower() == s and p.name.lower() not in ("classes.txt", "readme.txt")
                   for p in root.rglob(f"*{s}"))]
    hint = ""
    if nested:
        hint = (f"; .xml files are in {', '.join(str(p) for p in nested[:_SHOWN])}" + (", ..." if len(nested) > _SHOWN
                                                                                        else "")
                + ": set root to the folder above them or to one of them")
    elif seen:
        hint = f"; found {', '.join(seen)}"
    return DataError(f"VOC data folder {root} has no .xml annotations (looked in {', '.join(map(str, searched))}; "
                     f"accepted layouts: {'; '.join(VOC_LAYOUTS)}){hint}")


def read_voc(root: PathLike, split: Optional[str] = None, classes: Optional[Sequence[str]] = None,
             decode: bool = True, unannotated: str = "error", bad_boxes: str = "error") -> list[DetectionSample]:
    """A Pascal VOC data set in one of :data:`VOC_LAYOUTS`: the devkit's ``Annotations/``, ``JPEGImages/`` and
    ``ImageSets/Main/<split>.txt``; ``annotations/`` and ``images/`` side by side (any case); or a flat folder of
    images and XMLs. Each XML's image: :func:`voc_image`. ``split`` needs split files (``ImageSets/Main``);
    without it every XML is read.

    Annotations whose image is not found are one DataError naming each XML and the folders looked in. Outside the
    devkit layout (where the annotations select the images) an image no XML refers to is an error unless
    ``unannotated="empty"``; two XMLs of one image are an error."""
    _check_options(unannotated, bad_boxes)
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"VOC data folder {root} does not exist" if not root.exists() else
                        f"VOC data folder {root} is not a folder"
                        + (" (a YOLO data file: set format: yolo)" if root.suffix.lower() in (".yaml", ".yml") else ""))
    ann_dir, img_dir = _voc_layout(root)
    if split is not None:
        xmls = _voc_split_xmls(root, ann_dir, split)
    else:
        xmls = _xml_files(ann_dir if ann_dir is not None else root)
        if not xmls:
            raise _no_voc_xmls(root, [root] + [d for d in (ann_dir,) if d is not None])
    parsed = [(x, _load_voc(x)) for x in xmls]
    index, found, missing = _ImageIndex(), [], []
    for x, element in parsed:
        image, tried = voc_image(x, element, root, img_dir, index)
        (missing.append((x, element, tried)) if image is None else found.append(image))
    if missing:
        raise DataError(_missing_image_message(missing))
    by_image: dict[Path, Path] = {}
    for (x, _), image in zip(parsed, found):
        other = by_image.setdefault(image.resolve(), x)
        if other != x:
            raise DataError(f"annotations {other} and {x} both refer to image {image}: one image, one annotation")
    samples = [_voc_sample(x, element, image, classes, decode, bad_boxes) for (x, element), image in zip(parsed, found)]
    devkit = ann_dir is not None and ann_dir.name == "Annotations" and img_dir is not None \
        and img_dir.name == "JPEGImages"
    if split is None and not devkit:
        samples += _unannotated_voc(img_dir or root, set(by_image), unannotated, decode)
    return samples if devkit or split is not None else sorted(samples, key=lambda s: s.image.name)


def _unannotated_voc(folder: Path, used: set, unannotated: str, decode: bool) -> list[DetectionSample]:
    """The images of ``folder`` no XML refers to: an error, or zero-box samples (``unannotated="empty"``)."""
    out = []
    for img in sorted(p for p in folder.iterdir() if is_image(p)):
        if img.resolve() in used:
            continue
        if unannotated == "error":
            raise DataError(f"image {img} has no annotation (no XML names it or has its name {img.stem}.xml; an image "
                            "without objects needs an XML without <object>; or set unannotated: empty)")
        w, h = _image_size(img, decode, img)
        out.append(DetectionSample(img, w, h, np.zeros((0, 4), np.float32), [], None))
    return out


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
YOLO_DATA_SUFFIXES = (".yaml", ".yml")


def is_yolo_data_file(path: PathLike) -> bool:
    """A YOLO data file (Ultralytics' ``data.yaml``) rather than a folder or a class list."""
    return Path(path).suffix.lower() in YOLO_DATA_SUFFIXES


def _yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line message as one line: the problem and where (1-based line and column)."""
    problem = getattr(e, "problem", None) or (str(e).splitlines() or [type(e).__name__])[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem}" + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")


def load_yolo_data(data_yaml: PathLike) -> dict:
    """The mapping of a YOLO data file; missing, unreadable, not YAML or not a mapping: a DataError naming it."""
    import yaml

    data_yaml = Path(data_yaml).expanduser()
    if not data_yaml.is_file():
        raise DataError(f"YOLO data file {data_yaml} does not exist" if not data_yaml.exists() else
                        f"YOLO data file {data_yaml} is not a file")
    try:
        data = yaml.safe_load(data_yaml.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"YOLO data file {data_yaml} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    except yaml.YAMLError as e:
        raise DataError(f"YOLO data file {data_yaml} is not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise DataError(f"YOLO data file {data_yaml} is {'empty' if data is None else 'not a mapping'}: expected "
                        "keys names (the class names), path, train, val, test")
    return data


def _index(key, data_yaml: Path) -> int:
    if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.strip().isdigit())):
        raise DataError(f"YOLO data file {data_yaml}: 'names' key {key!r} is not a class index (expected 0, 1, ...)")
    return int(key)


def _names_of(data: dict, data_yaml: Path) -> list[str]:
    """``names`` of a parsed data file: a list, or a mapping index → name with indices 0..n-1 (Ultralytics)."""
    names = data.get("names")
    if names is None:
        nc = f" (it has nc: {data['nc']}, but the names are needed)" if "nc" in data else ""
        raise DataError(f"YOLO data file {data_yaml} has no 'names' list of class names{nc}: add names: [name0, "
                        "name1, ...] or names: {0: name0, 1: name1, ...}")
    if isinstance(names, Mapping):
        by_index = {_index(k, data_yaml): v for k, v in names.items()}
        gaps = sorted(set(range(max(by_index, default=-1) + 1)) - set(by_index))
        if gaps:
            raise DataError(f"YOLO data file {data_yaml}: 'names' has no entry for class index "
                            f"{', '.join(map(str, gaps[:_SHOWN * 3]))} (indices must run 0..{max(by_index)} without "
                            "gaps: each is a class the model outputs)")
        names = [by_index[i] for i in range(len(by_index))]
    if not isinstance(names, list) or not names:
        raise DataError(f"YOLO data file {data_yaml}: 'names' is {names!r}, expected a list of class names or a mapping "
                        "{0: name0, ...}")
    out = _unique_names(names, f"YOLO data file {data_yaml}: 'names'", ("entry", "entries"))
    nc = data.get("nc")
    if nc is not None and nc != len(out):
        raise DataError(f"YOLO data file {data_yaml}: 'nc' is {nc} but 'names' has {len(out)} classes")
    return out


def _unique_names(names: Sequence, where: str, item: tuple[str, str], first: int = 0) -> list[str]:
    """``names`` as strings; an empty entry or a name listed twice is a DataError: two indices of one name would score
    every box of the later class as the earlier one."""
    out, seen = [], {}
    for i, n in enumerate(names, first):
        if n is None or isinstance(n, (list, dict)) or not str(n).strip():
            raise DataError(f"{where} {item[0]} {i} is {n!r}, not a class name")
        if str(n) in seen:
            raise DataError(f"{where} lists {str(n)!r} twice ({item[1]} {seen[str(n)]} and {i})")
        seen[str(n)] = i
        out.append(str(n))
    return out


def yolo_names(data_yaml: PathLike) -> list[str]:
    """The class names of a YOLO data file (``names:`` a list, or a mapping index → name with indices 0..n-1); a file
    that is not YAML (darknet's ``obj.names``) is read as one name per line."""
    data_yaml = Path(data_yaml).expanduser()
    if not is_yolo_data_file(data_yaml):
        if not data_yaml.is_file():
            raise DataError(f"YOLO class-name file {data_yaml} does not exist")
        lines = data_yaml.read_text(encoding="utf-8", errors="replace").splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        if not lines:
            raise DataError(f"YOLO class-name file {data_yaml} is empty")
        return _unique_names([line.strip() for line in lines], f"YOLO class-name file {data_yaml}", ("line", "lines"), 1)
    return _names_of(load_yolo_data(data_yaml), data_yaml)


def _yolo_entry(data_yaml: Path, data: dict, entry) -> tuple[Optional[Path], list[Path]]:
    """Where a ``train``/``val``/``test`` entry is: absolute as written; relative to ``path`` (itself relative to the
    data file's folder) and to the data file's folder; a leading ``../`` also without it (Roboflow's exports write
    ``../valid/images`` in a data.yaml that sits beside ``valid/``). The path found (or None) and those tried."""
    entry = Path(str(entry).strip()).expanduser()
    if entry.is_absolute():
        return (entry if entry.exists() else None), [entry]
    bases = []
    if data.get("path"):
        p = Path(str(data["path"])).expanduser()
        bases.append(p if p.is_absolute() else data_yaml.parent / p)
    bases.append(data_yaml.parent)
    tried = [b / entry for b in bases]
    ups = 0
    while ups < len(entry.parts) and entry.parts[ups] == "..":
        ups += 1
    if 0 < ups < len(entry.parts):
        tried += [b / Path(*entry.parts[ups:]) for b in bases]
    tried = list(dict.fromkeys(tried))
    return next((t for t in tried if t.exists()), None), tried


def yolo_split_images(data_yaml: PathLike, split: str, data: Optional[dict] = None) -> list[tuple[Path, Path]]:
    """``(image, the folder it was listed under)`` for each image of one split of a YOLO data file: its ``split`` entry
    names image folders (read recursively), image list files (``.txt``, one path a line, relative to the list's
    folder) or images, one or a list of them."""
    data_yaml = Path(data_yaml).expanduser()
    data = load_yolo_data(data_yaml) if data is None else data
    entries = data.get(split)
    if not entries:
        have = [k for k in ("train", "val", "test") if data.get(k)]
        raise DataError(f"YOLO data file {data_yaml} has no {split!r} images"
                        + (f" (its splits: {', '.join(have)}): set split: {have[-1] if 'val' not in have else 'val'}"
                           if have else ": add train/val/test entries naming image folders"))
    out: list[tuple[Path, Path]] = []
    for entry in entries if isinstance(entries, list) else [entries]:
        found, tried = _yolo_entry(data_yaml, data, entry)
        if found is None:
            raise DataError(f"YOLO data file {data_yaml}: {split} entry {str(entry)!r} does not exist (looked for "
                            f"{', '.join(map(str, tried))}; relative entries are read from 'path', else from the data "
                            "file's folder)")
        if found.is_dir():
            out += [(p, found) for p in sorted(found.rglob("*")) if is_image(p)]
        elif is_image(found):
            out.append((found, found.parent))
        else:
            out += [(p, p.parent) for p in _image_list(found)]
    return out


def _image_list(txt: Path) -> list[Path]:
    """The images a ``.txt`` image list names (Ultralytics' ``train2017.txt``: ``./images/...`` per line), relative
    to the list's folder; a listed image that does not exist is a DataError naming the list and line."""
    out = []
    for ln, line in enumerate(txt.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        p = Path(line.strip()).expanduser()
        p = p if p.is_absolute() else txt.parent / p
        if not p.is_file():
            raise DataError(f"image list {txt}: line {ln} names {line.strip()!r}, and {p} does not exist")
        out.append(p)
    return out


def yolo_class_names(names: Union[None, Sequence[str], PathLike], images: PathLike) -> Optional[list[str]]:
    """The class names of a YOLO data set: ``names`` (a list, a data file or a class-name file), else the ``names``
    of ``images`` when that is a data file; None where neither gives them."""
    if names is not None:
        return yolo_names(names) if isinstance(names, (str, Path)) else [str(n) for n in names]
    if is_yolo_data_file(images):
        return yolo_names(images)
    return None


def _yolo_label_file(image: Path, images_root: Path, labels_root: Optional[Path]) -> Path:
    if labels_root is not None:
        try:
            return (labels_root / image.relative_to(images_root)).with_suffix(".txt")
        except ValueError:  # an image of a list file outside the folder labels mirror
            return labels_root / (image.stem + ".txt")
    parts = list(image.parts)
    if "images" in parts:  # Ultralytics' layout: .../images/<split>/x.jpg ↔ .../labels/<split>/x.txt
        k = len(parts) - 1 - parts[::-1].index("images")
        parts[k] = "labels"
        swapped = Path(*parts).with_suffix(".txt")
        if swapped.is_file() or not image.with_suffix(".txt").is_file():
            return swapped
    return image.with_suffix(".txt")


def _yolo_images(images: Path, split: Optional[str], data: Optional[dict]) -> list[tuple[Path, Path]]:
    """``(image, its listing folder)`` of a YOLO image folder, or of a data file's split."""
    if data is not None:
        files = yolo_split_images(images, split or "test", data)
        if not files:
            raise DataError(f"YOLO data file {images}: its {split or 'test'!r} entries hold no images")
        return files
    if not images.is_dir():
        raise DataError(f"YOLO image folder {images} does not exist" if not images.exists() else
                        f"YOLO image folder {images} is not a folder (a data file ends in .yaml)")
    files = [(p, images) for p in sorted(images.rglob("*")) if is_image(p)]
    if not files:
        raise DataError(f"YOLO image folder {images} has no images")
    return files


def read_yolo(images: PathLike, names: Union[None, Sequence[str], PathLike] = None, labels: Optional[PathLike] = None,
              decode: bool = True, unannotated: str = "error", bad_boxes: str = "error",
              split: Optional[str] = None) -> list[DetectionSample]:
    """YOLO txt labels: one ``class cx cy w h`` line per box (class a 0-based index into ``names``, the rest
    normalized to the image's width and height).

    ``images``: an image folder, or a YOLO data file (``data.yaml``), whose ``split`` entry (default test) gives the
    images. ``names``: the class list, a data file or a one-name-a-line file; by default the data file's ``names``.
    Label files are found under ``labels`` (mirroring the image folder), else by Ultralytics' ``images/`` →
    ``labels/`` swap, else beside each image. An empty label file is an image without boxes (YOLO's convention); a
    missing one is an error unless ``unannotated="empty"``."""
    _check_options(unannotated, bad_boxes)
    images = Path(images).expanduser()
    data = load_yolo_data(images) if is_yolo_data_file(images) else None
    names = yolo_class_names(names, images)
    if names is None:
        raise DataError(f"YOLO labels of {images} need names: the class names their indices refer to (a list, the "
                        "data.yaml, or a file with one name a line)")
    labels_root = Path(labels).expanduser() if labels is not None else None
    samples = []
    for img, listed_under in _yolo_images(images, split, data):
        txt = _yolo_label_file(img, listed_under, labels_root)
        if not txt.is_file():
            if unannotated == "error":
                raise DataError(f"image {img} has no label file {txt} (an image without objects needs an empty "
                                ".txt; or set unannotated: empty)")
            w, h = _image_size(img, decode, img)
            samples.append(DetectionSample(img, w, h, np.zeros((0, 4), np.float32), [], None))
            continue
        samples.append(_yolo_sample(img, txt, names, decode, bad_boxes))
    return samples


def _yolo_sample(img: Path, txt: Path, names: Sequence[str], decode: bool, bad_boxes: str) -> DetectionSample:
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
    return DetectionSample(img, w, h, boxes, [cls[i] for i in kept], txt, skipped)


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
