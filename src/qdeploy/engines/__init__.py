"""Engines: a capability table (what each engine runs, its options, its availability probe) and one
small interface (load / infer / prepare_timed / describe) over each runtime. See engines/base.py."""
from qdeploy.engines import onnxruntime_engine, openvino_engine, tensorrt_engine, torch_engine  # noqa: F401  (register the engines)
from qdeploy.engines.base import (
    ENGINES, CudaTimer, Engine, Variant, create_engine, engine_table, get_engine, register_engine, resolve_variant, resolve_variants,
)

__all__ = ["ENGINES", "CudaTimer", "Engine", "Variant", "create_engine", "engine_table", "get_engine", "register_engine",
           "resolve_variant", "resolve_variants"]
