"""``GET /dashboard``: a live page over the cache API (one HTML, one script, one stylesheet, no build step).

The files are static and public: they hold no figures. The page asks for an
API key (kept in the tab's ``sessionStorage``) and sends it as a bearer token
with every call to ``/v1/cache/*``, so the data and the admin actions are
behind the same keys as the API. A strict Content-Security-Policy keeps the
page to its own files (no inline script, no other origin, no framing).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from litestar import Response, get
from litestar.params import FromPath

from tierserve.server.errors import APIError

PAGE = {"public": "page"}
ASSETS = {
    "common.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    """A file of the page, read once from the installed package (``server/dashboard/``)."""
    return resources.files("tierserve.server").joinpath("dashboard", name).read_bytes()


@get("/dashboard", opt=PAGE, include_in_schema=False)
async def dashboard() -> Response[bytes]:
    """The live cache dashboard (an HTML page polling ``/v1/cache/stats``)."""
    return Response(asset("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@get("/dashboard/{name:str}", opt=PAGE, include_in_schema=False)
async def dashboard_asset(name: FromPath[str]) -> Response[bytes]:
    """The dashboard's script and style sheet."""
    if name not in ASSETS:
        raise APIError(404, f"no dashboard file {name!r}; the page's files: {', '.join(ASSETS)}", code="not_found")
    return Response(asset(name), media_type=ASSETS[name], headers=SECURITY_HEADERS)


ROUTES = [dashboard, dashboard_asset]
