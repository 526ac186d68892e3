"""The :class:`Task` record and the registry every task module registers itself in (``qdeploy.tasks`` imports
them all and re-exports this module's names)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from qdeploy.errors import ConfigError
from qdeploy.utils.registry import registrar


class Task:
    """The facts of one task; a subclass per task, registered with :func:`register_task`."""

    name: str
    # the metric the budget, the verdict and the headline read: its key in a results' ``metrics`` and its name in
    # sentences ("at most 1.00 point of top-1 below FP32")
    metric: str
    metric_label: str
    # the report's metric columns, headline first: (key in ``metrics``, column header)
    metric_columns: tuple[tuple[str, str], ...]
    # a per-class score in ``metrics`` (its own report table), or None
    per_class_scores: Optional[str] = None
    # what is compared for agreement, in sentences ("agrees with the reference on 97 % of its predictions")
    predictions_word: str
    # labels: one per image (N,), label < 0 = unlabelled; or one map per image (N, H, W) with ignore_index for void
    pixel_labels: bool
    # the data.*.format that holds this task's labels (an imagefolder's class folders, a segnet split's label maps)
    dataset_format: str
    # the output the saved program's load_model.py returns for evaluation: "logits" or "argmax" (per-pixel classes,
    # far smaller than logits for a whole split)
    program_output: str
    # how a variant's change against the reference is tested on the same images (evaluate/compare.paired_changes):
    # "mcnemar" (exact McNemar + Agresti–Min interval of a top-1 change, evaluate/stats.accuracy_change_of) or
    # "bootstrap" (paired bootstrap over images of an mIoU change, evaluate/stats.miou_change)
    paired_comparison: str
    # does the metric have a per-sample (binomial) standard error: optimize's paired standard errors of a drop and
    # its resolution warning need one; without it budgets use the point estimate
    per_sample_standard_error: bool
    # is the reference checked for near-chance top-1 (evaluate/compare.reference_chance)
    reference_chance: bool
    # the agreement with the reference below which an INT8 variant is degraded / not within budget, where the config
    # gives none (config.DEFAULT_MIN_AGREEMENT's reasoning: healthy INT8 far above it, a collapsed model far below)
    default_min_agreement: float = 0.9
    # images per batch of optimize's layer sensitivity pass (its activations for a whole batch sit in memory)
    sensitivity_batch_size: int

    # the model's raw output needs model.decode (detection's head decoder); config checks it
    needs_decoder: bool = False
    # QAT's distillation loss between the FP32 teacher's and the quantized student's raw outputs (quantize/qat.py):
    # "softmax-kl" (class scores on axis 1: per image or per pixel) or "output-mse" (a regression-and-scores head, each
    # output channel's squared error over the teacher's variance); and whether QAT can train on the task's labels
    # (detection cannot: its training loss needs the head's box assignment, which qdeploy does not know)
    distillation: str = "softmax-kl"
    supervised_qat: bool = True
    # a task whose raw outputs are decoded checks one batch of them itself in preflight: check_output(outputs, labels,
    # class_names) -> facts for the results (raising ValueError with the reason); None: preflight's shape checks of
    # per-image and per-pixel class scores
    check_output = None

    def make_metrics(self, num_classes: Optional[int] = None, ignore_index: int = 255,
                     class_names: Optional[Sequence[str]] = None, topk: Sequence[int] = (1, 5)):
        """An empty metrics accumulator (``update(logits, labels)``, ``result()``, ``predictions``) of this task.
        ``num_classes`` is the model's output count; ``topk`` the accuracies kept where the task has them."""
        raise NotImplementedError

    def metrics_of_program(self, outputs: np.ndarray, labels: np.ndarray, num_classes: Optional[int] = None,
                           ignore_index: int = 255, class_names: Optional[Sequence[str]] = None):
        """The metrics of a saved program's outputs (:attr:`program_output`) on a whole split's ``labels``."""
        raise NotImplementedError

    @property
    def dataset_formats(self) -> tuple[str, ...]:
        """Every data.*.format that holds this task's labels (detection: voc, coco, yolo)."""
        return (self.dataset_format,)

    def bind(self, model, base=None) -> "Task":
        """This task with what it needs of the model (``cfg.model``; ``base``: the config's folder): detection's
        decoder and NMS settings. Tasks that need nothing return themselves."""
        return self

    def unlabelled_label(self, image: np.ndarray, ignore_index: int = 255):
        """The label of an image read without one (``labels: false``, a flat calibration folder): every metric leaves
        it out, agreement still counts it."""
        raise NotImplementedError

    def examples(self, batches, predictions: dict, reference: Optional[str], count: int = 4) -> Optional[list]:
        """A few images with each variant's predictions for the report's picture (detection: boxes), or None."""
        return None

    @staticmethod
    def names_for(class_names: Optional[Sequence[str]], outputs: int) -> Optional[list]:
        """The class names to report for a model of ``outputs`` classes (None where the list does not fit)."""
        return list(class_names) if class_names and len(class_names) == outputs else None

    def __repr__(self) -> str:
        return f"<task {self.name}>"


TASKS: dict[str, Task] = {}
DEFAULT_TASK = "classification"  # config's model.task default; a results file without a task is read as this one


register_task = registrar(TASKS, "task", key=lambda task: task.name)  # TASKS[task.name] = task, once


def get_task(name) -> Task:
    """The registered task called ``name`` (a :class:`Task` is returned as it is)."""
    if isinstance(name, Task):
        return name
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown task {name!r}: model.task must be one of {', '.join(TASKS)}") from None


def task_of_metric(key) -> Optional[Task]:
    """The task whose headline metric is ``key`` (a QAT summary records the metric, not the task), or None."""
    return next((t for t in TASKS.values() if t.metric == key), None)
