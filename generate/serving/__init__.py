"""Serving: the OpenAI-compatible HTTP server (``server``), its request bodies (``openai_api``), answers
(``answer``) and the thread that steps the engine for it (``engine_loop``). See docs/server.md."""
