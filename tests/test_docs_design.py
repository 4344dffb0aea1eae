"""Citations of the design notes resolve: every `docs/design/<page>.md, "Section"` anywhere in the repository (code,
tests, configs, benchmarks, docs) names a page that exists and a heading on that page, every Markdown link into
docs/design/ names an existing page and anchor, and nothing cites the one-page notes the pages replaced."""
from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design"
SKIP_DIRS = {".git", "site", "node_modules", "__pycache__", ".pytest_cache", ".cache", "lightning_logs"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".sbatch", ".txt", ".cfg", ".ini", ""}
# docs/design/<page>.md, then maybe a separator and a quoted name, which may wrap onto a `#` comment line.
CITATION = re.compile(r"docs/design/(?P<page>[\w-]+)\.md(?:,?[ \t]*(?:\n[ \t]*(?:#+)?[ \t]*)?\(?"
                      r"(?P<q>\\\"|\"|')(?P<name>(?:(?!(?P=q)|docs/design).){1,100}?)(?P=q))?", re.DOTALL)
LINK = re.compile(r"\]\((?P<path>[\w./-]*design/(?P<page>[\w-]+)\.md|(?P<local>[\w-]+\.md))?(?:#(?P<anchor>[\w-]+))?\)")
# The one-page notes' path, spelt so that this file does not cite it.
OLD = "docs/" + "design.md"


def slug(title: str) -> str:
    """Python-Markdown's toc slugify: the anchor mkdocs gives a heading."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def headings(page: Path) -> set[str]:
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        m = None if fence else re.match(r"#{1,6} (.+?)\s*$", line)
        if m:
            out.add(m.group(1).strip())
    return out


def repository_texts():
    for root, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv")]
        for name in names:
            path = Path(root) / name
            if path.suffix in TEXT_SUFFIXES:
                try:
                    yield path, path.read_text()
                except (UnicodeDecodeError, OSError):
                    continue


def test_every_design_citation_names_an_existing_page_and_a_heading_on_it():
    pages = {p.stem: headings(p) for p in DESIGN.glob("*.md")}
    assert {"index", "update-rule", "schedules", "runtime", "lightning", "checkpoints"} <= set(pages)
    bad, count = [], 0
    for path, text in repository_texts():
        where = path.relative_to(ROOT)
        if OLD in text:
            bad.append(f"{where}: cites {OLD}, which the pages under docs/design/ replaced")
        for m in CITATION.finditer(text):
            count += 1
            page, line = m.group("page"), text[:m.start()].count("\n") + 1
            if page not in pages:
                bad.append(f"{where}:{line}: docs/design/{page}.md does not exist (pages: {sorted(pages)})")
                continue
            if m.group("name") is None or m.group("name").startswith("s "):  # no section, or `page.md's ...`
                continue
            name = re.sub(r"\s*\n\s*#*\s*", " ", m.group("name")).strip()
            if name not in pages[page]:
                bad.append(f"{where}:{line}: {name!r} is no heading of docs/design/{page}.md "
                           f"(headings: {sorted(pages[page])})")
    assert count >= 50, f"only {count} citations found: the pattern no longer matches how the code cites"
    assert not bad, "\n".join(bad)


def test_every_link_into_the_design_pages_names_an_existing_page_and_anchor():
    pages = {p.stem: {slug(h) for h in headings(p)} for p in DESIGN.glob("*.md")}
    bad = []
    for path in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        inside = path.parent == DESIGN
        for m in LINK.finditer(path.read_text()):
            page = m.group("page") or (Path(m.group("local")).stem if inside and m.group("local") else None)
            if page is None and inside and m.group("anchor") and not m.group("path") and not m.group("local"):
                page = path.stem  # a link to an anchor of the same page
            if page is None:
                continue
            if page not in pages:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}: no page design/{page}.md")
            elif m.group("anchor") and m.group("anchor") not in pages[page]:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}: no heading with that anchor on design/{page}.md")
    assert not bad, "\n".join(bad)
