"""The checks of addresses and ports that arrive over the network or on a command line."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from engine_core.errors import ConfigError

# A host name or IP (IPv6 bracketed or bare). Anything else (spaces, ``/`` paths, ``?``
# queries, ``@`` user parts, wildcards) is refused before a socket or URL is built from it:
# ``http://{address}/...`` with such a "host" would reach another port and path than the one
# given.
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]")
MAX_ADDRESS_CHARS = 255


def is_host_port(address: object) -> bool:
    """Whether ``address`` is a ``host:port`` a socket can connect to: a host name or IP and a
    port in 1-65535, at most 255 characters."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS_CHARS:
        return False
    host, _, port = address.rpartition(":")
    return (bool(host) and set(host) <= _HOST_CHARS and port.isdigit()
            and 0 < int(port) < 65536)


def route_source_host(host: str) -> str:
    """The local address this machine reaches ``host`` from, which ``host`` can call back.

    Connecting a UDP socket picks the route and sends nothing. Used as the advertised HTTP
    host of a worker bound to a wildcard address: ``127.0.0.1`` would be unreachable from a
    proxy on another machine. Falls back to ``127.0.0.1`` when there is no route.
    """
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((bare, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def check_distinct_ports(ports: Mapping[str, int | None]) -> None:
    """Raise ConfigError naming the flags when two of ``ports`` (flag -> port; None or 0:
    assigned later) are one port: two listeners cannot share it, and the second would fail
    only once the first is up, deep in a child's startup."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise ConfigError(f"{seen[port]} and {flag} are both {port}: each needs a port "
                              "of its own")
        seen[port] = flag
