"""What an open socket keeps (docs/performance.md, "Memory per connection"): the server's
input queue made lighter, daphne's protocol dict without what every socket of a factory
holds alike, uvicorn's handshake request and answer let go — and each still does all it did."""

from __future__ import annotations

import asyncio
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from realtime_app.outbound import input_queue
from realtime_app.outbound.base import text_frame
from realtime_app.outbound.input_queue import lighten
from tests.support.waiting import eventually


def test_an_unbounded_input_queue_drops_its_putters_and_join_event():
    def held(queue) -> int:
        event = queue._finished
        return sys.getsizeof(queue._putters) + sys.getsizeof(event) + sys.getsizeof(getattr(event, "_waiters", ()))

    queue: asyncio.Queue[int] = asyncio.Queue()
    before = held(queue)
    assert lighten(queue)
    assert held(queue) < before // 10 and not isinstance(queue._finished, asyncio.Event)
    queue.put_nowait(1)
    assert queue.get_nowait() == 1 and queue.empty()


async def test_a_lightened_queue_still_wakes_its_reader():
    queue: asyncio.Queue[str] = asyncio.Queue()
    assert lighten(queue)
    reader = asyncio.ensure_future(queue.get())
    await eventually(lambda: queue._getters, 5, "the reader waiting on the empty queue")
    queue.put_nowait("websocket.receive")
    assert await asyncio.wait_for(reader, 5) == "websocket.receive"
    await queue.put("websocket.disconnect")  # an unbounded put never waits
    assert queue.get_nowait() == "websocket.disconnect"


async def test_joining_a_lightened_queue_says_why_it_cannot():
    queue: asyncio.Queue[int] = asyncio.Queue()
    lighten(queue)
    queue.put_nowait(1)
    with pytest.raises(RuntimeError, match="cannot be joined"):
        await queue.join()


async def test_queues_that_are_not_the_servers_plain_input_queue_are_left_alone(monkeypatch):
    class Mine(asyncio.Queue):
        pass

    bounded: asyncio.Queue[int] = asyncio.Queue(maxsize=3)
    assert not lighten(bounded) and not lighten(Mine()) and not lighten(None)
    joined: asyncio.Queue[int] = asyncio.Queue()
    joined.put_nowait(1)
    waiter = asyncio.ensure_future(joined.join())
    await eventually(lambda: joined._finished._waiters, 5, "the join waiting")
    assert not lighten(joined)  # somebody waits on its join(): it keeps its event
    joined.get_nowait()
    joined.task_done()
    await asyncio.wait_for(waiter, 5)
    monkeypatch.setattr(input_queue, "TESTED", ((2, 7),))
    assert not lighten(asyncio.Queue())  # another Python: asyncio's internals are not guessed at


@given(st.lists(st.one_of(st.integers(0, 9), st.none()), max_size=60))
def test_a_lightened_queue_answers_as_asyncios_does(steps):
    """Any run of puts (an int) and gets (None) gets the same answers from both."""
    plain: asyncio.Queue[int] = asyncio.Queue()
    light: asyncio.Queue[int] = asyncio.Queue()
    assert lighten(light)
    for step in steps:
        if step is None:
            answers = []
            for queue in (plain, light):
                try:
                    answers.append(queue.get_nowait())
                except asyncio.QueueEmpty:
                    answers.append("empty")
            assert answers[0] == answers[1]
        else:
            plain.put_nowait(step)
            light.put_nowait(step)
        assert plain.qsize() == light.qsize() and plain.full() == light.full()


def daphne_socket(factory=None):
    """An open socket of daphne's protocol class, as autobahn leaves it after the handshake."""
    from autobahn.twisted.websocket import WebSocketServerFactory
    from daphne.ws_protocol import WebSocketProtocol
    from twisted.internet.testing import StringTransport

    factory = factory or WebSocketServerFactory()
    factory.protocol = WebSocketProtocol
    protocol = factory.buildProtocol(None)
    wire = StringTransport()
    protocol.makeConnection(wire)
    protocol.state = protocol.STATE_OPEN
    for n in range(30):  # what the handshake and daphne add: the peer, the path, the scope's headers, ...
        setattr(protocol, f"handshake_{n}", n)
    protocol.http_headers = None  # released at the first frame
    return protocol, wire


def test_daphnes_open_socket_keeps_no_copy_of_its_factorys_options():
    """Found: autobahn copies its factory's 29 options onto each protocol, which with the
    handshake's names took the dict past 85 keys: 3.2 KiB a socket instead of 1.5."""
    from autobahn.twisted.websocket import WebSocketServerProtocol

    from realtime_app.outbound.daphne import compact

    protocol, wire = daphne_socket()
    protocol.maxMessagePayloadSize = 12345  # a value of this socket's own
    before = sys.getsizeof(vars(protocol))
    compact(protocol)
    assert sys.getsizeof(vars(protocol)) < before * 0.6
    assert "autoPingInterval" not in vars(protocol) and "http_headers" not in vars(protocol)
    assert protocol.autoPingInterval == protocol.factory.autoPingInterval and protocol.http_headers is None
    assert protocol.maxMessagePayloadSize == 12345 and protocol.handshake_7 == 7
    assert isinstance(protocol, WebSocketServerProtocol) and type(protocol).__name__ == "WebSocketProtocol"
    protocol.sendMessage(b"still framed", False)
    assert wire.value() == text_frame(b"still framed")


def test_sockets_of_one_factory_share_one_class_and_another_factory_gets_its_own():
    from autobahn.twisted.websocket import WebSocketServerFactory

    from realtime_app.outbound.daphne import compact

    first, _ = daphne_socket()
    second, _ = daphne_socket(first.factory)
    other_factory = WebSocketServerFactory()
    other_factory.setProtocolOptions(autoPingInterval=7)
    other, _ = daphne_socket(other_factory)
    for protocol in (first, other, second):  # the factories alternate
        compact(protocol)
    compact(first)  # twice: nothing more happens
    assert type(first) is type(second) and type(other) is not type(first)
    assert first.autoPingInterval == 0 and other.autoPingInterval == 7


async def test_uvicorn_lets_go_of_the_handshake_at_the_first_frame():
    """Found: uvicorn kept the upgrade request and its answer (their headers twice, as
    parsed bytes and as websockets' ``Headers``) for the socket's life: about 4 KiB."""
    import socket

    import uvicorn
    import websockets

    from realtime_app.outbound.transports import transport_for

    seen: dict = {}

    async def app(scope, receive, send):
        assert (await receive())["type"] == "websocket.connect"
        transport = transport_for(send, require_measurable=True)
        protocol = transport.protocol
        request = protocol.request  # websockets' parser holds it for the socket's life
        await send({"type": "websocket.accept"})
        seen["before"] = protocol.request is not None and protocol.response is not None
        transport.write(b"first", text_frame(b"first"))
        seen["after"] = (protocol.request, protocol.response, protocol.queue._putters, len(request.headers))
        while (await receive())["type"] != "websocket.disconnect":
            transport.write(b"echo", text_frame(b"echo"))

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, ws="websockets-sansio", lifespan="off", log_level="warning"
    )
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve())
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while not server.started:
            assert asyncio.get_running_loop().time() < deadline, "uvicorn did not start"
            await asyncio.sleep(0.05)
        async with websockets.connect(f"ws://127.0.0.1:{port}/", compression=None) as ws:
            assert await asyncio.wait_for(ws.recv(), 10) == "first"
            await ws.send("again")
            assert await asyncio.wait_for(ws.recv(), 10) == "echo"
        assert seen["before"] is True
        assert seen["after"] == (None, None, (), 0)
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


def test_an_open_daphne_socket_queues_chopped_sends_as_autobahn_did(monkeypatch):
    """Its empty send queue holds no deque once compacted; a chopped send still queues in order."""
    from realtime_app.outbound.daphne import SendQueue, compact

    protocol, wire = daphne_socket()
    compact(protocol)
    assert type(protocol.send_queue) is SendQueue and len(protocol.send_queue) == 0
    assert sys.getsizeof(protocol.send_queue) < 100
    monkeypatch.setattr(protocol, "_trigger", lambda: None)  # what the reactor would run next
    protocol.sendData(b"abcd", chopsize=2)
    assert len(protocol.send_queue) == 2
    assert protocol.send_queue.popleft() == (b"ab", True) and protocol.send_queue.popleft() == (b"cd", True)
    with pytest.raises(IndexError):
        SendQueue().popleft()


@pytest.mark.django_db(transaction=True)
async def test_the_auth_stack_copies_a_handshakes_scope_once_and_never_changes_the_callers():
    """Found: the stack copied the scope twice (cookies and session, then the Bearer read);
    both copies stayed for the socket's life."""
    from realtime_app.endpoint.auth import authenticated
    from realtime_app.endpoint.tokens import AUTH_STACK, with_token

    scope = {"type": "websocket", "headers": [(b"cookie", b"sessionid=none")], "path": "/realtime/"}
    given = dict(scope)
    result = await authenticated(scope)
    assert scope == given  # the server's scope, as it was
    assert result is not scope and result[AUTH_STACK] is True and not result["user"].is_authenticated
    mine = dict(given)
    assert await with_token(mine, owned=True) is mine and mine[AUTH_STACK] is True
    copied = await with_token(given)
    assert copied is not given and AUTH_STACK not in given and copied[AUTH_STACK] is True
