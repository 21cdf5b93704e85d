"""GET /playground: a page that shows every token's probability, its alternatives and how
speculation produced it (docs/server.md, "The logprob playground").

The page is four static files shipped in the package (`static/`), no build step and nothing
fetched from elsewhere: it talks to this server's own OpenAI routes, with the API key the user
types. Its Content-Security-Policy allows only this origin's script and style, so model text
that spells `<script>` could not run even if it reached the DOM as markup (the page inserts it
as text).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse

from verispec.config import EngineConfig

STATIC = Path(__file__).parent / "static"
_FILES = {"playground.js": "text/javascript", "playground-view.js": "text/javascript", "playground.css": "text/css"}
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def playground_config(engine: EngineConfig, model_name: str, api_key_required: bool) -> dict:
    """What the page needs to know of the server: the model, its drafter, whether a key is needed."""
    spec = engine.speculative
    return {
        "model": model_name,
        "speculative_method": spec.method if spec is not None else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec is not None else 0,
        "api_key_required": api_key_required,
    }


def add_playground_routes(app: FastAPI, config: dict) -> None:
    """The page, its assets and its config. Reading them changes nothing: no API key."""

    @app.get("/playground", include_in_schema=False)
    async def playground_page():
        return FileResponse(STATIC / "playground.html", media_type="text/html", headers=_HEADERS)

    @app.get("/playground/", include_in_schema=False)
    async def playground_slash():
        return RedirectResponse("/playground")

    @app.get("/playground/config.json", include_in_schema=False)
    async def playground_config_route():
        return JSONResponse(config, headers=_HEADERS)

    for name, media_type in _FILES.items():
        def serve(name=name, media_type=media_type):
            return FileResponse(STATIC / name, media_type=media_type, headers=_HEADERS)
        app.add_api_route(f"/playground/{name}", serve, methods=["GET"], include_in_schema=False)
