"""The documentation builds: ``mkdocs build --strict`` over docs/ (a dead link, a missing anchor or a page left out
of the navigation fails), the README's links into docs/ resolve, and the benchmark page is what the results files
give."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: the README is the front door: a screen or two, the rest lives in docs/
README_MAX_LINES = 250


def _readme_links() -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", README.read_text())


def test_mkdocs_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "benchmark-results" / "index.html").exists()


def test_every_page_is_in_the_navigation():
    """mkdocs only reports a page missing from nav, so the test says which."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(path.relative_to(ROOT / "docs").as_posix() for path in (ROOT / "docs").rglob("*.md"))
    assert [page for page in pages if f" {page}" not in nav] == []


def test_readme_links_into_docs_resolve():
    links = _readme_links()
    into_docs = [link for link in links if link.startswith("docs/")]
    assert len(into_docs) >= 10
    assert [link for link in links if "://" not in link and not (ROOT / link).exists()] == []


def test_readme_anchors_into_docs_exist():
    """``docs/models.md#architectures`` names a heading of that page (mkdocs' slug: lower case, spaces to
    dashes, punctuation dropped)."""
    missing = []
    for page, anchor in re.findall(r"\]\((docs/[^)#\s]+)#([^)\s]+)\)", README.read_text()):
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), flags=re.MULTILINE)
        slugs = {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower()) for heading in headings}
        if anchor not in slugs:
            missing.append(f"{page}#{anchor}")
    assert missing == []


def test_readme_fits_on_a_few_screens_and_its_first_run_stops():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    headline = re.search(r"```bash\n(pip install -e \. && llmfw run .*)\n```", text)
    assert headline, "the README's first command installs and runs"
    assert re.search(r" -n \d+$", headline.group(1)), "the headline run says how many tokens to generate"
    assert "bash scripts/test.sh" in text


def test_benchmark_page_is_generated_from_the_results():
    result = subprocess.run([sys.executable, "benchmarks/make_docs.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 0, result.stderr
    page = (ROOT / "docs" / "benchmark-results.md").read_text()
    assert list((ROOT / "benchmarks" / "results").glob("*.json")), "one fresh run is committed"
    assert "- date: " in page and "- machine: " in page
