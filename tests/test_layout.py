"""The package's shape, measured from the source (docs/architecture.md): no import
circles between its modules (imports inside functions count), at most 12 modules at the
top level, no module over 500 lines and no class over 450."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "realtime_app"
MAX_TOP_LEVEL = 12
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 450


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    return {
        module_name(path): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if "migrations" not in path.parts and "__pycache__" not in path.parts
    }


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its body. ``from a import
    b`` counts ``a.b`` when that is a module, else ``a``; a package's ``__init__`` counts
    as the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package to the package's modules it imports."""
    mods = sources()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_no_import_circles() -> None:
    graph = import_graph()
    # Importing ``pkg.mod`` runs ``pkg/__init__`` first: that edge is Python's, not ours.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_twelve_modules_at_the_top_level() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


@pytest.mark.parametrize("name", sorted(sources()))
def test_modules_and_classes_stay_small(name: str) -> None:
    path = sources()[name]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_MODULE_LINES, f"{name}: {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS_LINES, f"{name}.{node.name}: {size} lines"


def test_the_architecture_pages_layers_are_the_contracts_layers() -> None:
    """docs/architecture.md's layer table is checked, not drawn by hand: the same layers,
    packages and order as the import-linter contract in pyproject.toml."""
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    contract = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = [
        sorted(n.removeprefix("realtime_app.") for n in re.split(r" [:|] ", layer)) for layer in contract["layers"]
    ]
    page = (root / "docs" / "architecture.md").read_text()
    table = page[page.index("| layer | packages |") :].split("\n\n", 1)[0].splitlines()[2:]
    drawn = [sorted(re.findall(r"`([a-z_.]+)`", row.replace("\\|", " ").split("|")[2])) for row in table]
    assert drawn == layers


def test_the_python_clients_class_reads_in_one_sitting() -> None:
    """The client is the user's twin of the server's rules: ``RealtimeClient`` stays under 250
    lines, its helpers module functions beside it (it was 258)."""
    tree = ast.parse((Path(__file__).resolve().parent.parent / "realtime_app/client/connection.py").read_text())
    [client] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RealtimeClient"]
    assert client.end_lineno is not None and client.end_lineno - client.lineno + 1 < 250


def test_every_module_is_named_in_the_architecture_pages_table() -> None:
    """A newcomer reads docs/architecture.md's table to find where a concern lives: every
    module of the package is named in its package's row (its own row at the top level)."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    rows = page[page.index("| package / module | concern |") :].split("\n\n", 1)[0].splitlines()[2:]
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in ("migrations", "management") or (path.name == "__init__.py" and len(parts) > 1):
            continue
        if len(parts) == 1 and path.stem != "__init__":
            row = next((r for r in rows if r.startswith("| top level")), "")
        elif len(parts) > 1:
            row = next((r for r in rows if r.startswith(f"| `{parts[0]}/`")), "")
        else:
            continue
        if f"`{path.stem}`" not in row:
            unnamed.append("/".join(parts))
    assert unnamed == []
