"""Eager route decisions, measured once per machine and kept: the same command takes the same routes (and so
computes the same bits) in every process on a machine.

The runner's eager routes (:mod:`generate.kernels`) are chosen by measurements that take a fraction of a
second and, near a break-even, can come out either way. Each decision is kept in ``routes.json`` in the
cache directory (:func:`generate.compiled.cache_dir`), keyed by a digest of what it depends on: the CPU and
thread count, torch's version, the source of ``model/`` and of the compiled step's module, the model's layer
kinds and sizes, its dtype and device, the source of the route code (``kernels.py``, ``probes.py``,
``runner.py``, this module), and the decision's own shape (rows, slots). A key not there is
measured and written; a directory that cannot be written, or a damaged file, only means measuring again.
Delete the file to measure again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from model import GPT

T = TypeVar("T")

# Besides model/ (in the compiled step's code digest): the modules whose source a kept answer depends on.
ROUTE_CODE = ("kernels.py", "probes.py", "runner.py", "routes.py")


def model_facts(model: GPT) -> dict[str, object]:
    """What of a model the routes depend on: its block's and head's layer kinds (and int4 group sizes), its
    sizes, dtype and device."""
    layers = (*model.h[0].modules(), model.wte)
    cfg = model.config
    return {
        "layers": [(type(m).__name__, getattr(m, "group_size", None)) for m in layers],
        "sizes": [cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.inner_dim, cfg.vocab_size],
        "dtype": str(model.compute_dtype),
        "device": str(model.device),
    }


def _path() -> Path:
    from generate.compiled import cache_dir

    return cache_dir() / "routes.json"


def _read(path: Path) -> dict[str, object]:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def recorded(
    name: str, facts: dict[str, object], measure: Callable[[], T], valid: Callable[[object], bool] = _is_bool
) -> T:
    """The kept answer to decision ``name`` for these ``facts``, or ``measure()``'s, kept for next time.

    Args:
        name: which decision (e.g. ``"onednn-decode"``).
        facts: what the decision depends on beyond the machine and the code (see the module docstring);
            JSON-serializable.
        measure: measures the answer (JSON-serializable) when none is kept.
        valid: whether a kept answer is one ``measure`` could give (default: a bool); one that is not (a
            file edited by hand) is measured again.
    """
    from generate.compiled import code_digest, cpu_signature, write_atomically

    here = Path(__file__).parent  # the routes' own code: what they run and how they are chosen
    routes_code = hashlib.blake2b(b"".join((here / f).read_bytes() for f in ROUTE_CODE), digest_size=16)
    everything = {"name": name, "facts": facts, "machine": cpu_signature(), "torch": torch.__version__,
                  "code": [code_digest(), routes_code.hexdigest()]}  # fmt: skip
    text = json.dumps(everything, sort_keys=True, default=str)
    key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    path = _path()
    table = _read(path)
    if key in table and valid(table[key]):
        return table[key]  # type: ignore[return-value]
    value = measure()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        table = _read(path)  # (another process may have added its own meanwhile)
        table[key] = value
        write_atomically(path, json.dumps(table, sort_keys=True))
    return value
