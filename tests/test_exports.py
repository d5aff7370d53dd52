"""The public API: what ``realtime_app`` exports exists, and pure modules need no Django."""

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import realtime_app

#: Django's own modules (an app's admin, models, urls, AppConfig), the channels the app
#: registers, ``python -m``'s entry point and the deprecated alias ``channels`` declare no
#: API of their own.
NOT_API = {"admin", "apps", "models", "urls", "realtime_channels", "client.__main__", "channels"}


def package_modules() -> list[str]:
    """Every module of the package with code (subpackages' docstring-only ``__init__`` aside)."""
    root = Path(realtime_app.__file__).resolve().parent
    names = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).with_suffix("")
        if relative.parts[0] in ("migrations", "management") or relative.name.startswith("_tmp"):
            continue
        if relative.name == "__init__":
            body = ast.parse(path.read_text()).body
            if len(relative.parts) == 1 or all(isinstance(node, ast.Expr) for node in body):
                continue
            relative = relative.parent
        name = ".".join(relative.parts)
        if name not in NOT_API:
            names.append(name)
    return names


PUBLIC_MODULES = package_modules()


def test_every_top_level_name_resolves_and_is_listed_once():
    assert len(realtime_app.__all__) == len(set(realtime_app.__all__))
    for name in realtime_app.__all__:
        assert getattr(realtime_app, name) is not None


def test_the_modules_are_found():
    assert {"hub", "client", "wire.protocol", "hub.core", "persistence.write_behind"} <= set(PUBLIC_MODULES)


def test_every_public_module_declares_what_it_exports():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"realtime_app.{module_name}")
        assert module.__all__, module_name
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.{name}"


def test_top_level_names_come_from_the_submodules():
    exported = {name for m in PUBLIC_MODULES for name in importlib.import_module(f"realtime_app.{m}").__all__}
    assert set(realtime_app.__all__) <= exported


def test_pure_modules_import_without_a_django_project():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "import realtime_app.wire.rate, realtime_app.client.adaptive, realtime_app.outbound.backpressure, "
        "realtime_app.wire.protocol, realtime_app.wire.names, realtime_app.client.scenarios, "
        "realtime_app.hub.reconciler, realtime_app.observability.logsafe, "
        "realtime_app.inbound.admission; "
        "from realtime_app import rate_channel, AdaptiveRate, decide_send; "
        "print(rate_channel('a', 2000, 1000))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "a:2000"


def test_the_old_declarations_name_still_imports_and_warns():
    """``realtime_app.channels`` was renamed ``realtime_app.declarations`` (it read as Django
    Channels' own package in every traceback); a host project's old import keeps working for
    a release, with a DeprecationWarning that names the new place."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    from realtime_app.channels.registry import ChannelSpec\n"
        "import realtime_app.declarations.registry as new\n"
        "assert ChannelSpec is new.ChannelSpec\n"
        "print([(str(w.message), w.filename) for w in caught if w.category is DeprecationWarning])\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "realtime_app.declarations" in out.stdout
    assert "'<string>'" in out.stdout  # the warning names the importing line, not importlib's


def test_a_type_checked_host_still_finds_the_old_declarations_name(tmp_path):
    """The alias is made at run time; a host project running mypy read ``import-not-found``
    for ``realtime_app.channels.registry`` until the alias shipped stubs."""
    host = tmp_path / "host.py"
    host.write_text(
        "from realtime_app.channels.registry import ChannelSpec\n"
        "from realtime_app.channels.declare import ticker\n\n"
        "def name(spec: ChannelSpec) -> str:\n    return spec.name + str(ticker)\n"
    )
    root = Path(realtime_app.__file__).resolve().parent.parent
    env = {**os.environ, "MYPYPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental", str(host)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
