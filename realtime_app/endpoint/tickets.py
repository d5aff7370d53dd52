"""Reconnect tickets: a client a draining process hands over comes back as one, not as a
stranger in a crowd.

A drain closes each connection with 1012 and ``retry_after_ms=<n>``; an anonymous
WebSocket is also told ``ticket=<t>`` (an event stream none: no client shows one there).
Its next WebSocket handshake, on any process of the cluster, shows the ticket in its URL
(``?ticket=<t>``: a browser cannot set a header on a WebSocket) and is not counted
against that process's anonymous handshake bucket
(``MAX_ANONYMOUS_HANDSHAKES_PER_S``): the drain already paces those clients, and where it
sends a survivor more than that bucket takes, a deploy's crowd was refused as a flood of
many addresses and came back seconds late, backing off (docs/performance.md, "Reconnect
tickets"). Everything else still applies — its network's own bucket
(``HANDSHAKES_PER_S``), the connection caps (a ticket whose handshake they refuse is given
back: good again here), the auth doors.

A ticket is signed with ``SECRET_KEY`` (:mod:`django.core.signing`, under this site's salt
and the client's network — the one its caps count, ``ADDRESS_PREFIX_V6``: shown from
another it is nothing), is good for :data:`TICKET_MAX_AGE_S`, names nobody, and each
process takes each ticket once while it runs (a restarted one has forgotten what it took:
the network's own bucket is the bound of them all). It sits in a URL, where proxies may log
it: it is worth one handshake past one bucket for a minute.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import time
import urllib.parse
from collections import OrderedDict

from django.core import signing

from realtime_app.conf.runtime import runtime
from realtime_app.wire.asgi import Scope

__all__ = [
    "MAX_TAKEN",
    "MAX_TICKET_CHARS",
    "SALT",
    "TICKET_MAX_AGE_S",
    "Taken",
    "give_back",
    "mint",
    "redeem",
    "shown_ticket",
    "ticket_network",
]

logger = logging.getLogger("realtime_app.consumers")

#: How long a ticket is good for after its drain told it (a client waits ``retry_after_ms``,
#: at most the drain's spacing, and then a few reconnect attempts).
TICKET_MAX_AGE_S = 60
#: Tickets a process remembers it took, each for twice a ticket's life (the processes'
#: clocks may differ): a drain tells one per connection it closes, so this is minutes of
#: drained connections; past it a ticket is refused (its handshake counted as a stranger's).
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
        if nonce in self or len(self) >= MAX_TAKEN:  # full: refused, never forgotten early
            return False
        self[nonce] = now + 2 * TICKET_MAX_AGE_S
        return True


def ticket_network(identity: tuple[str, str] | None) -> str | None:
    """The network a ticket of ``identity`` is bound to: an anonymous identity's, when it is
    an address (a client whose address is not known gets no ticket)."""
    if identity is None or identity[0] != "address":
        return None
    try:
        ipaddress.ip_network(identity[1], strict=False)
    except ValueError:
        return None
    return identity[1]


def _signer(network: str) -> signing.TimestampSigner:
    """Django's signer under this site's salt and ``network``: a ticket shown from another
    network, or to another site sharing ``SECRET_KEY``, does not verify."""
    from realtime_app.endpoint.tokens import site_salt

    return signing.TimestampSigner(salt=f"{SALT}:{site_salt()}:{network}")


def mint(network: str) -> str:
    """A ticket for the client of ``network`` (:func:`ticket_network`), told in its drain's
    close reason."""
    return str(_signer(network).sign(secrets.token_urlsafe(8)))


def redeem(ticket: str | None, network: str) -> str | None:
    """The ticket's nonce, taken, when ``ticket`` was told to a client of ``network`` less
    than :data:`TICKET_MAX_AGE_S` ago and this process has not taken it before; else None."""
    if not ticket or len(ticket) > MAX_TICKET_CHARS:
        return None
    try:
        nonce = _signer(network).unsign(ticket, max_age=TICKET_MAX_AGE_S)
    except signing.BadSignature as exc:  # forged, from another network or site, or expired
        if runtime().first_time("reconnect ticket refused"):  # once: a stranger's handshake, nothing more
            logger.info("a reconnect ticket was not taken (%s): its handshake counts as any other", exc)
        return None
    return str(nonce) if runtime().part(Taken).take(nonce, time.monotonic()) else None


def give_back(nonce: str) -> None:
    """The ticket :func:`redeem` took (its ``nonce``), whose handshake the connection caps
    then refused (``server full``), is good again on this process: nothing was let in for it."""
    runtime().part(Taken).pop(nonce, None)


def shown_ticket(scope: Scope) -> str | None:
    """The ``ticket`` of a handshake's query string, if it shows one."""
    raw = scope.get("query_string", b"")
    if b"ticket=" not in raw:
        return None
    try:
        query = urllib.parse.parse_qs(raw.decode("latin-1"), max_num_fields=100)
    except ValueError:  # too many fields: no ticket read
        return None
    found = query.get("ticket")
    return found[0] if found else None
