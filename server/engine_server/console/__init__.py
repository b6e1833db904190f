"""The web console: a chat playground and a live dashboard, served by ``engine serve`` at
``/ui/`` (``/`` leads there) unless ``--disable-web-ui``.

Plain HTML, JavaScript and CSS shipped as package data: no build step, nothing fetched from
a CDN, so it works offline and behind a proxy's ``--root-path`` (every URL in it is
relative). The page itself needs no API key — it asks for one and sends it with every call
it makes to the API, which checks it as for any client. The page may only talk to this
server and run its own scripts (a strict Content-Security-Policy)."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

# name -> media type: every file the console is made of
FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
PATHS = ("/", "/ui", "/ui/", *(f"/ui/{name}" for name in FILES if name != "index.html"))
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


def _serve(name: str):
    body, media_type = _read(name), FILES[name]

    async def endpoint(request: Request) -> Response:
        return Response(
            body,
            media_type=media_type,
            headers={"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff"},
        )

    return endpoint


async def _to_console(request: Request) -> Response:
    """``/`` and ``/ui`` lead to ``/ui/`` with the same query (the page reads ``?poll=MS``);
    the target is relative, so it holds behind a proxy's --root-path."""
    query = request.url.query
    return RedirectResponse("ui/" + (f"?{query}" if query else ""))


def routes() -> list[Route]:
    """The console's routes; the files are read once, here."""
    return [
        Route("/", _to_console),
        Route("/ui", _to_console),
        Route("/ui/", _serve("index.html")),
        *(Route(f"/ui/{name}", _serve(name)) for name in FILES if name != "index.html"),
    ]
