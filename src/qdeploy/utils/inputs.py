"""The user's input files, checked without torch, ONNX or ONNX Runtime: one home for each check and its message.

The stages (``models``, ``export``, ``data``, ``preflight``) raise these errors when they reach a file, and ``qdeploy``'s
command line raises the same ones before it imports the stages (seconds of torch/ONNX imports), so that a missing file
or a corrupt image is named in about a second, with the message the full run would give. Imports: PIL only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from PIL import Image

from qdeploy.errors import DataError, ModelError, QDeployError, UnreadableImage

PathLike = Union[str, Path]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".tif", ".tiff"})

# What PIL raises for unreadable files varies by plugin: OSError (UnidentifiedImageError,
# "image file is truncated"), SyntaxError (broken PNG chunks), ValueError, EOFError.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


def is_image(p: Path, extensions=IMAGE_EXTENSIONS) -> bool:
    # Dot-files are skipped: macOS writes "._x.jpg" resource forks next to real images.
    return p.suffix.lower() in extensions and not p.name.startswith(".") and p.is_file()


def class_folders(root: Path) -> list[str]:
    """An image folder's class folders, sorted; hidden folders (.ipynb_checkpoints, .git) are never classes."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def folder_images(folder: Path) -> list[Path]:
    """The images under one class folder, recursively, sorted (the folder's samples, in order)."""
    return sorted(p for p in folder.rglob("*") if is_image(p))


def unlabelled_images(root: Path) -> list[Path]:
    """Every image under ``root``, recursively, sorted, none inside a hidden folder (a data set without labels)."""
    return [p for p in sorted(root.rglob("*")) if is_image(p)
            and not any(part.startswith(".") for part in p.relative_to(root).parts)]


def has_loose_images(root: Path) -> bool:
    """Images directly under ``root`` (a flat folder, not class folders)."""
    return any(is_image(p) for p in root.iterdir())


def open_image(path: PathLike, what: str = "image") -> Image.Image:
    """Open and fully decode ``path``; any decoding problem becomes a one-line DataError."""
    try:
        with Image.open(path) as img:
            img.load()  # PIL decodes lazily: load() now so truncated files fail here, naming the file
            return img  # pixel data is in memory now; closing the file is fine
    except FileNotFoundError:
        raise DataError(f"{what} {path} does not exist") from None
    except Image.UnidentifiedImageError:
        raise UnreadableImage(f"{what} {path} is corrupt or not an image (PIL cannot identify it)") from None
    except _DECODE_ERRORS as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UnreadableImage(f"{what} {path} cannot be decoded: {reason}") from None


def unreadable_image_message(message: str, key: Optional[str]) -> str:
    """An unreadable image's message, naming the data set's ``on_error: skip`` option (``key``: ``data.eval``...)."""
    option = f"{key}.on_error: skip" if key else "on_error: skip in its data section"
    return message + f"; to leave unreadable images out (they are listed in results.json), set {option}"


def existing_dir(path: PathLike, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{what} {path} does not exist")
    if not path.is_dir():
        raise DataError(f"{what} {path} is not a folder")
    return path


def keyed_data_error(e: DataError, key: Optional[str]) -> DataError:
    """A data set's layout problem, starting with its config key (``data.calibration: ...``)."""
    if key and not str(e).startswith(key):
        return type(e)(f"{key}: {e}")
    return e


def check_model_file(path: Path) -> None:
    """The Python file of a ``file.py:factory`` model source."""
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")


def check_weights_file(path: Path) -> None:
    """A weights file (model.weights) before it is read."""
    if path.is_dir():
        raise ModelError(f"weights {path} is a folder: give the state_dict file in it (model.weights)")
    if not path.is_file():
        raise ModelError(f"weights file {path} does not exist")


def check_onnx_file(path: Path) -> None:
    """An ONNX model source before it is parsed."""
    if not path.is_file():
        raise ModelError(f"ONNX model file {path} does not exist")


def check_calibration_cache(index: int, path: PathLike) -> None:
    """A variant's TensorRT calibration cache (``variants[i].calibration_cache``)."""
    if not Path(path).is_file():
        raise QDeployError(f"variants[{index}].calibration_cache: file {path} does not exist")
