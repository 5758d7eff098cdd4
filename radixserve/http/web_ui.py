"""The chat page at `GET /`: static files shipped in `http/web/`, no build step, nothing fetched
from anywhere but this server.

The page holds no secret, so its files are served without the API key (`PUBLIC_PATHS`, which
the key middleware lets through); every call the page makes (`/v1/models`,
`/v1/chat/completions`) carries the key the user typed, kept in the tab's sessionStorage, and
is checked like any client's. `--disable-web-ui` leaves the routes out: `/` is then a 404 like
any unknown route.

The Content-Security-Policy is the page's second line of defence: the script inserts model
output and error text as text only, and even a bug there could load no script, style or image
from elsewhere, nor send anything but to this server.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

WEB_DIR = Path(__file__).with_name("web")

# URL path -> (file in WEB_DIR, media type)
_ASSETS = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
    "/web/chat.css": ("chat.css", "text/css; charset=utf-8"),
}
PUBLIC_PATHS = frozenset(_ASSETS)

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new release's page replaces the old one at once
}


def routes() -> list[Route]:
    """One GET route per file, read once here (a few tens of KB in all)."""
    out = []
    for path, (name, media_type) in _ASSETS.items():
        body = (WEB_DIR / name).read_bytes()

        async def serve(request: Request, body: bytes = body, media_type: str = media_type) -> Response:
            return Response(body, media_type=media_type, headers=_HEADERS)

        out.append(Route(path, serve, methods=["GET"]))
    return out
