"""The API key rule every HTTP server of the cluster (workers and proxy) applies.

With a key set (``--api-key``, ``VLLM_API_KEY``), every route but liveness and readiness
needs ``Authorization: Bearer KEY``: the OpenAI routes, ``/tokenize``, ``/metrics``, the
admin routes and unknown paths alike (an unknown path answers 401, not 404, so routes
cannot be probed without the key). Admin routes (sleep, wake-up, cache reset, the proxy's
``/instances``) need the key always: a server without one answers them to loopback
clients only. Enabling the admin routes (``VLLM_SERVER_DEV_MODE``) only registers them.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from engine_core.errors import AuthenticationError

# Liveness and readiness probes carry no credentials (load balancers, Kubernetes).
PUBLIC_ROUTES = frozenset({"/health", "/ping", "/ready"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def route_of(request: web.Request) -> str | None:
    """The path pattern of the route a request matched (None: no route), so the rule
    follows the router's decision, not the raw path's spelling."""
    resource = request.match_info.route.resource
    return None if resource is None else resource.canonical


def bearer_matches(header: str, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``api_key`` (compared in constant time)."""
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode())


def is_loopback(request: web.Request) -> bool:
    """Whether the client connected from this host."""
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:  # a Unix socket or no peer address
        return False


def api_key_middleware(api_key: str | None, admin_routes: Collection[str]) -> Any:
    """The middleware enforcing this module's rule for one server."""
    admin = frozenset(admin_routes)

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route in PUBLIC_ROUTES:
            return await handler(request)
        if api_key:
            if not bearer_matches(request.headers.get("Authorization", ""), api_key):
                raise AuthenticationError("invalid or missing API key")
        elif route in admin and not is_loopback(request):
            raise AuthenticationError("admin endpoints need an API key: this server has none "
                                      "(--api-key or VLLM_API_KEY), so it answers them only "
                                      "on loopback")
        return await handler(request)

    return check
