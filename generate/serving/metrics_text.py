"""The text of ``GET /metrics``: the server's counters and gauges in Prometheus's text format."""

from __future__ import annotations

from generate.serving.state import State


class _Lines:
    """The lines of the exposition, one metric (its help, its type, its samples) at a time."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        self.lines.extend([f"# HELP gptgen_{name} {help}", f"# TYPE gptgen_{name} {kind}"])
        # Counts exactly (:g would round past a million), other values as Python writes a float.
        self.lines.extend(f"gptgen_{name}{labels} {value if isinstance(value, int) else float(value)!r}"
                          for labels, value in samples)  # fmt: skip


def metrics_text(state: State) -> str:
    """The metrics of ``state`` in Prometheus's text format (version 0.0.4); zeros while the model loads."""
    out = _Lines()
    _engine_metrics(out, state)
    spec = state.loop.engine.speculator if state.loop is not None else None
    if spec is not None:
        _speculative_metrics(out, spec.stats())
    out.metric(
        "ready", "gauge", "1 once the model is loaded (and compiled).", [("", int(state.status == "ok"))]
    )
    return "\n".join(out.lines) + "\n"


def _engine_metrics(out: _Lines, state: State) -> None:
    metric = out.metric
    loop = state.loop
    m = loop.metrics if loop is not None else None
    requests = (
        [(f'{{endpoint="{e}",status="{s}"}}', c) for (e, s), c in sorted(m.requests.items())] if m else []
    )
    metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.", requests)
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of requests that joined the engine.",
        [("", m.prompt_tokens if m else 0)],
    )
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", m.generated_tokens if m else 0)])
    metric(
        "requests_cancelled_total",
        "counter",
        "Requests stopped because the client went away.",
        [("", m.cancelled if m else 0)],
    )
    metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", loop.queued if loop else 0)])
    metric("slots_busy", "gauge", "Slots running a request.", [("", loop.busy if loop else 0)])
    metric("slots_total", "gauge", "Slots of the engine.", [("", loop.engine.slots if loop else 0)])
    metric(
        "step_seconds",
        "summary",
        "Time of engine steps.",
        [("_sum", m.step_seconds if m else 0), ("_count", m.steps if m else 0)],
    )


def _speculative_metrics(out: _Lines, stats: dict) -> None:
    metric = out.metric
    metric("speculative_proposed_total", "counter", "Tokens proposed.", [("", stats["proposed"])])
    metric("speculative_accepted_total", "counter", "Proposed tokens accepted.", [("", stats["accepted"])])
    metric("speculative_acceptance_rate", "gauge", "Accepted / proposed.", [("", stats["acceptance_rate"])])
    metric(
        "speculative_tokens_per_pass",
        "gauge",
        "Tokens a row gains per step.",
        [("", stats["tokens_per_pass"])],
    )
