"""A hook server's command line: where it serves and how it registers, then serving until stopped.

``python -m koordrp.sdk`` and the example hook servers share these options, so every hook server
started from a shell takes the same flags::

    parser = command.parser("python -m mine", "What mine does.", socket="/run/mine/mine.sock", name="mine")
    command.serve_until_stopped(Mine(), command.parse(parser, argv))
"""

import argparse
import logging

# The SDK's own logger, not the root one: the server's output names who wrote each line, and the author's
# own lines are named after the author's module (``python -m koordrp.sdk`` loads the file under its name).
from koordrp.sdk import HookServer, log


def parser(prog: str, description: str, *, socket: str | None = None, name: str | None = None) -> argparse.ArgumentParser:
    """The serving options; without a default ``socket``, ``--socket`` is required."""
    options = argparse.ArgumentParser(prog=prog, description=description)
    options.add_argument("--socket", default=socket, required=socket is None, help="unix socket to serve on")
    options.add_argument("--register-in", metavar="DIR", help="hookserver.d directory to register in (default: do not)")
    options.add_argument(
        "--name", default=name, help="registration file name, without .json" + ("" if name else " [default: the socket's]")
    )
    # Without the flags, the server's own failure_policy and timeout_seconds: the command line only overrides.
    options.add_argument(
        "--failure-policy", choices=("Ignore", "Fail"), help="[default: the server's failure_policy, Ignore unless it sets one]"
    )
    options.add_argument(
        "--timeout-seconds", type=float, help="how long koordrp waits for one call [default: the server's timeout_seconds]"
    )
    return options


def parse(options: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The command line, with logging to stderr set up before anything else can log."""
    parsed = options.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return parsed


def serve_until_stopped(server: HookServer, options: argparse.Namespace, source: str = "") -> None:
    """Serve (and register) as the options say until SIGTERM or SIGINT; ``ready`` on stdout once it answers."""
    with server.serve(
        options.socket,
        register_in=options.register_in,
        name=options.name,
        failure_policy=options.failure_policy,
        timeout_seconds=options.timeout_seconds,
    ) as running:
        hooks = ", ".join(sorted(hook.value for hook in running.hooks))
        log.info("serving %s%s on %s", hooks, f" from {source}" if source else "", running.socket_path)
        print("ready", flush=True)
        running.wait()
        log.info("stopping")
