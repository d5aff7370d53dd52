"""The suite's own rules, read from its source: waits go through ``eventually`` (never a
fixed sleep directly followed by an assertion on state), and no test module is a helper
library of another (helpers live in ``tests/support/``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _sleep_names(tree: ast.Module) -> set[str]:
    """Names that are ``time.sleep``/``asyncio.sleep`` in this module (``from time import
    sleep``, ``... import sleep as nap``)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio")
        for alias in node.names
        if alias.name == "sleep"
    }


def _is_sleep(node: ast.stmt, bare: set[str]) -> bool:
    if not isinstance(node, ast.Expr):
        return False
    call = node.value.value if isinstance(node.value, ast.Await) else node.value
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in bare
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "sleep"
        and isinstance(func.value, ast.Name)
        and func.value.id in ("time", "asyncio")
    )


def sleeps_then_asserts(source: str) -> list[int]:
    """Lines of a ``time.sleep``/``asyncio.sleep`` (however imported) whose next statement —
    past any plain assignments (``x = read()``), in the same block, or the first one after
    the loop or block it ends — is an ``assert``."""
    found: list[int] = []
    tree = ast.parse(source)
    bare = _sleep_names(tree)

    def block(body: list[ast.stmt], after: ast.stmt | None) -> None:
        for i, statement in enumerate(body):
            following = body[i + 1] if i + 1 < len(body) else after
            if _is_sleep(statement, bare):
                j = i + 1
                while j < len(body) and isinstance(body[j], (ast.Assign, ast.AnnAssign)):
                    j += 1
                target = body[j] if j < len(body) else after
                if isinstance(target, ast.Assert):
                    found.append(statement.lineno)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    nested_after = None if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) else following
                    block(inner, nested_after)
            for handler in getattr(statement, "handlers", []):
                block(handler.body, following)

    block(tree.body, None)
    return found


def test_no_fixed_sleep_is_followed_by_an_assertion() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in sleeps_then_asserts(path.read_text())
    ]
    assert offenders == [], "wait with eventually(), not a fixed sleep: " + ", ".join(offenders)


def test_the_finder_sees_a_sleep_then_an_assertion() -> None:
    source = (
        "async def t():\n"
        "    await asyncio.sleep(1)\n"
        "    assert x\n"
        "    while y:\n"
        "        time.sleep(0.1)\n"
        "    assert z\n"
        "    await asyncio.sleep(0)\n"
        "    z = 1\n"
    )
    assert sleeps_then_asserts(source) == [2, 5]


def test_the_finder_sees_the_loopholes() -> None:
    """A bare ``sleep`` imported from time or asyncio, and a sleep, an assignment (a read),
    then an assertion: the same wait-and-hope."""
    source = (
        "from time import sleep\n"
        "from asyncio import sleep as nap\n"
        "def t():\n"
        "    sleep(1)\n"
        "    assert x\n"
        "async def u():\n"
        "    await nap(1)\n"
        "    state = read()\n"
        "    other: int = 2\n"
        "    assert state\n"
        "    await nap(1)\n"
        "    poll()\n"
        "    assert y\n"
    )
    assert sleeps_then_asserts(source) == [4, 7]


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]  # a dotted path in settings: "tests.test_history.GatedHistory"
            if any(_names_a_test_module(name) for name in names):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    assert offenders == [], offenders


def _names_a_test_module(name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) >= 2
        and parts[0] == "tests"
        and any(part.startswith("test_") for part in parts[1:2])
        and all(part.isidentifier() for part in parts)
    )


def test_the_import_rule_sees_dotted_strings() -> None:
    module = "tests." + "test_history"  # spelt in two parts: this file is read by the rule too
    assert _names_a_test_module(module + ".GatedHistory")
    assert _names_a_test_module(module)
    assert not _names_a_test_module("tests.support.cluster.Reader")
    assert not _names_a_test_module("tests/test_history.py")
