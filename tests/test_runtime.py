"""One runtime per process (``realtime_app.conf.runtime.Realtime``) owns every piece of
state the process keeps: no module of the package keeps mutable state of its own.

Found: about 25 pieces of process-global state in 17 modules (caches, once-logged flags,
hubs by loop, pools, stores, drains), each reset by hand in tests or never."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest
from django.test import override_settings

import realtime_app
from realtime_app.conf.runtime import SAID_KEPT, Realtime, reset_runtime, runtime

PACKAGE = Path(realtime_app.__file__).resolve().parent

#: Module-level names that are state on purpose, each with why it is not the runtime's.
ALLOWED = {
    ("conf/runtime.py", "_process"): "the holder of the runtime itself",
    ("declarations/registry.py", "registry"): "channels declared at import time, like Django's admin.site",
    ("endpoint/methods.py", "_methods"): "methods declared at import time by @rpc_method",
    ("inbound/pools.py", "decorated_pools"): "pools named by decorators at import time",
    ("persistence/lifecycle.py", "_stores"): "write-behind stores made at import time, flushed at any end",
    ("wire/protocol.py", "_encoder"): "the wire is below the runtime: the encoder the settings name is given to it",
    ("routing.py", "websocket_urlpatterns"): "Django's URL patterns",
    ("routing.py", "not_found_urlpatterns"): "Django's URL patterns",
    ("urls.py", "urlpatterns"): "Django's URL patterns",
}

MUTATORS = {"append", "add", "update", "clear", "pop", "popitem", "setdefault", "remove", "discard", "extend", "insert"}


def _is_state(value: ast.expr) -> bool:
    """A value a module could change later: a display of a mutable container or an object
    made by a call (type aliases, literals and attribute reads are not)."""
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        name = ast.unparse(value.func)
        immutable = {"frozenset", "tuple", "re.compile", "object", "TypeVar", "ParamSpec", "len", "timedelta", "float"}
        return name not in immutable and not name.endswith(("getLogger", "Struct"))
    return False


def module_state(package: Path = PACKAGE) -> list[tuple[str, str, str]]:
    """(module, name, why it is state) for every piece of module-level state in ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package))
        tree = ast.parse(path.read_text())
        constants: set[str] = set()
        for node in tree.body:
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            for target in targets:
                if not isinstance(target, ast.Name) or target.id.startswith("__") or target.id in ("logger", "log"):
                    continue
                if target.id.isupper() or target.id.lstrip("_").isupper():
                    if isinstance(value, (ast.Dict, ast.List, ast.Set)):
                        constants.add(target.id)  # a constant: it must never be changed (below)
                elif _is_state(value):
                    found.append((where, target.id, "bound to a mutable value"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.extend((where, name, "rebound by a global statement") for name in node.names)
            changed = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                changed = node.func.value
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                    if isinstance(target, ast.Subscript):
                        changed = target.value
            if isinstance(changed, ast.Name) and changed.id in constants:
                found.append((where, changed.id, "a module constant changed"))
    return found


def test_no_module_keeps_state_outside_the_runtime() -> None:
    unexpected = sorted({(w, n, why) for w, n, why in module_state() if (w, n) not in ALLOWED})
    assert unexpected == [], "keep it in a part of the runtime (realtime_app.conf.runtime)"


def test_the_finder_sees_each_kind_of_state(tmp_path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        "import re\nCACHE = {}\n_seen = set()\n_flag = False\nPATTERN = re.compile('x')\nAlias = dict[str, int]\n"
        "def f():\n    global _flag\n    _flag = True\n    CACHE['k'] = 1\n"
    )
    assert sorted((n, why) for _, n, why in module_state(package)) == [
        ("CACHE", "a module constant changed"),
        ("_flag", "rebound by a global statement"),
        ("_seen", "bound to a mutable value"),
    ]


async def test_the_runtime_closes_as_a_whole_and_a_new_one_starts_empty() -> None:
    """The hubs, caches and books of a process are one object's: closing it closes the
    running loop's hub; a new runtime shares nothing with the old one."""
    from realtime_app.conf import get_config
    from realtime_app.hub.connections import Connection
    from realtime_app.hub.hubs import get_hub, hubs

    old = runtime()
    fresh = reset_runtime()
    try:
        with override_settings(REALTIME_APP={**get_config(), "BACKPLANE": "memory"}):
            hub = await get_hub()
            assert hub.started and hubs().by_loop[asyncio.get_running_loop()] is hub
            first = Connection(asyncio.Queue().put).id
            assert fresh.first_time("said") and not fresh.first_time("said")
            await fresh.aclose()
            assert not hub.started and fresh.parts() == []
            again = reset_runtime()
            assert Connection(asyncio.Queue().put).id == first == 1
            assert again.first_time("said") and again is runtime() and again is not fresh
            await again.aclose()
    finally:
        import realtime_app.conf.runtime as module

        module._process[0] = old


def test_a_setting_change_reaches_every_part_through_the_runtime() -> None:
    """One receiver: the settings are built again and each part that derived something
    from them drops it (the HTTP pools, the compiled access rules)."""
    from realtime_app.declarations.policies import active_rules
    from realtime_app.inbound.pools import http_pools

    pools = {"narrow": {"max_concurrent": 1}}
    with override_settings(REALTIME_APP={"HTTP_POOLS": pools, "POLICIES": [{"pattern": "x:*", "staff": True}]}):
        assert runtime().settings.http_pools == pools
        assert list(http_pools()) == ["narrow"] and http_pools()["narrow"].settings.max_concurrent == 1
        assert any(rule.pattern == "x:*" for rule in active_rules())
    assert "narrow" not in http_pools()
    assert not any(rule.pattern == "x:*" for rule in active_rules())


def test_a_family_of_said_once_lines_is_bounded_and_a_process_wide_one_is_said_once_for_good() -> None:
    book = Realtime()
    assert book.first_time("check errors")
    for n in range(SAID_KEPT):
        assert book.first_time(n, family="per user")
    assert not book.first_time(0, family="per user")
    assert book.first_time("one more", family="per user")  # emptied at the bound: at worst said again
    assert not book.first_time("check errors")  # never emptied by a family filling up


def test_the_http_pools_outlive_a_change_of_another_setting() -> None:
    """A pool rebuilt by any settings change let in another ``max_concurrent`` beside the
    requests still holding the old pool's slots."""
    from realtime_app.inbound.pools import http_pools

    before = http_pools()
    with override_settings(REALTIME_APP={**settings_dict(), "METRICS_TOKEN": "another"}):
        assert http_pools() is before
    assert http_pools() is before


def test_a_channel_layer_change_leaves_the_parts_alone() -> None:
    from realtime_app.hub.gate import Gate

    gate = Gate()
    gate._refusal_budgets[("user", "1")] = object()  # type: ignore[assignment]
    with override_settings(CHANNEL_LAYERS={"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}):
        assert gate._refusal_budgets  # not reconfigured: nothing of REALTIME_APP changed
    with override_settings(REALTIME_APP={**settings_dict(), "ADMISSION_MAX_RUNNING": 7}):
        assert gate.pool.max_running == 7 and not gate._refusal_budgets


async def test_write_behind_stores_outlive_a_closed_runtime() -> None:
    """Stores are made at import time; a runtime closed or replaced must not forget them
    (the flush at the process's end would find none and lose their changes)."""
    from realtime_app.persistence.lifecycle import stores

    old = runtime()
    before = stores()
    assert before, "the test settings' apps declare stores"
    try:
        await reset_runtime().aclose()
        assert stores() == before
    finally:
        import realtime_app.conf.runtime as module

        module._process[0] = old


def settings_dict() -> dict:
    from realtime_app.conf import get_config

    return dict(get_config())


@pytest.mark.parametrize("setting", ["OTHER", "REALTIME_APP"])
def test_only_this_apps_settings_rebuild_the_settings(setting) -> None:
    book = Realtime()
    before = book.settings
    book.settings_changed(setting)
    assert (book.settings is before) == (setting == "OTHER")
