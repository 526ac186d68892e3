"""Terminal summary: one compact ``rich`` table, the numbers one looks at right after a run."""
from __future__ import annotations

import os
from collections.abc import Mapping

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from qdeploy.report import tables as T


STYLES = {"": None, "degraded": "yellow", "muted": "dim"}


def print_verdict(results: Mapping, console: Console) -> None:
    """The recommendation in a box, printed before the table: the answer first, the evidence after."""
    v = T.verdict(results)
    if v is None:
        return
    text = Text()
    for line in v.warnings:  # first: what makes the rest of the answer doubtful
        text.append(("\n" if text else "") + f"{T.WARNING_MARK} {line}", style="bold red")
    if v.headline:
        text.append(("\n" if text else "") + v.headline, style="bold")
        text.append(f" — {v.why}")
    for line in v.lines:
        text.append("\n" + line)
    for name, why in v.excluded:
        text.append(f"\n  not {name}: {why}", style="dim")
    console.print(Panel(text, border_style="green" if v.clean else "red" if v.warnings else "yellow", expand=False))


def print_table(results: Mapping, console: Console | None = None) -> Table:
    """Print the recommendation, then variant, status, accuracy, agreement, p50/p95 latency and throughput
    per batch size, the process's peak RSS and what the model adds to it; skipped/failed rows are dim,
    degraded ones yellow. Reasons and notes follow the table, one line per variant: inside it, a long
    reason would squeeze the numbers into slivers. Latencies flagged noisy carry ⚠ (why: under the table),
    variants timed outside their deployment engine †.
    Returns the ``rich`` table printed."""
    console = console or _stdout_console()
    key, metric = T.METRICS[T.task(results)][0]
    sizes = T.batch_sizes(results)
    vs = T.variants(results)
    gpu = any(T.num(T.section(v, "memory_mb").get("gpu_allocated_peak")) is not None for v in vs)

    rows, notes, noise = [], [], []
    any_noisy = any_elsewhere = False
    for v in vs:
        mem = T.section(v, "memory_mb")
        name = str(v.get("name") or "?") + ("" if T.deploys_speed(v) else f" {T.NOT_DEPLOYMENT_MARK}")
        any_elsewhere |= not T.deploys_speed(v)
        cells = [name, str(v.get("status") or "?"), T.pct(T.section(v, "metrics").get(key)),
                 "ref" if v.get("name") == results.get("reference") else T.pct(v.get("agreement"))]
        per_batch, why_noisy = [], []
        for bs in sizes:
            lat = T.latency_stats(v, bs)
            flag = f" {T.NOISY_MARK}" if T.noisy(lat) else ""
            any_noisy |= bool(flag)
            if flag:  # why, under the table: a speed-up from this timing is withheld, the reader should see the cause
                why_noisy.append(f"bs {bs}: {T.noise_text(lat)}")
            per_batch.append((f"{T.fmt(lat.get('p50'))}/{T.fmt(lat.get('p95'))}{flag}" if lat else T.DASH,
                              T.fmt(T.at_batch(T.section(v, "throughput_ips"), bs), 1, sep=True)))
        if why_noisy:
            noise.append(Text(f"  {T.NOISY_MARK} {v.get('name')}: {'; '.join(why_noisy)}", style="yellow"))
        tail = [T.fmt(mem.get("rss_peak"), 1, sep=True), T.fmt(mem.get("rss_delta"), 1, sep=True)] \
            + ([T.fmt(mem.get("gpu_allocated_peak"), 1, sep=True)] if gpu else [])
        rows.append((cells, per_batch, tail, T.row_style(v)))
        text = v.get("note") if T.is_ok(v) else T.status_text(v)
        if text:
            notes.append(Text(f"  {cells[0]}: {text}", style=STYLES[T.row_style(v)]))
    if any_elsewhere:
        notes.append(Text("  " + T.NOT_DEPLOYMENT_NOTE))
    if any_noisy:
        notes += noise + [Text("  " + T.NOISY_HINT, style="yellow")]

    def joined(pb: tuple[str, str]) -> str:
        return T.DASH if pb == (T.DASH, T.DASH) else "\n".join(pb)

    def build(stacked: bool) -> Table:
        # One line per variant when it fits; else each batch size becomes one column of "p50/p95 ⏎ img/s".
        # Headers span lines so that they are no wider than the numbers under them.
        headers = ["Variant", "Status", metric.replace(" ", "\n"), "Agree\n%"]
        for bs in sizes:
            headers += [f"bs {bs}\np50/p95 ms\nimg/s"] if stacked else [f"bs {bs}\np50/p95\nms", f"bs {bs}\nimg/s"]
        # the process's peak is mostly Python and the libraries (the same for every variant): what the model itself
        # adds over the process before it loaded stands beside it
        headers += ["RSS peak\n(process)\nMB", "model\nadds\nMB"] + (["GPU\npeak\nMB"] if gpu else [])
        body = [cells + [x for pb in per_batch for x in ([joined(pb)] if stacked else pb)] + tail
                for cells, per_batch, tail, _ in rows]
        table = Table(title=T.title(results), header_style="bold", title_justify="left", box=box.SIMPLE_HEAD,
                      collapse_padding=True, pad_edge=False)
        for i, h in enumerate(headers):
            # Numbers are never cut to "98.…": each column is at least as wide as its widest value.
            width = max(len(line) for text in [h] + [r[i] for r in body] for line in text.split("\n"))
            table.add_column(h, justify="left" if i < 2 else "right", no_wrap=i > 0, overflow="fold",
                             min_width=min(width, 18) if i == 0 else width)
        for cells, (*_, style) in zip(body, rows):
            # Text() so that "[...]" in names is shown verbatim, not parsed as rich markup.
            table.add_row(*map(Text, cells), style=STYLES[style])
        return table

    print_verdict(results, console)
    table = build(stacked=False)
    natural = Measurement.get(console, console.options.update_width(10**4), table).maximum  # unclamped width
    if natural > console.width:
        table = build(stacked=True)
    console.print(table)
    for line in notes:
        console.print(line)
    return table


SEVERITY_STYLES = {"blocks-int8": "red", "costs-reformat": "yellow", "fine": "dim"}


def print_lint(report: Mapping, console: Console | None = None) -> None:
    """`qdeploy lint`: the verdict, the structure in one line, then one row per finding."""
    console = console or Console()
    st = report.get("structure") or {}
    forms = ", ".join(f"{n} {k}" for k, n in (st.get("residual_add_forms") or {}).items()) or "none"
    head = Text(f"{report['file']}: {report['verdict']}", style="bold")
    by = report["by"]
    by = f"confirmed by {by}" if by.startswith("TensorRT") else by  # else "static analysis (...)"
    head.append(f" — {report['nodes']} nodes, opset {report['opset']}, {by}, {report['time_s']:.2f} s")
    head.append(f"\n{st.get('compute_ops_int8', 0)}/{st.get('compute_ops', 0)} compute ops INT8 (input and weights); "
                f"residual Adds: {forms}")
    if report.get("fixed"):
        head.append("\nfixed: " + ", ".join(f"{k} ×{v}" for k, v in report["fixed"].items()))
    color = {"clean": "green", "costs reformats": "yellow"}.get(report["verdict"], "red")
    console.print(Panel(head, border_style=color, expand=False))
    findings = report.get("findings") or []
    if not findings:
        return
    # one block per finding, not a table: messages are sentences and must stay readable at 80 columns
    for f in findings:
        nodes = ", ".join(f["nodes"])
        line = Text(f"{f['rule']} {f['name']} ", style="bold")
        line.append(f"[{f['severity']}]", style=SEVERITY_STYLES.get(f["severity"]))
        line.append(f" {nodes if len(nodes) <= 160 else nodes[:160] + '…'}")
        line.append(f"\n    {f['message']}")
        line.append(f"\n    fix: {f['fix']}" + (" (applied by --fix)" if f.get("fixable") else ""), style="dim")
        if f.get("confirmed"):
            line.append(f"\n    TensorRT: {f['confirmed']}", style="dim")
        console.print(line)


def _stdout_console() -> Console:
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)  # a log, not a screen: rich's 80-column fallback would cramp it
    return console


def print_report_table(table: T.Table, console: Console | None = None) -> Table:
    """Any :class:`tables.Table` (the cells the HTML page shows) as a terminal table, caption and notes under it."""
    console = console or _stdout_console()
    out = Table(title=table.title, box=box.SIMPLE_HEAD, title_justify="left")
    for header, numeric in zip(table.headers, table.numeric):
        out.add_column(header, justify="right" if numeric else "left", overflow="fold")
    for i, row in enumerate(table.rows):
        style = STYLES.get(table.styles[i] if i < len(table.styles) else "", None)
        out.add_row(*row, style=style)
    console.print(out)
    for line in ([table.caption] if table.caption else []) + list(table.notes):
        console.print(Text(line, style="dim"))
    return out


def print_optimize(summary: Mapping, console: Console | None = None) -> None:
    """``qdeploy optimize``'s answer first (the chosen row), then every candidate on the search split."""
    from qdeploy.report.optimize_page import optimize_tables, optimize_warnings

    console = console or _stdout_console()
    for line in optimize_warnings(summary):  # first: what makes the answer doubtful
        console.print(Text(f"{T.WARNING_MARK} {line}", style="bold red"))
    for table in [t for t in optimize_tables(summary) if t.key in ("chosen", "candidates", "program", "op-profile")]:
        print_report_table(table, console)
