"""Relative links and #anchors in the project's Markdown resolve (README.md, bench/README.md, bench/RESULTS.md,
bench/history/*.md).

A link resolves when its file exists (relative to the linking file) and, if it names a fragment, the fragment is a
heading's anchor in that file by GitHub's rule: the heading's rendered text lowercased, every character other than
a word character, a hyphen or a space dropped, spaces turned into hyphens; a repeated anchor gets -1, -2, ... in
order. Headings and links inside fenced code blocks and code spans do not count (an unclosed fence swallows every
heading after it, as GitHub renders it). Links to other sites (http:, https:, mailto:) are not checked.

Run as a script to list the broken links: ``python tests/test_docs_links.py``.
"""
from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "bench/README.md", "bench/RESULTS.md"]

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files(root: str = ROOT) -> list[str]:
    """The Markdown files checked, relative to ``root``."""
    hist = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "bench", "history", "*.md")))
    return [d for d in DOCS if os.path.exists(os.path.join(root, d))] + hist


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks (CommonMark fences: a closing fence has the
    opening's character, at least its length and no info string)."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence = m.group(1)
                continue
            yield n, line
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = None


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's source text (before the -N suffix of a repeat)."""
    text = _LINK.sub(lambda m: m.group(1), heading)  # a link in a heading renders as its text
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text, repeats suffixed -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        if base in seen:
            seen[base] += 1
            out.add(f"{base}-{seen[base]}")
        else:
            seen[base] = 0
            out.add(base)
    return out


def links(text: str):
    """(line number, target) of every inline link and image outside code."""
    for n, line in prose_lines(text):
        line = _CODE_SPAN.sub("", line)
        for m in _LINK.finditer(line):
            target = m.group(2)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            yield n, target


def broken_links(root: str = ROOT, files: list[str] | None = None) -> list[str]:
    """'file:line: target (why)' for every relative link or anchor among ``files`` that does not resolve."""
    cache: dict[str, set[str]] = {}

    def anchors_of(path: str) -> set[str]:
        if path not in cache:
            with open(path, encoding="utf-8") as f:
                cache[path] = anchors(f.read())
        return cache[path]

    bad = []
    for rel in files if files is not None else doc_files(root):
        src = os.path.join(root, rel)
        with open(src, encoding="utf-8") as f:
            text = f.read()
        for n, target in links(text):
            if _EXTERNAL.match(target):
                continue
            path, _, frag = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(src), path)) if path else src
            if not os.path.exists(dest):
                bad.append(f"{rel}:{n}: {target} (no such file)")
            elif frag and dest.endswith(".md") and frag not in anchors_of(dest):
                bad.append(f"{rel}:{n}: {target} (no such heading)")
    return bad


def test_anchor_rule():
    # GitHub's rule, including repeats and the characters it drops
    assert slug("Huge-page advice (issue 37): kept on, with `DBSP_HUGEPAGES=0` to turn it off") == \
        "huge-page-advice-issue-37-kept-on-with-dbsp_hugepages0-to-turn-it-off"
    assert slug("The step plan at W > 1 (issue 37 item 2, second slice)") == \
        "the-step-plan-at-w--1-issue-37-item-2-second-slice"
    assert slug("See [the log](history/x.md)") == "see-the-log"
    assert anchors("# A\n## A\n```\n# A\n```\n### A\n") == {"a", "a-1", "a-2"}
    # an unclosed fence hides every heading after it
    assert anchors("# A\n```bash\nx\n# B\n") == {"a"}


def test_checker_catches_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [ok](b.md#x-1) [bad](#two-word)\n"
                                   "[bad](b.md#y) [bad](c.md) `[code](nowhere.md)`\n")
    (tmp_path / "b.md").write_text("## X\n## X\n")
    bad = broken_links(str(tmp_path), ["a.md"])
    assert bad == ["a.md:5: #two-word (no such heading)", "a.md:6: b.md#y (no such heading)",
                   "a.md:6: c.md (no such file)"]


@pytest.mark.parametrize("doc", doc_files())
def test_links_resolve(doc):
    assert broken_links(files=[doc]) == []


if __name__ == "__main__":
    for line in broken_links():
        print(line)
