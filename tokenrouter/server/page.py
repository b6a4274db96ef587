"""The routing page (server/ui/: one HTML file, plain ES-module JavaScript and CSS, shipped as package
data): served at / by `tokenrouter serve` unless --no-ui. It calls the same /v1 endpoints as any
client, with the API key the user types in (kept in the page's memory, never by the server), so it
needs no authentication of its own and holds no data."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

UI_DIR = Path(__file__).with_name("ui")
# Nothing but this server's own files and endpoints: no inline script, no other origin.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def mount_ui(app: FastAPI) -> None:
    async def index() -> FileResponse:
        return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=_HEADERS)

    app.add_api_route("/", index, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
