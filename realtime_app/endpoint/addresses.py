"""Who is on the other end: the client's address, read through trusted proxies only.

An anonymous client's identity is its address (docs/admission.md): its connections share
one per-identity cap and one token bucket, so opening more sockets or reconnecting buys it
nothing. Behind a reverse proxy every connection comes from the proxy, so the proxy's
forwarding headers are read — but only when the peer is one of ``TRUSTED_PROXIES``;
anyone else could write any address into them. **One** header is read, the one the
proxy is configured to write (``FORWARDED_HEADER``: ``X-Forwarded-For`` by default,
``Forwarded`` (RFC 7239) or ``X-Real-IP``) — never "whichever is present", or a client
could send the other one through a proxy that passes it untouched. The list is walked
from the right (the hop nearest to us), skipping trusted proxies, and the first other
address is the client's.

Pure: no Django import; the trusted networks are passed in.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from functools import lru_cache

from realtime_app.wire.asgi import Scope

__all__ = ["FORWARDED_HEADERS", "client_address", "client_network", "parse_networks", "trusted_networks"]

#: The forwarding headers a proxy may be configured to write (``FORWARDED_HEADER``).
FORWARDED_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """``["10.0.0.0/8", "127.0.0.1", "::1"]`` → networks; raises ``ValueError`` for a bad one."""
    return tuple(ipaddress.ip_network(str(value).strip(), strict=False) for value in values)


@lru_cache(maxsize=8)
def trusted_networks(values: tuple[str, ...]) -> tuple[Network, ...]:
    """:func:`parse_networks`, cached for the settings' tuple."""
    return parse_networks(values)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip().strip('"')
    if text.startswith("["):  # [v6] or [v6]:port
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:  # v4:port
        text = text.split(":", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _trusted(address: str, networks: Sequence[Network]) -> bool:
    ip = _ip(address)
    return ip is not None and any(ip in network for network in networks)


def _header(scope: Scope, name: bytes) -> str | None:
    values = [value for key, value in scope.get("headers") or () if key.lower() == name]
    if not values:
        return None
    return ",".join(value.decode("latin-1") for value in values)


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` of each element of a ``Forwarded`` header, in order."""
    hops: list[str] = []
    for element in value.split(","):
        for pair in element.split(";"):
            key, _, item = pair.strip().partition("=")
            if key.strip().lower() == "for":
                hops.append(item.strip().strip('"'))
    return hops


def client_network(
    address: str,
    v4_prefix: int = 32,  # pragma: no mutate (33 or more: the address itself, as with 32)
    v6_prefix: int = 64,
) -> str:
    """The network an anonymous client is counted by: its IPv4 address (``/32``) and its
    IPv6 ``/64`` by default — one host holds a whole /64, each address of it is not a new
    client. Anything that is not an address is itself."""
    ip = _ip(address)
    if ip is None:
        return address
    # an IPv4 client of a dual-stack bind
    if ip.version == 6 and ip.ipv4_mapped is not None:  # pragma: no mutate (>= 6: the same: 4 or 6)
        ip = ip.ipv4_mapped
    prefix = v4_prefix if ip.version == 4 else v6_prefix  # pragma: no mutate (<= 4: the same)
    if prefix >= ip.max_prefixlen:
        return str(ip)
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


def client_address(scope: Scope, trusted: Sequence[Network] = (), header: str = "X-Forwarded-For") -> str:
    """The client's address for ``scope``: the peer's, or — when the peer is a trusted
    proxy — the nearest untrusted hop its forwarding ``header`` names (the leftmost when
    every hop is trusted; any other forwarding header is ignored). A malformed hop ends
    the walk at the last good address."""
    client = scope.get("client")
    peer = str(client[0]) if client else "unknown"
    if not trusted or not _trusted(peer, trusted):
        return peer
    value = _header(scope, header.lower().encode("latin-1"))
    if value is None:
        hops: list[str] = []
    elif header.lower() == "forwarded":  # pragma: no mutate (<=: the same for the three headers allowed)
        hops = _forwarded_for(value)
    else:
        hops = [hop.strip() for hop in value.split(",")]
    address = peer
    for hop in reversed(hops):
        ip = _ip(hop)
        if ip is None:
            break  # "unknown", an obfuscated name or garbage: stop at what we know
        address = str(ip)
        if not any(ip in network for network in trusted):
            break
    return address
