"""Every benchmark report or log the README and the docs name is committed under ``benchmarks/results/`` (README
numbers come from committed reports)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A report's file name: words, a date, an optional suffix. Names written as patterns (`<bench>_<commit>_...`) are
# cut at the `<...>`, which leaves a fragment starting with "_": those are not names.
NAME = re.compile(r"[A-Za-z0-9_.\-]+_20\d\d-\d\d-\d\d[A-Za-z0-9_\-]*\.(?:md|json|log|txt)")


def _cited(doc: Path) -> set[str]:
    return {name for name in NAME.findall(doc.read_text()) if not name.startswith("_")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_report_named_is_committed(doc):
    committed = {p.name for p in RESULTS.rglob("*") if p.is_file()}
    cited = _cited(doc)
    missing = sorted(cited - committed)
    assert not missing, f"{doc.relative_to(ROOT)} names reports not under benchmarks/results/: {missing}"


def test_the_readme_cites_reports():
    assert len(_cited(ROOT / "README.md")) > 20
