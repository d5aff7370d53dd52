"""Mutation testing of the guard functions (scripts/mutants; docs/testing.md).

Each target names a module, the functions in it that hold a guard, and the tests that
cover them. cosmic-ray makes every mutant of the module; those outside the named
functions, and lines marked ``# pragma: no mutate`` (an equivalent mutant, said why on the
line), are skipped; each remaining mutant runs the target's tests in a copy of the tree
(the working tree is never touched). A mutant the tests let through is a survivor: printed
with its diff, and the run fails.

    scripts/mutants                 # every target
    scripts/mutants drain outbox    # some
    scripts/mutants --list          # the targets, their functions and tests
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@dataclass(frozen=True)
class Target:
    name: str
    module: str
    functions: tuple[str, ...]  # "name", "Class.method" or "outer.inner"
    tests: tuple[str, ...]  # pytest arguments


TARGETS = (
    Target(
        "token-view",
        "realtime_app/views.py",
        ("issue_token",),
        ("tests/test_http_api.py", "tests/test_tokens_live.py::test_a_signed_in_session_gets_a_token_over_http"),
    ),
    Target(
        "publish-view",
        "realtime_app/views.py",
        ("publish_api",),
        (
            "tests/test_http_api.py",
            "tests/test_tokens_live.py::test_the_publish_api_reaches_a_subscriber_with_its_seq",
            "tests/test_tokens_live.py::test_the_publish_api_refuses_an_instance_its_exists_hook_denies",
        ),
    ),
    Target(
        "addresses",
        "realtime_app/endpoint/addresses.py",
        ("client_network", "client_address"),
        ("tests/test_addresses.py", "tests/test_hub_limits.py", "tests/test_admission.py", "-k", "address or network"),
    ),
    Target(
        "admission-shares",
        "realtime_app/inbound/slots.py",
        ("PoolCore._take",),
        (
            "tests/test_slots.py",
            "tests/test_admission.py",
            "tests/test_admission_live.py",
            "-k",
            "slot or share or pool or identity or Pool",
        ),
    ),
    Target(
        "delta-bound",
        "realtime_app/wire/fossil.py",
        ("cpu_bound",),
        ("tests/test_deltas.py", "tests/test_fossil.py"),
    ),
    Target(
        "presence-bounds",
        "realtime_app/wire/presence.py",
        ("LocalRoom.part", "view"),
        ("tests/test_presence.py", "tests/test_presence_endpoint.py"),
    ),
    Target(
        "presence-hub-bounds",
        "realtime_app/hub/presence.py",
        ("Presence._list_up_to", "Presence._listed"),
        ("tests/test_presence_endpoint.py",),
    ),
    Target(
        "outbox-once-memory",
        "realtime_app/cluster/memory.py",
        ("MemoryBackplane.publish_once",),
        ("tests/test_outbox.py",),
    ),
    Target(
        "outbox-once-redis",
        "realtime_app/cluster/redis.py",
        ("RedisBackplane.publish_once",),
        ("tests/test_outbox.py",),
    ),
    Target(
        "drain",
        "realtime_app/endpoint/drain.py",
        ("schedule", "drain"),
        ("tests/test_drain.py", "-k", "not sigterm and not hands"),
    ),
)


Position = tuple[int, int]  # (line, column), as cosmic-ray gives them


def spans(path: Path, names: tuple[str, ...]) -> tuple[list[tuple[int, int]], list[tuple[Position, Position]]]:
    """The line spans (first, last) of the named functions of ``path``, and the spans of
    every annotation in the module: with ``from __future__ import annotations`` they are
    strings never evaluated, so a mutant there cannot change anything."""
    tree = ast.parse(path.read_text(), str(path))
    found: dict[str, tuple[int, int]] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found[name] = (child.lineno, child.end_lineno or child.lineno)
                walk(child, name + ".")

    walk(tree, "")
    missing = [name for name in names if name not in found]
    if missing:
        raise SystemExit(f"{path}: no function {', '.join(missing)} (the target list is out of date)")
    annotations = [
        ((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0))
        for node in ast.walk(tree)
        for a in ([node.returns] if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else [])
        + ([node.annotation] if isinstance(node, ast.arg | ast.AnnAssign) else [])
        if a is not None
    ]
    return [found[name] for name in names], annotations


def copy_tree(destination: Path) -> None:
    """The project's files as git sees them (committed or not, ignored ones left out)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def skip_outside(session: Path, tree: Path, target: Target) -> tuple[int, int]:
    """Mark the mutants outside the target's functions, in an annotation, or on a
    ``pragma: no mutate`` line, as skipped: ``(kept, total)``."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    path = tree / target.module
    lines = path.read_text().splitlines()
    ranges, annotations = spans(path, target.functions)
    future = "from __future__ import annotations" in path.read_text()
    kept = total = 0
    with use_db(str(session)) as db:
        for item in db.work_items:
            total += 1
            inside = all(
                any(first <= m.start_pos[0] <= last for first, last in ranges)
                and "pragma: no mutate" not in lines[m.start_pos[0] - 1]
                and not (future and any(a <= tuple(m.start_pos) < b for a, b in annotations))
                for m in item.mutations
            )
            if inside:
                kept += 1
            else:
                db.set_result(
                    item.job_id,
                    WorkResult(output=None, test_outcome=None, diff=None, worker_outcome=WorkerOutcome.SKIPPED),
                )
    return kept, total


FAILED = re.compile(r"\b\d+ (failed|errors?)\b")


def results(session: Path) -> list[tuple[str, str, str]]:
    """``(outcome, worker outcome, diff)`` of each mutant run. A run counts as killed only
    when a test failed or errored (the clean run passed: the mutant did it — a module that
    no longer imports, say) or the tests hung past the timeout; pytest collecting nothing,
    or stopped otherwise, is ``error``."""
    from cosmic_ray.work_db import WorkDB, use_db

    out = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for _item, result in db.completed_work_items:
            worker = getattr(result.worker_outcome, "value", result.worker_outcome)
            if worker == "skipped":
                continue
            outcome = str(getattr(result.test_outcome, "value", result.test_outcome))
            output = result.output or ""
            if outcome == "killed" and output != "timeout" and not FAILED.search(output):
                outcome = "error"  # a hang (cosmic-ray's "timeout") is a kill: the suite would not pass
            out.append((outcome, str(worker), result.diff or ""))
    return out


def run(target: Target, tree: Path, work: Path, timeout: float) -> tuple[int, int, list[str]]:
    """Mutate one target: ``(mutants run, killed, the others' diffs)``: a mutant not killed
    (survived, a timeout, an error) fails the run."""
    test = shlex.join([PYTHON, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *target.tests])
    config = work / f"{target.name}.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(target.module)}\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(test)}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    session = work / f"{target.name}.sqlite"
    began = time.monotonic()
    baseline = subprocess.run(shlex.split(test), cwd=tree, capture_output=True, text=True)
    if baseline.returncode != 0:  # every mutant would count as killed
        raise SystemExit(f"{target.name}: the tests fail without any mutant:\n{baseline.stdout[-3000:]}")
    # a mutant that loops forever is a timeout (not killed): three times the clean run
    limit = timeout or max(20.0, 3 * (time.monotonic() - began))
    config.write_text(config.read_text().replace("timeout = 0.0\n", f"timeout = {limit:.0f}\n"))
    cosmic = [str(Path(PYTHON).parent / "cosmic-ray")]
    init = subprocess.run([*cosmic, "init", str(config), str(session)], cwd=tree, capture_output=True, text=True)
    if init.returncode != 0:
        raise SystemExit(f"{target.name}: cosmic-ray init failed:\n{init.stderr[-3000:]}")
    kept, total = skip_outside(session, tree, target)
    print(f"==> {target.name}: {kept} mutants in {', '.join(target.functions)} ({total} in the module)", flush=True)
    done = threading.Event()

    def progress() -> None:
        started = time.monotonic()
        while not done.wait(30):
            try:
                ran = len(results(session))
            except Exception:  # the session is being written: next time
                continue
            print(f"    {target.name}: {ran}/{kept} after {time.monotonic() - started:.0f} s", flush=True)

    watcher = threading.Thread(target=progress, daemon=True)
    watcher.start()
    try:
        subprocess.run([*cosmic, "exec", str(config), str(session)], cwd=tree, check=True)
    finally:
        done.set()
        watcher.join()
    outcomes = results(session)
    survivors = [f"({outcome}) {diff}" for outcome, _, diff in outcomes if outcome != "killed"]
    killed = sum(1 for outcome, _, _ in outcomes if outcome == "killed")
    return len(outcomes), killed, survivors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help="target names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument(
        "--timeout", type=float, default=0.0, help="seconds per mutant's test run (default: 3x the clean run)"
    )
    args = parser.parse_args()
    if args.list:
        for t in TARGETS:
            print(f"{t.name:20} {t.module} :: {', '.join(t.functions)}\n{'':20} pytest {' '.join(t.tests)}")
        return 0
    chosen = [t for t in TARGETS if not args.targets or t.name in args.targets]
    unknown = set(args.targets) - {t.name for t in TARGETS}
    if unknown:
        parser.error(f"unknown target(s): {', '.join(sorted(unknown))} (see --list)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="realtime-mutants-") as tmp:
        tree, work = Path(tmp) / "tree", Path(tmp) / "work"
        work.mkdir()
        copy_tree(tree)
        os.environ["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # the copy, not the tree
        rows = []
        for target in chosen:
            ran, killed, survivors = run(target, tree, work, args.timeout)
            rows.append((target.name, ran, killed, len(survivors)))
            for diff in survivors:
                print(f"--- survivor of {target.name}:\n{diff}", flush=True)
    print(f"\n{'target':22}{'mutants':>8}{'killed':>8}{'survived':>10}")
    for name, ran, killed, survived in rows:
        print(f"{name:22}{ran:>8}{killed:>8}{survived:>10}")
    total = sum(r[3] for r in rows)
    print(f"\n{sum(r[1] for r in rows)} mutants, {total} survivors, {time.monotonic() - started:.0f} s")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
