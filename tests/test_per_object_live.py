"""Channels per object, black-box: two daphne processes of the demo site on Redis, through
the names of SPEC §12 — rooms isolated with their own history and resume, a lot that does
not exist refused, a lot's price reaching every subscriber of a cadence on both processes
at its pace, with the same seqs, from one publisher in the cluster."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
import redis

from realtime_app.wire.names import group_name
from tests.support.servers import login, prepare_database, servers
from tests.support.wsclient import RPC, call_honouring_refusals

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


@pytest.fixture(params=["sqlite", "postgresql"])
def demo_cluster(redis_url, tmp_path, request):
    """Two daphne processes of the demo site on one database — an SQLite file, or this
    run's PostgreSQL database (its constraints: a message's required user, a lot's row
    lock) — and the real Redis, with a key prefix of their own (deleted after); and the
    lot the test bids on (one of its own on the shared PostgreSQL database)."""
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-obj-{secrets.token_hex(3)}"
    if request.param == "postgresql":
        database, lot = {"DATABASE_URL": request.getfixturevalue("postgres")[1]}, 17
    else:
        database, lot = prepare_database(str(tmp_path / "db.sqlite3")), 7
    env = {**database, "REDIS_URL": redis_url, "REALTIME_KEY_PREFIX": prefix}
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with servers(2, env) as procs:
        yield procs, client, prefix, lot
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


async def until(rpc: RPC, predicate, timeout: float = 15) -> list[dict]:
    """Frames of ``rpc`` until one satisfies ``predicate`` (that one last)."""
    got: list[dict] = []
    while not got or not predicate(got[-1]):
        got += await rpc.frames(1, timeout=timeout)
    return got


async def test_rooms_and_lots_on_two_processes(demo_cluster):
    (a, b), client, prefix, lot = demo_cluster
    cookie = login(a.http, "demo", "demo")  # one session, valid on both
    async with (
        RPC(a.ws) as lobby_a,
        RPC(b.ws) as garden_b,
        RPC(b.ws, cookie=cookie) as poster,
    ):
        lobby = await lobby_a.subscribe("demo:room:lobby")
        await garden_b.subscribe("demo:room:garden")
        for n in range(3):
            answer = await poster.call("demo.post", {"room": "lobby", "text": f"hello {n}"})
            assert answer["result"]["room"] == "lobby", answer
        garden_post = await poster.call("demo.post", {"room": "garden", "text": "in the garden"})
        got = await lobby_a.frames(3)
        assert [f["data"] for f in got] == [{"user": "demo", "text": f"hello {n}"} for n in range(3)]
        assert [f["seq"] for f in got] == [lobby["seq"] + 1, lobby["seq"] + 2, lobby["seq"] + 3]
        [garden] = await garden_b.frames(1)  # the garden's first frame is the garden's post: nothing of the lobby
        assert garden["data"] == {"user": "demo", "text": "in the garden"} and garden_post["result"]["id"] > 0
        # published, then rolled back: never delivered (the next frame is the next kept post)
        failed = await poster.call("demo.post", {"room": "garden", "text": "never kept", "fail": True})
        assert failed["error"]["data"]["reason"] == "failed_on_purpose", failed
        await poster.call("demo.post", {"room": "garden", "text": "kept"})
        [kept] = await garden_b.frames(1)
        assert kept["data"]["text"] == "kept" and kept["seq"] == garden["seq"] + 1
        since = {"seq": got[0]["seq"], "epoch": got[0]["epoch"]}

        error = (await lobby_a.call("subscribe", {"channel": "demo:lot:5000"}))["error"]
        assert (error["code"], error["data"]["reason"]) == (-32002, "unknown_channel")

        async with RPC(a.ws) as lot_a, RPC(b.ws) as lot_b:
            await lot_a.subscribe(f"demo:lot:{lot}:250")
            await lot_b.subscribe(f"demo:lot:{lot}:250")
            last = None
            for amount in range(10, 210, 10):  # 20 bids as fast as the server answers them
                answer = await call_honouring_refusals(poster, "demo.bid", {"lot": lot, "amount": amount})
                last = answer["result"]
            assert last == {"lot": lot, "price": 200, "bids": 20}
            final = lambda frame: frame["data"] == last  # noqa: E731
            seen_a, seen_b = await asyncio.gather(until(lot_a, final), until(lot_b, final))
            for seen in (seen_a, seen_b):
                prices = [f["data"]["price"] for f in seen]
                assert prices == sorted(set(prices)), prices  # only changes, in order
                # At most once per 250 ms: exactly on a fake clock in tests/test_instance_lifetime.py
                # (Pacing). Here the stamps are taken when published, after the pacing fired, so
                # a stall delays one stamp and shortens one gap: the frames' span is checked
                # instead, allowing one period for such a stall.
                span = seen[-1]["ts"] - seen[0]["ts"]
                assert span >= (len(seen) - 2) * 250, ([f["ts"] for f in seen], span)
            published = lambda seen: {f["seq"]: f["data"] for f in seen if f["seq"]}  # noqa: E731
            common = set(published(seen_a)) & set(published(seen_b))
            assert max(published(seen_a)) == max(published(seen_b)) in common  # the last frame: one seq on both
            assert all(published(seen_a)[s] == published(seen_b)[s] for s in common)
            holders = client.get(f"{prefix}:lease:{group_name(f'demo:lot:{lot}:250')}")
            assert holders is not None  # one lease for the instance and cadence, held by one process

            async with RPC(b.ws) as newcomer:  # a new subscriber gets the value at once, not 10 s later
                await newcomer.subscribe(f"demo:lot:{lot}:10000")
                [first] = await newcomer.frames(1, timeout=5)
                assert first["data"] == last

    async with RPC(a.ws) as first_a, RPC(b.ws) as first_b:  # a slow ticker's value, at once on the other process
        await first_a.subscribe("demo:clock:60000")
        [tick] = await first_a.frames(1, timeout=10)  # its first tick comes when it starts
        await first_b.subscribe("demo:clock:60000")
        [again_b] = await first_b.frames(1, timeout=10)  # asked of the ticker's process: not 60 s later
        assert again_b["data"] == tick["data"] and again_b["seq"] == tick["seq"]  # that frame: nothing republished

    async with RPC(b.ws) as again:  # the lobby resumes from its own seq, on the other process
        answer = await again.call("subscribe", {"channel": "demo:room:lobby", "since": since}, timeout=10)
        assert answer["result"]["recovered"] is True and answer["result"]["replayed"] == 2


def _lot_value(base_url: str, lot: int) -> dict:
    """The lot as the database has it: its page renders it."""
    import re
    import urllib.request

    page = urllib.request.urlopen(f"{base_url}/demo/lot/{lot}/", timeout=10).read().decode()
    price, bids = (int(re.search(rf'id="{field}">(\d+)<', page).group(1)) for field in ("price", "bids"))
    return {"lot": lot, "price": price, "bids": bids}


async def test_a_bid_sent_twice_with_one_key_runs_once_across_processes_and_after_a_cut(demo_cluster):
    """``demo.bid`` is idempotent: one key sent on two connections of one user, one on each
    process, raises the price once and both answers are equal; a connection cut after the
    server received the bid and before its answer arrived, the Python client sends it again
    with its key and gets the first answer (the lot shows one bid); a call that is not
    idempotent is never retried silently: it raises OutcomeUnknown."""
    from realtime_app.client import RealtimeClient
    from realtime_app.exceptions import OutcomeUnknown
    from tests.support.postgres import TcpProxy

    (a, b), _, _, lot = demo_cluster
    cookie = login(a.http, "demo", "demo")
    async with RPC(a.ws, cookie=cookie) as on_a, RPC(b.ws, cookie=cookie) as on_b:
        start = _lot_value(b.http, lot)
        key, amount = secrets.token_hex(8), start["price"] + 100
        params = {"lot": lot, "amount": amount, "idempotency_key": key}
        first, second = await asyncio.gather(on_a.call("demo.bid", params), on_b.call("demo.bid", params))
        assert first["result"] == second["result"] == {"lot": lot, "price": amount, "bids": start["bids"] + 1}

    proxy = TcpProxy(a.port).restore()
    url = f"ws://127.0.0.1:{proxy.port}/realtime/"
    try:
        async with RealtimeClient(url, headers={"Cookie": cookie}, backoff_initial=0.05, backoff_max=0.2) as client:
            proxy.drop_before = b'"bids"'  # the bid's answer never arrives: the connection is cut
            answer = await client.call("demo.bid", {"lot": lot, "amount": amount + 100}, idempotent=True, timeout=30)
            assert proxy.dropped == 1 and answer == {"lot": lot, "price": amount + 100, "bids": start["bids"] + 2}
            proxy.drop_before = b'"bids"'
            with pytest.raises(OutcomeUnknown):
                await client.call("demo.bid", {"lot": lot, "amount": amount + 200}, timeout=30)
    finally:
        proxy.cut()
    assert _lot_value(b.http, lot) == {"lot": lot, "price": amount + 200, "bids": start["bids"] + 3}
