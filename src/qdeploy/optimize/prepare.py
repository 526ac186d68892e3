"""Everything ``qdeploy optimize`` checks and decides before its first evaluation: the config is validated (a bad
one fails in seconds, not after an hour of search), the target resolved, the first candidates planned and the data
split into search and confirm."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from qdeploy.config import OptimizeConfig, RunConfig, source_format
from qdeploy.data import make_batches
from qdeploy.errors import ConfigError
from qdeploy.facts.onnxruntime import cuda_ep_problem
from qdeploy.facts.tensorrt import tensorrt_version
from qdeploy.optimize.candidates import Candidate, Target, plan, target_for
from qdeploy.preflight import check_qat_data

TORCH_TIME_LIMIT = 300.0  # seconds: optimize.time_limit's default for the PyTorch targets
CPU_TARGETS = ("onnxruntime-cpu", "cpu", "torch-cpu")  # the targets whose candidates run on CPU threads


@dataclasses.dataclass
class SearchPlan:
    """A validated search: its settings, target and first candidates, the run configs of the search and confirm
    splits, and the split sizes."""

    cfg: RunConfig
    o: OptimizeConfig
    target: Target
    planned: list[Candidate]
    search_cfg: dict   # the run config of the search split (every planned candidate a variant)
    base: dict         # the run config without variants or split, that the confirm run starts from
    n: int             # images in data.eval
    n_search: int      # of them, in the search split
    batch_size: int    # the batch size candidates are ranked at
    tensorrt: bool     # TensorRT and a GPU are here

    @property
    def threads(self) -> Optional[int]:
        """The CPU threads every candidate runs and is timed with (None: a GPU target)."""
        return (self.target.threads or os.cpu_count()) if self.o.target in CPU_TARGETS else None


def _check_target(cfg: RunConfig, o: OptimizeConfig) -> OptimizeConfig:
    if o.target == "torch-cuda" and not torch.cuda.is_available():
        raise ConfigError("optimize.target torch-cuda: no CUDA GPU is visible to PyTorch")
    if o.target == "onnxruntime-cuda":
        problem = cuda_ep_problem()
        if problem:
            raise ConfigError(f"optimize.target onnxruntime-cuda: {problem}")
    if o.target.startswith("torch-") and source_format(cfg.model.source) != "pytorch":
        raise ConfigError(f"optimize.target {o.target} runs the PyTorch model, but model.source is an ONNX or Keras model "
                          f"({cfg.model.source}): use target onnxruntime-cpu or tensorrt, or give the PyTorch model")
    if o.target.startswith("torch-") and o.time_limit is None:
        # compiling is open-ended (max-autotune: minutes per model): the PyTorch targets are bounded by default
        o = o.model_copy(update={"time_limit": TORCH_TIME_LIMIT})
    return o


def _check_data(cfg: RunConfig, o: OptimizeConfig) -> None:
    ev = cfg.data.eval
    if not ev.labels and not o.budget.agreement_only:
        kind = o.budget.kind
        raise ConfigError(f"optimize.budget.{kind} compares the task metric, which needs labels, but data.eval has labels: "
                          "false; without labels use optimize.budget.min_agreement (the share of FP32's predictions kept)"
                          + (f" alone: remove {kind}" if o.budget.min_agreement is not None else ""))
    if ev.subsplit is not None:
        raise ConfigError("optimize splits data.eval into search and confirm itself (data.eval.subsplit): remove subsplit "
                          "from data.eval (count/complement, to keep calibration images out, stay as they are)")


def prepare_search(cfg: RunConfig) -> SearchPlan:
    """Validate before any work, then plan the search."""
    o = _check_target(cfg, cfg.optimize or OptimizeConfig())
    _check_data(cfg, o)
    trt = tensorrt_version() is not None and torch.cuda.is_available()
    target = target_for(o.target, trt)
    if o.threads:
        if o.target not in CPU_TARGETS:
            raise ConfigError(f"optimize.threads sets CPU threads; target {o.target} runs on a GPU")
        target = dataclasses.replace(target, threads=o.threads)
    bs = o.batch_size or max(cfg.bench.batch_sizes)
    listing = make_batches(cfg.data.eval, cfg.model.preprocess, cfg.model.task, progress=False)
    n = listing.num_samples
    n_search = max(1, round(o.search_fraction * n))
    if n_search >= n:
        raise ConfigError(f"data.eval has {n} images: too few to split into search and confirm")
    planned = plan(o, target)
    if o.qat != "off":
        if target.placement is None:
            raise ConfigError(f"optimize.qat {o.qat}: target {o.target} runs no INT8 candidates to train")
        cfg = cfg.model_copy(update={"qat": cfg.qat_settings().model_copy(update={"objective": o.qat})})
        check_qat_data(cfg, listing)  # training images exist and are not evaluation images, before any work
    base = cfg.model_dump(mode="json", exclude_none=True)
    base.pop("optimize", None)
    # a PyTorch target is ranked over every configured batch size (its artifact serves them all), unless one is named
    ranked = [bs] if o.batch_size or not target.torch_program else sorted(set(cfg.bench.batch_sizes))
    base["bench"] = {**base.get("bench", {}), "batch_sizes": ranked, "enabled": target.measured}
    if target.torch_program:
        # evaluated in batches of the largest timed size: torch.compile specialises on shapes, so another batch size
        # would compile again (a last, smaller batch is padded by the engine and by load_model.py)
        base["data"] = {**base["data"], "eval": {**base["data"]["eval"], "batch_size": max(ranked)}}
    search_cfg = dict(base, variants=[c.spec for c in planned],
                      data={**base["data"], "eval": {**base["data"]["eval"], "subsplit": {"count": n_search, "seed": o.seed}}})
    return SearchPlan(cfg, o, target, planned, search_cfg, base, n, n_search, bs, trt)


__all__ = ["CPU_TARGETS", "SearchPlan", "TORCH_TIME_LIMIT", "prepare_search"]
