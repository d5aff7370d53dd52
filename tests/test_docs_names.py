"""What the docs name exists: every ``realtime_app.…`` path imports (or is an attribute
of a module that does), every check id the docs list is one the code raises and every id
the code raises is listed, every setting of docs/configuration.md is a setting and every
setting is documented there. Docs that drift from the code fail here."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from realtime_app.conf import DEFAULTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
PATH = re.compile(r"\brealtime_app(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
CHECK_ID = re.compile(r"\brealtime_app\.([EW]\d{3})\b")
#: Logger names (not modules): each must be a logger the code creates.
LOGGERS = {"realtime_app.consumers"}
#: Deprecated names the docs speak of (importing one here would make check W043 fire in
#: every later test of this process).
DEPRECATED = {"realtime_app.channels"}


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or attributes of the longest module prefix of it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def named_paths() -> list[tuple[str, str]]:
    found = set()
    for doc in DOCS:
        if doc.name == "CHANGELOG.md":
            continue  # it names what was, on purpose
        for match in PATH.finditer(doc.read_text()):
            dotted = match.group(0).rstrip(".")
            if CHECK_ID.fullmatch(dotted) or dotted.endswith((".py", ".md", ".js")) or dotted in LOGGERS | DEPRECATED:
                continue
            found.add((doc.relative_to(ROOT).as_posix(), dotted))
    return sorted(found)


@pytest.mark.parametrize(("doc", "dotted"), named_paths())
def test_every_module_path_named_in_the_docs_exists(doc, dotted):
    assert resolves(dotted), f"{doc} names {dotted}, which does not exist"


def test_the_loggers_named_in_the_docs_are_the_codes():
    code = "\n".join(p.read_text() for p in (ROOT / "realtime_app").rglob("*.py"))
    for name in LOGGERS:
        assert f'getLogger("{name}")' in code, name


def raised_ids() -> set[str]:
    code = "\n".join(p.read_text() for p in (ROOT / "realtime_app").rglob("*.py"))
    return set(re.findall(r"realtime_app\.([EW]\d{3})", code))


def test_every_check_id_is_listed_and_every_listed_id_is_raised():
    listed = set(CHECK_ID.findall((ROOT / "docs" / "checks.md").read_text()))
    named_anywhere = {i for doc in DOCS if doc.name != "CHANGELOG.md" for i in CHECK_ID.findall(doc.read_text())}
    raised = raised_ids()
    assert raised - listed == set(), "raised by the code, missing from docs/checks.md"
    assert named_anywhere - raised == set(), "named in the docs, raised by no check"


def test_every_setting_is_documented_and_every_documented_setting_exists():
    text = (ROOT / "docs" / "configuration.md").read_text()
    first_cells = re.findall(
        r"^\| (?:★ )?(`[A-Z][^|]*?) \|", text, flags=re.MULTILINE
    )  # a row may name several; ★: one to set
    documented = {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}
    assert set(DEFAULTS) - documented == set(), "settings missing from docs/configuration.md"
    assert documented - set(DEFAULTS) == set(), "documented settings that do not exist"


def test_every_lower_bound_above_zero_is_in_the_settings_table():
    """The bounds are declared beside the fields (conf/typed.py ``bounded``); the page says
    each one a value could break (``≥ 1``, ``≥ 50``)."""
    from realtime_app.conf.typed import bounds

    text = (ROOT / "docs" / "configuration.md").read_text()
    rows = {}
    for line in text.splitlines():
        cell = re.match(r"^\| (?:★ )?(`[A-Z][^|]*?) \|", line)
        for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell.group(1)) if cell else []:
            rows[name] = line
    unsaid = [key for key, (_, low, _) in bounds().items() if low > 0 and f"≥ {low:g}" not in rows[key]]
    assert unsaid == []
