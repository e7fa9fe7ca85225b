"""The ``gptgen`` command: the toolkit's tools as subcommands.

``gptgen generate`` is the ``generate`` command (same options); ``gptgen serve`` runs the OpenAI-compatible
server, and ``gptgen playground`` the same server announcing its web page; ``gptgen score`` scores a text
(mean NLL, perplexity); ``gptgen attention`` draws attention maps;
``gptgen batch`` runs a file of prompts (locally or on Ray).
Each subcommand's module is imported only when it runs, so ``gptgen --help`` is instant.
"""

from __future__ import annotations

import sys

COMMANDS = {  # name: (module, function, what it does)
    "generate": ("generate.tools.cli", "main", "continue a prompt (the generate command)"),
    "serve": ("generate.tools.serve", "main", "serve a model over OpenAI's HTTP API"),
    "playground": ("generate.tools.serve", "playground_main", "serve the page of generation and attention"),
    "score": ("generate.tools.commands", "score_main", "score a text: mean NLL and perplexity"),
    "attention": ("generate.tools.commands", "attention_main", "draw a model's causal attention over a text"),
    "batch": ("generate.tools.commands", "batch_main", "generate for a file of prompts, locally or on Ray"),
}
USAGE = (
    "usage: gptgen COMMAND [options]   (gptgen COMMAND --help for a command's options)\n\ncommands:\n"
    + "".join(f"  {name:<11} {about}\n" for name, (_, _, about) in COMMANDS.items())
)


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns its exit status (2 for an unknown or missing command)."""
    argv = sys.argv[1:] if argv is None else argv
    # (a stream closed, 2>&-, is None, and print() would write to standard output instead)
    if not argv or argv[0] in ("-h", "--help"):
        if (out := sys.stdout if argv else sys.stderr) is not None:
            print(USAGE, end="", file=out)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        message = f"gptgen: error: unknown command {name!r}; choose one of {', '.join(COMMANDS)}"
        if sys.stderr is not None:
            print(message, file=sys.stderr)
        return 2
    import importlib

    module, function, _ = COMMANDS[name]
    run = getattr(importlib.import_module(module), function)
    if name == "generate":
        return run(rest, prog="gptgen generate")
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
