"""A rolling restart of three daphne processes behind nginx: drained vs stopped at once.

Three daphne processes of the bench site on Redis behind nginx (docs/deploy/nginx.conf with
a third upstream, its per-address limits left out: every client of this benchmark comes
from 127.0.0.1), ``--clients`` clients (``RealtimeClient``, each with an address of its
own) subscribed to ``demo:events`` (an event channel with history), ``--rate``
publications per second, and one well-behaved client calling ``ping`` ten times a second.
Then a rolling restart, one process after the other: the process is taken out of nginx's
upstream (``down``, a reload: what a readiness check does for a load balancer that has
them), given SIGTERM, started again once it exited, put back. Two modes, in one run:

* **drained**: ``DRAIN_SECONDS`` = ``--drain``: the process closes its connections with
  1012 spread over the drain, each told ``retry_after_ms``;
* **immediate**: ``DRAIN_SECONDS`` = 0: daphne closes every connection at once.

Measured: publications lost (a client never got one it was subscribed for, after its
resumes), the most connections a process closed per second and the most clients away at
once, handshakes per second on the processes that were not restarting (peak, from their
established connections, read in ``/proc/net/tcp`` every 0.25 s), a well-behaved client's
``ping`` p99 during the deploy vs before it (in a process of its own), the time from the
first stop until every client is back, and until every client holds every publication
(resumes done: ``resumed s``, polled each second once every client is back; ``caught up s``,
from the last process back until every client held every publication made up to then, by
each frame's own arrival). ``--plot``: connections per process over the deploy.

The clients run in ``--client-processes`` worker processes (2 by default,
``bench/deploy_clients.py``) on ``--client-loop`` (uvloop by default): on a small machine
one process's CPU bounds how fast thousands of clients come back, in both modes alike
(before 2026-12-07 one asyncio process drove them all and sampled the servers too). Each
run reports the workers' CPU during the deploy (in cores) and each client's longest way
back (from the close that took it away until it was open again). On 2 cores, 3,000
clients at 10 publications a second need more CPU than there is (the servers write 30,000
frames a second and the clients read them): lower ``--rate`` there, and say so.

``--anonymous-handshakes N``: each process's ``MAX_ANONYMOUS_HANDSHAKES_PER_S`` (200 by
default): below what a drain sends each survivor, as on a site whose processes hold more
connections than this machine's clients, a drain meets the survivors' anonymous bucket.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/deploy.py [--clients 3000]
            [--rate 10] [--drain 20] [--anonymous-handshakes N] [--client-processes 2]
            [--client-loop uvloop|asyncio] [--json FILE]
            [--plot docs/img/deploy-connections.png]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, cpu_seconds, daphne, free_port, percentile, prepare_database, progress, wait_port
from bench.deploy_clients import SAMPLE_S, Clients, ways_back_summary

PROCESSES = 3


class Site:
    """Three daphne processes behind nginx; a process is restarted on its own port."""

    def __init__(self, env: dict[str, str], root: Path, clients: int = 3000) -> None:
        self.env = env
        self.root = root
        self.clients = clients
        self.ports = [free_port() for _ in range(PROCESSES)]
        self.front = free_port()
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * PROCESSES
        self.down: set[int] = set()
        self.nginx: subprocess.Popen[bytes] | None = None

    def start(self, i: int) -> None:
        command = [*daphne(self.ports[i]), "--proxy-headers"]
        self.procs[i] = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **self.env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def config(self) -> str:
        text = (ROOT / "docs" / "deploy" / "nginx.conf").read_text()
        text = re.sub(r"\n\s*limit_(req|conn)[^\n]*", "", text)  # one address here: 127.0.0.1
        servers = "".join(
            f"        server 127.0.0.1:{port} max_fails=0{' down' if i in self.down else ''};\n"
            for i, port in enumerate(self.ports)
        )
        text = re.sub(r"(upstream django \{\n[^\n]*\n)(?:\s*server [^\n]*\n)+", lambda m: m.group(1) + servers, text)
        text = text.replace("127.0.0.1:8000", f"127.0.0.1:{self.front}")
        text = text.replace("worker_processes auto;", "worker_processes 1;")
        # one worker holds every client twice (its socket and daphne's), with room for a deploy's overlap
        connections = max(8192, 2 * self.clients + 1024)
        text = re.sub(r"worker_connections \d+;", f"worker_connections {connections};", text)
        text = text.replace("worker_processes 1;", f"worker_processes 1;\nworker_rlimit_nofile {connections + 256};")
        return text.replace("include /etc/nginx/mime.types;", "")

    def write_config(self) -> None:
        (self.root / "nginx.conf").write_text(self.config())

    def start_nginx(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        (self.root / "tmp").mkdir(exist_ok=True)
        for path in (self.root, self.root / "tmp"):
            path.chmod(0o777)
        self.write_config()
        self.nginx = subprocess.Popen(
            [nginx, "-p", str(self.root), "-c", str(self.root / "nginx.conf"), "-g", "daemon off;"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(self.front, self.nginx)

    def route(self, i: int, up: bool) -> None:
        """Put process ``i`` in or out of nginx's upstream (a reload)."""
        (self.down.discard if up else self.down.add)(i)
        self.write_config()
        assert self.nginx is not None
        self.nginx.send_signal(signal.SIGHUP)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if self.nginx is not None and self.nginx.poll() is None:
            self.nginx.terminate()  # a fast stop: the master ends its workers, old ones included
            self.nginx.wait(10)


def site_root() -> Path:
    """A directory nginx's workers can read (they run unprivileged when the master is root)."""
    root = Path(tempfile.mkdtemp(prefix="realtime-deploy-"))
    root.chmod(0o755)
    return root


def established(ports: list[int]) -> list[int]:
    """Established TCP connections whose local port is each of ``ports`` (the server side)."""
    wanted = {port: i for i, port in enumerate(ports)}
    counts = [0] * len(ports)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "01":
                    i = wanted.get(int(fields[1].rsplit(":", 1)[1], 16))
                    if i is not None:
                        counts[i] += 1
    return counts


async def run_mode(mode: str, args: argparse.Namespace, base_env: dict[str, str]) -> dict[str, Any]:
    drain = args.drain if mode == "drained" else 0
    overrides: dict[str, float] = {"DRAIN_SECONDS": drain}
    if args.anonymous_handshakes is not None:
        overrides["MAX_ANONYMOUS_HANDSHAKES_PER_S"] = args.anonymous_handshakes
    env = {**base_env, "REALTIME_BENCH_OVERRIDES": json.dumps(overrides)}
    site = Site(env, site_root(), args.clients)
    root = site.root
    clients: Clients | None = None
    samples: list[tuple[float, list[int], int]] = []  # (time, connections per process, clients not open)
    pings: list[tuple[float, float]] = []
    published: list[tuple[float, int]] = []
    stopping = asyncio.Event()
    pinger_box: list[Any] = []
    tasks: list[asyncio.Task[Any]] = []
    try:
        for i in range(PROCESSES):
            site.start(i)
        for port, proc in zip(site.ports, site.procs, strict=True):
            assert proc is not None
            wait_port(port, proc)
        site.start_nginx()
        url = f"ws://127.0.0.1:{site.front}/realtime/"
        clients = await Clients.start(url, args.clients, args.client_processes, args.client_loop)
        opening = asyncio.create_task(clients.ask({"do": "connect"}, timeout=240))
        tasks.append(opening)
        while not opening.done():
            await asyncio.wait([opening], timeout=1)
            progress(f"{mode}: {sum(clients.open)}/{args.clients} clients open")
        await opening
        # the well-behaved client and the publisher in a process of their own: the latency
        # is the servers', the rate is kept, whatever the work for thousands of clients
        pinger = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--side",
            url,
            str(args.rate),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE,
        )
        pinger_box.append(pinger)
        assert pinger.stdout is not None and pinger.stdin is not None
        if (await pinger.stdout.readline()).strip() != b"ready":
            raise RuntimeError("the pinger did not connect")

        async def sample() -> None:
            assert clients is not None
            while not stopping.is_set():
                samples.append((time.monotonic(), established(site.ports), args.clients - clients.opened()))
                await asyncio.sleep(SAMPLE_S)

        tasks.append(asyncio.create_task(sample()))
        await asyncio.sleep(10)  # before the deploy: the idle figures
        await clients.ask({"do": "deploy"})
        first_stop = time.monotonic()
        cpu0 = [cpu_seconds(worker.pid) for worker in clients.workers]
        restarting: list[tuple[float, float, int]] = []
        for i in range(PROCESSES):
            began = time.monotonic()
            site.route(i, up=False)
            proc = site.procs[i]
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            progress(f"{mode}: process {i + 1} stopping")
            while proc.poll() is None:
                await asyncio.sleep(0.1)
            site.start(i)
            await asyncio.to_thread(wait_port, site.ports[i], site.procs[i])
            site.route(i, up=True)
            restarting.append((began, time.monotonic(), i))
            progress(f"{mode}: process {i + 1} back after {time.monotonic() - began:.1f} s")
        deadline = time.monotonic() + 180
        while clients.opened() < args.clients and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        deploy_end = time.monotonic()
        back = deploy_end - first_stop
        clients.check()  # a lost worker said so, before its /proc entry is read
        client_cpu = sum(cpu_seconds(w.pid) for w in clients.workers) - sum(cpu0)
        # the clients not back, by how their last connection ended (a final close stops a client)
        left = await clients.ask({"do": "away"})
        pinger.stdin.write(b"stop\n")
        await pinger.stdin.drain()
        side = json.loads(await asyncio.wait_for(pinger.stdout.read(), 60))
        offset = time.monotonic() - time.time()  # the side process's wall times, on this clock
        pings.extend((t + offset, ms) for t, ms in side["pings"])
        published.extend((t + offset, seq) for t, seq in side["published"])
        stopping.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        # resumes still replaying: wait until every client holds what was published (or 60 s)
        due = [seq for t, seq in published if t >= first_stop - 5]
        settle_deadline = time.monotonic() + 60
        while time.monotonic() < settle_deadline and sum(
            reply["missing"] for reply in await clients.ask({"do": "missing", "seqs": due})
        ):
            await asyncio.sleep(1)
        recovered = time.monotonic() - deploy_end
        finals = await clients.ask({"do": "finish", "seqs": due})
    finally:
        stopping.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if clients is not None:
            await clients.aclose()
        for process in pinger_box:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        site.stop_all()
        shutil.rmtree(root, ignore_errors=True)
    missing = [n for final in finals for n in final["missing"]]
    lacking = {seq for final in finals for seq in final["lacking"]}
    latest: dict[int, float] = {}
    for final in finals:
        for seq, t in final["latest"].items():
            if t is not None:
                latest[int(seq)] = max(t, latest.get(int(seq), t))
    closes: dict[str, collections.Counter[str]] = {"connecting": collections.Counter(), "deploy": collections.Counter()}
    away: collections.Counter[str] = collections.Counter()
    for final in finals:
        for when in closes:
            closes[when].update(final["closes"][when])
    for reply in left:
        away.update(reply["away"])
    row = summarize(mode, drain, args, samples, pings, due, missing, lacking, first_stop, deploy_end, back, restarting)
    row["resumed_all_after_s"] = round(recovered, 1)
    row["caught_up_after_s"] = caught_up(published, lacking, latest, first_stop, restarting[-1][1])
    row["not_back_by_last_close"] = dict(away.most_common(10))
    row["closes_before_deploy"] = dict(closes["connecting"].most_common(8))
    row["closes_by_reason"] = dict(closes["deploy"].most_common(8))
    row["ways_back"] = ways_back_summary([way for final in finals for way in final["ways"]])
    row["client_cpu_during_deploy"] = round(client_cpu / back, 2)  # cores, on average
    row["client_processes"] = args.client_processes
    row["client_loop"] = args.client_loop
    return row


def caught_up(
    published: list[tuple[float, int]],
    lacking: set[int],
    latest: dict[int, float],
    first_stop: float,
    last_back: float,
) -> float | None:
    """Seconds from the last process back until every client held every publication made
    up to then (each frame's own arrival: no polling step, nothing of the bench's teardown);
    0 when every client held them all already; None when some client never got one."""
    due = [seq for t, seq in published if first_stop - 5 <= t <= last_back]
    if any(seq in lacking for seq in due):
        return None
    return round(max([0.0, *(latest[seq] - last_back for seq in due)]), 2)


def summarize(
    mode: str,
    drain: float,
    args: argparse.Namespace,
    samples: list[tuple[float, list[int], int]],
    pings: list[tuple[float, float]],
    seqs: list[int],
    missing: list[int],
    lacking: set[int],
    first_stop: float,
    deploy_end: float,
    back: float,
    restarting: list[tuple[float, float, int]],
) -> dict[str, Any]:
    """``seqs``: the publications made while every client was subscribed; ``missing``:
    how many of them each client lacks; ``lacking``: those some client lacks (lost)."""
    lost_publications = len(lacking)
    # handshakes per second on the processes not restarting at that moment (their growth)
    peak = 0.0
    for (t0, c0, _), (t1, c1, _) in zip(samples, samples[1:], strict=False):
        busy = {i for began, ended, i in restarting if began - 1 <= t1 and t0 <= ended + 1}
        for i in range(PROCESSES):
            if i not in busy and t1 > t0:
                peak = max(peak, (c1[i] - c0[i]) / (t1 - t0))
    # closed at once: the most connections one process lost per second, between two readings
    pairs = list(zip(samples, samples[1:], strict=False))
    dropped = max(
        (max(c0[i] - c1[i] for i in range(PROCESSES)) / max(t1 - t0, SAMPLE_S) for (t0, c0, _), (t1, c1, _) in pairs),
        default=0.0,
    )
    idle = [ms for t, ms in pings if t < first_stop]
    during = [ms for t, ms in pings if first_stop <= t <= deploy_end]
    row = {
        "mode": mode,
        "drain_seconds": drain,
        "clients": args.clients,
        "rate": args.rate,
        "publications": len(seqs),
        "publications_lost": lost_publications,
        "frames_missed": sum(missing),
        "clients_missing_any": sum(1 for m in missing if m),
        "closes_per_s_peak": round(dropped),
        "disconnected_at_once": max((down for t, _, down in samples if t >= first_stop), default=0),
        "handshakes_per_s_peak": round(peak, 1),
        "ping_p99_idle_ms": percentile(idle, 99),
        "ping_p99_deploy_ms": percentile(during, 99),
        "back_after_s": round(back, 1),
        "series": [(round(t - first_stop, 2), counts) for t, counts, _ in samples],
    }
    progress(
        f"{mode}: lost {lost_publications}, at once {row['disconnected_at_once']}, "
        f"peak {row['handshakes_per_s_peak']}/s, back after {row['back_after_s']} s"
    )
    return row


def report(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'mode':<10}{'lost':>6}{'missed':>8}{'closes/s peak':>14}{'away at once':>13}{'hs/s peak':>11}"
        f"{'ping p99 idle':>15}{'ping p99 deploy':>17}{'all back s':>12}{'resumed s':>11}{'caught up s':>13}"
    )
    for row in rows:
        caught = "never" if row["caught_up_after_s"] is None else row["caught_up_after_s"]
        print(
            f"{row['mode']:<10}{row['publications_lost']:>6}{row['frames_missed']:>8}{row['closes_per_s_peak']:>14}"
            f"{row['disconnected_at_once']:>13}{row['handshakes_per_s_peak']:>11.0f}"
            f"{row['ping_p99_idle_ms']:>15.1f}{row['ping_p99_deploy_ms']:>17.1f}{row['back_after_s']:>12.1f}"
            f"{row['resumed_all_after_s']:>11.1f}{caught:>13}"
        )
    for row in rows:
        print(f"{row['mode']}: the clients' closes while they first connected: {row['closes_before_deploy']}")
        print(
            f"{row['mode']}: the clients' closes from the first stop on, by code and reason: {row['closes_by_reason']}"
        )
        ways = row.get("ways_back") or {}
        if ways.get("clients"):
            print(
                f"{row['mode']}: each client's longest way back (close to open), {ways['clients']} clients "
                f"({ways['not_back']} not back): p50 {ways['p50_s']} s, p99 {ways['p99_s']} s, max {ways['max_s']} s; "
                f"slowest: {ways['slowest']}"
            )
        print(
            f"{row['mode']}: the clients' {row['client_processes']} {row['client_loop']} process(es) used "
            f"{row['client_cpu_during_deploy']} cores during the deploy"
        )
        if row["not_back_by_last_close"]:
            print(f"{row['mode']}: clients not back, by their last close: {row['not_back_by_last_close']}")
    if len(rows) == 2:
        drained, immediate = rows
        print(
            f"drained vs immediate: disconnected at once {drained['disconnected_at_once']} vs "
            f"{immediate['disconnected_at_once']}, peak handshakes {drained['handshakes_per_s_peak']:.0f}/s vs "
            f"{immediate['handshakes_per_s_peak']:.0f}/s"
        )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 3.2 * len(rows)), sharex=True)
    for ax, row in zip(axes if len(rows) > 1 else [axes], rows, strict=True):
        times = [t for t, _ in row["series"]]
        for i in range(PROCESSES):
            ax.plot(times, [counts[i] for _, counts in row["series"]], label=f"process {i + 1}")
        ax.set_title(f"{row['mode']} (DRAIN_SECONDS {row['drain_seconds']}): {row['clients']} clients")
        ax.set_ylabel("connections")
        ax.legend(loc="upper right")
    axes_list = axes if len(rows) > 1 else [axes]
    axes_list[-1].set_xlabel("seconds since the first stop")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


async def side_main(url: str, rate: float) -> None:
    """``--side``: one client calling ``ping`` ten times a second, and ``rate`` publications
    per second on ``demo:events``; "ready", then on "stop" from stdin
    ``{"pings": [[wall time, ms], ...], "published": [[wall time, seq], ...]}``."""
    import django

    django.setup()
    from realtime_app import apublish
    from realtime_app.client import RealtimeClient

    client = RealtimeClient(url, origin="http://127.0.0.1", headers={"X-Forwarded-For": "10.255.255.254"})
    await client.connect(timeout=60)
    print("ready", flush=True)
    pings: list[tuple[float, float]] = []
    published: list[tuple[float, int]] = []
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    async def ping() -> None:
        while not stop.done():
            t0, wall = time.monotonic(), time.time()
            with contextlib.suppress(Exception):
                await client.call("ping", {}, timeout=10)
                pings.append((wall, (time.monotonic() - t0) * 1000))
            await asyncio.sleep(0.1)

    async def publish() -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.done():
            published.append((time.time(), await apublish("demo:events", {"t": time.time()})))
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - loop.time()))

    await asyncio.gather(ping(), publish())
    print(json.dumps({"pings": pings, "published": published}), flush=True)
    await client.close()
    from realtime_app.hub import running_hub

    hub = running_hub()
    if hub is not None:
        await hub.aclose()


async def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--side":
        await side_main(sys.argv[2], float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=10)
    parser.add_argument(
        "--drain", type=float, default=20, help="DRAIN_SECONDS of the drained mode (20: the setting's default)"
    )
    parser.add_argument("--modes", nargs="+", default=["drained", "immediate"])
    parser.add_argument(
        "--anonymous-handshakes",
        type=float,
        help="MAX_ANONYMOUS_HANDSHAKES_PER_S of each process (a bigger site's drain against its survivors' bucket)",
    )
    parser.add_argument("--client-processes", type=int, default=2, help="worker processes the clients are split over")
    parser.add_argument(
        "--client-loop", choices=["uvloop", "asyncio"], default="uvloop", help="the clients' event loop"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if not 1 <= args.client_processes <= args.clients:
        parser.error("--client-processes: at least 1, and at most one per client")
    url = os.environ.get("REDIS_URL")
    if not url:
        sys.exit("set REDIS_URL (e.g. redis://127.0.0.1:6379/0)")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    prefix = f"bench-{secrets.token_hex(3)}"
    db = Path(tempfile.mkdtemp()) / "db.sqlite3"
    base_env = {
        **prepare_database(str(db)),
        "REDIS_URL": url,
        "REALTIME_KEY_PREFIX": prefix,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
    }
    os.environ.update(base_env)
    import django

    django.setup()
    import redis

    rows = []
    try:
        for mode in args.modes:
            print(f"== {mode}", file=sys.stderr)
            rows.append(await run_mode(mode, args, base_env))
    finally:
        from realtime_app.hub import running_hub

        hub = running_hub()
        if hub is not None:
            await hub.aclose()
        r = redis.Redis.from_url(url)
        for key in r.scan_iter(match=f"{prefix}*"):
            r.delete(key)
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    asyncio.run(main())
