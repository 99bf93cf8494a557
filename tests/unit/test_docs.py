"""The docs: every relative link resolves, CONTRIBUTING.md's worked example is the code, and
the pages are reference, not history (no work item named by its number), and the source
files they name exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_EXCERPT = re.compile(r"<!-- excerpt: (\S+) -->\n```\w*\n(.*?)\n```", re.S)
_CUT = "# ..."


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and headings there are not links)."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slug_matches_github() -> None:
    assert _slug("Serving benchmark over gRPC: `tools/bench_serving.py`") == (
        "serving-benchmark-over-grpc-toolsbench_servingpy"
    )
    assert _slug("PauseGeneration / ContinueGeneration") == "pausegeneration--continuegeneration"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_links_every_docs_page() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_contributing_example_is_the_code() -> None:
    """Each block of the worked example is, piece by piece (cut at ``# ...``), verbatim in
    the file its marker names: renaming, re-signing or rewriting the code fails here."""
    blocks = _EXCERPT.findall((ROOT / "CONTRIBUTING.md").read_text())
    assert len(blocks) >= 7, "the worked example lost its excerpt markers"
    named = {path for path, _ in blocks}
    assert {"protos/common.proto", "sglang_admin/messages/types.py",
            "sglang_admin/client/client.py"} <= named
    for path, body in blocks:
        source = (ROOT / path).read_text()
        pieces = [p.strip("\n") for p in body.split(f"\n{_CUT}\n")]
        for piece in pieces:
            assert piece.strip(), f"an empty piece in the excerpt of {path}"
            assert piece in source, f"CONTRIBUTING.md's excerpt of {path} drifted:\n{piece}"


_HISTORY = re.compile(r"\b([Ii]ssue|[Ss]ession) [0-9]+")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_name_things_by_function_not_by_work_item(page: Path) -> None:
    """A page says what is true now: no "issue N" / "session N" (which work item changed
    what lives in git's history, not in the docs)."""
    hits = [f"{n}: {line.strip()[:80]}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if _HISTORY.search(line)]
    assert not hits, f"{page.relative_to(ROOT)} names work items: {hits}"


# a source path a page names: under sglang_admin/ (with or without the prefix), tests/, tools/
_SOURCE = re.compile(r"(?<![\w/.])((?:sglang_admin/)?(?:scheduler|model|server|client|messages"
                     r"|tests|tools)/[\w/.-]*\w\.(?:py|c|sh))")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_source_files_a_page_names_exist(page: Path) -> None:
    """A page that points at a module points at one that exists: a move or a rename updates
    the pages that name the file."""
    missing = sorted({path for path in _SOURCE.findall(page.read_text())
                      if not (ROOT / path).exists() and not (ROOT / "sglang_admin" / path).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"

