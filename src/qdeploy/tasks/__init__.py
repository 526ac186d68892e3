"""What a task is: one module per task (``classification.py``, ``segmentation.py``, ``detection.py``) and the registry of them.

Every per-task fact the stages need (the headline metric and its label, how outputs become predictions and
metrics, how a change against the reference is tested, the words for a prediction) is an attribute or method of a
:class:`Task`; the stages ask ``get_task(cfg.model.task)`` instead of comparing task names, so a new task touches its
own module and this registry only (timm's model registry and its ``pretrained_cfg`` record are the model).

This stage comes right after ``errors``/``utils``: config validates ``model.task`` against :data:`TASKS`, and data,
quantize and preflight read the facts; so a task module imports nothing later than that (the metric classes live
here, ``qdeploy.evaluate.metrics`` re-exports them).
"""
from __future__ import annotations

from qdeploy.tasks.base import DEFAULT_TASK, TASKS, Task, get_task, register_task, task_of_metric
# the task modules register themselves on import
from qdeploy.tasks import classification, detection, segmentation  # noqa: E402

__all__ = ["DEFAULT_TASK", "TASKS", "Task", "get_task", "register_task", "task_of_metric",
           "classification", "detection", "segmentation"]
