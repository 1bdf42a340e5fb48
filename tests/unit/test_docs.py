"""The docs: the generated pages are what their sources render (like the CRD in test_crd.py), the figures are drawn
by `make docs`, the site builds with `mkdocs build --strict`, and the README stays short, with a quick start of
exactly two commands and links that resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import docs_gen

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LIMIT = 12 * 1024
LINE_LIMIT = 120
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", docs_gen.GENERATED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_generated_pages_are_fresh(page: Path) -> None:
    assert page.exists(), f"{page.relative_to(ROOT)} is missing: run `make docs`"
    assert page.read_text() == docs_gen.render(page), f"{page.relative_to(ROOT)} is stale: run `make docs`"


def test_every_results_file_is_rendered_on_a_page() -> None:
    results = {p.stem for p in (ROOT / "bench" / "results").glob("*.json")}
    assert results == set(docs_gen.BENCHES), "a results file without a table (or a table without its file)"
    text = "".join(p.read_text() for p in docs_gen.REGION_PAGES)
    for name in results:
        assert f"`bench/results/{name}.json`" in text, f"bench/results/{name}.json has no table on the docs pages"


def test_every_generated_region_is_on_a_page_once() -> None:
    found = [name for p in docs_gen.REGION_PAGES for name in docs_gen.regions_in(p.read_text())]
    assert sorted(found) == sorted(docs_gen.REGIONS)


def test_the_figures_are_committed_and_drawn_by_make_docs(tmp_path: Path) -> None:
    pages = "".join(p.read_text() for p in DOCS.rglob("*.md"))
    for name, draw in docs_gen.FIGURE_FILES.items():
        assert (docs_gen.FIGURES / name).exists(), f"docs/figures/{name} is missing: run `make docs`"
        assert f"figures/{name}" in pages, f"no page shows docs/figures/{name}"
        draw(tmp_path / name)
        assert "<svg" in (tmp_path / name).read_text()[:2000]
    recipe = (ROOT / "Makefile").read_text().split("\ndocs:", 1)[1].split("\n\n", 1)[0]
    assert "bench/docs_gen.py" in recipe and "mkdocs build --strict" in recipe


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """A broken link or anchor, or a page missing from the navigation, is a warning; strict mode fails on it."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.exists(), "mkdocs is missing: pip install -e '.[dev]'"
    out = subprocess.run([str(mkdocs), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    assert "WARNING" not in log, log
    assert (tmp_path / "site" / "index.html").exists()


def test_the_readme_is_at_most_12_kb() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move what it grew by into docs/"


def test_the_quick_start_is_make_demo_and_make_test() -> None:
    section = README.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S)
    assert block is not None, "the quick start has no code block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]


def _anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as mkdocs and as GitHub make them (they differ on a few characters)."""
    out: set[str] = set()
    fence = False
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        m = None if fence else re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            out.add(docs_gen._anchor(m.group(1)))
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return broken


def test_the_readme_links_resolve() -> None:
    assert not _broken_links(README)
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(README.read_text())}
    assert DOCS / "getting-started.md" in linked and DOCS / "overview.svg" in linked


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(DOCS)))
def test_the_docs_links_resolve(page: Path) -> None:
    """The quick check of what `mkdocs build --strict` checks too (that one is slow)."""
    assert not _broken_links(page)


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_prose_lines_are_short_and_name_no_machine_paths(page: Path) -> None:
    fence, long = False, []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence ^= line.startswith("```")
        if not fence and not line.startswith(("|", "<!--", "```")) and len(line) > LINE_LIMIT:
            long.append(number)
    assert not long, f"lines over {LINE_LIMIT} characters outside tables and code: {long}"
    assert not re.search(r"(?<![\w.])/(work|tmp|root|home)/", page.read_text()), "a path of this machine"
