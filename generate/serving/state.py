"""The server's settings and live state: what ``gptgen serve`` was started with, and the model once loaded."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from generate.api import Generator
from generate.engine.engine import Engine
from generate.serving import openai_api as oa
from generate.serving.engine_loop import EngineLoop

log = logging.getLogger("gptgen.server")
MAX_BODY = 4 * 2**20  # bytes of request body; a full window of token ids is far smaller


@dataclass
class Settings:
    """What ``gptgen serve`` was started with (see :mod:`generate.tools.serve`)."""

    model_name: str
    max_queue: int = 256
    api_key: str | None = None
    max_body: int = MAX_BODY
    body_timeout: float = 30.0


@dataclass
class State:
    """The server's live state: ``loading`` until :meth:`attach` gives it the model, then ``ok``."""

    settings: Settings
    status: str = "loading"
    gen: Generator | None = None
    loop: EngineLoop | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    scoring: asyncio.Semaphore | None = None  # prompts scored for echo at once (each holds a KV cache)

    def attach(self, gen: Generator, engine: Engine) -> EngineLoop:
        """Serve ``gen`` through ``engine`` from now on; returns the loop for the engine's thread to run."""
        self.gen, self.loop = gen, EngineLoop(engine, self.settings.max_queue)
        self.status = "ok"
        slots = f"{engine.slots} slot{'s' * (engine.slots != 1)}"
        log.info("ready: %s, %s, queue of %d", self.settings.model_name, slots, self.loop.max_queue)
        return self.loop

    def ready(self) -> tuple[Generator, EngineLoop]:
        """The model and loop, or a 503 while loading."""
        if self.gen is None or self.loop is None:
            raise oa.APIError(
                f"the model is {self.status}; retry when GET /health says ok",
                status=503,
                type="server_error",
                code="not_ready",
            )
        return self.gen, self.loop
