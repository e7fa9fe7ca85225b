"""Serving: the OpenAI-compatible HTTP server (``server``), its wire format (``openai_api``; the request
bodies in ``openai_jobs`` and ``openai_fields``), answers (``answer``) and the thread that steps the engine
for it (``engine_loop``). See docs/server.md."""
