"""Write docs/bench/README.md: each result folder under docs/bench, the docs (and their sections) that cite it.

`python scripts/bench_index.py` rewrites the index; `--check` exits 1 when it is stale or a folder is cited by no
document (tests/unit/test_docs.py runs the check). A folder no document cites goes: git history keeps it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
INDEX = BENCH / "README.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def citations(folder: str) -> list[str]:
    """`DOC.md § section` for every section of a document that names `folder` as a path (`bench/FOLDER`) or in
    backquotes (`` `FOLDER` ``; a folder named by a plain word, like `eagle`, only as a path)."""
    name = re.escape(folder)
    word = re.fullmatch(r"[a-z]+", folder) is not None  # `eagle`, `typical`: only as a path
    pattern = re.compile(rf"bench/{name}(?![\w-])" + ("" if word else rf"|`{name}`"))
    found: list[str] = []
    for doc in DOCS:
        section, fenced = "", False
        for line in doc.read_text(encoding="utf-8").splitlines():
            if line.startswith("```"):
                fenced = not fenced
            if line.startswith("#") and not fenced:
                section = line.lstrip("#").strip()
            elif pattern.search(line):
                where = f"{doc.relative_to(ROOT)} § {section}" if section else str(doc.relative_to(ROOT))
                if where not in found:
                    found.append(where)
    return found


def index_text() -> tuple[str, list[str]]:
    """The index, and the folders no document cites."""
    lines = ["# Result folders", "",
             "Raw results behind the figures in the docs: each folder, and the documents and sections that cite it. "
             "Written by `python scripts/bench_index.py`; a folder no document cites is removed (git history keeps "
             "it).", "", "| folder | cited in |", "| --- | --- |"]
    uncited = []
    for folder in sorted(p.name for p in BENCH.iterdir() if p.is_dir()):
        cited = citations(folder)
        if not cited:
            uncited.append(folder)
        lines.append(f"| [`{folder}`]({folder}/) | {'<br>'.join(cited) or '(nothing)'} |")
    return "\n".join(lines) + "\n", uncited


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the index is stale or a folder is uncited")
    args = parser.parse_args(argv)
    text, uncited = index_text()
    if args.check:
        stale = not INDEX.is_file() or INDEX.read_text(encoding="utf-8") != text
        for folder in uncited:
            print(f"docs/bench/{folder}: cited by no document", file=sys.stderr)
        if stale:
            print(f"{INDEX.relative_to(ROOT)} is stale: python scripts/bench_index.py", file=sys.stderr)
        return int(stale or bool(uncited))
    INDEX.write_text(text, encoding="utf-8")
    for folder in uncited:
        print(f"docs/bench/{folder}: cited by no document", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
