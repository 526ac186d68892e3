"""Engines: one small interface (load / infer / prepare_timed / describe) over each runtime.

Add an engine by subclassing :class:`Engine` in a new module, decorating it with
``@register_engine("name")`` and importing the module here.
"""
from qdeploy.engines.base import ENGINES, CudaTimer, Engine, create_engine, register_engine
from qdeploy.engines import onnxruntime_engine, torch_engine  # noqa: F401  (registers the engines)

__all__ = ["ENGINES", "CudaTimer", "Engine", "create_engine", "register_engine"]
