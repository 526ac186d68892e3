"""Turn a results dict into display-ready tables, shared by the Markdown, HTML and terminal renderers.

Every cell is already a string here, so all reports show identical numbers and a missing value
(skipped variant, absent key, ``None``) becomes "–" in exactly one place. Nothing here assumes the
dict was validated: renderers may be called on partial results.
"""
from __future__ import annotations

import functools
import json
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from qdeploy.benchmark.latency import NOISY_CV, NOISY_DRIFT, NOISY_P50
from qdeploy.tasks import DEFAULT_TASK, TASKS, get_task

DASH = "–"
NOISY_MARK = "⚠"
WARNING_MARK = "⚠"  # before each results["warnings"] line that opens the reports
NOT_DEPLOYMENT_MARK = "†"
NOISY_HINT = (f"{NOISY_MARK} noisy timing (scatter: p50 not pinned to ±{100 * NOISY_P50:.0f} % by its samples; drift: first and last third of the "
              f"iterations over {100 * NOISY_DRIFT:.0f} % apart; batch: slower than a larger batch): no speed-up stated; "
              "re-run with more bench.repeats.")
NOT_DEPLOYMENT_NOTE = (f"{NOT_DEPLOYMENT_MARK} timed in ONNX Runtime, not in the engine it is built for (e.g. a "
                       "TensorRT-placement Q/DQ model): its latency says nothing about its deployment speed, so it "
                       "is listed apart, gets no speed-up and is left out of the recommendation.")
SKIPPED_FILES_SHOWN = 20  # a folder of broken images must not bury the report

# Per task: (metric key, column label); the first one is the headline metric (Δ, plots, terminal).
METRICS = {name: list(t.metric_columns) for name, t in TASKS.items()}  # task → its metric columns, headline first


# ---------------------------------------------------------------------------- values and formats
def num(x: Any) -> float | None:
    """``x`` as a float, or None when it is missing, not a number, a bool or not finite."""
    if x is None or isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    f = float(x)
    return f if math.isfinite(f) else None


def fmt(x: Any, digits: int = 2, scale: float = 1.0, sep: bool = False) -> str:
    f = num(x)
    if f is None:
        return DASH
    return f"{f * scale:,.{digits}f}" if sep else f"{f * scale:.{digits}f}"


def pct(x: Any) -> str:
    """A fraction in 0..1 as a percentage with 2 decimals: 0.9173 -> '91.73'."""
    return fmt(x, 2, 100.0)


def section(d: Any, key: str) -> dict:
    """``d[key]`` when it is a mapping, else {}: skipped variants may hold None or nothing at all."""
    value = d.get(key) if isinstance(d, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def at_batch(mapping: Mapping, bs: str) -> Any:
    """Per-batch-size lookup; keys are strings in JSON but may still be ints in a fresh dict."""
    if bs in mapping:
        return mapping[bs]
    return mapping.get(int(bs)) if bs.isdigit() else None


def task(results: Mapping) -> str:
    t = section(results, "model").get("task")
    if t in METRICS:
        return t
    # an older results file without model.task: the task whose headline metric a variant has
    return next((name for name, t in TASKS.items() if t.name != DEFAULT_TASK
                 and any(t.metric in section(v, "metrics") for v in variants(results))), DEFAULT_TASK)


def variants(results: Mapping) -> list[dict]:
    vs = results.get("variants") if isinstance(results, Mapping) else None
    return [v for v in vs if isinstance(v, Mapping)] if isinstance(vs, list) else []


def is_ok(v: Mapping) -> bool:
    return v.get("status") == "ok"


def is_degraded(v: Mapping) -> bool:
    return v.get("status") == "degraded"


def deploys_speed(v: Mapping) -> bool:
    """Whether the variant's latency is its deployment engine's (``speed_is_deployment``, True if absent)."""
    return v.get("speed_is_deployment", True) is not False


def row_style(v: Mapping) -> str:
    """"" for ok rows, "degraded" for measured-but-collapsed ones, "muted" for skipped/failed ones."""
    return "" if is_ok(v) else "degraded" if is_degraded(v) else "muted"


def label(v: Mapping) -> str:
    """Variant name, flagged when it did not run to completion so partial numbers are not misread."""
    name = str(v.get("name") or "?")
    return name if is_ok(v) else f"{name} ({v.get('status') or 'unknown'})"


def status_text(v: Mapping) -> str:
    """Why a variant is not ok, in one line: "failed at build: …", "skipped at check: …", "degraded: …"."""
    status = str(v.get("status") or "unknown")
    stage = v.get("failed_stage")
    where = f" at {stage}" if stage and status in ("failed", "skipped") else ""
    return f"{status}{where}: {v.get('reason') or 'no reason given'}"


def noisy(stats: Mapping) -> bool:
    """The benchmark's ``noisy`` flag; for records without it, the same rule on ``cv``."""
    flag = stats.get("noisy")
    if isinstance(flag, bool):
        return flag
    cv = num(stats.get("cv"))
    return cv is not None and cv > NOISY_CV


def noise_text(stats: Mapping) -> str:
    """Why a timing is noisy, to read after a variant's name: the benchmark's ``noisy_reason`` clauses ("p50 0.254 ms
    ± 5.5 % (…) and drift: first third median 88.0 ms, last third 40.1 ms", a scatter clause without its kind); for
    records without a reason, the CV."""
    reason = stats.get("noisy_reason")
    if isinstance(reason, str) and reason:  # " and ": "; " separates variants or batch sizes where this is quoted
        return " and ".join(c.removeprefix("scatter: ") for c in reason.split("; "))
    cv = num(stats.get("cv"))
    return f"CV {100 * cv:.1f} %" if cv is not None else "flagged noisy"


def ratio_withheld(timings) -> str | None:
    """The one rule for stating a ratio of two latencies (a speed-up: the latency tables, the recommendation): None
    when it may be stated, else why not, "timing too noisy (torch-fp32 drift: first third median 88.0 ms, last third
    40.1 ms)". ``timings``: (variant name, latency stats at one batch size) pairs. A ratio of a noisy timing is not a
    number to act on (a 1030× from a reference timed before its warm-up ended), so it is never shown as one."""
    flagged = {str(name): stats for name, stats in timings if noisy(stats)}
    if not flagged:
        return None
    return "timing too noisy (" + "; ".join(f"{name} {noise_text(st)}" for name, st in flagged.items()) + ")"


def cv_cell(stats: Mapping) -> str:
    cv = num(stats.get("cv"))
    if cv is None:
        return DASH
    return f"{100 * cv:.1f}" + (f" {NOISY_MARK}" if noisy(stats) else "")


def p50(v: Mapping | None, bs: str) -> float | None:
    """The headline latency: median ms for one batch of ``bs``, or None."""
    return num(latency_stats(v, bs).get("p50")) if isinstance(v, Mapping) else None


def stage(v: Mapping, name: str) -> dict:
    """``v["stages"][name]`` (build/load/eval/bench) or {} for records without stage details."""
    return section(section(v, "stages"), name)


def stage_time(v: Mapping, name: str) -> Any:
    """A stage's duration: ``stages[name].time_s``, else the older ``timings_s[name]``."""
    t = stage(v, name).get("time_s")
    return t if t is not None else section(v, "timings_s").get(name)


def batch_sizes(results: Mapping) -> list[str]:
    """Configured batch sizes plus any a variant reports, in numeric order, as strings."""
    sizes = {str(b) for b in section(results, "bench").get("batch_sizes") or []}
    for v in variants(results):
        for key in ("latency_ms", "throughput_ips", "latency_samples_ms"):
            sizes.update(str(k) for k in section(v, key))
    return sorted(sizes, key=lambda s: (0, int(s), "") if s.isdigit() else (1, 0, s))


def reference(results: Mapping) -> dict | None:
    name = results.get("reference")
    return next((v for v in variants(results) if v.get("name") == name), None)


def _compact(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    if isinstance(value, Mapping):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


# ---------------------------------------------------------------------------- tables
@dataclass
class Table:
    key: str                      # stable id: HTML anchor, and where the HTML page puts plots
    title: str
    headers: list[str]
    numeric: list[bool]           # per column: right-align
    caption: str = ""
    rows: list[list[str]] = field(default_factory=list)
    styles: list[str] = field(default_factory=list)  # per row: row_style() of its variant
    notes: list[str] = field(default_factory=list)   # lines under the table: markers, degraded reasons, hints

    def add(self, cells: list[str], style: str = "") -> None:
        self.rows.append(cells)
        self.styles.append(style)


def _shown(results: Mapping, has_data) -> list[dict]:
    """Variants for a measurement table: every ok one, plus non-ok ones that still measured something."""
    return [v for v in variants(results) if is_ok(v) or has_data(v)]


def _degraded_notes(shown: list[Mapping]) -> list[str]:
    # Degraded variants keep their numbers in every table; the reason sits right under it.
    return [f"{v.get('name')}: {status_text(v)}" for v in shown if is_degraded(v)]


def accuracy_table(results: Mapping) -> Table:
    metrics = METRICS[task(results)]
    head_key, head_label = metrics[0]
    ref = reference(results)
    ref_value = num(section(ref, "metrics").get(head_key)) if ref else None
    with_note = any(v.get("note") for v in variants(results))
    with_change = any(section(v, "accuracy_change") for v in variants(results))
    t = Table("accuracy", "Accuracy",
              ["Variant", *[m[1] for m in metrics], f"Δ {head_label.split()[0]} (pts)", "Agreement %", "Samples"]
              + (["Change vs reference (95 % CI, p)"] if with_change else []) + (["Note"] if with_note else []),
              [False] + [True] * (len(metrics) + 3) + ([False] if with_change else []) + ([False] if with_note else []),
              caption=(f"Δ is in percentage points against the reference variant {results.get('reference')}; "
                       "agreement is the share of predictions identical to the reference's."
                       + (f" {CHANGE_CAPTION}" if with_change else "")
                       if ref else "No reference variant: Δ and agreement are not available."))
    shown = _shown(results, lambda v: bool(section(v, "metrics")))
    t.notes = _degraded_notes(shown)
    for v in shown:
        m = section(v, "metrics")
        is_ref = ref is not None and v is ref
        value = num(m.get(head_key))
        delta = "ref" if is_ref else (DASH if value is None or ref_value is None
                                      else f"{100 * (value - ref_value):+.2f}")
        agreement = "ref" if is_ref else pct(v.get("agreement"))  # producers store None or 1.0 for it
        samples = fmt(m.get("samples"), 0, sep=True)
        change = "ref" if is_ref else change_cell(section(v, "accuracy_change"))
        t.add([label(v), *[pct(m.get(k)) for k, _ in metrics], delta, agreement, samples]
              + ([change] if with_change else []) + ([str(v.get("note") or "")] if with_note else []), row_style(v))
    return t


CHANGE_CAPTION = ("Change vs reference: a paired test on the same images (top-1: exact McNemar test on the images only "
                  "one of the two gets right, with an Agresti–Min interval; mIoU: bootstrap over images): \"no "
                  "detectable change\" unless p < 0.05. An INT8 variant is degraded by a detectable drop beyond the "
                  "tolerance, or by agreement with the reference below eval.min_agreement (or far below its INT8 "
                  "siblings'), whatever this change says.")


def change_cell(change: Mapping) -> str:
    """An ``accuracy_change`` in a cell: "no detectable change (-0.05, CI -2.01 to +1.91, p 1)"; – when absent."""
    if not change or not change.get("verdict"):
        return DASH
    drop, lo, hi, p = (num(change.get(k)) for k in ("drop_points", "ci_low_points", "ci_high_points", "p_value"))
    ci = f", CI {-hi:+.2f} to {-lo:+.2f}" if lo is not None and hi is not None else ""
    return (f"{change['verdict']} ({DASH if drop is None else f'{-drop:+.2f}'}{ci}"
            + (f", p {p:.2g}" if p is not None else "") + ")")


def latency_tables(results: Mapping) -> list[Table]:
    """One table per batch size. p50 is the headline (and the base of speed-ups); variants whose latency is
    not their deployment engine's are listed after the others, marked †, without a speed-up."""
    ref = reference(results)
    ref_deploys = ref is not None and deploys_speed(ref)
    multi = any(num(latency_stats(v, bs).get("repeats")) not in (None, 1.0)
                for v in variants(results) for bs in batch_sizes(results))
    tables = []
    for bs in batch_sizes(results):
        t = Table(f"latency-{bs}", f"Latency, batch size {bs}",
                  ["Variant", "p50 ms", "Mean ± std ms", "p95 ms", "p99 ms", "CV %", "Throughput img/s", "Speed-up"]
                  + (["Repeat p50s ms"] if multi else []),
                  [False] + [True] * 7 + ([True] if multi else []),
                  caption=f"Time for one batch of {bs}. p50 (median) is the headline latency; speed-up is the "
                          "reference's p50 over the variant's, with its 95 % bootstrap interval (ratio of medians of "
                          "the timed iterations), not stated when either timing is noisy (⚠: its p50 not pinned to ±5 % by "
                          "the 95 % interval of the median, a drift between the first and last third, or slower than a "
                          "larger batch); CV = std/mean of the timed iterations, reported, not the noise test (a few "
                          "preempted calls raise it without moving the p50); throughput is sustained throughput (batch size / mean latency of "
                          "back-to-back batches)."
                          + (" With several repeats, the repeat with the lowest median is kept; the last column "
                             "lists every repeat's median." if multi else ""))
        ref_p50 = p50(ref, bs) if ref_deploys else None
        shown = _shown(results, lambda v: latency_stats(v, bs) or at_batch(section(v, "throughput_ips"), bs))
        shown = [v for v in shown if deploys_speed(v)] + [v for v in shown if not deploys_speed(v)]  # stable
        for v in shown:
            lat = latency_stats(v, bs)
            mean, std, median = num(lat.get("mean")), num(lat.get("std")), num(lat.get("p50"))
            mean_std = DASH if mean is None else f"{mean:.2f}" + ("" if std is None else f" ± {std:.2f}")
            withheld = ratio_withheld([(ref.get("name"), latency_stats(ref, bs)), (v.get("name"), lat)]) \
                if ref_p50 else None
            speedup = DASH if not (median and ref_p50 and deploys_speed(v)) else \
                f"not stated: {withheld}" if withheld else \
                speedup_cell(ref_p50 / median, at_batch(section(ref, "latency_samples_ms"), bs),
                             at_batch(section(v, "latency_samples_ms"), bs), v is ref)
            name = label(v) + ("" if deploys_speed(v) else f" {NOT_DEPLOYMENT_MARK}")
            repeats = [f for f in map(num, lat.get("repeat_p50s") or []) if f is not None]
            t.add([name, fmt(median), mean_std, fmt(lat.get("p95")), fmt(lat.get("p99")), cv_cell(lat),
                   fmt(at_batch(section(v, "throughput_ips"), bs), 1, sep=True), speedup]
                  + ([" / ".join(f"{x:.2f}" for x in repeats) or DASH] if multi else []), row_style(v))
        t.notes = _degraded_notes(shown)
        if any(not deploys_speed(v) for v in shown):
            t.notes.append(NOT_DEPLOYMENT_NOTE)
        if ref is not None and not ref_deploys:
            t.notes.append(f"No speed-ups: the reference {ref.get('name')}'s latency is not its deployment engine's.")
        flagged = [v for v in shown if noisy(latency_stats(v, bs))]
        t.notes += [f"{NOISY_MARK} {v.get('name')}: {noise_text(latency_stats(v, bs))}" for v in flagged]
        if flagged:
            t.notes.append(NOISY_HINT)
        tables.append(t)
    return tables


def speedup_cell(ratio: float, ref_samples, samples, is_ref: bool = False) -> str:
    """"2.93× (2.85–3.01)": the ratio of p50s and its 95 % percentile-bootstrap interval when both samples exist."""
    text = f"{ratio:.2f}×"
    if is_ref or not (isinstance(ref_samples, list) and ref_samples and isinstance(samples, list) and samples):
        return text
    try:
        boot = _ratio_interval(tuple(ref_samples), tuple(samples))
    except (TypeError, ValueError):  # entries that are not numbers: no interval
        return text
    return text if boot is None else f"{text} ({boot[1]:.2f}–{boot[2]:.2f})"


@functools.lru_cache(maxsize=256)
def _ratio_interval(ref_samples: tuple, samples: tuple):
    """Cached: the Markdown and HTML reports show the same tables, and a bootstrap of 1,000 samples takes ~0.1 s."""
    from qdeploy.evaluate.stats import ratio_of_medians

    return ratio_of_medians(ref_samples, samples)


def latency_stats(v: Mapping, bs: str) -> Mapping:
    stats = at_batch(section(v, "latency_ms"), bs)
    return stats if isinstance(stats, Mapping) else {}


def memory_table(results: Mapping) -> Table:
    keys = [("rss_peak", "RSS peak (process) MB"), ("rss_delta", "Model adds MB"),
            ("gpu_allocated_peak", "GPU allocated peak MB"),
            ("gpu_reserved_peak", "GPU reserved peak MB"), ("artifact", "Artifact MB")]
    t = Table("memory", "Memory", ["Variant", *[k[1] for k in keys]], [False] + [True] * len(keys),
              caption="The deployed model's memory while loading, evaluating and benchmarking it. RSS peak is the "
                      "whole process's (Python, the libraries, the decoded images: about the same for every variant); "
                      "model adds is that peak minus the process's RSS just before the variant loaded (weights, "
                      "runtime, activations, timing buffers). Building its artifacts (export, calibration) is "
                      "measured apart, in the details table.")
    shown = _shown(results, lambda v: any(num(x) is not None for x in section(v, "memory_mb").values()))
    for v in shown:
        mem = section(v, "memory_mb")
        t.add([label(v), *[fmt(mem.get(k), 1, sep=True) for k, _ in keys]], row_style(v))
    t.notes = _degraded_notes(shown)
    return t


def per_class_table(results: Mapping) -> Table | None:
    """The task's per-class score (segmentation: IoU, detection: AP@0.5:0.95), one row per class, one column per
    variant. With many classes (COCO's 80 for a detector measured on a few), classes no variant has a score for are
    left out and the caption says how many."""
    t_ = get_task(task(results))
    key = t_.per_class_scores
    if key is None:
        return None
    names = list(section(section(results, "data"), "eval").get("class_names") or [])
    cols = []
    for v in variants(results):
        scores = section(v, "metrics").get(key)
        if isinstance(scores, list):  # tolerate index order instead of a name -> score map
            scores = {str(names[i]) if i < len(names) else str(i): x for i, x in enumerate(scores)}
        if isinstance(scores, Mapping) and scores:
            cols.append((v, scores))
    if not cols:
        return None
    classes = [str(n) for n in names]
    classes += [c for _, scores in cols for c in scores if c not in classes]  # classes the data section misses
    classes = list(dict.fromkeys(classes))
    caption = "– means the class does not occur in the evaluation data (or was not measured)."
    if len(classes) > 20:
        measured = [c for c in classes if any(num(scores.get(c)) is not None for _, scores in cols)]
        if len(measured) < len(classes):
            caption = (f"The {len(measured)} of the model's {len(classes)} classes that occur in the evaluation data; "
                       + caption)
            classes = measured
    what = {"per_class_iou": ("per-class-iou", "Per-class IoU %"),
            "per_class_ap": ("per-class-ap", "Per-class AP@0.5:0.95 %")}.get(key, (key.replace("_", "-"), key))
    t = Table(what[0], what[1], ["Class", *[label(v) for v, _ in cols]], [False] + [True] * len(cols), caption=caption)
    for c in classes:
        t.add([c, *[pct(scores.get(c)) for _, scores in cols]])
    t.notes = _degraded_notes([v for v, _ in cols])
    return t


def skipped_table(results: Mapping) -> Table:
    t = Table("skipped", "Skipped, failed and degraded variants", ["Variant", "Engine", "Precision", "Status", "Why"],
              [False] * 5, caption="Degraded variants ran and are measured in the tables above, but their INT8 "
                                   "accuracy dropped (a paired test's detectable drop beyond the tolerance; without "
                                   "labels, agreement below the minimum): they are never recommended.")
    for v in variants(results):
        if not is_ok(v):
            t.add([str(v.get("name") or "?"), str(v.get("engine") or DASH), str(v.get("precision") or DASH),
                   str(v.get("status") or "unknown"), status_text(v)], row_style(v))
    return t


def details_table(results: Mapping) -> Table:
    t = Table("details", "Variant details", ["Variant", "Engine", "Precision", "Device", "Details", "Build s",
                                              "Build peak MB", "Load s", "Eval s", "Bench s"],
              [False] * 5 + [True] * 5,
              caption="Build = producing the variant's artifacts (export, calibration, quantization; \"cached\" when "
                      "reused from the cache); its peak memory is not the deployed model's (see Memory).")
    for v in variants(results):
        # A failed variant's traceback would swamp the cell: it stays in results.json (and the HTML page).
        details = "; ".join(f"{k}={_compact(x)}" for k, x in section(v, "details").items() if k != "traceback")
        build = stage(v, "build")
        build_s = fmt(stage_time(v, "build"))
        if build.get("cache_hit") is True:
            build_s += " (cached)"
        t.add([label(v), str(v.get("engine") or DASH), str(v.get("precision") or DASH), str(v.get("device") or DASH),
               details or DASH, build_s, fmt(section(build, "memory_mb").get("rss_peak"), 1, sep=True),
               *[fmt(stage_time(v, k)) for k in ("load", "eval", "bench")]], row_style(v))
    return t


def artifacts_table(results: Mapping) -> Table | None:
    """Files the run produced, with their checksum: what to ship, and proof of which file was measured."""
    items = [a for a in (results.get("artifacts") or []) if isinstance(a, Mapping)]
    if not items:
        return None
    t = Table("artifacts", "Artifacts", ["Variant", "Kind", "Path", "SHA-256", "Produced by"], [False] * 5,
              caption="Paths are relative to the report's folder; SHA-256 shows its first 12 hex digits "
                      "(results.json has all 64).")
    for a in items:
        sha = str(a.get("sha256") or "")
        t.add([str(a.get("variant") or DASH), str(a.get("kind") or DASH), str(a.get("path") or DASH),
               sha[:12] or DASH, str(a.get("produced_by") or DASH)])
    return t


def skipped_files(results: Mapping) -> list[tuple[str, dict]]:
    """(split, {path, reason}) for every unreadable input file skipped with ``on_error: skip``."""
    data = section(results, "data")
    return [(split, f) for split in ("eval", "calibration")
            for f in (section(data, split).get("skipped_files") or []) if isinstance(f, Mapping)]


def skipped_files_table(results: Mapping) -> Table | None:
    files = skipped_files(results)
    if not files:
        return None
    t = Table("skipped-files", "Skipped input files", ["Data", "Path", "Reason"], [False] * 3,
              caption=f"{len(files)} unreadable image(s) left out (on_error: skip); metrics cover the others.")
    for split, f in files[:SKIPPED_FILES_SHOWN]:
        t.add([split, str(f.get("path") or DASH), str(f.get("reason") or DASH)])
    if len(files) > SKIPPED_FILES_SHOWN:
        t.add([DASH, f"… {len(files) - SKIPPED_FILES_SHOWN} more (see results.json)", ""])
    return t


def quantization_table(results: Mapping) -> Table | None:
    """INT8 variants: how ranges were obtained and the Q/DQ structure that decides TensorRT's INT8 fusion."""
    rows = [(v, section(v, "quantization")) for v in variants(results) if section(v, "quantization")]
    if not rows:
        return None
    t = Table("quantization", "INT8 artifacts",
              ["Variant", "Target", "Ranges", "Calib. images", "Calib. s", "Compute ops INT8", "Residual Adds",
               "TensorRT lint", "Left in float"], [False, False, False, True, True, True, False, False, False],
              caption="Target tensorrt = explicit Q/DQ placed for TensorRT (its INT8 accuracy is simulated in ONNX Runtime); "
                      "onnxruntime = ONNX Runtime's fast CPU placement. Residual Adds by Q/DQ form: fusible = skip input "
                      "quantized, conv path float (what TensorRT fuses into one INT8 Conv+Add kernel); conv-path-quantized = "
                      "Q/DQ on both inputs (ONNX Runtime's QLinearAdd form; splits Conv and Add in TensorRT). TensorRT lint: "
                      "`qdeploy lint` findings (blocks INT8 / costs a reformat / fine), static analysis unless TensorRT "
                      "confirmed them. Left in float: compute ops without Q/DQ on input and weights, and excluded layers.")
    for v, q in rows:
        st = section(q, "structure")
        ranges = str(q.get("method") or DASH) + (" (cache hit)" if q.get("cache_hit") else "")
        floats = list(st.get("compute_ops_float") or []) + list(st.get("compute_ops_partly_quantized") or []) \
            + [f"{n} (excluded)" for n in q.get("excluded_by_user") or []] \
            + [f"{n} (narrow)" for n in q.get("excluded_small_channel_convs") or []]
        shown = ", ".join(dict.fromkeys(floats)) if floats else "none"
        if len(shown) > 300:
            shown = shown[:300] + f"… ({len(floats)} in all, see results.json)"
        forms = st.get("residual_add_forms") or {}
        adds = ", ".join(f"{n} {k}" for k, n in forms.items()) if forms else ("none" if st else DASH)
        t.add([label(v), str(q.get("target") or q.get("placement") or DASH), ranges, fmt(q.get("samples"), 0, sep=True),
               fmt(q.get("time_s")), f"{st.get('compute_ops_int8', DASH)}/{st.get('compute_ops', DASH)}", adds,
               lint_cell(q.get("lint")), shown], row_style(v))
    return t


def lint_cell(lint) -> str:
    if not lint:
        return DASH
    if "skipped" in lint:
        return "n/a (ONNX Runtime placement)"
    c = lint.get("counts") or {}
    parts = [f"{c[k]} {k}" for k in ("blocks-int8", "costs-reformat", "fine") if c.get(k)]
    rules = sorted({f["rule"] for f in lint.get("findings") or [] if f.get("severity") != "fine"})
    return f"{lint.get('verdict', DASH)}" + (f" ({', '.join(parts)}: {' '.join(rules)})" if parts else "")


def lint_table(results: Mapping) -> Table | None:
    """Every TensorRT lint finding of every TensorRT-placement INT8 variant (what `qdeploy lint` prints)."""
    rows = [(v, f) for v in variants(results) for f in (section(section(v, "quantization"), "lint").get("findings") or [])]
    if not rows:
        return None
    t = Table("lint", "TensorRT lint findings",
              ["Variant", "Rule", "Severity", "Nodes", "What TensorRT will do", "Fix"], [False] * 6,
              caption="Static analysis of each TensorRT-placement Q/DQ artifact (`qdeploy lint ARTIFACT.onnx` prints the same); "
                      "'explained' findings are layers left float on purpose.")
    for v, f in rows:
        nodes = ", ".join(f.get("nodes") or [])
        t.add([label(v), f"{f.get('rule')} {f.get('name')}", str(f.get("severity")),
               nodes if len(nodes) <= 120 else nodes[:120] + "…", str(f.get("message")), str(f.get("fix"))], row_style(v))
    return t


def calibration_table(results: Mapping) -> Table | None:
    """What the calibration set could not tell: activations constant or all zero over every image (scale floor),
    and a set too small for the chosen estimator (with the number of images needed)."""
    rows = [(v, w) for v in variants(results) for w in (section(v, "quantization").get("warnings") or [])]
    if not rows:
        return None
    t = Table("calibration-warnings", "Calibration warnings", ["Variant", "Kind", "Layer", "What it means"], [False] * 4,
              caption="Layers whose activation never varied on the calibration images get the smallest scale (they "
                      "quantize to 0); 'too-few-images' gives the count the range method needs.")
    for v, w in rows:
        t.add([label(v), str(w.get("kind")), str(w.get("layer") or w.get("tensor") or DASH), str(w.get("message"))], row_style(v))
    return t


def qat_runs(results: Mapping) -> list[tuple[str, dict]]:
    """(variant name, its ``quantization.qat`` summary) of every QAT variant."""
    return [(label(v), section(section(v, "quantization"), "qat")) for v in variants(results)
            if section(section(v, "quantization"), "qat")]


def qat_table(results: Mapping) -> Table | None:
    """QAT variants: how they were trained (the curves follow the table in the HTML report)."""
    runs = qat_runs(results)
    if not runs:
        return None
    t = Table("qat", "Quantization-aware training",
              ["Variant", "Objective", "Epochs", "Train images/s", "Loss first → last epoch", "Train s", "Checkpoint"],
              [False, False, True, True, False, True, False],
              caption="Fine-tuned from the variant's PTQ (ModelOpt, TensorRT placement) with the config's qat: section; "
                      "trained once per setting and cached with its checkpoint (copied next to the artifact).")
    for name, q in runs:
        losses = [e.get("loss") for e in q.get("log") or [] if e.get("loss") is not None]
        loss = f"{fmt(losses[0], 4)} → {fmt(losses[-1], 4)}" if losses else DASH
        t.add([name, str(q.get("objective") or DASH), fmt(q.get("epochs"), 2), fmt(q.get("images_per_s"), 0, sep=True), loss,
               fmt(q.get("train_seconds"), 1), str(q.get("checkpoint_file") or q.get("checkpoint") or DASH)])
    return t


def tensorrt_table(results: Mapping) -> Table | None:
    """TensorRT engines: what the engine inspector says the compute layers run in (no silent precision)."""
    rows = [(v, section(v, "tensorrt_engine")) for v in variants(results) if section(v, "tensorrt_engine")]
    if not rows:
        return None
    t = Table("tensorrt", "TensorRT engines",
              ["Variant", "TensorRT", "How it was built", "Compute layers INT8 / FP16 / FP32", "FP32 layers", "Flag"],
              [False, False, False, True, False, False],
              caption="From each engine's inspector (profiling verbosity DETAILED): the precision of every conv/GEMM "
                      "layer's output. Flag: asked for FP16 or INT8 and got mostly FP32.")
    for v, e in rows:
        p = section(e, "precisions")
        fp32 = ", ".join(str(n) for n in (section(p, "layers").get("FP32") or []))
        t.add([label(v), str(e.get("tensorrt_version") or DASH), str(section(e, "plan").get("summary") or DASH),
               f"{p.get('INT8', 0)} / {p.get('FP16', 0)} / {p.get('FP32', 0)}",
               (fp32[:200] + "…") if len(fp32) > 200 else (fp32 or "none"), str(e.get("precision_shortfall") or "–")],
              row_style(v))
    return t


def all_tables(results: Mapping) -> list[Table]:
    """Every report table, in report order (per-class IoU only for segmentation)."""
    tables = [accuracy_table(results), *latency_tables(results), memory_table(results), quantization_table(results),
              qat_table(results), tensorrt_table(results), calibration_table(results), lint_table(results), per_class_table(results), skipped_table(results), details_table(results), artifacts_table(results),
              skipped_files_table(results)]
    return [t for t in tables if t is not None]


# ---------------------------------------------------------------------------- header
def warnings(results: Mapping) -> list[str]:
    """``results["warnings"]``' messages (reference near chance, every INT8 variant failed): the lines every report
    opens with, before the recommendation."""
    items = results.get("warnings") if isinstance(results, Mapping) else None
    return [str(w.get("message") or w.get("code")) for w in items or [] if isinstance(w, Mapping)
            and (w.get("message") or w.get("code"))]


@dataclass
class Verdict:
    """The recommendation as every report opens with it."""
    found: bool                   # a variant is recommended
    headline: str                 # "Recommended: X" or "No variant recommended on this machine" (shown bold); "" = none
    why: str                      # the recommendation's reason, after the headline and a dash
    lines: list[str]              # runner-up, then the basis (metric, tolerance, batch size)
    excluded: list[tuple[str, str]]  # (variant, why it was not recommended)
    warnings: list[str] = field(default_factory=list)  # shown first, before the headline

    @property
    def clean(self) -> bool:
        """A recommendation with nothing to warn about: the only case shown in green."""
        return self.found and not self.warnings


def verdict(results: Mapping) -> Verdict | None:
    """``results["recommendation"]`` ready to show, after ``results["warnings"]``; None when neither is there."""
    rec = section(results, "recommendation")
    warned = warnings(results)
    if not rec:
        return Verdict(False, "", "", [], [], warned) if warned else None
    name, reason = rec.get("variant"), str(rec.get("reason") or "no reason given")
    # The reason must read alone in results.json, so it names the winner (or says "No variant …") itself;
    # that opening becomes the headline here instead of being said twice.
    if name:
        headline = f"Recommended: {name}"
        why = reason[len(f"{name}: "):] if reason.startswith(f"{name}: ") else reason
    elif reason.startswith("No ") and ": " in reason:
        headline, why = reason.split(": ", 1)
    else:
        headline, why = "No recommendation", reason
    metric = dict(METRICS[task(results)]).get(rec.get("metric"), str(rec.get("metric") or "?")).removesuffix(" %")
    lines = []
    runner_up = rec.get("runner_up")
    if name and "runner-up" not in reason.lower():  # the reason already names it (or says there is none): once is enough
        bs = rec.get("batch_size")
        runner = next((v for v in variants(results) if v.get("name") == runner_up), None)
        lines.append(f"Runner-up: {runner_up}" + (f" (p50 {fmt(p50(runner, str(bs)))} ms)" if runner and bs else "")
                     if runner_up else "Runner-up: none (no other variant qualifies)")
    tol = num(rec.get("tolerance"))
    basis = (f"Tolerance: {metric} within {DASH if tol is None else f'{tol:g}'} points of the reference "
             f"{results.get('reference') or 'none'}")
    if rec.get("batch_size") is not None:
        basis += f"; fastest p50 at batch size {rec['batch_size']}"
    lines.append(basis + "; speed measured on this machine.")
    excluded = [(str(k), str(why)) for k, why in section(rec, "excluded").items()]
    return Verdict(bool(name), headline, why, lines, excluded, warned)


def title(results: Mapping) -> str:
    return f"qdeploy report: {section(results, 'model').get('source') or 'unknown model'}"


def _exporter(onnx: Mapping) -> str:
    """Who made the ONNX: ``exporter`` when recorded, else what ``produced_by`` says (the pipeline records
    "export (torchscript exporter, opset 17)" or "user's ONNX file")."""
    if onnx.get("exporter"):
        return f"{onnx['exporter']} exporter"
    by = str(onnx.get("produced_by") or "").strip()
    m = re.fullmatch(r"export \((\S+) exporter(?:, opset \d+)?\)", by)
    if m:
        return f"{m.group(1)} exporter"
    return by or "exporter not recorded"


def onnx_line(results: Mapping) -> str | None:
    """One line on the ONNX export and its check against PyTorch, or None when nothing was exported."""
    onnx = section(results, "model").get("onnx")
    if not isinstance(onnx, Mapping):
        return None
    parts = [f"opset {onnx.get('opset', DASH)}", _exporter(onnx), f"{fmt(onnx.get('size_mb'), 1)} MB"]
    verify = onnx.get("verify")
    if isinstance(verify, Mapping):
        passed = verify.get("passed")
        verdict = "passed" if passed is True else "FAILED" if passed is False else "inconclusive"
        diff = num(verify.get("max_abs_diff"))
        cos = num(verify.get("cosine"))
        parts.append(f"verification {verdict} (max |Δ| {DASH if diff is None else f'{diff:.2e}'}, "
                     f"cosine {DASH if cos is None else f'{cos:.6f}'}, {verify.get('samples', DASH)} samples)")
    else:
        parts.append("not verified")
    return ", ".join(parts)


def summary(results: Mapping) -> list[tuple[str, str]]:
    """Key facts for the report header as (label, text) pairs; absent facts are left out."""
    model, env, bench = section(results, "model"), section(results, "environment"), section(results, "bench")
    data = section(section(results, "data"), "eval")
    rows = []
    size = model.get("input_size")
    size = "×".join(map(str, size)) if isinstance(size, list) else size
    rows.append(("Model", f"{model.get('source') or '?'} ({task(results)}"
                          + (f", input {size}" if size else "") + ")"))
    if data:
        bits = [str(data.get("format") or "?"), f"{fmt(data.get('samples'), 0, sep=True)} samples"]
        if data.get("num_classes") is not None:
            bits.append(f"{data['num_classes']} classes")
        rows.append(("Data", ", ".join(bits) + (f" from {data['root']}" if data.get("root") else "")))
    rows.append(("Reference", str(results.get("reference") or "none")))
    if bench:
        bs = ", ".join(map(str, bench.get("batch_sizes") or [])) or DASH
        repeats = bench.get("repeats")
        rows.append(("Benchmark", f"batch sizes {bs}; {bench.get('warmup', DASH)} warm-up + "
                                  f"{bench.get('iterations', DASH)} timed iterations"
                                  + (f", {repeats} repeats (lowest median kept)"
                                     if isinstance(repeats, int) and repeats > 1 else "")))
    static = section(section(model, "check"), "static_batch")
    if static.get("message"):
        rows.append(("Static batch", str(static["message"])))
    files = skipped_files(results)
    if files:
        counts = {}
        for split, _ in files:
            counts[split] = counts.get(split, 0) + 1
        rows.append(("Skipped files", ", ".join(f"{n} {split}" for split, n in counts.items())
                     + " image(s) unreadable, left out (see Skipped input files)"))
    onnx = onnx_line(results)
    if onnx:
        rows.append(("ONNX export", onnx))
    if env:
        rows.append(("Python", f"{env.get('python') or '?'} on {env.get('platform') or '?'}"))
        # INT8 speed on a CPU depends on its vector extensions (VNNI, AMX): said next to every CPU timing
        flags = env.get("cpu_flags")
        threads = sorted({str(v["details"]["threads"]) for v in results.get("variants") or []
                          if isinstance(v.get("details"), Mapping) and v["details"].get("threads")})
        rows.append(("CPU", f"{env.get('cpu') or '?'}" + (f" ({env['cpu_count']} cores)" if env.get("cpu_count") else "")
                     + (f"; flags {' '.join(flags)}" if flags else "; flags: none of avx2/avx512/vnni/amx" if flags == [] else "")
                     + (f"; timed with {', '.join(threads)} thread(s)" if threads else "")))
        gpu = env.get("gpu")
        rows.append(("GPU", "none" if not gpu else str(gpu) + "".join(
            f", {label} {env[k]}" for k, label in (("driver", "driver"), ("cuda", "cuda"), ("cudnn", "cudnn"),
                                                    ("sm_clock_mhz", "SM MHz now"), ("sm_clock_max_mhz", "SM MHz max"))
            if env.get(k) is not None)))
        libs = [f"{k} {env[k]}" for k in ("torch", "torchvision", "onnx", "onnxruntime", "openvino") if env.get(k)]
        if libs:
            rows.append(("Libraries", ", ".join(libs)))
    created, version = results.get("created"), results.get("qdeploy_version")
    if created or version:
        rows.append(("Created", f"{created or '?'}" + (f" by qdeploy {version}" if version else "")))
    return rows
