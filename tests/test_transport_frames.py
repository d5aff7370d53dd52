"""The hub's own framing on daphne (docs/performance.md): a publication's text frame is
built once and written to every subscriber's socket as is. These tests pin it to the bytes
autobahn (26, the version check W020 names) would have written, and to its conditions:
per-message compression, server masking or automatic fragmentation fall back to autobahn."""

from __future__ import annotations

import pytest
from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from twisted.internet.testing import StringTransport

from realtime_app.outbound import daphne
from realtime_app.outbound.base import text_frame
from realtime_app.outbound.daphne import DaphneTransport


def autobahn_protocol() -> tuple[WebSocketServerProtocol, StringTransport]:
    factory = WebSocketServerFactory()
    factory.protocol = WebSocketServerProtocol
    protocol = factory.buildProtocol(None)
    wire = StringTransport()
    wire.dataBuffer, wire.offset, wire._tempDataLen = b"", 0, 0  # what the guard reads on TCP
    wire._writeDisconnected = False
    wire.fileno = lambda: -1
    protocol.makeConnection(wire)
    protocol.state = protocol.STATE_OPEN
    return protocol, wire


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_the_frame_is_byte_for_byte_what_autobahn_writes(size):
    protocol, wire = autobahn_protocol()
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    protocol.sendMessage(payload, False)
    assert wire.value() == text_frame(payload)


def test_daphne_connections_get_the_frame_as_is():
    protocol, wire = autobahn_protocol()
    transport = DaphneTransport(protocol)
    payload = b'{"jsonrpc":"2.0","method":"message"}'
    assert transport.write(payload, text_frame(payload))
    assert transport._direct is True and wire.value() == text_frame(payload)


@pytest.mark.parametrize(
    "setting",
    [
        ("_perMessageCompress", object()),  # permessage-deflate negotiated: compressed per connection
        ("autoFragmentSize", 16),
        ("trackedTimings", object()),
        ("logFrames", True),
    ],
)
def test_anything_that_changes_the_bytes_falls_back_to_autobahn(setting, monkeypatch):
    protocol, wire = autobahn_protocol()
    monkeypatch.setattr(protocol, setting[0], setting[1], raising=False)
    sent = []
    monkeypatch.setattr(protocol, "sendMessage", lambda payload, binary: sent.append(payload))
    transport = DaphneTransport(protocol)
    assert transport.write(b"x", text_frame(b"x"))
    assert transport._direct is False and sent == [b"x"] and wire.value() == b""


def test_a_frame_over_the_message_limit_goes_through_autobahn_which_refuses_it():
    protocol, wire = autobahn_protocol()
    protocol.maxMessagePayloadSize = 10
    transport = DaphneTransport(protocol)
    with pytest.raises(Exception, match="exceeding payload limit"):
        transport.write(b"x" * 11, text_frame(b"x" * 11))  # the hub closes that connection with 1011
    assert wire.value() == b""


def test_masking_servers_fall_back(monkeypatch):
    protocol, wire = autobahn_protocol()
    monkeypatch.setattr(protocol, "maskServerFrames", True)
    transport = DaphneTransport(protocol)
    transport.write(b"x", text_frame(b"x"))
    written = wire.value()
    # autobahn wrote it, masked: FIN + text, the mask bit and length 1, a 4-byte key, 1 byte
    assert transport._direct is False and written[:2] == b"\x81\x81" and len(written) == 2 + 4 + 1


class Socket:
    """A socket that takes ``room`` bytes, then would block."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.sent = b""

    def send(self, data: bytes) -> int:
        if not self.room:
            raise BlockingIOError
        taken = data[: self.room]
        self.room -= len(taken)
        self.sent += taken
        return len(taken)


def test_a_frame_goes_to_the_socket_at_once_and_what_it_does_not_take_to_twisted_in_order():
    protocol, wire = autobahn_protocol()
    wire.disconnecting, wire.connected = False, 1
    wire.socket = sock = Socket(room=10)
    queued = []
    wire.write = queued.append  # Twisted's buffer (StringTransport keeps no dataBuffer)
    transport = DaphneTransport(protocol)
    first, second = text_frame(b"a" * 20), text_frame(b"b" * 5)
    transport.write(b"a" * 20, first)
    assert sock.sent == first[:10] and queued == [first[10:]]  # the rest waits in Twisted, in order
    wire.dataBuffer = b"".join(queued)  # as Twisted would hold it
    transport.write(b"b" * 5, second)
    assert queued == [first[10:], second] and sock.sent == first[:10]  # behind what waits, not before it


@pytest.fixture
def gate(monkeypatch):
    """The version gate, read afresh by each test; ``gate(shut=True)`` fakes untested versions."""
    from importlib import metadata

    real = metadata.version

    from realtime_app.conf.runtime import runtime

    fence = runtime().part(daphne.DaphneFence)

    def set_gate(*, shut: bool) -> None:
        fence.tested = None  # read again, as in a fresh process
        if shut:
            monkeypatch.setattr(
                daphne.metadata, "version", lambda name: "99.0" if name in daphne.TESTED else real(name)
            )

    yield set_gate
    fence.tested = None


def test_untested_versions_shut_the_direct_path_with_one_warning(gate, caplog, monkeypatch):
    gate(shut=True)
    monkeypatch.setattr(daphne, "SendAtOnce", None)  # the private path must not be taken
    assert daphne.untested() == ["daphne 99.0", "autobahn 99.0", "twisted 99.0"]
    protocol, wire = autobahn_protocol()
    wire.socket = Kernel(1 << 20)  # plain TCP: only the gate keeps the direct path shut
    transport = DaphneTransport(protocol)
    payloads = [b'{"n":1}', b'{"n":2}']
    with caplog.at_level("WARNING", logger="realtime_app.backpressure"):
        for payload in payloads:
            assert transport.write(payload, text_frame(payload))
    assert wire.value() == b"".join(text_frame(p) for p in payloads)  # the same bytes, through autobahn
    warned = [r for r in caplog.records if "not the series realtime_app was tested with" in r.getMessage()]
    assert len(warned) == 1


def test_the_tested_versions_open_the_gate(gate):
    gate(shut=False)
    assert daphne.untested() == [] and daphne.internals_tested()


@pytest.mark.parametrize("mode", ["prepared", "message"])
def test_autobahns_public_paths_write_the_same_bytes(mode, monkeypatch):
    monkeypatch.setattr(DaphneTransport, "write_mode", mode)
    frames = []
    for payload in (b"x" * 10, b"y" * 70000):
        protocol, wire = autobahn_protocol()
        frame = text_frame(payload)
        assert DaphneTransport(protocol).write(payload, frame)
        frames.append(wire.value() == frame)
    assert frames == [True, True]


def test_a_publication_is_prepared_once_for_all_connections(monkeypatch):
    monkeypatch.setattr(DaphneTransport, "write_mode", "prepared")
    prepared = []
    payload = b'{"same":"publication"}'
    frame = text_frame(payload)
    for _ in range(3):
        protocol, wire = autobahn_protocol()
        real = protocol.factory.prepareMessage
        protocol.factory.prepareMessage = lambda p, real=real: prepared.append(p) or real(p)
        DaphneTransport(protocol).write(payload, frame)
        assert wire.value() == frame
    assert prepared == [payload]  # built once, written three times


class Kernel:
    """A socket's send queue: ``send`` takes what fits in ``size`` bytes; the client
    reads with ``read``; ``queue`` is what SIOCOUTQ would say."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queue = 0
        self.sent = b""
        self.reads = 0  # SIOCOUTQ reads

    def send(self, data: bytes) -> int:
        room = self.size - self.queue
        if not room:
            raise BlockingIOError
        taken = data[:room]
        self.queue += len(taken)
        self.sent += taken
        return len(taken)

    def read(self, n: int) -> None:
        self.queue -= min(n, self.queue)

    def outq(self, fileno: int) -> int:
        self.reads += 1
        return self.queue


def on_kernel(monkeypatch, size: int = 1 << 20) -> tuple[WebSocketServerProtocol, StringTransport, Kernel, list[bytes]]:
    """An open autobahn protocol over a plain-TCP-like transport whose socket is ``Kernel``;
    what Twisted would buffer goes to the returned list."""
    protocol, wire = autobahn_protocol()
    wire.disconnecting, wire.connected = False, 1
    wire.socket = kernel = Kernel(size)
    twisted: list[bytes] = []
    wire.write = twisted.append
    monkeypatch.setattr(daphne, "kernel_queue", kernel.outq)
    return protocol, wire, kernel, twisted


def test_autobahns_own_writes_go_to_the_socket_at_once(monkeypatch):
    """Found: a ping (and every reply autobahn framed) went through Twisted's buffer — two
    epoll_ctl calls and a turn of the loop each — while the fanned-out frames did not."""
    protocol, wire, kernel, twisted = on_kernel(monkeypatch)
    DaphneTransport(protocol)
    protocol.sendPing(b"p")
    protocol.sendMessage(b"reply", False)
    assert kernel.sent == b"\x89\x01p" + text_frame(b"reply") and twisted == []


def test_small_writes_cost_the_guard_no_read_of_the_kernels_queue(monkeypatch):
    """Found: the guard read the kernel's queue (an ioctl) before every frame, though
    frames that all went to the kernel and add up to little cannot reach the threshold."""
    from realtime_app.outbound.backpressure import SEND, BackpressureConfig
    from realtime_app.outbound.guard import Guard

    protocol, wire, kernel, twisted = on_kernel(monkeypatch)
    transport = DaphneTransport(protocol)
    guard = Guard(None, BackpressureConfig(4000, "drop", 0), transport=transport)  # type: ignore[arg-type]
    payload = b"x" * 90
    decisions = [guard.send(payload, frame=text_frame(payload)) for _ in range(10)]  # 920 bytes: under 1000
    assert decisions == [SEND] * 10 and kernel.reads == 0
    for _ in range(2):  # past a quarter of the threshold: read, then counted afresh
        guard.send(payload, frame=text_frame(payload))
    assert kernel.reads == 1


@pytest.mark.parametrize("seed", range(30))
def test_the_guard_skips_a_read_only_when_the_queue_cannot_exceed_the_bound(monkeypatch, seed):
    """Random writes, client reads and a full socket: ``queued(under)`` is the exact
    queue, or 0 only when the exact queue is at most ``under``."""
    import random

    rng = random.Random(seed)
    protocol, wire, kernel, twisted = on_kernel(monkeypatch, size=rng.choice([200, 2000, 1 << 20]))
    transport = DaphneTransport(protocol)
    under = rng.choice([0, 50, 500, 5000])
    for _ in range(300):
        step = rng.random()
        if step < 0.5:
            size = rng.choice([1, 10, 100, 1000])
            transport.write(b"y" * size, text_frame(b"y" * size))
        elif step < 0.8:
            kernel.read(rng.choice([1, 50, 500, 5000]))
        else:  # Twisted writes what it holds once the socket has room
            while twisted and kernel.queue < kernel.size:
                chunk = twisted.pop(0)
                sent = kernel.send(chunk)
                if sent < len(chunk):
                    twisted.insert(0, chunk[sent:])
            wire.dataBuffer = b"".join(twisted)  # what the guard reads of Twisted's buffer
        wire.dataBuffer = b"".join(twisted)
        exact = kernel.queue + len(wire.dataBuffer)
        seen = transport.queued(under)
        assert seen == exact or (seen == 0 and exact <= under)


def test_an_open_socket_lets_go_of_the_http_request_it_was_upgraded_from(monkeypatch):
    """Found: Twisted's HTTPChannel stayed the TCP transport's producer for the socket's
    life, keeping the upgraded request, its headers and body, and autobahn kept its own
    copies of the handshake: about 5.7 KiB of each connection's 26 KiB of Python heap."""
    import weakref

    from twisted.web.http import HTTPChannel

    protocol, wire, kernel, twisted = on_kernel(monkeypatch)
    channel = HTTPChannel()
    channel.requests = [request := object()]
    wire.registerProducer(channel, True)
    wire.protocol = protocol  # daphne handed the socket over to the WebSocket
    protocol.http_request_data = b"GET /realtime/ HTTP/1.1\r\nHost: x\r\n\r\n"
    protocol.http_headers = {"host": "x"}

    class Request:
        path = "/realtime/"
        headers = protocol.http_headers

    protocol.request = Request()
    gone = weakref.ref(channel)
    transport = DaphneTransport(protocol)
    assert transport.write(b"x", text_frame(b"x"))  # the first frame: the socket is open
    assert wire.producer is None and channel.requests == [] and request is not None
    del channel
    assert gone() is None  # nothing else held it
    assert protocol.http_request_data is None and protocol.http_headers is None
    assert protocol.request.path == "/realtime/" and not hasattr(protocol.request, "headers")  # daphne's log reads it
    assert kernel.sent == text_frame(b"x")


def test_the_direct_writer_keeps_no_closed_connection_alive(monkeypatch):
    """Found (review): the writer installed as the connection's ``write`` held the
    connection: a cycle that kept a closed connection and its unsent buffers until a full
    collection."""
    import gc
    import weakref

    protocol, wire, kernel, twisted = on_kernel(monkeypatch)
    DaphneTransport(protocol)
    gone = weakref.ref(wire)
    gc.disable()
    try:
        protocol.transport = None
        del wire
        assert gone() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_bytes_twisted_holds_without_our_write_make_the_guard_read(monkeypatch):
    """Found (review): ``writeSequence`` puts bytes in Twisted's buffer without our
    ``write``: the guard must not answer 0 while Twisted holds them."""
    protocol, wire, kernel, twisted = on_kernel(monkeypatch)
    transport = DaphneTransport(protocol)
    assert transport.queued(1000) == 0 and kernel.reads == 0
    wire._tempDataLen = 5000  # what writeSequence leaves
    assert transport.queued(1000) == 5000 and kernel.reads == 1


class UvicornWire:
    """asyncio's transport of a uvicorn connection, as the guard reads it."""

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, chunks) -> None:
        self.written += b"".join(chunks)

    def get_write_buffer_size(self) -> int:
        return self.held

    def __init__(self, tls: bool = False) -> None:
        self.held = 0  # asyncio's write buffer
        self.written = b""
        self.tls = tls

    def get_extra_info(self, name: str):
        return object() if name == "sslcontext" and self.tls else None

    def is_closing(self) -> bool:
        return False


def uvicorn_protocol(tls: bool = False):
    from websockets.server import ServerProtocol

    class Protocol:
        close_sent = False
        conn = ServerProtocol()
        writable = None

    protocol = Protocol()
    protocol.conn.state = protocol.conn.state.OPEN
    protocol.transport = UvicornWire(tls)
    return protocol


def test_uvicorn_bytes_asyncio_held_at_a_read_count_until_read_again(monkeypatch):
    """Found (review): under uvicorn a read forgot what asyncio held then; flushed to the
    kernel later, uncounted, the guard answered 0 with 900 KB queued."""
    from realtime_app.outbound import uvicorn
    from realtime_app.outbound.uvicorn import UvicornTransport

    protocol = uvicorn_protocol()
    transport = UvicornTransport(protocol)
    kernel = [0]
    monkeypatch.setattr(uvicorn, "kernel_queue", lambda fileno: kernel[0])
    protocol.transport.real.held = 900_000
    assert transport.buffered() == 900_000
    protocol.transport.real.held, kernel[0] = 0, 900_000  # asyncio flushed it to the kernel
    assert transport.queued(250_000) == 900_000


def test_uvicorn_writes_of_its_own_count_too(monkeypatch):
    """Found (review): only the guard's own writes were counted under uvicorn; uvicorn's
    pings and close frames, and binary messages sent past the guard, were not."""
    from realtime_app.outbound import uvicorn
    from realtime_app.outbound.uvicorn import UvicornTransport

    protocol = uvicorn_protocol()
    transport = UvicornTransport(protocol)
    reads = []
    monkeypatch.setattr(uvicorn, "kernel_queue", lambda fileno: reads.append(fileno) or 0)
    transport.buffered()
    protocol.transport.write(b"b" * 300_000)  # uvicorn's own write of a binary message
    transport.queued(250_000)
    assert len(reads) == 2  # past the mark: read again
    protocol.transport.writelines([b"p" * 10])
    assert transport.queued(250_000) == 0 and len(reads) == 2
    assert protocol.transport.real.written == b"b" * 300_000 + b"p" * 10


def test_uvicorns_own_tls_reads_the_queue_before_every_frame(monkeypatch):
    """Found (review): under uvicorn's own TLS what its SSL layer handed the TCP transport
    is in no buffer the guard reads, and the counted plaintext is not the wire's bytes:
    no read is skipped there."""
    from realtime_app.outbound import uvicorn
    from realtime_app.outbound.uvicorn import UvicornTransport

    reads = []
    monkeypatch.setattr(uvicorn, "kernel_queue", lambda fileno: reads.append(fileno) or 0)
    transport = UvicornTransport(uvicorn_protocol(tls=True))
    transport.queued(250_000)
    transport.queued(250_000)
    assert len(reads) == 2


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 70000])
def test_uvicorn_connections_get_the_frame_as_is_byte_for_byte_what_websockets_writes(size, monkeypatch):
    """No extension negotiated: the publication's frame, built once, is written as is —
    not framed again per connection by websockets' sans-I/O connection."""
    from realtime_app.outbound.uvicorn import UvicornTransport

    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    reference = uvicorn_protocol()
    reference.conn.send_text(payload)
    protocol = uvicorn_protocol()
    transport = UvicornTransport(protocol)
    monkeypatch.setattr(protocol.conn, "send_text", lambda *a: pytest.fail("framed per connection"))
    assert transport.write(payload, text_frame(payload))
    assert protocol.transport.real.written == b"".join(reference.conn.data_to_send())


def test_uvicorn_connections_with_permessage_deflate_are_framed_per_connection():
    from websockets.extensions.permessage_deflate import PerMessageDeflate

    from realtime_app.outbound.uvicorn import UvicornTransport

    protocol = uvicorn_protocol()
    protocol.conn.extensions = [PerMessageDeflate(False, False, 15, 15)]
    transport = UvicornTransport(protocol)
    payload = b'{"jsonrpc":"2.0","method":"message","params":{"data":"' + b"x" * 500 + b'"}}'
    assert transport.write(payload, text_frame(payload))
    written = protocol.transport.real.written
    assert written != text_frame(payload) and written[0] & 0x40  # RSV1: compressed
    assert len(written) < len(payload)


def test_uvicorn_connections_no_longer_open_take_nothing():
    """A frame to a connection the client is closing reports it (False), never raises."""
    from realtime_app.outbound.uvicorn import UvicornTransport

    protocol = uvicorn_protocol()
    transport = UvicornTransport(protocol)
    protocol.conn.state = protocol.conn.state.CLOSING
    assert transport.write(b"{}", text_frame(b"{}")) is False
    assert transport.write(b"{}") is False
    assert protocol.transport.real.written == b""


def test_uvicorns_wsproto_implementation_is_refused_not_guessed_at():
    """Found: ``uvicorn_protocol`` matched ``--ws wsproto`` too (it has a ``conn``), whose
    first frame then failed; it is refused as an unsupported server instead."""
    import asyncio

    from uvicorn.config import Config
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
    from uvicorn.protocols.websockets.wsproto_impl import WSProtocol
    from uvicorn.server import ServerState

    from realtime_app.outbound.uvicorn import uvicorn_protocol as matches

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    loop = asyncio.new_event_loop()
    try:
        config = Config(app=app)
        wsproto = WSProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        sansio = WebSocketsSansIOProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    finally:
        loop.close()
    assert not matches(wsproto)
    assert matches(sansio)
