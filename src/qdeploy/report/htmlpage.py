"""HTML report: one self-contained file (inline CSS, plots as base64 PNG, no scripts, no external URLs),
so it can be mailed, archived as a CI artifact or opened offline and still look the same."""
from __future__ import annotations

import base64
from collections.abc import Mapping
from html import escape

from qdeploy.report import plots
from qdeploy.report import tables as T

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d2433;margin:0;background:#f6f7f9}
main{max-width:1200px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 12px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #d8dce3;padding-bottom:4px}
p.caption{color:#5b6475;margin:2px 0 8px;font-size:13px}
table{border-collapse:collapse;background:#fff;margin:4px 0 8px;font-size:13px}
th,td{border:1px solid #d8dce3;padding:4px 9px;vertical-align:top}
th{background:#eef1f5;text-align:left}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr:nth-child(even) td{background:#fafbfc}tr.muted td{color:#8a93a3;font-style:italic}
tr.degraded td{background:#fff4e0;color:#7a4b00}ul.notes{color:#5b6475;font-size:13px;margin:0 0 8px;padding-left:20px}
.verdict{background:#eaf6ec;border:1px solid #8cc79a;border-left:6px solid #2e8b47;padding:10px 14px;margin:8px 0 16px}
.verdict.none{background:#fff6e5;border-color:#e0b060;border-left-color:#c88a12}
.verdict.warned{background:#fdecec;border-color:#e0a0a0;border-left-color:#b42318}.verdict p.warning{color:#b42318}
.verdict p{margin:3px 0}.verdict p.headline{font-size:15px}.verdict strong{font-size:17px}.verdict ul{margin:4px 0;font-size:13px}
table.kv th{width:130px}figure{margin:10px 0;background:#fff;border:1px solid #d8dce3;padding:8px;display:inline-block}
figure img{max-width:100%;height:auto;display:block}figcaption{color:#5b6475;font-size:13px;margin-top:4px}
details{margin:4px 0}pre{background:#fff;border:1px solid #d8dce3;padding:8px;overflow-x:auto;font-size:12px}
"""


def _table(t: T.Table) -> str:
    out = [f'<h2 id="{escape(t.key)}">{escape(t.title)}</h2>']
    if t.caption:
        out.append(f'<p class="caption">{escape(t.caption)}</p>')
    if not t.rows:
        return "\n".join(out + ["<p><em>No data.</em></p>"])

    def cls(i: int) -> str:
        return ' class="n"' if t.numeric[i] else ""

    out.append("<table><thead><tr>" + "".join(f"<th{cls(i)}>{escape(h)}</th>" for i, h in enumerate(t.headers))
               + "</tr></thead><tbody>")
    for row, style in zip(t.rows, t.styles):
        out.append((f'<tr class="{style}">' if style else "<tr>")
                   + "".join(f"<td{cls(i)}>{escape(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</tbody></table>")
    if t.notes:
        out.append('<ul class="notes">' + "".join(f"<li>{escape(n)}</li>" for n in t.notes) + "</ul>")
    return "\n".join(out)


def _verdict(results: Mapping) -> list[str]:
    """The recommendation box that opens the page."""
    v = T.verdict(results)
    if v is None:
        return []
    out = [f'<section class="verdict{"" if v.clean else " warned" if v.warnings else " none"}" id="recommendation">']
    out += [f'<p class="warning"><strong>{escape(T.WARNING_MARK)} {escape(line)}</strong></p>' for line in v.warnings]
    if v.headline:
        out.append(f'<p class="headline"><strong>{escape(v.headline)}</strong> — {escape(v.why)}</p>')
    out += [f"<p>{escape(line)}</p>" for line in v.lines]
    if v.excluded:
        out.append("<details><summary>Why not the others</summary><ul>"
                   + "".join(f"<li><b>{escape(n)}</b>: {escape(why)}</li>" for n, why in v.excluded)
                   + "</ul></details>")
    return out + ["</section>"]


def _figure(png: bytes | None, alt: str, caption: str) -> str:
    if png is None:
        return f'<p class="caption">{escape(alt)}: nothing to plot.</p>'
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{escape(alt)}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def render_html(results: Mapping) -> str:
    """The whole report as one HTML page: the Markdown report's tables plus two embedded plots."""
    title = T.title(results)
    body = [f"<h1>{escape(title)}</h1>", *_verdict(results), '<table class="kv">']
    body += [f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in T.summary(results)]
    body.append("</table>")
    tables = T.all_tables(results)
    last_latency = next((t.key for t in reversed(tables) if t.key.startswith("latency-")), "accuracy")
    metric = T.METRICS[T.task(results)][0][1]
    for t in tables:
        body.append(_table(t))
        # Plots sit right after the tables they illustrate.
        if t.key == "accuracy":
            body.append(_figure(plots.accuracy_vs_latency(results), "Accuracy vs latency",
                                f"{metric} against p50 (median) latency per batch size; colour = engine, "
                                "marker = precision (○ fp32, □ fp16, △ bf16, ◇ int8); hollow markers and † = latency "
                                "not measured in the deployment engine (not comparable); red name = degraded."))
        if t.key == "qat":
            body.append(_figure(plots.qat_curves([(n, q.get("log") or []) for n, q in T.qat_runs(results)], metric),
                                "QAT curves", "Training loss per epoch of each QAT variant (and the data.eval metric per "
                                "epoch where it was measured)."))
        if t.key == "per-class-ap":
            body.append(_figure(plots.detection_examples(results), "Detections, reference and INT8",
                                "The images where the variants disagree most with the reference: each variant's "
                                "detections scoring at least the agreement threshold (model.nms.agreement_score), "
                                "ground truth dashed white."))
        if t.key == "skipped":
            body += [f"<details><summary>Traceback of {escape(str(v.get('name')))}</summary>"
                     f"<pre>{escape(str(T.section(v, 'details')['traceback']))}</pre></details>"
                     for v in T.variants(results) if T.section(v, "details").get("traceback")]
        if t.key == last_latency:
            body.append(_figure(plots.latency_distribution(results), "Latency distribution",
                                "Per-iteration latency of every timed batch (box = quartiles, whiskers = 1.5 IQR); "
                                "orange box = noisy timing (no speed-up stated from it); "
                                "† = latency not measured in the deployment engine."))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body><main>\n"
            + "\n".join(body) + "\n</main></body>\n</html>\n")
