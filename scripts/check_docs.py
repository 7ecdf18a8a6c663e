"""Check that every link and every cited file in README.md and docs/*.md exists.

Checked, per page: markdown links and images (relative to the page; ``#anchors`` against the
headings of the target page, slugged as GitHub does), repository paths anywhere in the text
(``benchmarks/…``, ``docs/…``, ``src/…``, ``tests/…``, ``scripts/…``, ``models/…``; relative to the
repository root, commands included), and results files named alone in backticks
(``perf_full.json``: somewhere under ``benchmarks/results/``); and that every file and run directory
in ``benchmarks/results/`` is named by one of the pages. Prints one line per problem and exits 1 if any.

    python scripts/check_docs.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:benchmarks|docs|src|tests|scripts|models)/[\w./*{}=,+-]*[\w/])")
# paths that name what a command writes or reads at run time, not committed files
RUNTIME = ("models/heads/", "benchmarks/results/serve.json")
BARE_FILE = re.compile(r"`([\w.+-]+\.(?:json|png|csv))`")  # a results file named without its folder


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.MULTILINE)}


def check(page: Path) -> list[str]:
    problems = []
    text = page.read_text(encoding="utf-8")
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.relative_to(ROOT)}: link {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{page.relative_to(ROOT)}: link {target}: no heading #{anchor}")
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if path.startswith(RUNTIME) or "*" in path or "{" in path:
            continue
        if not (ROOT / path).exists():
            problems.append(f"{page.relative_to(ROOT)}: path {path}: no such file")
    known = {p.name for p in (ROOT / "benchmarks" / "results").rglob("*")} | {p.name for p in page.parent.iterdir()}
    for m in BARE_FILE.finditer(text):
        if m.group(1) not in known:
            problems.append(f"{page.relative_to(ROOT)}: file {m.group(1)}: not in benchmarks/results/")
    return problems


def main() -> int:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for page in pages for p in check(page)]
    # every results file or run directory is cited by a page (a plot next to its JSON counts as cited
    # where the page names the JSON and its plot)
    cited = "\n".join(page.read_text(encoding="utf-8") for page in pages)
    results = ROOT / "benchmarks" / "results"
    entries = [p for p in results.iterdir() if p.name != "bench"] + list((results / "bench").iterdir())
    for entry in sorted(entries):
        if entry.name not in cited:
            problems.append(f"{entry.relative_to(ROOT)}: cited by no page")
    for p in problems:
        print(p)
    print(f"{len(pages)} pages, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
