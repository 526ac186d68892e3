"""The ``qdeploy.results/2`` contract: what a results dict must hold before any report is written.

Validation runs before anything touches the disk, so a malformed dict fails with one clear
``ValueError`` naming the offending key instead of a half-rendered report or an invalid JSON file.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import PurePath, PurePosixPath, PureWindowsPath
from typing import Any

from qdeploy.evaluate.verdict_rules import RAN_STATUSES
from qdeploy.tasks import TASKS

SCHEMA_VERSION = "qdeploy.results/2"

# degraded: ran and measured, but its INT8 accuracy collapsed (see report.verdict.mark_degraded).
STATUSES = (*RAN_STATUSES, "skipped", "failed")
# A variant's stages, in order (its record's ``stages``: pipeline.VariantRecord).
STAGES = ("build", "load", "eval", "bench")
# Where a variant stopped: "check" = found unavailable before anything was built.
FAILED_STAGES = ("check", *STAGES)
STAGE_STATUSES = ("ok", "failed", "skipped", "not_run")
# accuracy_change.verdict: the paired test's answer (qdeploy.evaluate.stats)
CHANGE_VERDICTS = ("no detectable change", "worse", "better")
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

    The keys added in results/2 are optional (absent = not measured) but checked when present:
    per variant ``failed_stage``, ``stages``, ``speed_is_deployment``, ``latency_ms[bs]``'s ``cv``,
    ``noisy``, ``noisy_reason`` (why, "kind: detail" clauses joined by "; ", kinds scatter, drift, batch),
    ``repeats``, ``repeat_p50s``, ``warmup_calls`` and ``accuracy_change`` (the paired test against the reference:
    ``verdict`` one of :data:`CHANGE_VERDICTS`, ``p_value`` in [0, 1], ``n``, points); top-level ``recommendation``
    (names only ok variants; optional ``speedup``), ``warnings`` (``[{code, message, ...}]``, codes such as
    ``reference-near-chance`` and ``every-int8-variant-failed``) and ``artifacts`` (paths relative to the output
    folder); ``data.eval/calibration.skipped_files``.
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
        _check_variant_v2(v, where)

    ref = data["reference"]
    if ref is not None and ref not in names:
        raise ValueError(f"results.reference {ref!r} is not the name of any variant")
    statuses = {v["name"]: v["status"] for v in variants}
    if "recommendation" in data:
        _check_recommendation(data["recommendation"], statuses)
    if "artifacts" in data:
        _check_artifacts(data["artifacts"], names)
    if "warnings" in data:
        _check_warnings(data["warnings"])
    _check_skipped_files(data.get("data"))
    return data


# ---------------------------------------------------------------------------- keys added in results/2
# All optional: a record without them reads as "not measured". Present ones must be well formed.
def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _opt_num(d: dict, key: str, where: str, minimum: float | None = 0.0) -> None:
    x = d.get(key)
    if x is not None and (not _is_num(x) or (minimum is not None and x < minimum)):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{where}.{key} must be a number{bound} or None, got {x!r}")


def _opt_str(d: dict, key: str, where: str) -> None:
    if d.get(key) is not None and not isinstance(d[key], str):
        raise ValueError(f"{where}.{key} must be a string or None, got {d[key]!r}")


def _nonempty_str(d: dict, key: str, where: str) -> None:
    if not (isinstance(d.get(key), str) and d[key].strip()):
        raise ValueError(f"{where}.{key} must be a non-empty string, got {d.get(key)!r}")


def _check_variant_v2(v: dict, where: str) -> None:
    if v.get("failed_stage") is not None and v["failed_stage"] not in FAILED_STAGES:
        raise ValueError(f"{where}.failed_stage must be None or one of {', '.join(FAILED_STAGES)}, "
                         f"got {v['failed_stage']!r}")
    if "speed_is_deployment" in v and not isinstance(v["speed_is_deployment"], bool):
        raise ValueError(f"{where}.speed_is_deployment must be true or false, got {v['speed_is_deployment']!r}")
    stages = v.get("stages")
    if stages is not None:
        if not isinstance(stages, dict):
            raise ValueError(f"{where}.stages must be a dict of {', '.join(STAGES)}, got {type(stages).__name__}")
        for name, st in stages.items():
            at = f"{where}.stages.{name}"
            if name not in STAGES:
                raise ValueError(f"{where}.stages: unknown stage {name!r} (known: {', '.join(STAGES)})")
            if not isinstance(st, dict):
                raise ValueError(f"{at} must be a dict, got {type(st).__name__}")
            if st.get("status") not in STAGE_STATUSES:
                raise ValueError(f"{at}.status must be one of {', '.join(STAGE_STATUSES)}, got {st.get('status')!r}")
            _opt_num(st, "time_s", at)
            _opt_str(st, "error", at)
            if st.get("cache_hit") is not None and not isinstance(st["cache_hit"], bool):
                raise ValueError(f"{at}.cache_hit must be true, false or None, got {st['cache_hit']!r}")
            mem = st.get("memory_mb")
            if mem is not None:
                if not isinstance(mem, dict):
                    raise ValueError(f"{at}.memory_mb must be a dict or None, got {type(mem).__name__}")
                for key in ("rss_peak", "rss_delta"):
                    _opt_num(mem, key, f"{at}.memory_mb")
    for bs, stats in (v.get("latency_ms") or {}).items():
        if isinstance(stats, dict):
            _check_latency(stats, f"{where}.latency_ms.{bs}")
    if v.get("accuracy_change") is not None:
        _check_change(v["accuracy_change"], f"{where}.accuracy_change")


def _check_change(change: Any, where: str) -> None:
    if not isinstance(change, dict):
        raise ValueError(f"{where} must be a dict, got {type(change).__name__}")
    if change.get("verdict") not in CHANGE_VERDICTS:
        raise ValueError(f"{where}.verdict must be one of {', '.join(map(repr, CHANGE_VERDICTS))}, got {change.get('verdict')!r}")
    p = change.get("p_value")
    if p is not None and (not _is_num(p) or not 0.0 <= p <= 1.0):
        raise ValueError(f"{where}.p_value must be a probability in [0, 1] or None, got {p!r}")
    n = change.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}.n must be an integer >= 1 (images compared), got {n!r}")
    for key in ("drop_points", "ci_low_points", "ci_high_points"):
        _opt_num(change, key, where, minimum=None)
    lo, hi = change.get("ci_low_points"), change.get("ci_high_points")
    if _is_num(lo) and _is_num(hi) and lo > hi:
        raise ValueError(f"{where}: ci_low_points {lo} is above ci_high_points {hi}")


def _check_latency(stats: dict, where: str) -> None:
    _opt_num(stats, "cv", where)
    if "noisy" in stats and not isinstance(stats["noisy"], bool):
        raise ValueError(f"{where}.noisy must be true or false, got {stats['noisy']!r}")
    _opt_str(stats, "noisy_reason", where)
    if stats.get("noisy") is True and "noisy_reason" in stats and not stats["noisy_reason"]:
        raise ValueError(f"{where}: a noisy timing must say why (noisy_reason)")
    warm = stats.get("warmup_calls")
    if warm is not None and not (isinstance(warm, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                and x >= 0 for x in warm)):
        raise ValueError(f"{where}.warmup_calls must be a list of call counts, got {warm!r}")
    repeats = stats.get("repeats")
    if repeats is not None and (not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1):
        raise ValueError(f"{where}.repeats must be an integer >= 1, got {repeats!r}")
    p50s = stats.get("repeat_p50s")
    if p50s is not None:
        if not isinstance(p50s, list) or not all(_is_num(x) and x >= 0 for x in p50s):
            raise ValueError(f"{where}.repeat_p50s must be a list of latencies (ms), got {p50s!r}")
        if repeats is not None and len(p50s) != repeats:
            raise ValueError(f"{where}.repeat_p50s has {len(p50s)} medians but repeats is {repeats}")


def _check_recommendation(rec: Any, statuses: dict[str, str]) -> None:
    where = "results.recommendation"
    if not isinstance(rec, dict):
        raise ValueError(f"{where} must be a dict, got {type(rec).__name__}")
    for key in ("variant", "runner_up"):
        name = rec.get(key)
        if name is None:
            continue
        if name not in statuses:
            raise ValueError(f"{where}.{key} {name!r} is not the name of any variant")
        if statuses[name] != "ok":  # degraded/skipped/failed variants are never recommended
            raise ValueError(f"{where}.{key} {name!r} has status {statuses[name]!r}; only ok variants qualify")
    if rec.get("variant") is not None and rec.get("runner_up") == rec["variant"]:
        raise ValueError(f"{where}.runner_up is the recommended variant itself")
    if not _is_num(rec.get("tolerance")) or rec["tolerance"] < 0:
        raise ValueError(f"{where}.tolerance must be a number of points >= 0, got {rec.get('tolerance')!r}")
    _nonempty_str(rec, "metric", where)
    _nonempty_str(rec, "reason", where)
    _opt_str(rec, "batch_size", where)
    gain = rec.get("speedup")
    if gain is not None:
        if not isinstance(gain, dict):
            raise ValueError(f"{where}.speedup must be a dict, got {type(gain).__name__}")
        if not _is_num(gain.get("ratio")) or gain["ratio"] <= 0:
            raise ValueError(f"{where}.speedup.ratio must be a positive number, got {gain.get('ratio')!r}")
        for key in ("ci_low", "ci_high"):
            _opt_num(gain, key, f"{where}.speedup")
        if not isinstance(gain.get("noisy", []), list):
            raise ValueError(f"{where}.speedup.noisy must be a list of variant names, got {gain.get('noisy')!r}")
        _opt_str(gain, "withheld", f"{where}.speedup")  # why the ratio is not stated (report.tables.ratio_withheld)
    excluded = rec.get("excluded", {})
    if not isinstance(excluded, dict):
        raise ValueError(f"{where}.excluded must be a dict variant -> why, got {type(excluded).__name__}")
    for name, why in excluded.items():
        if name not in statuses:
            raise ValueError(f"{where}.excluded: {name!r} is not the name of any variant")
        if not (isinstance(why, str) and why.strip()):
            raise ValueError(f"{where}.excluded.{name} must say why, got {why!r}")


def _check_artifacts(artifacts: Any, names: set[str]) -> None:
    if not isinstance(artifacts, list):
        raise ValueError(f"results.artifacts must be a list, got {type(artifacts).__name__}")
    for i, a in enumerate(artifacts):
        where = f"results.artifacts[{i}]"
        if not isinstance(a, dict):
            raise ValueError(f"{where} must be a dict, got {type(a).__name__}")
        for key in ("variant", "kind", "path", "produced_by"):
            _nonempty_str(a, key, where)
        if a["variant"] not in names:
            raise ValueError(f"{where}.variant {a['variant']!r} is not the name of any variant")
        path = PureWindowsPath(a["path"])  # splits on both / and \, and knows drives: stricter than Posix
        if path.drive or path.root or PurePosixPath(a["path"]).is_absolute() or ".." in path.parts:
            raise ValueError(f"{where}.path must be relative to the output folder, got {a['path']!r}")
        sha = a.get("sha256")
        if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"{where}.sha256 must be 64 lowercase hex digits, got {sha!r}")
        inputs = a.get("inputs", [])
        if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
            raise ValueError(f"{where}.inputs must be a list of strings, got {inputs!r}")


def _check_warnings(warnings: Any) -> None:
    if not isinstance(warnings, list):
        raise ValueError(f"results.warnings must be a list of {{code, message}}, got {type(warnings).__name__}")
    for i, w in enumerate(warnings):
        if not isinstance(w, dict):
            raise ValueError(f"results.warnings[{i}] must be a dict with code and message, got {type(w).__name__}")
        _nonempty_str(w, "code", f"results.warnings[{i}]")
        _nonempty_str(w, "message", f"results.warnings[{i}]")


def _check_skipped_files(data: Any) -> None:
    if not isinstance(data, dict):
        return
    for split in ("eval", "calibration"):
        section = data.get(split)
        if not isinstance(section, dict) or section.get("skipped_files") is None:
            continue
        files, where = section["skipped_files"], f"results.data.{split}.skipped_files"
        if not isinstance(files, list):
            raise ValueError(f"{where} must be a list of {{path, reason}}, got {type(files).__name__}")
        for i, f in enumerate(files):
            if not isinstance(f, dict):
                raise ValueError(f"{where}[{i}] must be a dict with path and reason, got {type(f).__name__}")
            _nonempty_str(f, "path", f"{where}[{i}]")
            _nonempty_str(f, "reason", f"{where}[{i}]")


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
