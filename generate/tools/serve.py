"""``gptgen serve``: an OpenAI-compatible server for a checkpoint (see :mod:`generate.serving.server`), with
the playground page at ``/``; ``gptgen playground`` is the same command that also says (``--open``: opens) the
page's address.

It binds its socket first and says where it listens, then loads (and with ``--compile`` compiles) the model;
``GET /health`` answers 503 until that is done. The model loads and runs in the main thread, HTTP is served
from another (see :mod:`generate.serving.engine_loop`). SIGINT or SIGTERM stop it cleanly: no new connections,
new requests get 503, running ones ``--shutdown-timeout`` seconds to finish, then the rest end with an
OpenAI-style 503 error (a stream: an error event, then ``[DONE]``); the exit status is 0. Only the standard
library is imported before the arguments are checked.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

from generate.tools.options import (
    CommandParser,
    add_checkpoint_option,
    add_draft_option,
    add_model_options,
    check_model_options,
    load_generator,
)
from generate.tools.runner import import_holding_signals

PROG = "gptgen serve"
PLAYGROUND = "gptgen playground"
SHUTDOWN_MARGIN = 5.0  # seconds after --shutdown-timeout for the last answers to be sent


def build_parser(playground: bool = False) -> argparse.ArgumentParser:
    """The command's argument parser (with ``playground``: ``gptgen playground``'s, which adds ``--open``)."""
    p = CommandParser(
        prog=PLAYGROUND if playground else PROG,
        description="Serve a GPT-2-family checkpoint over OpenAI's HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, /detokenize, "
        "/v1/attention), with the playground, a web page of generation and its attention, at /."
        + (" Says the playground's address (--open: opens it in a browser)." if playground else ""),
    )
    if playground:
        p.add_argument("--open", action="store_true", help="open the playground in the default web browser")
    add_checkpoint_option(p)
    p.add_argument("--model-name", help="the model id clients ask for (default: the checkpoint's name)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    add_model_options(
        p, "weights and compute (default float32); int8 and int4 are weight-only (bf16 compute)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step at start (kept on disk: later starts load it in seconds)",
    )
    add_draft_option(p)
    _add_limit_options(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _add_limit_options(p: argparse.ArgumentParser) -> None:
    """Add the options that bound the server's work: slots, queue, API key and timeouts."""
    p.add_argument("--max-slots", type=int, default=8, help="requests generated at once (default 8)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for a slot before new ones get 429 (default 256)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("GPTGEN_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $GPTGEN_API_KEY, else none)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM (default 10)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers before it is closed (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request has to send its body once its headers are in; then 408 (default 30)",
    )


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if not 1 <= args.max_slots <= 4096:
        parser.error(f"--max-slots must be in 1..4096, got {args.max_slots}")
    if args.max_queue < 1:
        parser.error(f"--max-queue must be >= 1, got {args.max_queue}")
    if not 0.1 <= args.header_timeout <= 3600:
        parser.error(f"--header-timeout must be in 0.1..3600 seconds, got {args.header_timeout}")
    if not 0.1 <= args.body_timeout <= 3600:
        parser.error(f"--body-timeout must be in 0.1..3600 seconds, got {args.body_timeout}")
    if not 0 <= args.shutdown_timeout <= 3600:
        parser.error(f"--shutdown-timeout must be in 0..3600 seconds, got {args.shutdown_timeout}")
    key, source = args.api_key, "the API key (--api-key or $GPTGEN_API_KEY)"  # (never shown)
    if key is not None and not key.strip():
        parser.error(f"{source} is empty; give a key, or leave it out (and $GPTGEN_API_KEY unset)")
    if key is not None and key != key.strip():
        parser.error(f"{source} begins or ends with whitespace, which an HTTP header drops; remove it")
    if key is not None and (bad := [c for c in key if not " " <= c <= "~"]):
        parser.error(f"{source} holds {bad[0]!r}, U+{ord(bad[0]):04X}; use ASCII letters, digits, "
                     "punctuation and spaces (an HTTP header carries it)")  # fmt: skip
    check_model_options(args, parser)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise OSError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --host or --port"
        ) from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def playground_main(argv: list[str] | None = None) -> int:
    """``gptgen playground``: ``gptgen serve`` that also prints the playground's address (and with ``--open``
    opens it in the default browser); returns the exit status as :func:`main`."""
    return main(argv, playground=True)


def main(argv: list[str] | None = None, *, playground: bool = False) -> int:
    """Run the server until SIGINT/SIGTERM; returns the exit status (0 after a clean stop, 1 on error)."""
    parser = build_parser(playground)
    args = parser.parse_args(argv)
    prog = parser.prog
    logging.basicConfig(format=f"{prog}: %(message)s", level=args.log_level.upper(), stream=sys.stderr)
    try:
        _check(args, parser)  # (its device check imports torch)
        import uvicorn

        # torch and the rest, before the stop handlers are in place
        import_holding_signals("generate.serving.server")
    except KeyboardInterrupt:
        return 0  # stopped before it listened
    except ImportError as e:
        extra = (e.name or "").split(".")[0] in ("uvicorn", "starlette")
        print(
            f"{prog}: error: the server needs its extra; install it with pip install -e '.[server]'"
            if extra
            else f"{prog}: error: {e}",
            file=sys.stderr,
        )
        return 1
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint)) or args.checkpoint
    print(f"{prog}: listening on {_url(host, port)} (model {name!r} loading)", file=sys.stderr, flush=True)
    if playground:
        _announce(prog, host, port, args.open)
    if args.api_key is None and not _loopback(args.host):
        print(
            f"{prog}: WARNING: listening on {args.host} without --api-key: anyone who can reach this "
            "port can use the model",
            file=sys.stderr,
            flush=True,
        )
    return _serve(args, sock, name, uvicorn, prog)


def _url(host: str, port: int) -> str:
    """``http://HOST:PORT``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce(prog: str, host: str, port: int, open_it: bool) -> None:
    """Say where the playground is (a wildcard address as this machine's loopback), and open it if asked."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    url = _url(host, port) + "/"
    print(f"{prog}: the playground is at {url}", file=sys.stderr, flush=True)
    if open_it:
        import webbrowser

        if not webbrowser.open(url):
            print(f"{prog}: no web browser could be opened here; open {url} yourself", file=sys.stderr)


def _header_deadline_protocol(seconds: float) -> type:
    """uvicorn's HTTP/1.1 protocol with a deadline for headers: a connection that has not sent a whole
    request line and headers ``seconds`` after it opened, or after its last answer, is closed (a client
    trickling bytes would otherwise hold a connection open for good)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole request arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


def _serve(args: argparse.Namespace, sock: socket.socket, name: str, uvicorn: Any, prog: str) -> int:
    """HTTP in a thread, the model in this one (see :mod:`generate.serving.engine_loop` for why)."""
    from generate.serving.server import Settings, build_app

    settings = Settings(name, max_queue=args.max_queue, api_key=args.api_key, body_timeout=args.body_timeout)
    app = build_app(settings)
    state = app.state.gptgen
    config = uvicorn.Config(
        app,
        # (uvicorn's start and stop lines, at info, say nothing ours do not: shown with debug)
        log_level="warning" if args.log_level == "info" else args.log_level,
        access_log=False,
        lifespan="on",
        # (ours ends what still runs at --shutdown-timeout; uvicorn's, later, leaves time to say so)
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN,
        log_config=None,
        http=_header_deadline_protocol(args.header_timeout),
        timeout_keep_alive=args.header_timeout,  # (uvicorn's own, 5 s, would close idle connections first)
    )
    server = uvicorn.Server(config)  # (outside the main thread it leaves signals alone)

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            if state.loop is not None:
                state.loop.close()

    def stop(signum: int, frame: object) -> None:
        server.should_exit = True
        if state.loop is not None:  # loaded: the HTTP side shuts down gracefully, then closes the loop
            state.loop.stop(args.shutdown_timeout)
            return
        raise KeyboardInterrupt  # loading or compiling: abandon it

    thread = threading.Thread(target=http, name="gptgen-http")
    thread.start()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        gen = load_generator(args, slots=args.max_slots)
        loop = state.attach(gen, gen.engine(args.max_slots, gen.model.config.n_positions))
    except KeyboardInterrupt:
        thread.join()
        return 0
    except (ValueError, MemoryError, RuntimeError, OSError, ImportError) as e:
        from checkpoints.errors import elide

        print(f"{prog}: error: {elide(str(e))}", file=sys.stderr, flush=True)
        server.should_exit = True
        thread.join()
        return 1
    if thread.is_alive():
        loop.run()
    thread.join()
    return 0
