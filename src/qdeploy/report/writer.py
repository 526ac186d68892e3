"""Write results.json, report.md and report.html into one folder, each file atomically."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from qdeploy.report.htmlpage import render_html
from qdeploy.report.md import render_markdown
from qdeploy.report.schema import validate_results
from qdeploy.utils import atomic

FILES = {"results": "results.json", "markdown": "report.md", "html": "report.html"}


def write_reports(results: Mapping, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Validate ``results``, then write them and both reports into ``out_dir``.

    Returns ``{"results": .../results.json, "markdown": .../report.md, "html": .../report.html}``.
    Invalid results raise ``ValueError`` before anything is written. results.json goes first, so the
    measurements survive even if a report fails to render; a report whose rendering fails is not
    written at all, and any older copy of it is removed since it would describe other results.
    """
    data = validate_results(results)
    out = Path(out_dir)
    paths = {"results": atomic.write_json(out / FILES["results"], data)}
    # Looked up at call time (module globals), so tests can inject a failing renderer.
    for key, render in (("markdown", render_markdown), ("html", render_html)):
        path = out / FILES[key]
        try:
            text = render(data)
        except Exception:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise
        paths[key] = atomic.write_text(path, text)
    return paths
