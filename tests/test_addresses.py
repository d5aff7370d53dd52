"""The client's address (realtime_app.endpoint.addresses): forwarding headers read from trusted
proxies only, from the right, stopping at the first untrusted or malformed hop."""

from __future__ import annotations

import pytest

from realtime_app.endpoint.addresses import client_address, parse_networks

TRUSTED = parse_networks(["127.0.0.1", "10.0.0.0/8", "::1"])


def scope(peer: str, **headers: str) -> dict:
    return {
        "client": (peer, 5000),
        "headers": [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()],
    }


@pytest.mark.parametrize(
    ("peer", "headers", "expected"),
    [
        ("203.0.113.9", {}, "203.0.113.9"),  # no proxy
        ("203.0.113.9", {"x_forwarded_for": "198.51.100.1"}, "203.0.113.9"),  # not trusted: header ignored
        ("127.0.0.1", {"x_forwarded_for": "198.51.100.1"}, "198.51.100.1"),
        ("127.0.0.1", {"x_forwarded_for": "6.6.6.6, 198.51.100.1"}, "198.51.100.1"),  # a forged first hop
        ("127.0.0.1", {"x_forwarded_for": "198.51.100.1, 10.1.2.3"}, "198.51.100.1"),  # a chain of proxies
        ("127.0.0.1", {"x_forwarded_for": "10.1.2.3, 10.4.5.6"}, "10.1.2.3"),  # all trusted: the leftmost
        ("127.0.0.1", {"x_forwarded_for": "garbage, 198.51.100.1"}, "198.51.100.1"),
        ("127.0.0.1", {"x_forwarded_for": "198.51.100.1, unknown"}, "127.0.0.1"),  # stop at what we know
        # found: a client-sent Forwarded, passed untouched by nginx, won over the X-Forwarded-For
        # nginx wrote; only the configured header is read
        ("127.0.0.1", {"forwarded": "for=6.6.6.6", "x_forwarded_for": "198.51.100.1"}, "198.51.100.1"),
        ("127.0.0.1", {"forwarded": "for=6.6.6.6"}, "127.0.0.1"),
        ("127.0.0.1", {"x_real_ip": "6.6.6.6"}, "127.0.0.1"),
        ("::1", {"x_forwarded_for": "198.51.100.1"}, "198.51.100.1"),
        ("127.0.0.1", {}, "127.0.0.1"),  # a trusted peer without a header is the client
    ],
)
def test_the_client_is_the_nearest_untrusted_hop(peer, headers, expected):
    assert client_address(scope(peer, **headers), TRUSTED) == expected


def test_without_trusted_proxies_the_peer_is_the_client():
    assert client_address(scope("127.0.0.1", x_forwarded_for="198.51.100.1")) == "127.0.0.1"
    assert client_address({"headers": []}) == "unknown"


def test_bad_networks_are_refused():
    with pytest.raises(ValueError):
        parse_networks(["10.0.0.0/33"])
    with pytest.raises(ValueError):
        parse_networks(["nginx"])


@pytest.mark.parametrize(
    ("header", "headers", "expected"),
    [
        ("Forwarded", {"forwarded": 'for=192.0.2.60;proto=http, for="[2001:db8::1]:4711"'}, "2001:db8::1"),
        ("Forwarded", {"forwarded": "for=192.0.2.60:8080", "x_forwarded_for": "6.6.6.6"}, "192.0.2.60"),
        ("Forwarded", {"x_forwarded_for": "6.6.6.6"}, "127.0.0.1"),  # not the configured header
        ("X-Real-IP", {"x_real_ip": "198.51.100.7", "x_forwarded_for": "6.6.6.6"}, "198.51.100.7"),
    ],
)
def test_only_the_configured_header_is_read(header, headers, expected):
    assert client_address(scope("127.0.0.1", **headers), TRUSTED, header) == expected


def test_an_unknown_forwarded_header_is_a_check_error(settings):
    from realtime_app.checks.configuration import check_settings

    settings.REALTIME_APP = {"FORWARDED_HEADER": "X-Client-IP"}
    assert [m.id for m in check_settings()] == ["realtime_app.E007"]
