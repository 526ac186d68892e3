"""Terminal summary: one compact ``rich`` table, the numbers one looks at right after a run."""
from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qdeploy.report import tables as T


def print_table(results: Mapping, console: Console | None = None) -> Table:
    """Print variant, status, accuracy, agreement, p50/p95 latency and throughput per batch size and peak
    memory; skipped/failed rows are dim and carry their reason. Returns the ``rich`` table."""
    console = console or Console()
    key, metric = T.METRICS[T.task(results)][0]
    sizes = T.batch_sizes(results)
    vs = T.variants(results)
    gpu = any(T.num(T.section(v, "memory_mb").get("gpu_allocated_peak")) is not None for v in vs)
    table = Table(title=T.title(results), header_style="bold", title_justify="left")
    table.add_column("Variant")
    table.add_column("Status")
    for name in (metric, "Agree %"):
        table.add_column(name, justify="right")
    for bs in sizes:
        table.add_column(f"bs {bs} p50/p95 ms", justify="right")
        table.add_column(f"bs {bs} img/s", justify="right")
    table.add_column("RSS peak MB", justify="right")
    if gpu:
        table.add_column("GPU peak MB", justify="right")
    table.add_column("Note / reason")
    for v in vs:
        mem = T.section(v, "memory_mb")
        cells = [str(v.get("name") or "?"), str(v.get("status") or "?"), T.pct(T.section(v, "metrics").get(key)),
                 "ref" if v.get("name") == results.get("reference") else T.pct(v.get("agreement"))]
        for bs in sizes:
            lat = T.latency_stats(v, bs)
            cells.append(f"{T.fmt(lat.get('p50'))} / {T.fmt(lat.get('p95'))}" if lat else T.DASH)
            cells.append(T.fmt(T.at_batch(T.section(v, "throughput_ips"), bs), 1, sep=True))
        cells.append(T.fmt(mem.get("rss_peak"), 1, sep=True))
        if gpu:
            cells.append(T.fmt(mem.get("gpu_allocated_peak"), 1, sep=True))
        cells.append(str((v.get("note") or "") if T.is_ok(v) else (v.get("reason") or "")))
        # Text() so that "[...]" in names or reasons is shown verbatim, not parsed as rich markup.
        table.add_row(*map(Text, cells), style=None if T.is_ok(v) else "dim")
    console.print(table)
    return table
