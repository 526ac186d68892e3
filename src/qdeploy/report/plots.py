"""Report plots as PNG bytes, drawn with matplotlib's object-oriented API on the Agg canvas.

``Figure`` + ``FigureCanvasAgg`` never touches pyplot, so no GUI backend is selected, nothing leaks
between calls, and it works headless and from threads.
"""
from __future__ import annotations

import io
from collections.abc import Mapping

import matplotlib
import matplotlib.patches
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qdeploy.report import tables as T

MARKERS = {"fp32": "o", "fp16": "s", "bf16": "^", "int8": "D"}


def _grid(n: int) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = -(-n // cols)
    fig = Figure(figsize=(4.6 * cols, 3.8 * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, list(axes[:n])


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})  # no version string: same input, same bytes
    return buf.getvalue()


def _log_if_wide(values: list[float], set_scale) -> None:
    # CPU and GPU latencies can differ 100×; a linear axis would squash the fast variants into one spot.
    if values and min(values) > 0 and max(values) / min(values) > 20:
        set_scale("log")


def accuracy_vs_latency(results: Mapping) -> bytes | None:
    """Scatter of headline accuracy against p50 latency, one panel per batch size; None when nothing to plot.

    Variants whose latency is not their deployment engine's are drawn hollow and named with "†": their x
    position is not a deployment speed. Degraded variants are named in red."""
    key, name = T.METRICS[T.task(results)][0]
    panels = []
    for bs in T.batch_sizes(results):
        pts = []
        for v in T.variants(results):
            x = T.p50(v, bs)
            y = T.num(T.section(v, "metrics").get(key))
            if x is not None and y is not None:
                pts.append((v, x, 100 * y))
        if pts:
            panels.append((bs, pts))
    if not panels:
        return None
    engines = sorted({str(v.get("engine")) for _, pts in panels for v, _, _ in pts})
    colour = {e: f"C{i % 10}" for i, e in enumerate(engines)}
    fig, axes = _grid(len(panels))
    for ax, (bs, pts) in zip(axes, panels):
        for v, x, y in pts:
            c = colour[str(v.get("engine"))]
            deploys = T.deploys_speed(v)
            ax.scatter(x, y, s=40, marker=MARKERS.get(v.get("precision"), "P"), zorder=3,
                       facecolors=c if deploys else "none", edgecolors="black" if deploys else c,
                       linewidths=0.5 if deploys else 1.5)
        _log_if_wide([x for _, x, _ in pts], ax.set_xscale)
        ax.set(title=f"batch size {bs}", xlabel="p50 latency (ms)", ylabel=name)
        ax.grid(True, alpha=0.3)
        ax.margins(0.15)  # room for the point labels
        low, high = ax.get_ylim()
        ax.set_ylim(low, min(high, 100.5))  # an axis running to 104 % would look like a bug
    handles = [axes[0].scatter([], [], color=colour[e], label=e) for e in engines]
    axes[0].legend(handles=handles, fontsize=8, loc="best")
    fig.draw_without_rendering()  # fix the layout first: label placement works in screen coordinates
    for ax, (_, pts) in zip(axes, panels):
        _label_points(ax, [(_point_name(v), x, y, "#b42318" if T.is_degraded(v) else "black") for v, x, y in pts])
    return _png(fig)


def _point_name(v) -> str:
    name = str(v.get("name"))
    return name if T.deploys_speed(v) else f"{name} {T.NOT_DEPLOYMENT_MARK}"


def _label_points(ax, pts: list[tuple[str, float, float, str]]) -> None:
    """Name each point; variants often tie on accuracy, so a label moves up/down until it overlaps no other."""
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for name, x, y, colour in sorted(pts, key=lambda p: (p[1], p[2])):
        # Points in the right part of the panel get their label on the left, or it would run off the figure.
        left = ax.transAxes.inverted().transform(ax.transData.transform((x, y)))[0] > 0.6
        dx, ha = (-5, "right") if left else (5, "left")
        for dy in (4, -12, 14, -22, 24, -32, 34, -42, None):
            ann = ax.annotate(name, (x, y), xytext=(dx, 4 if dy is None else dy), textcoords="offset points",
                              fontsize=8, ha=ha, color=colour)
            ann.set_in_layout(False)
            box = ann.get_window_extent(renderer)
            if dy is None or not any(box.overlaps(b) for b in placed):
                break  # free spot found (or crowded beyond help: the first spot)
            ann.remove()
        placed.append(box)


# matplotlib 3.10 replaced boxplot's vert=False by orientation= (vert deprecated in 3.11); pyproject allows >= 3.7
_HORIZONTAL = {"orientation": "horizontal"} if matplotlib.__version_info__ >= (3, 10) else {"vert": False}
NOISY_COLOUR = "#f5b041"  # boxes of timings flagged noisy (tables.noisy): the reports withhold their speed-ups


def latency_distribution(results: Mapping) -> bytes | None:
    """Horizontal box plots of the raw per-iteration latencies, one panel per batch size, one row per variant; None
    without samples. Horizontal: variant names are read along the y axis, so they never overlap however many
    variants or batch sizes there are (rotated x labels did at 5 variants). Noisy timings are filled orange."""
    panels = []
    for bs in T.batch_sizes(results):
        series = {}
        for v in T.variants(results):
            raw = T.at_batch(T.section(v, "latency_samples_ms"), bs)
            values = [f for f in map(T.num, raw if isinstance(raw, list) else []) if f is not None]
            if values:
                series[_point_name(v)] = (values, T.noisy(T.latency_stats(v, bs)))
        if series:
            panels.append((bs, series))
    if not panels:
        return None
    names = list(dict.fromkeys(n for _, series in panels for n in series))  # every panel: the same rows, same order
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    width = max(len(n) for n in names)
    # a row of 0.3 inch per variant fits 8-point names; the name column grows with the longest name
    fig = Figure(figsize=(0.07 * width + 3.6 * cols, (1.1 + 0.3 * len(names)) * rows), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (bs, series) in zip(axes, panels):
        rows_here = [(i, *series[n]) for i, n in enumerate(names) if n in series]
        boxes = ax.boxplot([s for _, s, _ in rows_here], positions=[i for i, _, _ in rows_here], **_HORIZONTAL,
                           widths=0.6, patch_artist=True, showfliers=True,
                           flierprops={"markersize": 2, "alpha": 0.5}, medianprops={"color": "black"})
        for patch, (_, _, noisy) in zip(boxes["boxes"], rows_here):
            patch.set_facecolor(NOISY_COLOUR if noisy else "#d6e4f0")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)  # the first variant on top, as in the tables
        _log_if_wide([x for _, s, _ in rows_here for x in s], ax.set_xscale)
        ax.set(title=f"batch size {bs}", xlabel="latency per batch (ms)")
        ax.grid(True, axis="x", alpha=0.3)
    if any(noisy for _, series in panels for _, noisy in series.values()):
        from matplotlib.patches import Patch

        fig.legend(handles=[Patch(facecolor=NOISY_COLOUR, label="noisy timing (no speed-up stated)")], fontsize=8,
                   loc="outside lower right")  # outside the panels: it hides no box
    return _png(fig)


def qat_curves(runs: list[tuple[str, list]], metric_name: str = "metric") -> bytes | None:
    """Training loss per epoch, and the evaluation metric per epoch where it was measured, one line per QAT run."""
    runs = [(name, log) for name, log in runs if log]
    if not runs:
        return None
    with_metric = any(e.get("metric") is not None for _, log in runs for e in log)
    fig, axes = _grid(2 if with_metric else 1)
    for name, log in runs:
        pts = [(e["epoch"], e["loss"]) for e in log if e.get("loss") is not None]
        if pts:
            axes[0].plot(*zip(*pts), marker="o", label=name)
        if with_metric:
            pts = [(e["epoch"], 100 * e["metric"]) for e in log if e.get("metric") is not None]
            if pts:
                axes[1].plot(*zip(*pts), marker="o", label=name)
    axes[0].set(title="training loss", xlabel="epoch", ylabel="loss (mean over the epoch)")
    if with_metric:
        axes[1].set(title=f"{metric_name} on data.eval after each epoch", xlabel="epoch", ylabel=metric_name)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return _png(fig)


def detection_examples(results: Mapping, variants: int = 3) -> bytes | None:
    """The report's picture of a detector: a few images (results["examples"]), one row each, the reference's boxes and
    up to ``variants`` - 1 other variants' side by side (ground truth dashed white; detections coloured by class,
    with their scores). None without examples or when no image file can be opened any more."""
    from PIL import Image

    examples = results.get("examples") or []
    names = list((examples[0].get("detections") or {}) if examples else {})[:variants]
    if not names:
        return None
    class_names = list(T.section(T.section(results, "data"), "eval").get("class_names") or [])
    rows = []
    for ex in examples:
        try:
            with Image.open(ex["image"]) as im:
                rows.append((ex, im.convert("RGB").copy()))
        except (OSError, KeyError):
            continue
    if not rows:
        return None
    fig = Figure(figsize=(3.6 * len(names), 3.0 * len(rows)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), len(names), squeeze=False)
    colours = matplotlib.colormaps["tab10"]
    for r, (ex, im) in enumerate(rows):
        for c, name in enumerate(names):
            ax = axes[r][c]
            ax.imshow(im)
            ax.set_xticks([])
            ax.set_yticks([])
            for cls, x0, y0, x1, y1 in ex.get("ground_truth") or []:
                ax.add_patch(matplotlib.patches.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec="white", lw=1.2,
                                                          ls="--"))
            for x0, y0, x1, y1, score, cls in (ex.get("detections") or {}).get(name) or []:
                colour = colours(int(cls) % 10)
                ax.add_patch(matplotlib.patches.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec=colour, lw=1.5))
                text = class_names[int(cls)] if 0 <= int(cls) < len(class_names) else str(int(cls))
                ax.text(x0, y0, f"{text} {score:.2f}", fontsize=6, color="black", va="bottom",
                        bbox={"facecolor": colour, "alpha": 0.7, "pad": 1, "lw": 0})
            if r == 0:
                ax.set_title(name, fontsize=8)
    return _png(fig)
