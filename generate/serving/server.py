"""The OpenAI-compatible HTTP server (Starlette): the application, its routes, errors and lifespan.

The model loads in the background after the server starts listening, so ``/health`` answers 503 while it
loads or compiles; everything else waits for it. One :class:`generate.serving.engine_loop.EngineLoop` runs
every request; the server only turns HTTP into engine requests and engine updates into OpenAI's objects.
The pieces: :mod:`generate.serving.state` (the settings and live state), :mod:`generate.serving.routes` (the
endpoints), :mod:`generate.serving.checks` (the API key, request bodies), :mod:`generate.serving.streaming`
(waiting on the engine, server-sent events) and :mod:`generate.serving.metrics_text` (``/metrics``).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException

from generate.serving.routes import Endpoints
from generate.serving.state import MAX_BODY, Settings, State

__all__ = ["MAX_BODY", "Settings", "State", "build_app"]


def build_app(settings: Settings) -> Starlette:
    """The Starlette application; :func:`generate.tools.serve.main` runs it under uvicorn."""
    state = State(settings)
    endpoints = Endpoints(state)
    app = Starlette(
        routes=endpoints.routes(),
        lifespan=endpoints.lifespan,
        exception_handlers={HTTPException: endpoints.errors, Exception: endpoints.errors},
    )
    app.state.gptgen = state
    return app
