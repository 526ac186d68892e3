"""The engine interface every backend implements, and the registry that maps ``engine:`` names to classes.

An engine runs one variant (engine × precision × options) of the model:
  ``load()``               build/compile; raise VariantUnavailable when this machine cannot run it
  ``infer(batch)``         float32 NCHW numpy in → float32 numpy logits out (used for evaluation)
  ``prepare_timed(batch)`` stage ``batch`` where the engine reads it (e.g. GPU memory) and return a
                           zero-argument callable that runs one inference on it (used for benchmarks,
                           so host↔device copies are not counted as model latency)
  ``synchronize()``        wait for queued device work (no-op on CPU)
  ``describe()``           what exactly runs: device, dtype, threads, providers, artifact...
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

import numpy as np

from qdeploy.config import VariantSpec
from qdeploy.models.artifacts import ModelArtifacts

ENGINES: dict[str, type["Engine"]] = {}


def register_engine(name: str):
    def deco(cls):
        cls.engine_name = name
        ENGINES[name] = cls
        return cls

    return deco


def create_engine(variant: VariantSpec, artifacts: ModelArtifacts) -> "Engine":
    try:
        cls = ENGINES[variant.engine]
    except KeyError:
        raise ValueError(f"unknown engine '{variant.engine}'; known: {sorted(ENGINES)}") from None
    return cls(variant, artifacts)


class Engine(ABC):
    engine_name: str = ""

    def __init__(self, variant: VariantSpec, artifacts: ModelArtifacts):
        self.variant = variant
        self.artifacts = artifacts
        self.device = "cpu"

    @abstractmethod
    def load(self) -> None: ...

    @abstractmethod
    def infer(self, batch: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def prepare_timed(self, batch: np.ndarray) -> Callable[[], object]: ...

    def synchronize(self) -> None:
        pass

    def timer(self) -> Optional["CudaTimer"]:
        """A device timer when the engine runs on a GPU (None: use the host clock)."""
        return None

    @abstractmethod
    def describe(self) -> dict: ...

    def artifact_path(self) -> Optional[str]:
        return None

    def note(self) -> Optional[str]:
        """A caveat shown next to the variant's numbers in every table (e.g. 'simulated INT8')."""
        return None

    def quantization(self) -> Optional[dict]:
        """Calibration/placement details for INT8 variants."""
        return None

    def close(self) -> None:
        pass


class CudaTimer:
    """Time one call with CUDA events on the current stream, waiting for it to finish.

    Events bracket exactly the device work that the call enqueues (plus any launch gaps), and the
    synchronize makes each sample the latency of one complete inference, as a user would see it.
    """

    def __init__(self):
        import torch

        self._torch = torch
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def time_ms(self, fn: Callable[[], object]) -> float:
        self.start.record()
        fn()
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)
