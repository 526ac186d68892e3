"""Batches of decoded ``uint8`` images, decoded in parallel once and then served from memory.

Evaluation runs every variant (engine × precision) over the same images: decoding JPEGs once and
replaying the cached ``uint8`` batches keeps later passes from measuring the decoder.
"""
from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional

import numpy as np
from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import Dataset

from qdeploy.config import DatasetSpec, Preprocess, Task
from qdeploy.data.datasets import build_dataset
from qdeploy.errors import QDeployError, UnreadableImage
from qdeploy.tasks import get_task
from qdeploy.utils.inputs import unreadable_image_message
from qdeploy.utils.log import is_quiet

# Below this many samples, starting the decoding threads costs more than decoding in one.
MIN_SAMPLES_FOR_WORKERS = 64
# batches decoded ahead of the one being consumed, per worker (as DataLoader's default prefetch_factor)
PREFETCH_PER_WORKER = 2


class _Failure:
    """A user error raised while decoding a sample, carried back as data: the batch's other samples still decode
    (``on_error: skip`` lists it), and the original one-line message and exception class are raised again."""

    def __init__(self, exc: QDeployError, path: str = "?"):
        self.exc_type, self.message, self.path = type(exc), str(exc), path

    def reraise(self, key: Optional[str] = None):
        """Raise it again; an unreadable image's message names the data set's ``on_error: skip`` option."""
        message = self.message
        if issubclass(self.exc_type, UnreadableImage):
            message = unreadable_image_message(message, key)
        raise self.exc_type(message)


class _Guarded(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        try:
            return self.dataset[i]
        except QDeployError as e:  # only user errors: bugs keep their traceback
            samples = getattr(self.dataset, "samples", None)
            return _Failure(e, str(samples[i][0]) if samples is not None else f"sample {i}")


def _stack(items: list):
    images = np.stack([im for im, _ in items])
    labels = [np.asarray(lab) for _, lab in items]
    # class ids and label maps as int64; detection's label tables (float32 box coordinates) as they are
    labels = np.stack(labels if labels[0].dtype == np.float32 else [lab.astype(np.int64) for lab in labels])
    return images, labels


def _collate(items: list):
    """``((N,C,H,W) uint8, (N,...) int64)`` of the samples that decoded, and the failures (``_Failure``) of the rest."""
    good = [it for it in items if not isinstance(it, _Failure)]
    failed = [it for it in items if isinstance(it, _Failure)]
    return (_stack(good) if good else None), failed


def _start_progress(desc: str, total: int) -> Optional[tuple[Progress, int]]:
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=False,
    )
    try:
        progress.start()
    except LiveError:  # the caller already shows a live display on this console: go without a bar
        return None
    return progress, progress.add_task(desc, total=total)


class Batches:
    """Re-iterable ``(images uint8 (N,C,H,W), labels int64)`` batches of a dataset, in order.

    The first pass decodes with ``workers`` threads (and shows a progress bar); if the decoded
    data fits in ``cache_limit_mb`` it is kept, and later passes replay it without decoding.
    Do not modify yielded arrays in place: they may be the cached ones.
    """

    def __init__(self, dataset: Dataset, *, task: Task, preprocess: Preprocess, batch_size: int, workers: int,
                 desc: Optional[str] = None, cache_limit_mb: float = 2048, ignore_index: Optional[int] = None,
                 progress: bool = True, on_error: str = "error", key: Optional[str] = None):
        self.dataset, self.task, self.preprocess = dataset, task, preprocess
        self.batch_size, self.desc, self.progress = int(batch_size), desc, progress
        self.on_error = on_error
        self.key = key  # config key of the data set (data.eval), named in messages
        self.skipped: list[dict] = []  # {path, reason} of samples left out (on_error: skip)
        self.num_samples = len(dataset)
        self.workers = workers if self.num_samples >= MIN_SAMPLES_FOR_WORKERS else 0
        self.input_size = tuple(preprocess.input_size)
        self.class_names = getattr(dataset, "class_names", None)
        self.num_classes = getattr(dataset, "num_classes", None)
        pixel_labels = get_task(task).pixel_labels
        self.ignore_index = ignore_index if pixel_labels else None
        h, w = self.input_size
        label_bytes = h * w * 8 if pixel_labels else 8
        if getattr(dataset, "max_boxes", None) is not None:  # detection: a table of boxes per image
            label_bytes = (1 + dataset.max_boxes) * 7 * 4
        self.estimated_mb = self.num_samples * (preprocess.channels * h * w + label_bytes) / 2**20
        self.cacheable = self.estimated_mb <= cache_limit_mb
        self._cache: Optional[list[tuple[np.ndarray, np.ndarray]]] = None

    @property
    def cached(self) -> bool:
        return self._cache is not None

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return iter(self._cache) if self._cache is not None else self._decode()

    def _decoded(self) -> Iterator[tuple]:
        """``(batch, failures)`` of each batch in order, its samples decoded by ``workers`` threads.

        Threads, not processes: decoding is PIL's and numpy's C code, which releases the GIL, and a forked worker
        inherits the parent's native thread pools in whatever state they are. After an optimize in the same process
        (OpenVINO, NNCF and ONNX Runtime loaded and run), DataLoader's forked workers took the parent down with
        SIGSEGV (tests/test_data.py after tests/test_agreement_floor.py); spawn or forkserver workers would re-import
        the caller's script, which then needs an ``if __name__ == "__main__"`` guard."""
        guarded = _Guarded(self.dataset)
        n = len(self.dataset)
        spans = [range(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
        if self.workers <= 0:
            for span in spans:
                yield _collate([guarded[i] for i in span])
            return
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="qdeploy-decode")
        try:
            ahead: deque = deque()
            for span in spans:
                ahead.append([pool.submit(guarded.__getitem__, i) for i in span])
                if len(ahead) > PREFETCH_PER_WORKER * self.workers:
                    yield _collate([f.result() for f in ahead.popleft()])
            while ahead:
                yield _collate([f.result() for f in ahead.popleft()])
        finally:  # also on error or early exit: what is queued is dropped, what runs is waited for
            pool.shutdown(wait=True, cancel_futures=True)

    def _decode(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        cache = [] if self.cacheable else None
        it = self._decoded()
        bar = _start_progress(self.desc or "decoding images", self.num_samples) if self.progress and not is_quiet() else None
        skipped = []
        try:
            for batch, failed in it:
                if failed and self.on_error != "skip":
                    failed[0].reraise(self.key)
                skipped += [{"path": f.path, "reason": f.message} for f in failed]
                if bar is not None:
                    bar[0].advance(bar[1], (len(batch[0]) if batch is not None else 0) + len(failed))
                if batch is None:
                    continue
                if cache is not None:
                    cache.append(batch)
                yield batch
            self.skipped = skipped
            if cache is not None:  # only a complete pass is cached; an abandoned one is dropped
                self._cache = cache
                self.num_samples = sum(len(b[0]) for b in cache)
        finally:
            if bar is not None:
                bar[0].stop()
            it.close()  # stops the decoding threads now, also on error or early exit

    def first(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` samples (fewer if the dataset is smaller), decoded in this process."""
        n = min(int(n), self.num_samples)
        if n <= 0:
            raise ValueError("first(n) needs n >= 1")
        if self._cache is not None:
            images = np.concatenate([b[0] for b in self._cache[: math.ceil(n / self.batch_size)]])[:n]
            labels = np.concatenate([b[1] for b in self._cache[: math.ceil(n / self.batch_size)]])[:n]
            return images, labels
        guarded = _Guarded(self.dataset)
        items = []
        for i in range(len(self.dataset)):
            item = guarded[i]
            if isinstance(item, _Failure) and self.on_error != "skip":
                item.reraise(self.key)
            if not isinstance(item, _Failure):
                items.append(item)
            if len(items) == n:
                break
        if not items:
            raise QDeployError(f"{self.key or 'the data set'}: no image could be decoded (every one was unreadable and skipped)")
        return _stack(items)


def default_workers() -> int:
    return min(4, os.cpu_count() or 1)


def make_batches(spec: DatasetSpec, preprocess: Preprocess, task: Task, batch_size: Optional[int] = None,
                 desc: Optional[str] = None, cache_limit_mb: float = 2048, progress: bool = True) -> Batches:
    """Build the dataset ``spec`` describes and wrap it in re-iterable, cached :class:`Batches`."""
    dataset = build_dataset(spec, preprocess, task)
    return Batches(dataset, task=task, preprocess=preprocess, batch_size=batch_size or spec.batch_size,
                   workers=spec.workers if spec.workers is not None else default_workers(), desc=desc,
                   cache_limit_mb=cache_limit_mb, ignore_index=spec.ignore_index, progress=progress, on_error=spec.on_error,
                   key=spec.key)


class ArrayBatches:
    """Batches over images and labels already in memory (a subset picked by index): the same interface as
    :class:`Batches` for evaluation (iteration, ``num_samples``, ``class_names``, ``first``)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, class_names=None, num_classes=None):
        self.images, self.labels, self.batch_size = images, labels, max(1, int(batch_size))
        self.num_samples = len(images)
        self.class_names, self.num_classes = class_names, num_classes
        self.cached = True

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, self.num_samples, self.batch_size):
            yield self.images[start:start + self.batch_size], self.labels[start:start + self.batch_size]

    def first(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.images[:n], self.labels[:n]


def take(batches, indices) -> tuple[np.ndarray, np.ndarray]:
    """The samples at ``indices`` (positions in iteration order) of re-iterable batches, in the order given."""
    indices = np.asarray(indices, dtype=np.int64)
    wanted = {int(i): k for k, i in enumerate(indices)}
    images, labels = [None] * len(indices), [None] * len(indices)
    pos = 0
    for x, y in batches:
        for j in range(len(x)):
            k = wanted.get(pos + j)
            if k is not None:
                images[k], labels[k] = x[j], y[j]
        pos += len(x)
    missing = [int(indices[k]) for k, im in enumerate(images) if im is None]
    if missing:
        raise IndexError(f"samples {missing[:5]} are beyond the {pos} samples of the split")
    return np.stack(images), np.stack(labels)
