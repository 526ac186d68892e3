"""User-facing errors.

Everything the user can fix (a wrong path, a bad config key, a corrupt image) is raised as a
:class:`QDeployError`. The CLI prints its message on one line and exits with code 2; anything else
is a bug in qdeploy and keeps its traceback.
"""
from __future__ import annotations


class QDeployError(Exception):
    """An error caused by the user's input; the message says what and where."""

    exit_code = 2


class ConfigError(QDeployError):
    """The config file has unknown keys, wrong types or missing values."""


class ModelError(QDeployError):
    """The model cannot be built or its weights do not fit it."""


class DataError(QDeployError):
    """The data folder, an image or a label map is missing, empty, corrupt or inconsistent."""


class ExportError(QDeployError):
    """The ONNX export or its verification against PyTorch failed."""


class VariantUnavailable(Exception):
    """A variant cannot run on this machine (e.g. FP16 without a GPU): reported as skipped."""
