"""Lazy, cached access to the forms of one model that engines need (Polygraphy-style loaders).

An engine asks for ``torch_model()`` or ``onnx()``; each is built at most once per run, and the ONNX
export is also cached on disk across runs (see :mod:`qdeploy.export.onnx`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np
from torch import nn

from qdeploy.config import ExportSpec, ModelSpec
from qdeploy.errors import ModelError
from qdeploy.models.loader import build_torch_model, is_onnx_source


class ModelArtifacts:
    def __init__(
        self,
        spec: ModelSpec,
        export: ExportSpec,
        verify_inputs: Optional[Callable[[], np.ndarray]] = None,
        cache_dir: Optional[Path] = None,
        calibration: Optional[Callable[[], object]] = None,
    ):
        self.spec = spec
        self.export_spec = export
        self.verify_inputs = verify_inputs  # real, preprocessed images for export verification
        self.cache_dir = cache_dir
        self.calibration = calibration  # () -> Batches of data.calibration (memoised by the caller)
        self._torch: Optional[nn.Module] = None
        self._onnx = None
        self._derived: dict = {}

    @property
    def has_torch(self) -> bool:
        return not is_onnx_source(self.spec.source)

    def torch_model(self) -> nn.Module:
        """The FP32 CPU reference module (engines copy it before changing device/dtype)."""
        if not self.has_torch:
            raise ModelError(f"model source {self.spec.source} is ONNX-only: there is no PyTorch model to run")
        if self._torch is None:
            self._torch = build_torch_model(self.spec)
        return self._torch

    def onnx(self):
        """The FP32 ONNX artifact (exported and verified, or the user's own .onnx)."""
        if self._onnx is None:
            from qdeploy.export.onnx import export_onnx, use_onnx_file

            if self.has_torch:
                inputs = self.verify_inputs() if self.verify_inputs else None
                self._onnx = export_onnx(self.torch_model(), self.spec, self.export_spec, inputs, self.cache_dir)
            else:
                self._onnx = use_onnx_file(self.spec.source)
        return self._onnx

    def derived(self, key: str, build: Callable[[], object]):
        """Memoise artifacts derived from the above (e.g. an FP16 ONNX) for the rest of the run."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]
