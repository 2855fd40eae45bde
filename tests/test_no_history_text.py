"""Product code and the user documents describe what moemesh does, not how it got there.

Scans common/, services/, moemesh/, tools/, deploy/, README.md and docs/ for development-history
markers (work sessions, rounds, issue numbers, commit hashes) and for pointers to files outside the
repository (`../shared`), and names every offending file:line.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED_FOLDERS = ("common", "services", "moemesh", "tools", "deploy", "docs")
SCANNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".md", ".c", ".h", ".sh", ".toml", ".service", ".target", ".conf", ".html", ".txt", ".json"}
MAX_FILE_BYTES = 2_000_000

MARKERS = {
    "work session": re.compile(r"\bsession[ -]?[0-9]", re.IGNORECASE),
    "round": re.compile(r"\bround [0-9]", re.IGNORECASE),
    "issue number": re.compile(r"\bissues? #?[0-9]", re.IGNORECASE),
    "pointer outside the repository": re.compile(r"\.\./shared\b"),
    "commit hash": re.compile(r"\bcommits? (?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", re.IGNORECASE),
}


def scanned_paths(root: Path) -> list[Path]:
    paths = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for folder in SCANNED_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if (path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts
                    and path.stat().st_size <= MAX_FILE_BYTES):
                paths.append(path)
    return paths


def history_findings(paths: list[Path], root: Path) -> list[str]:
    """'file:line: marker: text' for every line carrying a history marker."""
    findings = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            for name, pattern in MARKERS.items():
                if pattern.search(line):
                    findings.append(f"{path.relative_to(root)}:{number}: {name}: {line.strip()[:120]}")
    return findings


def test_markers_catch_what_they_should(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("\n".join([
        '"""Measured in session 3."""',
        "# see ../shared/design/architecture.md",
        "# fixed for issue 9 part 3",
        "# as of commit 6e3ca25",
        "# round 2 of the review",
        "x = round(3.5)  # plain code, no marker",
        "# the session's socket (an OS process session)",
    ]), encoding="utf-8")
    findings = history_findings([sample], tmp_path)
    assert [finding.split(":")[1] for finding in findings] == ["1", "2", "3", "4", "5"]


def test_no_history_text_in_product_code_and_documents():
    paths = scanned_paths(ROOT)
    assert any(path.name == "README.md" for path in paths)
    findings = history_findings(paths, ROOT)
    assert not findings, "development history or outside pointers:\n" + "\n".join(findings)
