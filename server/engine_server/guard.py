"""The checks in front of every route, as pure ASGI middleware (so streaming and disconnects
pass untouched), in the order a refusal is most useful: the Host header (DNS rebinding),
the API key, then for routes that take a body its declared size, encoding and type. A
request whose method the route does not take passes through to the router, so it gets the
405 (with ``Allow``) it deserves instead of a 415 about a body nobody will read."""

from __future__ import annotations

import hashlib
import hmac

from starlette.routing import get_route_path

from engine_server.errors import APIError, anthropic_route, bad_request

OPEN_PATHS = ("/health",)  # with the console's pages, all that needs no API key when one is set
LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")
LOOPBACK_NAMES = ["localhost", "127.0.0.1", "::1"]


def default_allowed_hosts(bind_host: str, given: list[str] | None) -> list[str] | None:
    """The Host names a request may carry (None: any). Bound to loopback, a browser on this
    machine can be talked into sending requests to us under an attacker's name (DNS
    rebinding): only the loopback names are accepted unless ``--allowed-hosts`` says more.
    Bound elsewhere the server cannot guess the names it is reached by, so any is accepted."""
    if given is not None:
        return None if "*" in given else [name.lower().rstrip(".") for name in given]
    if bind_host in LOOPBACK_BINDS or bind_host.startswith("127."):
        return list(LOOPBACK_NAMES)
    return None


def host_name(header: bytes) -> str:
    """The name of a Host header, without its port: ``[::1]:8000`` -> ``::1``."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def host_allowed(name: str, allowed: list[str]) -> bool:
    """An exact name, or ``*.example.com`` for any subdomain of example.com."""
    return any(name == p or (p.startswith("*.") and name.endswith(p[1:])) for p in allowed)


def tenant_salt(key: str) -> str:
    """The prefix-cache salt of one API key: a hash, so neither the engine nor its KV events
    ever see the key, and requests under different keys never share cached blocks (a tenant
    cannot time another's prompts through prefix-cache hits)."""
    return "key-" + hashlib.sha256(b"engine-cache-salt\0" + key.encode()).hexdigest()[:32]


class Guard:
    def __init__(
        self, app, state, body_paths: frozenset[str], open_paths: frozenset[str] = frozenset(OPEN_PATHS)
    ):
        """``body_paths``: the routes that take a POST body; a POST elsewhere is the router's
        to answer (404, or 405 with ``Allow``). ``open_paths``: the routes that need no key."""
        self.app, self.state, self.body_paths, self.open_paths = app, state, body_paths, open_paths
        self.salts = {f"Bearer {key}".encode(): tenant_salt(key) for key in state.api_keys}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                return await error.response(anthropic_route(get_route_path(scope)))(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        path = get_route_path(scope)  # the path past --root-path
        return (
            self._host(headers)
            or self._key(scope, headers, path)
            or (self._body(headers) if scope["method"] == "POST" and path in self.body_paths else None)
        )

    def _host(self, headers: dict) -> APIError | None:
        allowed = self.state.allowed_hosts
        host = headers.get(b"host")
        if allowed is None or host is None or host_allowed(host_name(host), allowed):
            return None
        return APIError(
            421,
            f"the Host header {host_name(host)[:100]!r} is not one this server answers to "
            f"(allowed: {', '.join(allowed)}); start it with --allowed-hosts to add names",
            code="invalid_host",
        )

    def _key(self, scope, headers: dict, path: str) -> APIError | None:
        if not self.salts or path in self.open_paths:
            return None
        # ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY`` (Anthropic's)
        given = [headers.get(b"authorization", b""), b"Bearer " + headers.get(b"x-api-key", b"")]
        # compare with every key, so the time taken does not tell which one nearly matched
        matches = [
            salt for token, salt in self.salts.items() for value in given if hmac.compare_digest(value, token)
        ]
        if not matches:
            return APIError(401, "invalid or missing API key", code="invalid_api_key")
        if self.state.api_key_cache_salt:
            scope.setdefault("state", {})["tenant_salt"] = matches[0]
        return None

    def _body(self, headers: dict) -> APIError | None:
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return bad_request("invalid Content-Length header")
        if int(length) > self.state.max_body_bytes:
            return APIError(
                413,
                f"the request body of {int(length)} bytes exceeds the limit of {self.state.max_body_bytes}",
            )
        encoding = headers.get(b"content-encoding", b"identity").strip().lower()
        if encoding not in (b"", b"identity"):
            # read as it is, a compressed body would be garbage; decompressed, a zip bomb
            return APIError(
                415,
                f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: send the body "
                "uncompressed",
                code="unsupported_media_type",
            )
        # a web page can send text/plain or form bodies cross-origin without a CORS preflight
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            return APIError(
                415,
                "request bodies must be JSON (Content-Type: application/json)",
                code="unsupported_media_type",
            )
        return None
