"""Report stage: turn a ``qdeploy.results/2`` dict into results.json, report.md, report.html and a
terminal table, each opening with the recommendation.

    from qdeploy.report import mark_degraded, recommend, write_reports, print_table
    mark_degraded(results["variants"], results["model"]["task"])   # before recommending
    results["recommendation"] = recommend(results)
    paths = write_reports(results, "runs/resnet18")   # {"results": Path, "markdown": Path, "html": Path}
    print_table(results)
"""
from qdeploy.report.console import print_lint, print_table
from qdeploy.report.htmlpage import render_html
from qdeploy.report.md import render_markdown
from qdeploy.report.schema import SCHEMA_VERSION, validate_results
from qdeploy.report.verdict import mark_degraded, recommend
from qdeploy.report.writer import write_reports

__all__ = ["SCHEMA_VERSION", "mark_degraded", "print_lint", "print_table", "recommend", "render_html", "render_markdown",
           "validate_results", "write_reports"]
