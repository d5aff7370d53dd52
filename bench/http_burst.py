"""A burst of heavy HTTP requests, with and without the concurrency limiter, on daphne.

Each request to ``/demo/heavy/`` allocates and touches 20 MB and holds it 200 ms; the
pool ``heavy`` runs 2 at a time (50 waiting, 10 s). ``/demo/heavy-unlimited/`` is the same
view outside any pool. In one run, for each path: ``--requests`` (200) simultaneous
requests against a fresh daphne process (in-memory layer); it prints the server's idle and
peak RSS, requests answered (200 / 503 / failed), p50/p99 latency.

Then the same under a memory cap (``--cap-mib``, default 200), as a container would have
it: the server runs in a memory cgroup of its own (``memory.limit_in_bytes`` of cgroup v1,
or ``memory.max`` of cgroup v2 — root needed), where the kernel's OOM killer stops it when
it passes the cap. Without a writable cgroup it falls back to ``RLIMIT_AS`` (address space,
so the cap is added to the idle process's size) and says so: an allocation past the cap
then raises ``MemoryError`` (answered 500) instead of killing the process. Does the server
survive, and are the requests answered?

Usage: python bench/http_burst.py [--requests 200] [--cap-mib 200] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, free_port, percentile, prepare_database, progress, rss_bytes, wait_port

MIB = 1024 * 1024


def memory_cgroup(cap_bytes: int) -> Path | None:
    """A fresh memory cgroup capped at ``cap_bytes`` (v1 or v2), or None if none can be made."""
    for root, limit_file in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/unified"), "memory.max"),
    ):
        group = root / f"realtime-bench-{os.getpid()}-{time.monotonic_ns()}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit_file).write_text(str(cap_bytes))
            if (group / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                (group / "memory.memsw.limit_in_bytes").write_text(str(cap_bytes))
            return group
        except OSError:
            group.rmdir()
    return None


def start_server(
    port: int, env: dict[str, str], cap_bytes: int | None
) -> tuple[subprocess.Popen[bytes], Path | None, str]:
    group = memory_cgroup(cap_bytes) if cap_bytes else None
    how = "cgroup" if group else ("RLIMIT_AS" if cap_bytes else "")

    def limit() -> None:  # in the child, before exec
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))
        elif cap_bytes:  # address space: what the idle server maps (about 1 GiB), plus the cap
            resource.setrlimit(resource.RLIMIT_AS, (cap_bytes + 1024 * MIB, cap_bytes + 1024 * MIB))

    cmd = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "project.asgi:application"]
    process = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=limit,
    )
    wait_port(port, process)
    return process, group, how


async def one(port: int, path: str) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 60)
        await asyncio.wait_for(reader.read(), 60)
        writer.close()
        status = int(head.split()[1]) if head else 0
    except (OSError, TimeoutError, ValueError, IndexError):
        status = 0  # connection refused or reset, or no answer: the server is gone or stuck
    return status, (time.perf_counter() - started) * 1000


async def burst(name: str, path: str, env: dict[str, str], n: int, cap_bytes: int | None) -> dict[str, Any]:
    port = free_port()
    server, group, how = start_server(port, env, cap_bytes)
    try:
        await one(port, "/accounts/login/")  # warm: the hub and the URL resolver exist
        await asyncio.sleep(0.5)
        idle = rss_bytes(server.pid)
        peak = idle
        series: list[tuple[float, int]] = []
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(port, path)) for _ in range(n)]
        while not all(task.done() for task in tasks):
            if server.poll() is None:
                rss = rss_bytes(server.pid)
                peak = max(peak, rss)
                series.append((time.monotonic() - t0, rss))
            await asyncio.sleep(0.02)
        results = [task.result() for task in tasks]
        alive = server.poll() is None
    finally:
        if server.poll() is None:
            server.terminate()
        _, err = server.communicate(timeout=15)
        if group is not None:
            group.rmdir()
    statuses = [s for s, _ in results]
    ok = [ms for s, ms in results if s == 200]
    answered = [ms for s, ms in results if s in (200, 503)]
    row = {
        "run": name,
        "path": path,
        "cap_mib": cap_bytes // MIB if cap_bytes else None,
        "cap_by": how,
        "idle_mib": idle / MIB,
        "peak_mib": peak / MIB,
        "ok": statuses.count(200),
        "busy_503": statuses.count(503),
        "server_error": sum(1 for s in statuses if s >= 500 and s != 503),
        "failed": statuses.count(0),
        "p50_ms": percentile(answered, 50) if answered else 0.0,
        "p99_ms": percentile(answered, 99) if answered else 0.0,
        "ok_p99_ms": percentile(ok, 99) if ok else 0.0,
        "alive": alive,
        "memory_errors": err.decode(errors="replace").count("MemoryError"),
        "series": series,
    }
    progress(
        f"{name}: {row['ok']} ok, {row['busy_503']} 503, {row['server_error']} 5xx, {row['failed']} failed, "
        f"peak {row['peak_mib']:.0f} MiB, server {'alive' if alive else 'DEAD'}"
    )
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for row in rows:
        label = f"{row['run']}" + (f" (cap {row['cap_mib']} MiB)" if row["cap_mib"] else "")
        ax.plot([t for t, _ in row["series"]], [r / MIB for _, r in row["series"]], label=label)
    ax.set_xlabel("s since the burst")
    ax.set_ylabel("server RSS, MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--cap-mib", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    os.chdir(ROOT)
    db = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    env = {**db, "REDIS_URL": "", "REALTIME_LOG_LEVEL": "ERROR", "DJANGO_SETTINGS_MODULE": "project.settings"}
    cap = args.cap_mib * MIB
    rows = [
        await burst("limited", "/demo/heavy/", env, args.requests, None),
        await burst("unlimited", "/demo/heavy-unlimited/", env, args.requests, None),
        await burst("limited", "/demo/heavy/", env, args.requests, cap),
        await burst("unlimited", "/demo/heavy-unlimited/", env, args.requests, cap),
    ]
    print(f"\n{args.requests} simultaneous requests, each allocating 20 MB for 200 ms (daphne, one process)")
    print(
        f"{'run':<10}{'cap':>8}{'idle MiB':>9}{'peak MiB':>9}{'peak-idle':>10}{'200':>5}{'503':>5}{'5xx':>5}"
        f"{'failed':>7}{'p50 ms':>8}{'p99 ms':>8}  server"
    )
    for row in rows:
        cap_text = f"{row['cap_mib']} MiB" if row["cap_mib"] else "–"
        if row["cap_by"] == "RLIMIT_AS":
            cap_text += "*"
        fate = "alive" if row["alive"] else "died"
        if row["memory_errors"]:
            fate += f", {row['memory_errors']} MemoryError"
        print(
            f"{row['run']:<10}{cap_text:>8}{row['idle_mib']:>9.0f}{row['peak_mib']:>9.0f}"
            f"{row['peak_mib'] - row['idle_mib']:>10.0f}{row['ok']:>5}{row['busy_503']:>5}{row['server_error']:>5}"
            f"{row['failed']:>7}{row['p50_ms']:>8.0f}{row['p99_ms']:>8.0f}  {fate}"
        )
    if any(row["cap_by"] == "RLIMIT_AS" for row in rows):
        print("* no writable memory cgroup here: capped with RLIMIT_AS (MemoryError, not the OOM killer)")
    limited = rows[0]
    goal = limited["peak_mib"] <= limited["idle_mib"] + 3 * 20
    print(f"\ngoal (limited peak <= idle + 3 x 20 MB, every request answered): {'met' if goal else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    asyncio.run(main())
