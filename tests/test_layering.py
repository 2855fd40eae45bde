"""The import graph is layered: each package imports only the layers docs/layers.md allows.

Every `.py` file under moemesh/, common/, services/, bench/ and tools/ is parsed (no import is
executed) and every absolute import of a `moemesh...` module is collected, imports inside
functions included. The rules:

  moemesh.cli, moemesh.commands   may import anything except moemesh.bench and tests
  moemesh.bench                   common, services, tools, bench (never cli or commands)
  moemesh.services.<svc>          common and its own service
  moemesh.common                  common only, and its subpackages form no cycle
  moemesh.tools                   common, tools

No file imports the bare folder names (`common`, `services`, `bench`, `tools`) as top-level
packages, and no product file (common/, services/, moemesh/) imports `moemesh.bench` or `tests`.
Each failure lists every offending import as `file:line src -> dst`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED_FOLDERS = ("moemesh", "common", "services", "bench", "tools")
PRODUCT_FOLDERS = ("moemesh", "common", "services")
OLD_ROOTS = ("common", "services", "bench", "tools")


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen from the file holding it."""

    path: str  # repository-relative file path
    line: int
    src: str  # dotted module name of the importing file
    dst: str  # dotted module name imported (a submodule where `from pkg import sub` names one)

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.src} -> {self.dst}"


def module_name(path: Path) -> str:
    """Dotted import name of a source file: common/model/moe.py -> moemesh.common.model.moe."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[0] != "moemesh":
        parts = ["moemesh", *parts]
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for folder in SCANNED_FOLDERS for p in (REPO_ROOT / folder).rglob("*.py"))


def known_modules(files: list[Path]) -> set[str]:
    return {module_name(p) for p in files}


def imported_names(tree: ast.AST, modules: set[str]):
    """(line, dotted name) of every absolute import in a tree, nested ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                yield node.lineno, submodule if submodule in modules else node.module


def collect_imports() -> list[Import]:
    files = source_files()
    modules = known_modules(files)
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(REPO_ROOT).as_posix()
        src = module_name(path)
        for line, dst in imported_names(tree, modules):
            found.append(Import(rel, line, src, dst))
    return sorted(set(found), key=lambda i: (i.path, i.line, i.dst))


IMPORTS = collect_imports()


def layer_of(module: str) -> tuple[str, ...]:
    """('top',), ('common',), ('bench',), ('tools',) or ('services', <service>)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("cli", "commands"):
        return ("top",)
    if parts[1] == "services":
        return ("services", parts[2] if len(parts) > 2 else "")
    return (parts[1],)


def layer_allows(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    if src[0] == "top":
        return dst[0] != "bench"
    if src[0] == "bench":
        return dst[0] in ("common", "services", "bench", "tools")
    if src[0] == "services":
        return dst[0] == "common" or dst == src
    if src[0] == "common":
        return dst[0] == "common"
    if src[0] == "tools":
        return dst[0] in ("common", "tools")
    return False


def moemesh_imports(imports: list[Import]) -> list[Import]:
    return [i for i in imports if i.dst == "moemesh" or i.dst.startswith("moemesh.")]


def report(violations: list[Import], what: str) -> str:
    lines = sorted(str(v) for v in violations)
    text = "\n".join(lines)
    print(text)
    return f"{len(lines)} {what}:\n{text}"


def test_the_scan_sees_the_packages():
    """A broken scan (no files, no imports) would pass every rule below."""
    sources = {i.src.split(".")[1] for i in IMPORTS if i.src.count(".") >= 1}
    assert {"commands", "common", "services", "bench"} <= sources
    assert len(moemesh_imports(IMPORTS)) > 500


def test_the_rules_refuse_what_the_layers_forbid():
    def allows(src: str, dst: str) -> bool:
        return layer_allows(layer_of(src), layer_of(dst))

    assert allows("moemesh.services.router.app", "moemesh.services.router.engine")
    assert allows("moemesh.services.router.app", "moemesh.common.wire.messages")
    assert allows("moemesh.bench.serve", "moemesh.services.router.main")
    assert allows("moemesh.commands.serve", "moemesh.services.router.main")
    assert not allows("moemesh.services.router.app", "moemesh.services.draft.worker")
    assert not allows("moemesh.services.attention.main", "moemesh.commands.serve_config")
    assert not allows("moemesh.common.model.dspark", "moemesh.services.attention.sampling.rng")
    assert not allows("moemesh.bench.soak", "moemesh.commands.serve_config")
    assert not allows("moemesh.tools.corpus.build", "moemesh.services.router.app")
    assert not allows("moemesh.commands.bench", "moemesh.bench.serve")


def test_nested_imports_and_imported_submodules_are_seen():
    source = "def f():\n    from moemesh.common import sampling_params\n    import moemesh.services.router.app\n"
    names = list(imported_names(ast.parse(source), {"moemesh.common.sampling_params"}))
    assert names == [(2, "moemesh.common.sampling_params"), (3, "moemesh.services.router.app")]


def test_each_layer_imports_only_the_layers_below_it():
    violations = [i for i in moemesh_imports(IMPORTS)
                  if not layer_allows(layer_of(i.src), layer_of(i.dst))]
    assert not violations, report(violations, "imports across layers")


def test_no_import_uses_the_old_top_level_names():
    violations = [i for i in IMPORTS if i.dst.split(".")[0] in OLD_ROOTS]
    assert not violations, report(violations, "imports of old top-level names")


def test_product_code_imports_neither_bench_nor_tests():
    def is_harness(dst: str) -> bool:
        return dst.split(".")[0] == "tests" or dst == "moemesh.bench" or dst.startswith("moemesh.bench.")

    violations = [i for i in IMPORTS
                  if i.path.split("/")[0] in PRODUCT_FOLDERS and is_harness(i.dst)]
    assert not violations, report(violations, "product imports of bench or tests")


def common_node(module: str) -> str:
    """The cycle-graph node of a common module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "common"


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of a small directed graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_strongly_connected_finds_a_cycle_and_ignores_a_chain():
    assert {frozenset(c) for c in strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}})} == {
        frozenset({"a", "b", "c"})}
    assert all(len(c) == 1 for c in strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}))


def shortest_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """Nodes of a shortest cycle inside one strongly connected component, first node repeated last."""
    best: list[str] = []
    for start in sorted(component):
        paths = {start: [start]}
        frontier = [start]
        while frontier:
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node] & component):
                    if nxt == start and (not best or len(paths[node]) < len(best) - 1):
                        best = paths[node] + [start]
                    if nxt not in paths:
                        paths[nxt] = paths[node] + [nxt]
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
    return best


def test_common_subpackages_form_no_cycle():
    edges: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for i in moemesh_imports(IMPORTS):
        if layer_of(i.src) == layer_of(i.dst) == ("common",):
            a, b = common_node(i.src), common_node(i.dst)
            if a != b:
                edges[a, b].append(i)
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    cycles = [c for c in strongly_connected(graph) if len(c) > 1]
    message = []
    for component in cycles:
        message.append("cycle " + " -> ".join(shortest_cycle(graph, component))
                       + "; every import between " + ", ".join(sorted(component)) + ":")
        for (a, b), found in sorted(edges.items()):
            if a in component and b in component:
                message.append(f"  {a} -> {b}")
                message += [f"    {i}" for i in found]
    print("\n".join(message))
    assert not cycles, "\n".join(message)

