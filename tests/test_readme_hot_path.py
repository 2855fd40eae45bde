"""README's hot-path table names one function per step, and each one exists where the table says.

Every row of the table under "### The hot path, one step" ends with `path.py: Class.method` (or
`path.py: function`); the test parses the file and finds that definition, so a rename or a move
that forgets the README fails here. The steps a user's request goes through must all be there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ("request in", "scheduled", "attention", "layers", "dispatch", "experts", "combine", "sample",
         "stream out")
REFERENCE = re.compile(r"`([\w/]+\.py): ([\w.]+)`")


def _hot_path_rows() -> dict[str, list[tuple[str, str]]]:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### The hot path, one step", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("step", "") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0]] = REFERENCE.findall(cells[2])
    return rows


def _defines(path: Path, dotted: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    for part in dotted.split("."):
        found = [node for node in scope if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.name == part]
        if not found:
            return False
        scope = found[0].body
    return True


def test_every_step_has_one_named_function():
    rows = _hot_path_rows()
    assert set(STEPS) <= set(rows), f"steps missing from the table: {sorted(set(STEPS) - set(rows))}"
    for step in STEPS:
        assert rows[step], f"{step!r}: no `file.py: Name` reference in its function cell"


def test_every_named_function_exists():
    missing = []
    for step, references in _hot_path_rows().items():
        for file_name, dotted in references:
            path = REPO_ROOT / file_name
            if not path.is_file() or not _defines(path, dotted):
                missing.append(f"{step}: {file_name}: {dotted}")
    assert not missing, "README hot-path functions not found:\n" + "\n".join(missing)


def test_the_parser_sees_a_missing_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class A:\n    def b(self):\n        pass\n")
    assert _defines(source, "A.b") and not _defines(source, "A.c") and not _defines(source, "B")
