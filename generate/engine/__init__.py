"""The engine: requests (``request``), slots stepped one token at a time (``engine``), the model calls
(``runner``, ``compiled``), sampling (``sampling``) and settled text (``text``). See docs/engine.md."""
