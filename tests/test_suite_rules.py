"""The suite's own rules, read from its source: waits go through ``eventually`` (never a
fixed sleep directly followed by an assertion on state), and no test module is a helper
library of another (helpers live in ``tests/support/``)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _is_sleep(node: ast.stmt) -> bool:
    if not isinstance(node, ast.Expr):
        return False
    call = node.value.value if isinstance(node.value, ast.Await) else node.value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "sleep"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id in ("time", "asyncio")
    )


def sleeps_then_asserts(source: str) -> list[int]:
    """Lines of a ``time.sleep``/``asyncio.sleep`` whose next statement (in the same block,
    or the first one after the loop or block it ends) is an ``assert``."""
    found: list[int] = []

    def block(body: list[ast.stmt], after: ast.stmt | None) -> None:
        for i, statement in enumerate(body):
            following = body[i + 1] if i + 1 < len(body) else after
            if _is_sleep(statement) and isinstance(following, ast.Assert):
                found.append(statement.lineno)
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    nested_after = None if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) else following
                    block(inner, nested_after)
            for handler in getattr(statement, "handlers", []):
                block(handler.body, following)

    block(ast.parse(source).body, None)
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


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(name.split(".")[-1].startswith("test_") and name.startswith("tests.") for name in names):
                offenders.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}")
    assert offenders == [], offenders
