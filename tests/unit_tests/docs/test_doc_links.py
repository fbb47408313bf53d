"""Every relative link in the committed Markdown (README, docs/, the leaderboard's readings as
the board includes them) leads to a file that exists, and a link to a heading of a Markdown
file to a heading it has (GitHub's anchors): a moved page or a renamed section breaks a
test, not a reader's click."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def markdown_files():
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "*.md"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [f for f in out.stdout.split() if not f.startswith("tests/")]


def anchors(path: str) -> set:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    a repeated heading numbered -1, -2..."""
    seen, out = {}, set()
    with open(path, encoding="utf-8") as f:
        text = FENCE.sub("", f.read())
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: str, root: str = ROOT) -> list:
    with open(os.path.join(root, page), encoding="utf-8") as f:
        text = FENCE.sub("", f.read())
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        full = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path else os.path.join(root, page)
        if not os.path.exists(full):
            broken.append(f"{page}: {target} (no such file)")
        elif fragment and full.endswith(".md") and fragment not in anchors(full):
            broken.append(f"{page}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    pages = markdown_files()
    assert "README.md" in pages and "docs/leaderboard.md" in pages
    broken = [b for page in pages for b in broken_links(page)]
    assert not broken, "\n".join(broken)


def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Some section: the first\n")
    page.write_text("[ok](other.md#some-section-the-first) [gone](missing.md) [no heading](other.md#nope)\n"
                    "```\n[in a fence](ignored.md)\n```\n[web](https://example.org/x.md)\n")
    assert broken_links("docs/page.md", str(tmp_path)) == ["docs/page.md: missing.md (no such file)",
                                            "docs/page.md: other.md#nope (no such heading)"]


def test_docs_hold_only_pages_and_figures():
    """Measured data (cells, runs, raw JSON, logs) is kept under results/, at the same path as
    the page it belongs to (issue 51): docs/ holds prose and the figures it shows."""
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "docs"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = out.stdout.split()
    assert "docs/leaderboard.md" in files
    data = [f for f in files if not f.endswith((".md", ".png"))]
    assert not data, "measured data belongs under results/ (the same path): " + ", ".join(data[:10])
