"""The docs are the reference, so their links and section citations must hold.

* every relative Markdown link in the repository's ``*.md`` files names an existing
  file, and its ``#anchor`` (if any) an existing heading of that file;
* nothing points at the original specification files outside the repository;
* every citation like ``docs/statistics.md §5`` (in code, comments, docs or
  templates) names an existing doc that has a section numbered 5.

The repository is walked with Python (not ``git``), so the test behaves the same in
a clean CI checkout and in a working tree.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

#: Directories that are tools' caches or build output, not the project's text.
SKIP_DIRS = {".git", ".venv", "venv", ".pytest_cache", ".ruff_cache", ".hypothesis", ".mypy_cache",
             "__pycache__", "build", "dist", "runs", "node_modules", ".tox", ".eggs"}
TEXT_SUFFIXES = {".md", ".py", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".html", ".j2", ".jinja",
                 ".json", ".sh", ".rst", ""}

# Built from parts so that this file does not match its own patterns.
_SPEC_NAMES = "|".join(["METH" + "OD", "SCH" + "EMA", "SERV" + "ICE"])
FORBIDDEN = re.compile(rf"\b(?:{_SPEC_NAMES})\.md\b|\.\./shared\b|/work/" + "shared")

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CITATION = re.compile(
    r"(?:docs/)?(?P<doc>[A-Za-z_][\w-]*)\.md\s*§\s*(?P<first>\d+(?:\.\d+)*)"
    r"(?P<more>(?:\s*(?:[-–]|,|and)\s*§?\s*\d+(?:\.\d+)*)*)"
)
NUMBERED_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)[.)]?\s")


def _files(suffixes: set[str]) -> list[Path]:
    out = []
    stack = [ROOT]
    while stack:
        d = stack.pop()
        for p in sorted(d.iterdir()):
            if p.is_dir():
                if p.name not in SKIP_DIRS and not p.name.endswith(".egg-info"):
                    stack.append(p)
            elif p.suffix in suffixes and (p.suffix or p.name in {"Makefile", "Dockerfile"}):
                out.append(p)
    return sorted(out)


def _strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)       # link text only
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


@cache
def _headings(path: Path) -> tuple[list[str], set[str]]:
    """(heading texts, anchors) of a Markdown file, headings in code blocks excluded."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    heads = [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M)]
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for h in heads:
        base = _slug(h)
        n = seen.get(base, 0)
        anchors.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return heads, anchors


def _sections(path: Path) -> set[str]:
    """Section numbers of a doc: "3" for "## 3. Estimands", "3.1" for "### 3.1 ..."."""
    heads, _ = _headings(path)
    out = set()
    for h in heads:
        m = NUMBERED_HEADING.match("# " + h)
        if m:
            out.add(m.group(1))
    return out


def _cited(first: str, more: str) -> list[str]:
    """Section numbers in '§2', '§2-3, §9', '§1, §2', '§6–7'."""
    nums = [first]
    for sep, num in re.findall(r"([-–]|,|and)\s*§?\s*(\d+(?:\.\d+)*)", more):
        if sep in "-–" and nums[-1].isdigit() and num.isdigit():
            nums += [str(i) for i in range(int(nums[-1]) + 1, int(num) + 1)]
        else:
            nums.append(num)
    return nums


MARKDOWN = _files({".md"})
TEXT = _files(TEXT_SUFFIXES)


def test_the_walk_finds_the_docs() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in MARKDOWN}
    assert {"README.md", "docs/index.md", "docs/statistics.md", "docs/contract.md", "docs/service.md"} <= names
    assert Path(__file__).resolve() in TEXT


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md: Path) -> None:
    problems = []
    for target in LINK.findall(_strip_code(md.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):      # http:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (md.parent / path_part).resolve() if path_part else md
        if not dest.exists():
            problems.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor.lower() not in _headings(dest)[1]:
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not problems, f"{md.relative_to(ROOT)}: " + "; ".join(problems)


def test_no_pointer_to_the_outside_specification() -> None:
    hits = []
    for path in TEXT:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "cite docs/statistics.md, docs/contract.md or docs/service.md instead:\n" + "\n".join(hits)


def test_section_citations_point_at_existing_sections() -> None:
    problems = []
    count = 0
    for path in TEXT:
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            count += 1
            line = text.count("\n", 0, m.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}"
            doc = DOCS / f"{m['doc']}.md"
            if not doc.exists():
                problems.append(f"{where}: docs/{doc.name} does not exist")
                continue
            missing = [n for n in _cited(m["first"], m["more"]) if n not in _sections(doc)]
            if missing:
                problems.append(f"{where}: docs/{doc.name} has no section {', '.join('§' + n for n in missing)}")
    assert count > 20, f"only {count} citations found: the pattern is probably broken"
    assert not problems, "\n".join(problems)


def test_citation_parsing() -> None:
    found = [(m["doc"], _cited(m["first"], m["more"])) for m in CITATION.finditer(
        "see docs/statistics.md §2-3, §9 and contract.md §1; statistics.md §6–7 (docs/service.md)")]
    assert found == [("statistics", ["2", "3", "9"]), ("contract", ["1"]), ("statistics", ["6", "7"])]
    assert _slug("## 3. On the wire".lstrip("# ")) == "3-on-the-wire"
    assert _slug("`POST /v1/traces`") == "post-v1traces"
