"""Every relative link in the project's Markdown (README, docs/, bench/ and the package's own) resolves inside the
repository: the file exists, and a `#fragment` names a heading of the target as GitHub spells its anchors."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/**/*.md"),
                *ROOT.glob("omnijax/**/*.md")})
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), images excluded
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped (hyphens and underscores
    kept), spaces to hyphens; a repeated heading gets `-1`, `-2`, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    problems = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto: ...
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)} -> {target}"
        if not dest.is_relative_to(ROOT) or not dest.exists():
            problems.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where}: no heading with that anchor")
    return problems


def test_the_anchor_rule_and_the_link_finder():
    assert anchors("# A\n## Replicas (`--replicas N`, Ray Serve)\n```\n# not a heading\n```\n## A\n") == {
        "a", "replicas---replicas-n-ray-serve", "a-1"}
    assert LINK.findall("see [x](docs/a.md#b) and ![img](p.png) and [y](https://e.org)") == ["docs/a.md#b",
                                                                                           "https://e.org"]


def test_every_relative_link_resolves():
    assert ROOT / "README.md" in FILES and len(FILES) > 5
    problems = [p for path in FILES for p in broken_links(path)]
    assert not problems, "\n".join(problems)
