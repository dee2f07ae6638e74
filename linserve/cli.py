"""The ``linserve`` command (also ``python -m linserve``).

- ``linserve serve [MODEL] [flags]``: start the server. MODEL is what ``--model`` takes (a
  checkpoint folder, a GGUF file or a hub id); every flag is a setting (``linserve serve
  --help``), and each ``--some-name`` is also the variable ``LINSERVE_SOME_NAME``.
- ``linserve build-kernels DIR``: compile the native kernels into DIR ahead of time (what the
  Docker image does; ``LINSERVE_KERNEL_DIR`` / ``LINSERVE_KERNEL_LIB`` load them).
- ``linserve --version``.
"""

from __future__ import annotations

import sys

USAGE = """usage: linserve COMMAND [ARGS]

commands:
  serve [MODEL] [flags]   start the OpenAI-compatible server (linserve serve --help)
  build-kernels DIR       compile the native kernels into DIR ahead of time
  --version               print the version
"""


def serve_args(args: list[str]) -> list[str]:
    """``serve``'s arguments as settings flags: a leading positional MODEL becomes
    ``--model MODEL`` (as in ``vllm serve MODEL``); everything else passes through."""
    if args and not args[0].startswith("-"):
        return ["--model", args[0], *args[1:]]
    return args


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``linserve COMMAND``; exits with status 2 and the usage on a bad command."""
    args = sys.argv[1:] if argv is None else argv
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command == "serve":
        import time

        from linserve.server.engine.prelaunch import prelaunch

        boot = time.monotonic()
        early = prelaunch(serve_args(rest))  # the engine process imports while this one does
        try:
            from linserve.server.serve import main as serve

            serve(serve_args(rest), boot, early)
        finally:
            if early is not None:  # not taken (a bad checkpoint, an interrupt): it leaves
                early.cancel()
    elif command == "build-kernels":
        from linserve.model.kernels import main as kernels_main

        kernels_main(["build", *rest])
    elif command in ("--version", "-V"):
        from linserve import __version__

        print(f"linserve {__version__}")
    elif command in ("-h", "--help"):
        print(USAGE, end="")
    else:
        print(USAGE, end="", file=sys.stderr)
        if command:
            print(f"linserve: unknown command {command!r}", file=sys.stderr)
        raise SystemExit(2)
