"""Report stage: turn a ``qdeploy.results/1`` dict into results.json, report.md, report.html and a
terminal table.

    from qdeploy.report import write_reports, print_table
    paths = write_reports(results, "runs/resnet18")   # {"results": Path, "markdown": Path, "html": Path}
    print_table(results)
"""
from qdeploy.report.console import print_table
from qdeploy.report.htmlpage import render_html
from qdeploy.report.md import render_markdown
from qdeploy.report.schema import SCHEMA_VERSION, validate_results
from qdeploy.report.writer import write_reports

__all__ = ["SCHEMA_VERSION", "print_table", "render_html", "render_markdown", "validate_results", "write_reports"]
