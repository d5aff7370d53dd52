"""Reconnect tickets: a client a draining process hands over comes back as one, not as a
stranger in a crowd.

A drain closes each connection with 1012 and ``retry_after_ms=<n>``; an anonymous one is
also told ``ticket=<t>``. Its next handshake, on any process of the cluster, shows the
ticket in its URL (``?ticket=<t>``: a browser cannot set a header on a WebSocket) and is
not counted against that process's anonymous handshake bucket
(``MAX_ANONYMOUS_HANDSHAKES_PER_S``): the drain already paces those clients, and a deploy's
crowd refused as a flood of many addresses came back seconds late, backing off
(docs/performance.md, "Deploys"). Everything else still applies — its address's own bucket
(``HANDSHAKES_PER_S``), the connection caps, the auth doors.

A ticket is signed with ``SECRET_KEY`` (:mod:`django.core.signing`, under this site's salt
and the client's address: shown from another address it is nothing), is good for
:data:`TICKET_MAX_AGE_S`, names nobody, and each process takes each ticket once. It sits in
a URL, where proxies may log it: it is worth one handshake past one bucket for a minute.
"""

from __future__ import annotations

import secrets
import time
import urllib.parse
from collections import OrderedDict

from django.core import signing

from realtime_app.conf.runtime import runtime
from realtime_app.wire.asgi import Scope

__all__ = ["TICKET_MAX_AGE_S", "MAX_TAKEN", "Taken", "mint", "redeem", "shown_ticket"]

#: How long a ticket is good for after its drain told it (a client waits ``retry_after_ms``,
#: at most the drain's spacing, and then a few reconnect attempts).
TICKET_MAX_AGE_S = 60
#: Tickets a process remembers it took (the oldest forgotten first): a drain tells one per
#: connection it closes, so this is a minute of drained connections, whatever a client does.
MAX_TAKEN = 50_000
#: The longest ticket read from a URL (one is about 62 characters).
MAX_TICKET_CHARS = 100
SALT = "realtime_app.reconnect-ticket"


class Taken(OrderedDict[str, float]):
    """The tickets this process took, each with when it expires (a part of its runtime)."""

    def take(self, nonce: str, now: float) -> bool:
        """True the first time ``nonce`` is shown while it is good."""
        while self and next(iter(self.values())) <= now:
            self.popitem(last=False)
        if nonce in self:
            return False
        if len(self) >= MAX_TAKEN:
            self.popitem(last=False)
        self[nonce] = now + TICKET_MAX_AGE_S
        return True


def _signer(address: str) -> signing.TimestampSigner:
    from realtime_app.endpoint.tokens import site_salt

    return signing.TimestampSigner(salt=f"{SALT}:{site_salt()}:{address}")


def mint(address: str) -> str:
    """A ticket for the client at ``address``, told in its drain's close reason."""
    return str(_signer(address).sign(secrets.token_urlsafe(8)))


def redeem(ticket: str | None, address: str) -> bool:
    """True when ``ticket`` was told to a client at ``address`` less than
    :data:`TICKET_MAX_AGE_S` ago and this process has not taken it before."""
    if not ticket or len(ticket) > MAX_TICKET_CHARS:
        return False
    try:
        nonce = _signer(address).unsign(ticket, max_age=TICKET_MAX_AGE_S)
    except signing.BadSignature:  # forged, from another address or site, or expired
        return False
    return runtime().part(Taken).take(nonce, time.monotonic())


def shown_ticket(scope: Scope) -> str | None:
    """The ``ticket`` of a handshake's query string, if it shows one."""
    raw = scope.get("query_string", b"")
    if b"ticket=" not in raw:
        return None
    try:
        query = urllib.parse.parse_qs(raw.decode("latin-1"), max_num_fields=20)
    except ValueError:  # too many fields: no ticket read
        return None
    found = query.get("ticket")
    return found[0] if found else None
