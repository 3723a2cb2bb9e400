"""List citations of BENCHMARKS.md and DESIGN.md sections whose heading does not exist.

    python -m bench.check_citations [-v]

Comments and docs cite a benchmark by its heading (``BENCHMARKS.md "The CPU forward"``, or a
link ``BENCHMARKS.md#anchor``) and the design by its section number (``DESIGN.md §4.3``). A
quoted citation names a heading when it is the beginning of one (backticks and case ignored), so
a topic may be cited without the date its subsection carries. Also checked: BENCHMARKS.md's own
``"Heading" below/above`` and ``see "Heading"`` references and its ``(#anchor)`` links (GitHub's
anchors). Exit status 1 when something is missing. Standard library only.
"""
from __future__ import annotations

import bisect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUFFIXES = (".py", ".c", ".h", ".md", ".sh")
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__", ".cache", ".whl"}


def headings(path: str) -> list[str]:
    """Markdown headings outside fenced code blocks (a '#' in a bash block is a comment)."""
    found, fenced = [], False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip())
    return found


def normal(text: str) -> str:
    return " ".join(text.replace("`", "").replace("**", "").lower().split())


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")


def flatten(text: str) -> tuple[str, list[int]]:
    """The file as one line (comment markers and indentation dropped), and each line's offset."""
    parts, starts, at = [], [], 0
    for line in text.split("\n"):
        starts.append(at)
        part = line.strip().lstrip("#*/").strip() + " "
        parts.append(part)
        at += len(part)
    return "".join(parts), starts


CITED = re.compile(r'BENCHMARKS\.md`?\]?(?:\(BENCHMARKS\.md)?(#[\w-]+|[\s,(]*((?:"[^"]+"\s*,?\s*)+)|[\s,]+([A-Z]\w*))')
DESIGN = re.compile(r"DESIGN(?:\.md)? §(\d+(?:\.\d+)?)")
SELF_REF = re.compile(r'(?:(?:see|under) "([^"]+)")|(?:"([^"]+)" (?:below|above))')


def main() -> int:
    verbose = "-v" in sys.argv
    bench_headings = headings(os.path.join(ROOT, "BENCHMARKS.md"))
    known = [normal(h) for h in bench_headings]
    anchors = {anchor(h) for h in bench_headings}
    design = {re.match(r"[\d.]*", h).group().rstrip(".") for h in headings(os.path.join(ROOT, "docs", "DESIGN.md"))}

    def names_heading(cited: str) -> bool:
        return any(h.startswith(normal(cited)) for h in known)

    missing = checked = 0

    def report(where: str, what: str, ok: bool) -> None:
        nonlocal missing, checked
        checked += 1
        missing += not ok
        if verbose or not ok:
            print(f"{'ok     ' if ok else 'MISSING'} {where}: {what}")

    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(SUFFIXES) or name == "check_citations.py":  # its own examples
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            flat, starts = flatten(open(path, encoding="utf-8", errors="replace").read())

            def where(offset: int) -> str:
                return f"{rel}:{bisect.bisect_right(starts, offset)}"  # noqa: B023 (used in this loop only)

            for m in CITED.finditer(flat):
                target, quoted, word = m.group(1), m.group(2), m.group(3)
                if target.startswith("#"):
                    report(where(m.start()), f"BENCHMARKS.md{target}", target[1:] in anchors)
                elif quoted:
                    for cited in re.findall(r'"([^"]+)"', quoted):
                        report(where(m.start()), f'BENCHMARKS.md "{cited}"', names_heading(cited))
                elif word:
                    report(where(m.start()), f"BENCHMARKS.md {word}", names_heading(word))
            for m in DESIGN.finditer(flat):
                report(where(m.start()), f"DESIGN.md §{m.group(1)}", m.group(1) in design)
            if rel == "BENCHMARKS.md":
                for m in SELF_REF.finditer(flat):
                    cited = m.group(1) or m.group(2)
                    report(where(m.start()), f'"{cited}"', names_heading(cited))
                for m in re.finditer(r"\]\(#([\w-]+)\)", flat):
                    report(where(m.start()), f"#{m.group(1)}", m.group(1) in anchors)
    print(f"{checked} citations checked, {missing} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
