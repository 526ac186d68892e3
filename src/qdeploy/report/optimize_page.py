"""``qdeploy optimize``'s report: one self-contained HTML page with the chosen artifact and its confirm-split result,
the accuracy-vs-latency Pareto front of the candidates (search split), every candidate, and the decision log."""
from __future__ import annotations

from collections.abc import Mapping
from html import escape
from pathlib import Path
from typing import Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qdeploy.report import tables as T
from qdeploy.report.htmlpage import CSS, _figure, _table
from qdeploy.report.plots import _label_points, _png
from qdeploy.utils.atomic import atomic_path


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Names of the points no other point beats on both axes (lower cost x, higher accuracy y)."""
    front = []
    for name, x, y in points:
        if not any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for _, x2, y2 in points):
            front.append(name)
    return front


def pareto_plot(summary: Mapping) -> bytes | None:
    measured = summary.get("latency_measured")
    pts = []
    for c in summary.get("candidates") or []:
        y = T.num(c.get("search_metric"))
        x = T.num(c.get("latency_p50_ms")) if measured else T.num(c.get("int8_share"))
        if x is not None and y is not None:
            pts.append((str(c["variant"]), -x if not measured else x, 100 * y))  # INT8 share: higher is cheaper
    if not pts:
        return None
    front = set(pareto_front(pts))
    fig = Figure(figsize=(6.4, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    chosen = (summary.get("chosen") or {}).get("variant")
    for name, x, y in pts:
        xv = x if measured else -x
        ax.scatter(xv, y, s=60 if name == chosen else 30, marker="*" if name == chosen else "o",
                   color="#b42318" if name == chosen else ("C0" if name in front else "0.6"), zorder=3)
    line = sorted((x if measured else -x, y) for n, x, y in pts if n in front)
    if len(line) > 1:
        ax.plot(*zip(*line), color="C0", alpha=0.5, zorder=2)
    ax.set(xlabel=f"p50 latency (ms), batch {summary.get('batch_size')}" if measured else "share of compute ops in INT8",
           ylabel=f"{summary.get('metric')} % (search split)", title="candidates: Pareto front (blue), chosen (red star)")
    ax.grid(True, alpha=0.3)
    ax.margins(0.15)
    fig.draw_without_rendering()  # label placement works in screen coordinates: fix the layout first
    _label_points(ax, [(n, x if measured else -x, y, "#b42318" if n == chosen else "black") for n, x, y in pts])
    return _png(fig)


def optimize_warnings(summary: Mapping) -> list[str]:
    """What must be read before the answer (the reference near chance, every INT8 candidate failed), most basic first."""
    return [str(w.get("message")) for w in summary.get("warnings") or [] if w.get("message")]


def chosen_engine(chosen: Mapping) -> str | None:
    """The engine that runs the chosen artifact (its variant setting's ``engine``: onnxruntime, openvino, torch, ...)."""
    return (chosen.get("setting") or {}).get("engine") if isinstance(chosen.get("setting"), Mapping) else None


def chosen_name(chosen: Mapping) -> str:
    """The chosen candidate with its engine: "onnxruntime fp32"; a variant already named after its engine
    ("openvino-int8-max") as it is."""
    variant, engine = str(chosen.get("variant")), chosen_engine(chosen)
    return variant if not engine or variant.startswith(f"{engine}-") else f"{engine} {variant}"


def budget_text(summary: Mapping) -> str:
    """The budget in words (optimize.json's ``budget_text``; an older file's budget dict as key: value pairs)."""
    if summary.get("budget_text"):
        return str(summary["budget_text"])
    budget = summary.get("budget")
    return ", ".join(f"{k}: {v}" for k, v in budget.items()) if isinstance(budget, Mapping) else str(budget or "–")


def chosen_line(summary: Mapping) -> str:
    """The answer in one line, metrics in percent like every table, naming the engine that runs the artifact."""
    c = T.section(summary, "chosen")
    metric = "top-1" if summary.get("metric") == "top1" else str(summary.get("metric") or "metric")
    met = "met" if summary.get("budget_met") else "MISSED"
    return (f"chosen: {chosen_name(c)} ({c.get('artifact') or 'no file'}); {metric} search {T.pct(c.get('search_metric'))} %, "
            f"confirm {T.pct(c.get('confirm_metric'))} % vs FP32 {T.pct(c.get('reference_confirm_metric'))} %; "
            f"budget {met} on the confirm split" + (f"; run it with {c['deploy']}" if c.get("deploy") else ""))


def optimize_tables(summary: Mapping) -> list[T.Table]:
    c = T.section(summary, "chosen")
    met = "met" if summary.get("budget_met") else "MISSED"
    head = T.Table("chosen", f"Chosen: {c.get('variant')} (budget {met} on the confirm split)",
                   ["", "Chosen", "FP32 reference"], [False, True, True],
                   caption=f"Budget: {budget_text(summary)}; {T.section(summary, 'confirm').get('why')}. The confirm split "
                           "was never used by the search." + (" The time limit stopped the search: best candidate so far."
                                                             if summary.get("timed_out") else ""))
    head.add(["confirm split metric", T.pct(c.get("confirm_metric")), T.pct(c.get("reference_confirm_metric"))])
    head.add(["search split metric", T.pct(c.get("search_metric")), "–"])
    head.add(["p50 latency (ms)", T.fmt(c.get("latency_p50_ms"), 3), T.fmt(c.get("reference_latency_p50_ms"), 3)])
    head.add(["engine", str(chosen_engine(c) or "–"), str(c.get("reference_engine") or "–")])
    head.add(["found by", str(c.get("stage") or "–"), "–"])
    basis = c.get("int8_share_basis") or "macs"
    head.add(["INT8 share of compute (MACs)" if basis == "macs" else f"INT8 share of {basis}", T.pct(c.get("int8_share")), "–"])
    head.add(["layers left in float", ", ".join(c.get("float_layers") or []) or "none", "all"])
    head.add(["artifact", str(c.get("artifact") or "–"), "–"])
    program = T.section(summary, "program")
    for b, v in (program.get("latency_p50_ms") or {}).items():
        head.add([f"p50 at batch {b}, loaded from --out in a fresh process (ms)", T.fmt(v, 3), "–"])
    env = T.section(summary, "environment")
    if summary.get("threads"):  # CPU targets: INT8 speed depends on the CPU's vector extensions and the threads
        flags = env.get("cpu_flags")
        head.add(["timed on", f"{env.get('cpu') or '?'}, {summary['threads']} thread(s)"
                  + (f"; flags {' '.join(flags)}" if flags else "; flags: none of avx2/avx512/vnni/amx"), "–"])
    ev = T.section(summary, "evaluations")
    head.add(["evaluations (full / subset)", f"{ev.get('full', 0)} / {ev.get('subset', 0)}"
              + (f"; {ev['ruled_out_by_speed']} timed only (too slow to be the answer: not evaluated)"
                 if ev.get("ruled_out_by_speed") else ""), "–"])
    torch_target = str(summary.get("target") or "").startswith("torch-")
    cands = T.Table("candidates", "Candidates (search split)",
                    ["Variant", "Found by", "Status", "Metric", "Agreement", "Budget, or why it failed", "p50 ms",
                     "Brief p50 ms" if torch_target else "INT8 share", "Compile s" if torch_target else "Seconds"],
                    [False, False, False, True, True, False, True, not torch_target, True],
                    caption=("p50 at the largest ranked batch size (ranked on the geometric mean over all); brief: a few "
                             "dozen calls per batch size, every candidate; compile: loading plus first calls (Inductor "
                             "compiles per shape; a second candidate of the same graph hits Inductor's cache). NOISY: "
                             "a timed batch size flagged noisy (its p50 not pinned to ±5 %, a drift, or a batch slower than a larger "
                             "one)." if torch_target else ""))
    for x in summary.get("candidates") or []:
        agree = T.pct(x.get("agreement")) if x.get("agreement") is not None else \
            (f"{T.pct(x.get('subset_agreement'))} (subset)" if x.get("subset_agreement") is not None else "–")
        status = str(x.get("status"))
        if status in ("failed", "skipped") and x.get("failed_stage"):
            status += f" at {x['failed_stage']}"
        if x.get("replayed"):  # from the resume store: same model, data, settings, code, libraries (and machine)
            status += " (replayed)"
        p50 = T.fmt(x.get("latency_p50_ms"), 3) + (" NOISY" if x.get("noisy") else "")
        if torch_target:
            brief = "/".join(T.fmt(v, 3) for v in (x.get("brief_p50_ms") or {}).values()) or "–"
            last = [brief, T.fmt(x.get("compile_s"), 1)]
        else:
            last = [T.pct(x.get("int8_share")), T.fmt(x.get("time_s"), 1)]
        cands.add([str(x.get("variant")), str(x.get("stage") or "–"), status, T.pct(x.get("search_metric")), agree,
                   str(x.get("budget")), p50, *last],
                  style="muted" if x.get("status") in ("failed", "skipped") else "")
    tables = [head, cands]
    prof = T.section(summary, "int8_op_profile")
    if prof.get("classes"):
        tables.append(op_profile_table(prof))
    if program:
        tables.append(program_table(program, T.section(summary, "environment")))
    fb = T.section(T.section(summary, "stages"), "fallback")
    if fb.get("rankings"):
        rank = T.Table("fallback", "Per-layer fallback: the refined ranking",
                       ["Ranking", "Layer", "SQNR (dB)", "Subset agreement gain"], [True, False, True, True],
                       caption=f"From {fb.get('start')} on a subset of {fb.get('subset_size')} search samples; stopped: "
                               f"{fb.get('stop')}; float layers: {', '.join(fb.get('float_layers') or []) or 'none'} "
                               f"({T.pct(fb.get('float_fraction'))} of the MACs).")
        for i, r in enumerate(fb["rankings"], 1):
            for x in r.get("refined") or []:
                rank.add([str(i), str(x.get("layer")), T.fmt(x.get("sqnr_db"), 1), T.fmt(x.get("subset_gain"), 4)])
        tables.append(rank)
    peers = missed_budget_table(summary)
    if peers is not None:
        tables.append(peers)
    log = T.Table("decisions", "Decision log", ["#", "Decision"], [True, False])
    for i, d in enumerate(summary.get("decisions") or [], 1):
        log.add([str(i), str(d)])
    return tables + [log]


def missed_budget_table(summary: Mapping) -> Optional[T.Table]:
    """qdeploy's per-layer fallback and NNCF's accuracy control side by side (None: neither ran): the evaluations each
    spent, the compute layers each left float, and where its answer landed."""
    stages = T.section(summary, "stages")
    fb, ac = T.section(stages, "fallback"), T.section(stages, "nncf_accuracy_control")
    if not fb and not ac:
        return None
    by = {x.get("variant"): x for x in summary.get("candidates") or []}
    t = T.Table("missed-budget", "Where INT8 misses the budget: qdeploy's fallback and NNCF's accuracy control",
                ["Method", "Evaluations", "Float layers", "Result", "Top metric", "Within budget", "p50 ms"],
                [False, False, True, False, True, False, True],
                caption="Evaluations: passes over the whole search split, plus subset or per-image evaluations "
                        "(qdeploy ranks on a subset by SQNR and agreement; NNCF on each image's metric). NNCF's loop "
                        "stops on the metric drop alone; qdeploy's budget also has an agreement floor.")
    if fb.get("skipped"):
        t.add(["qdeploy per-layer fallback", "–", "–", f"not run: {fb['skipped']}", "–", "–", "–"])
    elif fb:
        trials = fb.get("trials") or []
        last = by.get(trials[-1]) if trials else None
        t.add(["qdeploy per-layer fallback", f"{len(trials)} full, subset ranking",
               str(len(fb.get("float_layers") or [])), str(trials[-1] if trials else "–"),
               T.pct(last.get("search_metric")) if last else "–", "yes" if fb.get("within_budget") else "no",
               T.fmt(last.get("latency_p50_ms"), 3) if last else "–"])
    if ac.get("skipped"):
        t.add(["NNCF quantize_with_accuracy_control", "–", "–", f"not run: {ac['skipped']}", "–", "–", "–"])
    elif ac:
        res = T.section(ac, "result")
        row = by.get(res.get("variant")) or {}
        t.add(["NNCF quantize_with_accuracy_control",
               f"{ac.get('evaluations_full_split', '–')} full, {ac.get('item_evaluations', '–')} per-image"
               if "error" not in ac else "–",
               str(len(ac.get("float_compute_ops") or [])) if "error" not in ac else "–",
               str(res.get("variant") or ac.get("error") or "–"), T.pct(row.get("search_metric")),
               "yes" if res.get("within_budget") else "no", T.fmt(row.get("latency_p50_ms"), 3)])
    return t


def op_profile_table(prof: Mapping) -> T.Table:
    """The ONNX Runtime INT8 graph against the FP32 graph, kernel time per op class: where INT8 costs more than float."""
    slower = set(prof.get("slower") or [])
    who = "the chosen candidate" if prof.get("chosen") else "the fastest ONNX Runtime INT8 candidate (not chosen)"
    ov = prof.get("engine") == "openvino"
    tool = "OpenVINO's per-layer counters (PERF_COUNT)" if ov else "ONNX Runtime's profiler"
    unfused = ("Q/DQ: FakeQuantize layers OpenVINO could not fold; layout: Reorder layers" if ov else
               "Q/DQ: quantize/dequantize nodes ONNX Runtime could not fuse; layout: NCHWc reorders")
    t = T.Table("op-profile", f"Where INT8 time goes: {prof.get('candidate')} vs FP32, per op class",
                ["Op class", "FP32 ms", "INT8 ms", "INT8 / FP32", "INT8 kernels", "INT8 costs more"],
                [False, True, True, True, False, False],
                caption=f"{tool} on {who}: kernel time per op class over {prof.get('runs')} runs at batch "
                        f"{prof.get('batch_size')}, {prof.get('threads')} threads (p50 FP32 {T.fmt(prof.get('fp32_p50_ms'), 3)}"
                        f" ms, INT8 {T.fmt(prof.get('int8_p50_ms'), 3)} ms). {unfused}. A class that costs more in INT8 "
                        "is what the placement rules (lint/placement.py) leave float where that is faster.")
    for r in prof.get("classes") or []:
        t.add([str(r.get("op_class")), T.fmt((r.get("fp32_us") or 0) / 1e3, 3), T.fmt((r.get("int8_us") or 0) / 1e3, 3),
               T.fmt(r.get("ratio"), 2) if r.get("ratio") is not None else "–", ", ".join(r.get("int8_ops") or []) or "–",
               "YES" if r.get("op_class") in slower else ""], style="degraded" if r.get("op_class") in slower else "")
    return t


def program_table(program: Mapping, env: Mapping) -> T.Table:
    """The PyTorch targets' saved program: what it is, how it loads, and what a fresh process measured from --out."""
    m = T.section(program, "manifest")
    fresh = T.section(program, "fresh_process")
    fenv = T.section(fresh, "environment")
    t = T.Table("program", "Saved program (loaded from --out by load_model.py in a fresh process)", ["", "Value"],
                [False, False], caption=str(program.get("how_to_load") or ""))
    if program.get("error"):
        t.add(["error", str(program["error"])])
        return t
    t.add(["format", f"{m.get('format')}: {m.get('why_format')}"])
    t.add(["runs as", f"{m.get('precision')}{', TF32' if m.get('tf32') else ''}{', channels_last' if m.get('channels_last') else ''}"
                      f"{', torch.compile ' + str(m.get('compile')) if m.get('compile') else ', eager'}"
                      f"{', CUDA graph per input shape' if m.get('cuda_graphs') else ''}"
                      f"{', Inductor freezing' if m.get('freezing') else ''}{', torchao ' + m['torchao'] if m.get('torchao') else ''}"
                      f"{', patch convolutions as matmuls' if m.get('patch_matmul') else ''}"
                      f"{', depthwise convolutions as stencils' if m.get('depthwise_stencil') else ''} on {m.get('device')}"])
    t.add(["batch", "one program, dynamic batch dimension" if m.get("dynamic_batch")
           else f"one program per batch size ({', '.join(str(k) for k in (m.get('programs') or {}))})"])
    t.add(["files", ", ".join(sorted(set((m.get("programs") or {}).values()) | {"load_model.py", "qdeploy-program.json"}
                                     | ({m["compile_cache"]} if m.get("compile_cache") else set())))])
    t.add(["save time", f"{T.fmt(program.get('save_s'), 1)} s (export {T.fmt(m.get('export_s'), 1)} s"
                        + (f", compile for the cache {T.fmt(m.get('compile_s'), 1)} s" if m.get("compile_s") else "") + ")"])
    t.add(["load time in the fresh process", f"{T.fmt(fresh.get('load_s'), 2)} s"])
    for b, v in (program.get("first_call_s") or {}).items():
        t.add([f"first call at batch {b} after the reload", f"{T.fmt(v, 2)} s"])
    for b, v in (program.get("latency_p50_ms") or {}).items():
        t.add([f"p50 at batch {b}", f"{T.fmt(v, 4)} ms" + (" (NOISY)" if b in (program.get("noisy") or []) else "")])
    imported = fenv.get("imported_sources")
    t.add(["imports in the fresh process", "torch and numpy only (qdeploy, timm, torchvision not imported)" if imported == []
           else f"imported {', '.join(imported or ['?'])}"])
    machine = ", ".join(f"{k} {env.get(k)}" for k in ("gpu", "driver", "cuda", "cudnn", "sm_clock_mhz", "sm_clock_max_mhz",
                                                      "power_limit_w", "torch") if env.get(k) is not None)
    t.add(["machine", machine or str(env.get("cpu") or "–")])
    return t


def write_optimize_report(summary: Mapping, path: Path, title: str) -> Path:
    body = [f"<h1>{escape(title)}</h1>"]
    warnings = optimize_warnings(summary)
    if warnings:
        body.append('<section class="verdict warned">' + "".join(
            f'<p class="warning"><strong>{escape(T.WARNING_MARK)} {escape(w)}</strong></p>' for w in warnings) + "</section>")
    tables = optimize_tables(summary)
    body.append(_table(tables[0]))
    body.append(_figure(pareto_plot(summary), "Pareto front",
                        "Search-split accuracy against latency on the target (or INT8 share of compute where the target's "
                        "latency was not measured); the Pareto front in blue, the chosen candidate as a red star."))
    body += [_table(t) for t in tables[1:]]
    html = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body><main>\n" + "\n".join(body)
            + "\n</main></body>\n</html>\n")
    with atomic_path(Path(path)) as tmp:
        Path(tmp).write_text(html, encoding="utf-8")
    return Path(path)
