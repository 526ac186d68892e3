"""The real-size GPU results in the schema of the issue's realsize_gpu.json, from what the device calls wrote.

    python bench/suites/realsize_gpu.py --rows PART.json ... --optimize DIR ... --json RESULTS.json [--markdown TABLE.md]

``--rows``: bench/suites/gpu_reference.py's rows (bench/device/realsize_gpu.sh's ``realsize_gpu_<tag>.json``: one per
model and batch size, the hand-written references' p50s and qdeploy's program timed in a fresh process). ``--optimize``:
folders holding each model's optimize.json as ``<model>.optimize.json`` (realsize_gpu.sh copies them there), read for
the torchao candidates: each one's brief p50 per batch size beside the p50 of the compiled FP16/BF16 candidate it
quantized, at the same batch size and from the same timer.

Writes ``{"gpu", "rows": [{"model", "input_size", "batch", "chosen", "fresh_process_p50_ms", "references", "budget_met",
"optimize_wall_s", "fresh_spread", ...}], "low_precision": [{"model", "batch", "variant", "p50_ms", "fp16_p50_ms",
"within_budget"}], "low_precision_why"}``. ``fresh_spread``: each side's fresh processes, (max - min) / median.
``low_precision_why`` is written only where no FP8/INT8 candidate is faster than its base at
any batch size within budget, and says what was measured (or why nothing was: each model's optimize notes on torchao).
Rows merge into an existing --json by (model, batch): a row measured again replaces the earlier one, unless the earlier
one ran both sides in more fresh processes (``newer_row``). Each row names its card (``gpu``; the document's ``gpu``
lists the cards where rows ran on several). A row whose own search is among the --optimize folders names the
references in a precision that search found outside the budget (``references_outside_budget``) and its ratio to the
best one left (``ratio_to_best_reference_within_budget``), beside the goal's ratio to every reference.
A search whose log (``<model>.log`` beside its optimize.json) shows torch._dynamo hitting its recompile limit ran the
candidates compiled after that point eagerly (fixed in the torch engine since): its torchao timings go to
``low_precision_void`` with that reason, not into ``low_precision``, and its rows say ``search_hit_recompile_limit``.
A torchao candidate that failed has no timing: ``low_precision_failed`` names it with its reason (replaced when the
model's search is merged again), and so does the sentence.
``--speed``: bench/suites/torchao_speed.py's JSON lines (each torchao scheme and FP16 alone, compiled + CUDA graph, on
random weights), merged into ``low_precision`` beside the search's candidates with ``source`` saying so and
``within_budget`` null: their speed is the program's, their accuracy was not measured, so they never count as paying.
Lines written with ``--profile`` carry the GPU's time per call by kernel kind (``gpu_ms_by_kind`` beside
``fp16_gpu_ms_by_kind``), which the sentence quotes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

INPUT_SIZE = {"deeplabv3_camvid": [360, 480], "yolo_bccd640": [640, 640]}  # the classifiers: 224
RECOMPILE_LIMIT_HIT = "torch._dynamo hit config.recompile_limit"  # Dynamo's warning before its eager fallback
LOW_PRECISION_BATCH = 32  # the goal: FP8/INT8 faster than FP16 on transformer rows at batch >= 32


def spread(p50s: list) -> float | None:
    """(max - min) / median of one side's fresh-process p50s: how far apart its processes ran (None below two)."""
    if len(p50s or []) < 2:
        return None
    return round((max(p50s) - min(p50s)) / statistics.median(p50s), 4)


def suite_row(r: dict) -> dict:
    """One gpu_reference.py row in the issue's schema (its other fields kept under ``details``)."""
    q = r["qdeploy"]
    alt = q.get("fresh_alternating") or {}
    refs = r["references"]
    best = min(refs, key=refs.get)
    fresh = q.get("fresh_process_p50_ms")
    return {"model": r["model"], "input_size": INPUT_SIZE.get(r["model"], [224, 224]), "batch": r["batch_size"],
            "gpu": r.get("gpu"), "chosen": q["variant"], "fresh_process_p50_ms": fresh, "references": refs,
            "best_reference": best,
            "ratio_to_best_reference": None if fresh is None else round(fresh / refs[best], 4),
            "ratio_fresh_vs_fresh": q.get("ratio_fresh_vs_fresh"),
            # the "spread stated": each side's fresh processes, (max - min) / median, and how many there were
            "fresh_spread": {"program": spread(alt.get("program_p50_ms")), "hand": spread(alt.get("hand_p50_ms")),
                             "processes_per_side": len(alt.get("program_p50_ms") or [])},
            "budget_met": q.get("budget_met"),
            "confirm_drop_points": q.get("confirm_drop"), "optimize_wall_s": q.get("optimize_time_s"),
            "references_not_measured": r.get("references_not_measured") or [], "date": r.get("date"),
            "details": {k: q.get(k) for k in ("artifact", "format", "reloaded_in_benchmark_p50_ms", "noisy",
                                              "fresh_alternating", "outputs_vs_eager_fp32",
                                              "first_call_s_after_reload")}}


def low_precision_rows(model: str, summary: dict) -> tuple[list[dict], list[str]]:
    """(each torchao candidate's p50 per batch size beside its base's, optimize's notes on torchao) of one search."""
    cands = {c["variant"]: c for c in summary.get("candidates", [])}
    rows = []
    for name, c in cands.items():
        if "-ao-" not in name:
            continue
        base = cands.get(name.split("-ao-")[0]) or {}
        mine, theirs = c.get("brief_p50_ms") or {}, base.get("brief_p50_ms") or {}
        for b, p50 in mine.items():
            if b in theirs and p50 is not None:
                rows.append({"model": model, "batch": int(b), "variant": name, "scheme": name.split("-ao-")[1],
                             "base": base.get("variant"),
                             "base_precision": base.get("precision"), "p50_ms": p50, "fp16_p50_ms": theirs[b],
                             "speedup_vs_base": round(theirs[b] / p50, 4),
                             # a candidate only timed briefly (not among the finalists) was never evaluated
                             "evaluated": c.get("search_metric") is not None,
                             "within_budget": bool(c.get("within_budget")) and c.get("status") == "ok",
                             "budget": c.get("budget") or None})
    notes = [d for d in summary.get("decisions", []) if "torchao" in d]
    return rows, notes


SPEED_SOURCE = "bench/suites/torchao_speed.py: random weights, speed only (accuracy not measured)"


def speed_rows(files: list[Path]) -> tuple[list[dict], list[dict], list[str]]:
    """(each torchao scheme's p50 beside FP16's at the same model and batch, the schemes that failed, the GPUs) from
    torchao_speed.py's JSON lines."""
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]

    def key(r):  # FP16 is the base of the schemes timed in its layout
        return r["model"], r["batch"], bool(r.get("channels_last"))

    fp16 = {key(r): r for r in lines if r["scheme"] == "none" and "p50_ms" in r}
    rows, failed = [], []
    for r in lines:
        if r["scheme"] == "none":
            continue
        if "p50_ms" not in r:
            failed.append({"model": r["model"], "variant": f"{r['scheme']} (torchao_speed)",
                           "failed_stage": "torchao_speed", "reason": r.get("error")})
            continue
        base = fp16.get(key(r))
        if base is None:  # no FP16 row at this batch (a run cut short): nothing to compare with
            continue
        layout = " channels_last" if r.get("channels_last") else ""
        rows.append({"model": r["model"], "batch": r["batch"], "variant": f"{r['scheme']}{layout} (torchao_speed)",
                     "scheme": r["scheme"], "base": f"fp16{layout} compiled + CUDA graph (torchao_speed)",
                     "base_precision": "fp16", "p50_ms": r["p50_ms"], "fp16_p50_ms": base["p50_ms"],
                     "speedup_vs_base": round(base["p50_ms"] / r["p50_ms"], 4), "evaluated": False,
                     "within_budget": None, "source": SPEED_SOURCE,
                     "quantized_layers": f"{r.get('quantized_layers')} of {r.get('linear_layers')} Linear",
                     "compile_s": r.get("compile_s"), "fp16_compile_s": base.get("compile_s")})
        if r.get("profile") and base.get("profile"):  # --profile: the GPU's time per call by kernel kind, both sides
            rows[-1].update(gpu_ms_by_kind=r["profile"]["ms_per_call"],
                            fp16_gpu_ms_by_kind=base["profile"]["ms_per_call"])
    return rows, failed, sorted({r["gpu"] for r in lines if r.get("gpu")})


def failed_low_precision(model: str, summary: dict) -> list[dict]:
    """The torchao candidates of one search that failed (no timing to compare), each with its reason."""
    return [{"model": model, "variant": c["variant"], "failed_stage": c.get("failed_stage"),
             "reason": c.get("reason") or c.get("budget")}
            for c in summary.get("candidates", []) if "-ao-" in c["variant"] and c.get("status") == "failed"]


def why_none(low: list[dict], notes: dict[str, list[str]], void: list[dict] = (), failed: list[dict] = ()) -> str | None:
    """The sentence the schema asks for where no FP8/INT8 candidate pays: what was measured, or why nothing was."""
    if any(r["within_budget"] and r["p50_ms"] < r["fp16_p50_ms"] for r in low):
        return None
    return _why_none(low, notes, void) + "".join(f"; {f['variant']} on {f['model']} failed ({f['failed_stage']}): "
                                                 f"{f['reason']}" for f in failed)


def _why_none(low: list[dict], notes: dict[str, list[str]], void) -> str:
    if low:
        big = [r for r in low if r["batch"] >= LOW_PRECISION_BATCH] or low
        best = {}  # the fastest measurement of each scheme, at the batch sizes where there are any
        for r in big:
            scheme = r.get("scheme") or r["variant"].split("-ao-")[-1]
            if scheme not in best or r["speedup_vs_base"] > best[scheme]["speedup_vs_base"]:
                best[scheme] = r
        return ("no FP8/INT8 candidate was faster than its FP16/BF16 base within budget: the best of each scheme, "
                + "; ".join(f"{r['variant']} on {r['model']} at batch {r['batch']}, ran {r['p50_ms']:.4f} ms vs "
                            f"{r['fp16_p50_ms']:.4f} ms ({r['speedup_vs_base']:.2f}x)" + _unproven(r)
                            for _, r in sorted(best.items()))
                + f"; {len(low)} measurements in all" + _kernel_split(big))
    if void:
        return (f"no valid FP8/INT8 measurement: the {len(void)} torchao timings ("
                + ", ".join(sorted({r["model"] for r in void})) + ") ran eagerly, after the search had hit "
                "torch._dynamo's recompile limit (low_precision_void)")
    said = "; ".join(f"{m}: {' / '.join(n)}" for m, n in notes.items() if n)
    return "no FP8/INT8 candidate was timed" + (f" ({said})" if said else " (optimize's notes name none)")


def _kernel_split(rows: list[dict]) -> str:
    """Where the GPU time went, for the profiled measurements (torchao_speed.py --profile): each kind's ms per call
    against FP16's, so the sentence shows whether the quantized matmuls saved more than quantizing costs."""
    said = []
    for r in sorted((r for r in rows if r.get("gpu_ms_by_kind")), key=lambda r: (r["model"], r["batch"], r["variant"])):
        kinds, base = r["gpu_ms_by_kind"], r["fp16_gpu_ms_by_kind"]
        said.append(f"{r['variant']} on {r['model']} at batch {r['batch']}: " + ", ".join(
            f"{k} {kinds.get(k, 0.0):.2f} ms (FP16 {base.get(k, 0.0):.2f})" for k in sorted({*kinds, *base})))
    return ("; GPU time per call by kernel kind (torchao_speed.py --profile): " + "; ".join(said)) if said else ""


def _unproven(r: dict) -> str:
    """Why a measurement does not count as paying besides its speed: no accuracy behind it, or outside the budget."""
    if r.get("source"):
        return ", its accuracy not measured (torchao_speed.py, random weights)"
    if r["within_budget"]:
        return ""
    return ", and it is not within budget" if r["evaluated"] else ", timed only (not among the finalists optimize evaluated)"


def processes_per_side(r: dict) -> int:
    return (r.get("fresh_spread") or {}).get("processes_per_side") or 0


def newer_row(old: dict | None, new: dict) -> dict:
    """The row kept for one (model, batch): ``new``, unless ``old`` had both sides in more fresh processes (the
    issue's timing) than ``new``, whose figures then go under the old row's ``later_measurement``: a measurement cut
    before its alternating processes does not displace one that ran them."""
    if old is None or processes_per_side(new) >= processes_per_side(old):
        return new
    keep = ("date", "chosen", "fresh_process_p50_ms", "best_reference", "ratio_to_best_reference",
            "ratio_fresh_vs_fresh", "fresh_spread", "budget_met", "optimize_wall_s")
    return {**old, "later_measurement": {k: new.get(k) for k in keep}}


def cards_said(rows) -> str | None:
    """The document's ``gpu``: the one card every row ran on, or each card with its row count, most rows first (each
    row's ratio compares programs on its own card: rows[].gpu)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("gpu"):
            counts[r["gpu"]] = counts.get(r["gpu"], 0) + 1
    if len(counts) <= 1:
        return next(iter(counts), None)
    said = [f"{g} ({n} row{'s' if n != 1 else ''})" for g, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return "; ".join(said) + " (each row's card: rows[].gpu)"


def short_card(gpu: str | None) -> str:
    """"H100" for "NVIDIA H100 80GB HBM3": the table's note of a row's card where the rows ran on several."""
    words = (gpu or "").replace("NVIDIA", "").split()
    return words[0] if words else "?"


def merge(old: dict, new: dict, notes: dict[str, list[str]]) -> dict:
    """``new``'s rows and low-precision measurements replace ``old``'s of the same (model, batch[, variant]);
    ``notes``: each model's optimize notes on torchao, for the sentence where nothing pays."""
    # rows of earlier merges from before each row named its card: the document's card then
    rows = {(r["model"], r["batch"]): {**r, "gpu": r.get("gpu") or old.get("gpu")} for r in old.get("rows", [])}
    for r in new["rows"]:
        rows[(r["model"], r["batch"])] = newer_row(rows.get((r["model"], r["batch"])), r)
    low = {(r["model"], r["batch"], r["variant"]): r for r in old.get("low_precision", [])}
    low.update({(r["model"], r["batch"], r["variant"]): r for r in new["low_precision"]})
    void = {(r["model"], r["batch"], r["variant"]): r for r in old.get("low_precision_void", [])}
    void.update({(r["model"], r["batch"], r["variant"]): r for r in new.get("low_precision_void", [])})
    failed = {(r["model"], r["variant"]): r for r in old.get("low_precision_failed", [])}
    searched_again = {r["model"] for r in new["low_precision"] if not r.get("source")} | {
        r["model"] for r in new.get("low_precision_failed", []) if r.get("failed_stage") != "torchao_speed"}
    ran = {(r["model"], r["variant"]) for r in new["low_precision"]}  # a failure that ran since is no longer one
    failed = {k: r for k, r in failed.items()  # a model searched again: its new failures
              if (k[0] not in searched_again or r.get("failed_stage") == "torchao_speed") and k not in ran}
    failed.update({(r["model"], r["variant"]): r for r in new.get("low_precision_failed", [])})
    for key in low:  # a measurement taken again, validly, replaces a void one
        void.pop(key, None)
    doc = {"gpu": cards_said(rows.values()) or new["gpu"] or old.get("gpu"),
           "rows": sorted(rows.values(), key=lambda r: (r["model"], r["batch"])),
           "low_precision": sorted(low.values(), key=lambda r: (r["model"], r["batch"], r["variant"]))}
    if void:
        doc["low_precision_void"] = sorted(void.values(), key=lambda r: (r["model"], r["batch"], r["variant"]))
    if failed:
        doc["low_precision_failed"] = sorted(failed.values(), key=lambda r: (r["model"], r["variant"]))
    why = why_none(doc["low_precision"], notes, doc.get("low_precision_void", []), doc.get("low_precision_failed", []))
    if why:
        doc["low_precision_why"] = why
    return doc


def collect(rows_files: list[Path], optimize_dirs: list[Path], speed_files: list[Path] = ()) -> tuple[dict, dict]:
    """(the rows and low-precision measurements of these files, each model's optimize notes on torchao)"""
    rows = [r for f in rows_files for r in json.loads(f.read_text())]
    low, failed, speed_gpus = speed_rows(list(speed_files))
    if not rows and not low and not failed:
        raise SystemExit(f"no rows in {', '.join(map(str, [*rows_files, *speed_files]))}")
    gpus = sorted({r.get("gpu") for r in rows if r.get("gpu")} | set(speed_gpus))
    if len(gpus) > 1:
        raise SystemExit(f"rows from more than one GPU ({', '.join(gpus)}): one file per card")
    void, notes, limit_hit = [], {}, set()
    for model in sorted({r["model"] for r in rows}):
        for d in optimize_dirs:
            p = d / f"{model}.optimize.json"
            if p.is_file():
                summary = json.loads(p.read_text())
                got, notes[model] = low_precision_rows(model, summary)
                failed += failed_low_precision(model, summary)
                log = d / f"{model}.log"
                if log.is_file() and RECOMPILE_LIMIT_HIT in log.read_text(errors="replace"):
                    limit_hit.add(model)
                    void += [{**r, "void": "the search hit torch._dynamo's recompile limit before this candidate: it "
                                           "ran eagerly, not compiled"} for r in got]
                else:
                    low += got
                break
    suite = [suite_row(r) for r in rows]
    for r in suite:
        r["search_hit_recompile_limit"] = r["model"] in limit_hit
    return {"gpu": gpus[0] if gpus else None, "rows": suite, "low_precision": low, "low_precision_void": void,
            "low_precision_failed": failed}, notes


RECIPE_PRECISIONS = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}  # as the hand-written recipes' names spell them


def precisions_outside_budget(summary: dict) -> set[str]:
    """The precisions a search evaluated and found outside the accuracy budget for every candidate of that precision
    (e.g. {"bf16"} where bf16-eager's drop had its upper bound above max_drop): what a hand-written recipe in that
    precision would not be allowed either, on this model and budget. Candidates only timed are not evaluated."""
    evaluated = [c for c in summary.get("candidates", []) if c.get("status") == "ok" and c.get("precision")]
    inside = {c["precision"] for c in evaluated if c.get("within_budget")}
    return {c["precision"] for c in evaluated if c.get("within_budget") is False} - inside


def mark_outside_budget(row: dict, outside: set[str]) -> None:
    """``references_outside_budget`` (recipes in a precision the model's search found outside its budget) and the
    ratio to the best reference left (``ratio_to_best_reference_within_budget``): beside the goal's ratio, which stays
    the one to every reference."""
    recipe_precision = {name: next((v for k, v in RECIPE_PRECISIONS.items() if k in name.split()), None)
                        for name in row["references"]}
    out = sorted(n for n, prec in recipe_precision.items() if prec in outside)
    row["references_outside_budget"] = out
    if not out:
        return
    left = {n: v for n, v in row["references"].items() if n not in out}
    best = min(left, key=left.get) if left else None
    fresh = row.get("fresh_process_p50_ms")
    row["best_reference_within_budget"] = best
    row["ratio_to_best_reference_within_budget"] = \
        None if best is None or fresh is None else round(fresh / left[best], 4)


def mark_rows_outside_budget(rows: list[dict], optimize_dirs: list[Path]) -> int:
    """``mark_outside_budget`` on each row whose search is among ``optimize_dirs``' ``<model>.optimize.json`` (the
    same model and the same optimize wall time: weights retrained between sessions can move a precision in or out of
    the budget, so a verdict belongs to its own search's rows). Returns the rows marked."""
    outside = {}
    for d in optimize_dirs:
        for p in sorted(d.glob("*.optimize.json")):
            summary = json.loads(p.read_text())
            if summary.get("time_s") is not None:
                model = p.name[:-len(".optimize.json")]
                outside[(model, round(summary["time_s"], 1))] = precisions_outside_budget(summary)
    marked = 0
    for r in rows:
        key = (r["model"], None if r.get("optimize_wall_s") is None else round(r["optimize_wall_s"], 1))
        if key in outside:
            mark_outside_budget(r, outside[key])
            marked += 1
    return marked


GOAL_PROCESSES = 3  # the timing: 3 alternating fresh processes a side, median


def goal_verdict(r: dict) -> str:
    """The issue's goal for one row: qdeploy's program at most 1.0x the best hand-written reference, from 3 fresh
    processes a side; "met", "missed" (above 1.0x either way it was measured) or how far the evidence goes."""
    ratios = [x for x in (r.get("ratio_to_best_reference"), r.get("ratio_fresh_vs_fresh")) if x is not None]
    n = processes_per_side(r)
    if not ratios:
        return "not timed"
    if max(ratios) > 1.0:
        return "missed"
    return "met" if n >= GOAL_PROCESSES and r.get("budget_met") else \
        ("outside budget" if not r.get("budget_met") else
         f"≤ 1.0x, {n} process{'es' if n != 1 else ''} a side" if n else "≤ 1.0x, sides not alternated")


def later_said(later: dict | None) -> str:
    """The table's note of a later measurement kept beside a row (``newer_row``), or ""."""
    if not later or later.get("ratio_to_best_reference") is None:
        return ""
    n = processes_per_side(later)
    return (f" (later, {f'{n} processes a side' if n else 'sides not alternated'}: {later.get('chosen')} "
            f"{later['ratio_to_best_reference']:.3f}x, {later.get('date')})")


def budget_said(r: dict) -> str:
    """The table's note where the best reference runs in a precision the model's search found outside its budget."""
    out, ratio = r.get("references_outside_budget"), r.get("ratio_to_best_reference_within_budget")
    if not out or ratio is None or r["best_reference"] not in out:
        return ""
    return (f" (best reference in a precision outside this model's budget; {ratio:.3f}x the best within it, "
            f"{r['best_reference_within_budget']})")


def markdown_table(doc: dict) -> str:
    """The rows as the docs page's table (docs/results/realsize_gpu.md), one line per model and batch size."""
    def ms(x):
        return "–" if x is None else f"{x:.4f}"

    lines = [f"Real-size GPU rows ({doc.get('gpu')}): `bench/suites/realsize_gpu.py` from "
             "[realsize_gpu.json](realsize_gpu.json); how each was measured: docs/gpu.md, \"Real-size rows\".", "",
             "| model | input | batch | chosen | qdeploy, fresh process (ms) | best hand-written (ms) | ratio | both fresh, "
             "alternating (processes a side; spread program / hand) | confirm drop | optimize (s) | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    several_cards = len({r.get("gpu") for r in doc["rows"]}) > 1
    for r in sorted(doc["rows"], key=lambda r: (r["model"], r["batch"])):
        best = r["best_reference"]
        card = f" ({short_card(r.get('gpu'))})" if several_cards else ""
        sp = r.get("fresh_spread") or {}
        n = sp.get("processes_per_side") or 0
        spreads = " / ".join("–" if sp.get(k) is None else f"{100 * sp[k]:.1f} %" for k in ("program", "hand"))
        fresh = "–" if r.get("ratio_fresh_vs_fresh") is None else f"{r['ratio_fresh_vs_fresh']:.3f}x ({n}; {spreads})"
        fresh_p50, ref = r["fresh_process_p50_ms"], r["references"][best]
        ratio = None if fresh_p50 is None else fresh_p50 / ref
        lines.append(f"| {r['model']}{card} | {'x'.join(map(str, r['input_size']))} | {r['batch']} | {r['chosen']} | "
                     f"{ms(fresh_p50)} | {ms(ref)} ({best}) | "
                     f"{'–' if ratio is None else f'{ratio:.3f}x'} | {fresh} | "
                     f"{'–' if r.get('confirm_drop_points') is None else r['confirm_drop_points']} | "
                     f"{'–' if r.get('optimize_wall_s') is None else round(r['optimize_wall_s'])} | {goal_verdict(r)}"
                     f"{budget_said(r)}{later_said(r.get('later_measurement'))} |")
    met = sum(goal_verdict(r) == "met" for r in doc["rows"])
    lines += ["", f"{met} of {len(doc['rows'])} rows meet the goal (≤ 1.0x both ways, {GOAL_PROCESSES} fresh processes "
              "a side, within budget)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=Path, nargs="*", default=[], help="gpu_reference.py's rows (realsize_gpu.sh)")
    ap.add_argument("--optimize", type=Path, nargs="*", default=[])
    ap.add_argument("--speed", type=Path, nargs="*", default=[], help="torchao_speed.py's JSON lines")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--markdown", type=Path, default=None,
                    help="also write the merged rows as a markdown table here (docs/results/realsize_gpu.md)")
    a = ap.parse_args(argv)
    if not a.rows and not a.speed:
        print("error: nothing to merge: give --rows and/or --speed", file=sys.stderr)
        return 2
    for flag, paths in (("--rows", a.rows), ("--speed", a.speed)):
        for p in paths:
            if not p.is_file():
                print(f"error: {flag} {p}: no such file", file=sys.stderr)
                return 2
    old = json.loads(a.json.read_text()) if a.json.is_file() else {}
    doc = merge(old, *collect(a.rows, a.optimize, a.speed))
    mark_rows_outside_budget(doc["rows"], a.optimize)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(doc, indent=1) + "\n")
    for r in doc["rows"]:
        ratio = r["ratio_to_best_reference"]
        print(f"{r['model']:>20} b{r['batch']:<4} {r['chosen']:<40} fresh {r['fresh_process_p50_ms']} ms, "
              f"best reference {r['best_reference']} {r['references'][r['best_reference']]} ms"
              + (f" = {ratio:.3f}x" if ratio is not None else "") + f", budget met {r['budget_met']}")
    if doc.get("low_precision_why"):
        print("low precision: " + doc["low_precision_why"])
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(markdown_table(doc))
        print(f"table: {a.markdown} ({sum(goal_verdict(r) == 'met' for r in doc['rows'])} of {len(doc['rows'])} rows "
              "meet the goal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
