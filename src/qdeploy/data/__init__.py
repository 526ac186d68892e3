"""Data stage: datasets on disk → re-iterable, cached batches of ``uint8`` images and labels.

Public API::

    make_batches(spec, preprocess, task, batch_size=None, desc=None, cache_limit_mb=2048) -> Batches
    build_dataset(spec, preprocess, task) -> Dataset
    ImageFolderDataset(root, preprocess, classes_file=None)
    SegNetDataset(root, split, preprocess, ignore_index=255, class_names=None)
    subset(dataset, count, seed=0)
    load_image(path, preprocess) -> uint8 (C, H, W)
    load_label(path, image_size_hw, preprocess) -> int64 (H, W)
    normalize(batch_uint8, preprocess) -> float32 (N, C, H, W)
"""
from qdeploy.data.datasets import (
    IMAGE_EXTENSIONS,
    ImageFolderDataset,
    SegNetDataset,
    SubsetDataset,
    build_dataset,
    read_class_file,
    subset,
)
from qdeploy.data.loader import ArrayBatches, Batches, make_batches, take
from qdeploy.data.transforms import load_image, load_label, normalize

__all__ = [
    "IMAGE_EXTENSIONS", "ArrayBatches", "Batches", "ImageFolderDataset", "SegNetDataset", "SubsetDataset", "build_dataset",
    "load_image", "load_label", "make_batches", "normalize", "read_class_file", "subset", "take",
]
