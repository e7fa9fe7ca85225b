"""How every command runs and ends: Ctrl-C held back during imports, and the exit statuses and one-line
errors the commands share.

Only the standard library is imported at module level (see :mod:`generate.tools.cli`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

GENERATE_MEMORY_ADVICE = (
    "use a smaller --batch-size or --max-new-tokens, a shorter prompt, or a smaller --dtype"
)


def import_holding_signals(name: str) -> None:
    """Import module ``name`` with Ctrl-C (and SIGTERM, where Python handles it) held back until it is done.

    torch imports numpy and treats any failure there as "numpy is missing", so an interrupt that lands in
    that ~0.3 s was lost (the command then ran to its end, exit 0), left numpy half-imported ("cannot load
    module more than once"), or aborted the process from C++. Here the signal is only recorded during the
    import and handed to the handler that was in place once it ends. An ignored or default-action signal
    (SIG_IGN, SIG_DFL) and calls outside the main thread are left alone.
    """
    if name in sys.modules:
        return
    import importlib
    import signal
    import threading

    caught: list[int] = []
    held = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(signum)
            if callable(handler):
                held[signum] = handler
                signal.signal(signum, lambda s, _frame: caught.append(s))
    try:
        importlib.import_module(name)
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
    for signum in dict.fromkeys(caught):
        held[signum](signum, None)  # default_int_handler raises KeyboardInterrupt here


def run_command(
    prog: str, body: Callable[[], None], *, memory_advice: str, on_stop: Callable[[], None] | None = None
) -> int:
    """Run a command's body with the commands' endings: 0 when it returns; 130 on Ctrl-C; 0, quietly, when
    the reader of standard output went away (``| head``); 1 with one line on stderr for a documented error
    (out of memory said with ``memory_advice``). ``on_stop`` runs first on Ctrl-C or an error. A usage
    error leaves as argparse's ``SystemExit(2)``."""
    try:
        body()
    except KeyboardInterrupt:
        if on_stop is not None:
            on_stop()
        return 130
    except BrokenPipeError:
        if sys.stderr is not None:  # (quiets Python's own complaint as it flushes standard output at exit)
            sys.stderr.close()
        return 0
    # CheckpointError is a ValueError and GenerationError a RuntimeError; naming them would import torch.
    except (ValueError, MemoryError, RuntimeError, OSError, ImportError) as e:
        if on_stop is not None:
            on_stop()
        if sys.stderr is not None:  # closed (`2>&-`): print() would write the error to standard output
            print(f"{prog}: error: {error_message(e, memory_advice)}", file=sys.stderr)
        return 1
    return 0


def error_message(error: BaseException, memory_advice: str = GENERATE_MEMORY_ADVICE) -> str:
    """One line for the error, long paths shortened. The allocator's failures (a ``RuntimeError`` such as
    ``[enforce fail at alloc_cpu.cpp...]``, or a MemoryError made from one) end with ``memory_advice``:
    what to change in this command."""
    from checkpoints.errors import elide

    allocator = error.__cause__ if isinstance(error, MemoryError) else error
    if isinstance(allocator, RuntimeError):
        from generate.engine.memory import out_of_memory

        error = out_of_memory(allocator, memory_advice) or error
    text = str(error) or ("out of memory" if isinstance(error, MemoryError) else type(error).__name__)
    return elide(text.replace("\n", " "))  # one line, with any huge path shortened
