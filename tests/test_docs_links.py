"""The repository stands alone: code and docs cite docs/design/ and nothing outside the repo.

Every ``docs/design/<page>.md#<anchor>`` cited anywhere, and every relative Markdown link in
docs/ and README.md, must resolve to an existing page and to an ``<a id>`` or heading anchor in
it. No text may cite numbered sections (the section sign), spec files that are not in the
repository, or paths beside the checkout.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".pyi", ".c", ".cc", ".cpp", ".cu", ".h", ".hpp", ".md", ".toml", ".txt"}
SUFFIXES |= {".sh", ".cfg", ".ini", ".yaml", ".yml", ".json"}
SKIP_DIRS = {"build", "dist", "_skbuild", "__pycache__", "node_modules", "bench-results"}
SKIP_DIRS |= {"lmcache-data"}

# Each pattern names a reference to something outside the repository.
OUTSIDE = {
    "section sign (cite docs/design/<page>.md#<anchor> instead)": re.compile("\u00a7"),
    "path beside the checkout": re.compile(r"\.\./shared|/work/|shared/(?:seeds|spec)\b"),
    "seed document": re.compile(r"\bseeds/|\bseed \d{3}\b|\"shared\" / \"seeds\""),
    "spec file outside the repo": re.compile(
        r"\bspec/|\bDESIGN\.md|(?<![\w/-])(?<!\]\()(?:platform|protocol|storage|connector)\.md\b"
    ),
    "numbered section of a spec outside the repo": re.compile(
        r"\b(?:connector |storage |protocol |platform )?spec (?:sections? )?\d|"
        r"\b(?:connector|storage|protocol|platform) spec\b|checklist of section"
    ),
}
DESIGN_REF = re.compile(r"docs/design/([\w-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([\w-]+))?\)")


def text_files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIP_DIRS and not d.endswith(".egg-info")
        ]
        for name in files:
            path = Path(root, name)
            if path.suffix in SUFFIXES and path != Path(__file__).resolve():
                out.append(path)
    return sorted(out)


def heading_slug(title: str) -> str:
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    text = page.read_text()
    ids = set(re.findall(r'<a id="([\w-]+)"', text))
    ids |= {heading_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return frozenset(ids)


def test_no_reference_outside_the_repository():
    found = []
    for path in text_files():
        rel = path.relative_to(REPO)
        in_design = rel.parts[:2] == ("docs", "design")
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for what, pattern in OUTSIDE.items():
                for m in pattern.finditer(line):
                    if in_design and (REPO / "docs" / "design" / m.group(0)).is_file():
                        continue  # docs/design's pages name each other by file name
                    found.append(f"{rel}:{lineno}: {what}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_every_design_reference_resolves():
    broken = []
    cited = 0
    for path in text_files():
        rel = path.relative_to(REPO)
        text = path.read_text(errors="replace")
        for m in DESIGN_REF.finditer(text):
            cited += 1
            page = REPO / "docs" / "design" / m.group(1)
            if not page.is_file():
                broken.append(f"{rel}: {m.group(0)}: no page {m.group(1)}")
            elif m.group(2) and m.group(2) not in anchors(page):
                broken.append(f"{rel}: {m.group(0)}: no anchor #{m.group(2)}")
    assert cited > 100, f"only {cited} docs/design references found: is the scan broken?"
    assert not broken, "\n".join(broken)


def test_markdown_links_in_docs_resolve():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for m in MD_LINK.finditer(page.read_text()):
            target, anchor = m.group(1), m.group(2)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: outside links are not files
            dest = (page.parent / target).resolve() if target else page
            rel = page.relative_to(REPO)
            if not dest.exists():
                broken.append(f"{rel}: ({target}) does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{rel}: ({target}#{anchor}) has no such anchor")
    assert not broken, "\n".join(broken)
