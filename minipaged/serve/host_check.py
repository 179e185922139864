"""The Host header allow-list: a defence against DNS rebinding.

A web page on ``evil.example`` can make its own name resolve to 127.0.0.1 (or to the teacher's address) a
moment after it loaded; the browser then lets that page read whatever the server answers, for it is "the same
origin". The one thing that still gives it away is the ``Host`` header, which says ``evil.example``. So the
server answers only requests whose Host is one of its own names: a server bound to loopback accepts loopback
names; one bound for a class (``--host 0.0.0.0`` or an address) also accepts the machine's own addresses and
names; ``--allowed-hosts`` adds others (a DNS name the class uses, a proxy's name; ``*`` turns the check off).
Requests without a Host header (HTTP/1.0 tools) are not browsers, and pass.
"""
from __future__ import annotations

import ipaddress
import socket
from contextlib import suppress
from typing import Iterable

from .http_guards import ASGIApp, Receive, Scope, Send, send_json
from .protocol import error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def machine_names() -> set[str]:
    """This machine's names and addresses, as far as the standard library can tell without a network."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        with suppress(OSError):
            names.update(info[4][0] for info in socket.getaddrinfo(name, None))
    with suppress(OSError):             # the address of the default route (a UDP "connect" sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            names.add(probe.getsockname()[0])
    return {n.lower() for n in names if n}


def allowed_hosts(bind: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names a server bound to ``bind`` answers to (``*`` in the result: any)."""
    allowed = set(LOOPBACK_NAMES)
    if not is_loopback(bind):
        allowed |= machine_names()
        if bind not in WILDCARD_BINDS:
            allowed.add(bind.lower())
    allowed |= {h.strip().lower().strip("[]") for h in extra if h.strip()}
    return frozenset(allowed)


def host_name(header: str) -> str:
    """The name in a Host header, without its port; IPv6 addresses without their brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    """Refuse (400, OpenAI's error JSON, naming the flag) a request whose Host is not one of ``allowed``."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            header = dict(scope["headers"]).get(b"host")
            if header is not None:
                name = host_name(header.decode("latin-1"))
                if name not in self.allowed and not is_loopback(name):   # loopback names never reach a rebinder
                    return await send_json(send, 400, error_body(
                        400, f"this server does not answer to the host name {name!r} (a guard against DNS "
                             f"rebinding); open it by one of its own names or addresses, or start it with "
                             f"--allowed-hosts {name}."))
        await self.app(scope, receive, send)
