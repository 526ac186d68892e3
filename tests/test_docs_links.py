"""The docs name real files: every bench/ script, config and docs/results/ file a page cites (in a reproduce command or
as the source of a table) exists, so "how do I reproduce this row" never ends at a missing path. A script removed
once its question was answered is cited with "script removed" and the commit that last had it."""
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "README.md"]
PATH = re.compile(r"(?<![\w/.])((?:docs/)?results/[\w.\-*{},/]+|bench/[\w.\-*{},/]+)")


def cited(text: str):
    for m in PATH.finditer(text):
        ref = m.group(1).rstrip(".,:/")
        after = text[m.end():m.end() + 200]
        if "script removed" in after or "not written yet" in after or re.search(r"[A-Z]{3,}", ref):
            # a removed diagnostic (named with its last commit), a results file a documented command writes before its
            # first row exists, or a placeholder (bench/weights/NAME.pt)
            continue
        yield ref


def exists(ref: str, page: Path) -> bool:
    path = ref if ref.startswith(("bench/", "docs/")) else f"docs/{ref}"
    for alt in re.findall(r"\{([^}]*)\}", path)[:1]:  # heldout_{tv_swin,hf_vit}.yaml: each alternative
        return all(exists(path.replace("{" + alt + "}", a, 1), page) for a in alt.split(","))
    return bool(glob.glob(str(ROOT / path))) if "*" in path else (ROOT / path).exists()


def test_the_check_finds_a_missing_file():
    refs = list(cited("run `python bench/ci/zoo.py` and `bench/nowhere.py`; see docs/results/cpu/cpu_goals.json."))
    assert refs == ["bench/ci/zoo.py", "bench/nowhere.py", "docs/results/cpu/cpu_goals.json"]
    assert [exists(r, PAGES[0]) for r in refs] == [True, False, True]
    assert list(cited("docs/results/gpu/x.json (not written yet: no row has run)")) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cited_path_exists(page):
    missing = sorted({ref for ref in cited(page.read_text()) if not exists(ref, page)})
    assert not missing, f"{page.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_every_results_file_the_code_cites_exists():
    """A measured reason in a comment cites its docs/results file; the file is there."""
    files = [p for folder in ("src", "tests", "bench") for p in (ROOT / folder).rglob("*.py")]
    missing = sorted({f"{p.relative_to(ROOT)}: {ref}" for p in files for ref in cited(p.read_text())
                      if ref.startswith("docs/results/") and not exists(ref, p)})
    assert not missing, missing
