"""The ``qdeploy.results/1`` contract: what a results dict must hold before any report is written.

Validation runs before anything touches the disk, so a malformed dict fails with one clear
``ValueError`` naming the offending key instead of a half-rendered report or an invalid JSON file.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

SCHEMA_VERSION = "qdeploy.results/1"

TASKS = ("classification", "segmentation")
STATUSES = ("ok", "skipped", "failed")
# Only the keys the reports cannot do without; the others (config, data, created, ...) are shown when present.
REQUIRED_TOP = ("schema", "model", "environment", "bench", "reference", "variants")
REQUIRED_VARIANT = ("name", "engine", "precision", "status", "metrics", "agreement",
                    "latency_ms", "throughput_ips", "memory_mb")
# Sections that may be {} (or None) when a variant was skipped or failed before measuring anything.
MAPPING_KEYS = ("metrics", "latency_ms", "throughput_ips", "memory_mb")


def validate_results(results: Any) -> dict:
    """Check ``results`` against the schema and return a JSON-ready copy of it.

    Raises ``ValueError`` naming the first problem found. The copy has numpy scalars/arrays turned
    into plain numbers/lists, tuples into lists and dict keys into strings (what ``json`` would store),
    so rendering from it gives exactly what ``results.json`` says. NaN and infinity are rejected:
    strict JSON cannot hold them, and a missing measurement must be ``None``.
    """
    if not isinstance(results, Mapping):
        raise ValueError(f"results must be a dict, got {type(results).__name__}")
    missing = [k for k in REQUIRED_TOP if k not in results]
    if missing:
        raise ValueError(f"results: missing top-level key(s) {', '.join(map(repr, missing))}")
    data = to_plain(results)
    if data["schema"] != SCHEMA_VERSION:
        raise ValueError(f"results.schema is {data['schema']!r}; this qdeploy reads {SCHEMA_VERSION!r}")
    for key in ("model", "environment", "bench"):
        if not isinstance(data[key], dict):
            raise ValueError(f"results.{key} must be a dict, got {type(data[key]).__name__}")
    if data["model"].get("task") not in TASKS:
        raise ValueError(f"results.model.task must be one of {', '.join(TASKS)}, got {data['model'].get('task')!r}")

    variants = data["variants"]
    if not isinstance(variants, list) or not variants:
        raise ValueError("results.variants must be a non-empty list")
    names: set[str] = set()
    for i, v in enumerate(variants):
        where = f"variants[{i}]"
        if not isinstance(v, dict):
            raise ValueError(f"{where} must be a dict, got {type(v).__name__}")
        if isinstance(v.get("name"), str) and v["name"]:
            where += f" ({v['name']!r})"
        missing = [k for k in REQUIRED_VARIANT if k not in v]
        if missing:
            raise ValueError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
        if not isinstance(v["name"], str) or not v["name"].strip():
            raise ValueError(f"{where}: name must be a non-empty string")
        if v["name"] in names:
            raise ValueError(f"{where}: duplicate variant name")
        names.add(v["name"])
        if v["status"] not in STATUSES:
            raise ValueError(f"{where}: status must be one of {', '.join(STATUSES)}, got {v['status']!r}")
        if v["status"] != "ok" and not (isinstance(v.get("reason"), str) and v["reason"].strip()):
            raise ValueError(f"{where}: status is {v['status']!r} but no reason says why")
        for key in MAPPING_KEYS:
            if v[key] is not None and not isinstance(v[key], dict):
                raise ValueError(f"{where}.{key} must be a dict (or {{}} when not measured), got {type(v[key]).__name__}")
        agreement = v["agreement"]
        if agreement is not None and (isinstance(agreement, bool) or not isinstance(agreement, (int, float))
                                      or not 0.0 <= agreement <= 1.0):
            raise ValueError(f"{where}.agreement must be a fraction in [0, 1] or None, got {agreement!r}")

    ref = data["reference"]
    if ref is not None and ref not in names:
        raise ValueError(f"results.reference {ref!r} is not the name of any variant")
    return data


def to_plain(obj: Any, path: str = "results") -> Any:
    """Recursively convert ``obj`` into JSON-native types; ``path`` names the culprit in errors."""
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        f = float(obj)
        if not math.isfinite(f):
            raise ValueError(f"{path} is {f}: use None for a missing value (JSON has no NaN/inf)")
        return f
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, PurePath):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy arrays and numpy scalars (np.bool_ is neither bool nor Integral)
        return to_plain(obj.tolist(), path)
    raise ValueError(f"{path}: a {type(obj).__name__} cannot be stored in results.json")
