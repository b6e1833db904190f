"""The web console's routes without an engine: where its pages are, that they need no API
key while everything they call still does, the headers that keep the page to this server's
own scripts, and --disable-web-ui."""

from __future__ import annotations

from starlette.testclient import TestClient

from engine_server import console
from engine_server.app import ServerState, build_app


def _app(web_ui: bool = True) -> TestClient:
    state = ServerState(object(), object(), "m", 64, 100, metrics=None, api_keys=("k",), web_ui=web_ui)
    return TestClient(build_app(state), raise_server_exceptions=False)


def test_pages_need_no_key_but_the_api_still_does():
    with _app() as http:
        for path in ("/", "/ui"):
            response = http.get(path, follow_redirects=False)
            assert response.status_code == 307 and response.headers["location"] == "ui/"
        page = http.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == console.POLICY
        assert "default-src 'none'" in console.POLICY and "connect-src 'self'" in console.POLICY
        for name in ("console.js", "console.css"):
            asset = http.get(f"/ui/{name}")
            assert asset.status_code == 200 and asset.content == console._read(name)
            assert f'src="{name}"' in page.text or f'href="{name}"' in page.text  # relative: --root-path
        assert http.get("/v1/models").status_code == 401
        assert http.get("/metrics").status_code == 401
        assert http.get("/ui/secret.txt").status_code == 401  # only the console's own files are open
        assert http.get("/ui/secret.txt", headers={"Authorization": "Bearer k"}).status_code == 404


def test_disable_web_ui_leaves_no_page_and_no_open_path():
    with _app(web_ui=False) as http:
        assert http.get("/ui/").status_code == 401  # not an open path any more
        assert http.get("/ui/", headers={"Authorization": "Bearer k"}).status_code == 404
