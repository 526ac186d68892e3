"""User-facing errors.

Everything the user can fix (a wrong path, a bad config key, a corrupt image) is raised as a
:class:`QDeployError`. The CLI prints its message on one line and exits with code 2; anything else
is a bug in qdeploy and keeps its traceback.
"""
from __future__ import annotations


class QDeployError(Exception):
    """An error caused by the user's input; the message says what and where, on one line.

    A message that quotes another library's multi-line text (a factory's exception, a parser's diagnostic) is
    folded onto one line here, so the CLI's ``qdeploy: error: ...`` stays one line whatever it quotes."""

    exit_code = 2

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str) and "\n" in args[0]:
            args = (" ".join(line.strip() for line in args[0].splitlines() if line.strip()),)
        super().__init__(*args)


class ConfigError(QDeployError):
    """The config file has unknown keys, wrong types or missing values."""


class ModelError(QDeployError):
    """The model cannot be built or its weights do not fit it."""


class DataError(QDeployError):
    """The data folder, an image or a label map is missing, empty, corrupt or inconsistent."""


class UnreadableImage(DataError):
    """An image (or label map) that cannot be decoded: the data set's ``on_error: skip`` leaves such files out."""


class ExportError(QDeployError):
    """The ONNX export or its verification against PyTorch failed."""


class VariantUnavailable(Exception):
    """A variant cannot run on this machine (e.g. FP16 without a GPU): reported as skipped."""
