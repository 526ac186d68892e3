"""Datasets on disk → ``(uint8 CHW array, label)`` samples.

Every problem with the data (missing folder, stray class folder, unreadable image, label of the
wrong size) is a :class:`~qdeploy.errors.DataError` naming the path, raised as early as possible:
layout problems when the dataset is built, pixel problems when the sample is decoded.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
from torch.utils.data import Dataset

from qdeploy.config import DatasetSpec, Preprocess, Task
from qdeploy.data.transforms import _open, image_to_array, load_image, load_label
from qdeploy.errors import DataError
from qdeploy.tasks import TASKS, get_task
# the checks that need no torch (folders, which files are images, their order, decoding) live in utils.inputs: the
# command line makes the same ones before it imports this module
from qdeploy.utils.inputs import IMAGE_EXTENSIONS, class_folders, folder_images, has_loose_images, keyed_data_error
from qdeploy.utils.inputs import existing_dir as _existing_dir
from qdeploy.utils.inputs import is_image as _is_image
from qdeploy.utils.inputs import unlabelled_images

PathLike = Union[str, Path]
SEGNET_IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png"})


def _other_files_hint(root: Path, limit: int = 10000) -> str:
    """What lies under ``root`` instead of images, e.g. `` (12 files, none an image: .txt; images are .bmp, .jpeg, ...)``."""
    suffixes, n = set(), 0
    for p in root.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            n += 1
            suffixes.add(p.suffix.lower() or "(no extension)")
            if n >= limit:
                break
    if not n:
        return ""
    return (f" ({n} files, none of them an image: {', '.join(sorted(suffixes)[:5])}; images are "
            f"{', '.join(sorted(IMAGE_EXTENSIONS))})")


ClassList = Union[PathLike, Sequence[str]]  # data.*.classes: a class-list file, or the names themselves


def _classes_where(classes: ClassList) -> str:
    """Where a class list came from, for messages: the file, or the config's list."""
    return f"the class-list file {Path(classes).expanduser()}" if isinstance(classes, (str, Path)) else "the classes list"


def _class_file_lines(path: ClassList) -> list[tuple[int, str]]:
    """``(line number, stripped line)`` for the non-empty lines of a class-list file; a list given in the config instead
    of a file reads as the file's lines would (entry i = line i + 1)."""
    if not isinstance(path, (str, Path)):
        return [(n, str(name).strip()) for n, name in enumerate(path, 1)]
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"class-list file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"class-list file {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    out = [(n, line.strip()) for n, line in enumerate(lines, 1) if line.strip()]
    if not out:
        raise DataError(f"class-list file {path} is empty")
    return out


def read_class_file(path: ClassList) -> list[tuple[str, str]]:
    """``(folder name, display name)`` per non-empty line, in index order.

    The first whitespace-separated token is the folder name; the display name is the first
    comma-separated entry of the rest (``n01440764 tench, Tinca tinca`` → ``tench``), or the token.
    """
    if not isinstance(path, (str, Path)):  # a list in the config: each entry is a whole folder name (spaces included)
        return [(name, name) for _, name in _class_file_lines(path)]
    entries, seen = [], {}
    for lineno, line in _class_file_lines(path):
        parts = line.split(maxsplit=1)
        name = parts[0]
        if name in seen:  # a duplicate would shift every later index by one
            raise DataError(f"{_classes_where(path)} lists '{name}' twice (lines {seen[name]} and {lineno})")
        seen[name] = lineno
        words = parts[1].split(",")[0].strip() if len(parts) > 1 else ""
        entries.append((name, words or name))
    return entries


class ImageFolderDataset(Dataset):
    """``root/<class>/**/<image>``; labels from sorted folder names or from a class-list file.

    With a class-list file, indices are the file's line order, so a subset of class folders (e.g.
    725 of the 1000 ImageNet classes) still gets the model's indices; a folder missing from the
    file is an error (its images would otherwise get no or a wrong label).
    """

    def __init__(self, root: PathLike, preprocess: Preprocess, classes_file: Optional[ClassList] = None):
        self.root = _existing_dir(root, "dataset folder")
        self.preprocess = preprocess
        folders = class_folders(self.root)
        if classes_file is None:
            # Empty folders still get an index so that indices do not depend on which are empty.
            index = {name: i for i, name in enumerate(folders)}
            self.class_names = list(folders)
        else:
            entries = read_class_file(classes_file)
            index = {name: i for i, (name, _) in enumerate(entries)}
            self.class_names = [words for _, words in entries]
            for name in folders:
                if name not in index:
                    raise DataError(
                        f"class folder {self.root / name} is not listed in {_classes_where(classes_file)}: list every "
                        "class of the model, in its output order"
                    )
        self.samples: list[tuple[str, int]] = []
        for name in folders:
            files = folder_images(self.root / name)
            self.samples.extend((str(p), index[name]) for p in files)
        if not self.samples:
            loose = has_loose_images(self.root)
            hint = " (the images there have no class folders: for images without labels set labels: false)" if loose else \
                _other_files_hint(self.root)
            raise DataError(f"no images found under {self.root} (expected {self.root}/<class>/<image>){hint}")
        self.num_classes = len(self.class_names)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path, label = self.samples[i]
        return load_image(path, self.preprocess), label


class SegNetDataset(Dataset):
    """SegNet/CamVid layout: ``root/<split>/<name>.jpg`` with ``root/<split>annot/<name>.png``."""

    def __init__(
        self,
        root: PathLike,
        split: str,
        preprocess: Preprocess,
        ignore_index: int = 255,
        class_names: Optional[Sequence[str]] = None,
    ):
        self.root = _existing_dir(root, "dataset folder")
        self.split, self.preprocess, self.ignore_index = split, preprocess, ignore_index
        self.class_names = list(class_names) if class_names is not None else None
        self.num_classes = len(self.class_names) if self.class_names is not None else None
        images_dir = _existing_dir(self.root / split, f"split folder (split '{split}')")
        labels_dir = _existing_dir(self.root / f"{split}annot", f"label folder (split '{split}')")
        images = sorted(p for p in images_dir.iterdir() if _is_image(p, SEGNET_IMAGE_EXTENSIONS))
        if not images:
            raise DataError(f"no images found in {images_dir} (expected {images_dir}/<name>.jpg|.png)")
        self.samples: list[tuple[str, str]] = []
        for img in images:
            label = labels_dir / f"{img.stem}.png"
            if not label.is_file():
                raise DataError(f"label {label} for image {img} does not exist")
            self.samples.append((str(img), str(label)))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        image_path, label_path = self.samples[i]
        img = _open(image_path)
        size_hw = (img.height, img.width)  # labels are checked against the size *before* geometry
        image = image_to_array(img, self.preprocess, image_path)
        label = load_label(label_path, size_hw, self.preprocess, image_path=image_path, fill=self.ignore_index)
        return image, label


UNLABELLED = -1  # the classification label of an image without one; segmentation gets a mask of ignore_index


class UnlabelledImages(Dataset):
    """Every image under ``root`` (recursively, sorted), without labels: for agreement-only evaluation, calibration
    and distillation. Labels are UNLABELLED (classification) or all ``ignore_index`` (segmentation), which every
    metric leaves out, so a task metric over these images is None rather than a silently wrong number."""

    def __init__(self, root: PathLike, preprocess: Preprocess, task: Task, ignore_index: int = 255):
        self.root = _existing_dir(root, "dataset folder")
        self.preprocess, self.task, self.ignore_index = preprocess, task, ignore_index
        self.samples = [(str(p), UNLABELLED) for p in unlabelled_images(self.root)]
        if not self.samples:
            raise DataError(f"no images found under {self.root}{_other_files_hint(self.root)}")
        self.class_names, self.num_classes = None, None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        image = load_image(self.samples[i][0], self.preprocess)
        return image, get_task(self.task).unlabelled_label(image, self.ignore_index)


class DetectionDataset(Dataset):
    """Images with boxes (Pascal VOC, COCO JSON or YOLO txt, read and checked by ``tasks.detection_data``): samples are
    ``(uint8 CHW image resized or letterboxed to input_size, label table)`` (``tasks.detection.label_table``: the
    boxes in original pixels with the model's class ids, and the geometry that maps the model's boxes back).
    ``classes``: the model's class names in output order; the data set's class names are mapped onto them by name
    (``map_classes``: exact, else ignoring case and separators), a name the model lacks is one DataError."""

    def __init__(self, spec: DatasetSpec, preprocess: Preprocess, classes: Sequence[str]):
        from qdeploy.tasks import detection_data as dd

        self.preprocess = preprocess
        self.class_names = list(classes)
        self.num_classes = len(self.class_names)
        options = {"bad_boxes": spec.bad_boxes}
        if spec.format == "voc":
            samples = dd.read_voc(spec.root, _voc_split(spec), unannotated=spec.unannotated, **options)
        elif spec.format == "coco":
            if spec.annotations is None:
                raise DataError(f"format coco needs annotations: the COCO JSON of the images under {spec.root}")
            samples = dd.read_coco(spec.annotations, spec.root, **options)
        else:
            if spec.names is None and not dd.is_yolo_data_file(spec.root):
                raise DataError("format yolo needs names: the data set's class names (a list or its data.yaml), "
                                "which its txt files' class indices refer to (or root: its data.yaml)")
            samples = dd.read_yolo(spec.root, spec.names, spec.annotations, unannotated=spec.unannotated,
                                   split=spec.split, **options)
        if not samples:
            raise DataError(f"no annotated images under {spec.root}")
        names = sorted({c for smp in samples for c in smp.classes})
        index = dict(zip(names, dd.map_classes(names, self.class_names).tolist())) if names else {}
        self.records = samples
        self.skipped_boxes = dd.skipped_boxes(samples)
        self.max_boxes = max(len(smp.boxes) for smp in samples)
        self.samples = [(str(smp.image), np.array([index[c] for c in smp.classes], np.int64)) for smp in samples]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        from qdeploy.data.transforms import box_geometry
        from qdeploy.tasks.detection import label_table

        smp = self.records[i]
        img = _open(str(smp.image))
        if img.size != (smp.width, smp.height):  # the readers checked it; a file changed since is not scored wrongly
            raise DataError(f"image {smp.image} is {img.width}x{img.height} but its annotation says "
                            f"{smp.width}x{smp.height}")
        image = image_to_array(img, self.preprocess, smp.image)
        table = label_table(smp.width, smp.height, box_geometry(smp.width, smp.height, self.preprocess), smp.boxes,
                            self.samples[i][1], self.max_boxes)
        return image, table


def _voc_split(spec: DatasetSpec) -> Optional[str]:
    """The split a VOC data set is read with: ``split`` where the data set has split files (ImageSets/Main); without
    them the default (test) reads every annotation, and another split is asked for and refused by name."""
    from qdeploy.tasks.detection_data import voc_split_files

    default = type(spec).model_fields["split"].default
    return spec.split if voc_split_files(spec.root) is not None or spec.split != default else None


def detection_classes(spec: DatasetSpec) -> list[str]:
    """The model's class names in output order for a detection data set: ``classes``, else a YOLO data set's
    ``names`` (a model trained on it, e.g. by Ultralytics, outputs them in that order)."""
    from qdeploy.tasks.detection_data import yolo_class_names

    if spec.classes is not None:
        return [line for _, line in _class_file_lines(spec.classes)]
    names = yolo_class_names(spec.names, spec.root) if spec.format == "yolo" else None
    if names is None:
        yolo = " (YOLO data: or names, the data set's data.yaml or list, taken as the model's)" \
            if spec.format == "yolo" else ""
        raise DataError("detection needs classes: the model's class names in output order (a list, or a file with "
                        f"one name per line, e.g. coco.names), onto which the annotations' names are mapped{yolo}")
    return names


class SubsetDataset(Dataset):
    """A fixed selection of another dataset's samples; other attributes come from the base."""

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        self.dataset, self.indices = dataset, [int(i) for i in indices]
        base_samples = getattr(dataset, "samples", None)
        if base_samples is not None:
            self.samples = [base_samples[i] for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[self.indices[i]]

    def __getattr__(self, name: str):
        # Guard: during unpickling (a copy sent to another process) 'dataset' is not set yet and a
        # plain delegation would recurse forever.
        if name.startswith("__") or name in ("dataset", "indices"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def subset(dataset: Dataset, count: Optional[int], seed: int = 0, complement: bool = False) -> Dataset:
    """A seeded random ``count`` samples, kept in the dataset's order; all of them if count ≥ len.

    ``complement=True`` gives every sample *except* that subset, so one folder can be split into
    disjoint calibration (``count``) and evaluation (``count`` + ``complement``) parts.
    """
    n = len(dataset)
    if count is None or (count == n and not complement):
        return dataset
    if count > n:
        warnings.warn(f"count={count} but the dataset has only {n} samples: using all {n}", stacklevel=2)
        count = n
        if not complement:
            return dataset
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:count])
    if complement:
        chosen = np.setdiff1d(np.arange(n), chosen)
    return SubsetDataset(dataset, chosen.tolist())


_FORMAT_TASK = {f: name for name, t in TASKS.items() for f in t.dataset_formats}  # data.*.format → its labels' task


def build_dataset(spec: DatasetSpec, preprocess: Preprocess, task: Task) -> Dataset:
    """The dataset ``spec`` describes, checked against the model's task, subset to ``spec.count``.

    A layout problem is a DataError that starts with the spec's config key (``data.calibration: ...``)."""
    try:
        ds = _selected(spec, preprocess, task)
    except DataError as e:
        raise keyed_data_error(e, spec.key) from None
    if spec.subsplit is not None:
        ds = subset(ds, spec.subsplit.count, spec.subsplit.seed, spec.subsplit.complement)
    return ds


def _without_labels(spec: DatasetSpec) -> Optional[Path]:
    """Where to read images without labels: ``labels: false``, or a calibration set (which never needs labels) whose
    layout has none (a flat folder; a SegNet split without its annotation folder). None: read it with labels."""
    if not spec.labels:
        if Path(spec.root).expanduser().is_file():  # a YOLO data.yaml: its images are those of a split, not a folder
            raise DataError(f"labels: false reads every image under a folder, and root {spec.root} is a file: give "
                            "the image folder as root")
        return Path(spec.root)
    if not spec.labels_optional or Path(spec.root).expanduser().is_file():  # a data.yaml: read through its split
        return None
    root = _existing_dir(spec.root, "dataset folder")
    if spec.format == "segnet":
        images = root / spec.split
        return images if images.is_dir() and not (root / f"{spec.split}annot").is_dir() else None
    # images directly under root: a flat folder (class folders beside them would leave them out)
    return root if has_loose_images(root) else None


def _selected(spec: DatasetSpec, preprocess: Preprocess, task: Task) -> Dataset:
    unlabelled_root = _without_labels(spec)
    if unlabelled_root is not None:
        return subset(UnlabelledImages(unlabelled_root, preprocess, task, spec.ignore_index), spec.count, spec.seed,
                      spec.complement)
    needed = _FORMAT_TASK.get(spec.format)
    if needed is None:
        raise DataError(f"unknown dataset format '{spec.format}' for {spec.root} (expected one of {sorted(_FORMAT_TASK)})")
    if spec.format not in get_task(task).dataset_formats:
        raise DataError(f"dataset {spec.root} has format '{spec.format}', which needs task '{needed}', but the model's task is '{task}'")
    if spec.format == "imagefolder":
        ds = ImageFolderDataset(spec.root, preprocess, spec.classes)
        if spec.class_names:  # display names only: indices still come from folders / the classes file
            if len(spec.class_names) != ds.num_classes:
                raise DataError(f"class_names has {len(spec.class_names)} names but {spec.root} has {ds.num_classes} classes: "
                                "give one name per class, in label order")
            ds.class_names = list(spec.class_names)
    elif spec.format in ("voc", "coco", "yolo"):
        ds = DetectionDataset(spec, preprocess, detection_classes(spec))
    else:
        # For segmentation the class-list file only names the classes: line order = label id,
        # the whole line is the name ("Road marking").
        names = [line for _, line in _class_file_lines(spec.classes)] if spec.classes is not None else spec.class_names
        ds = SegNetDataset(spec.root, spec.split, preprocess, spec.ignore_index, names)
    return subset(ds, spec.count, spec.seed, spec.complement)
