"""Serve a hook server written in a file, without writing its start-up code:

    python -m koordrp.sdk path/to/server.py --socket /run/mine/mine.sock \\
        [--register-in /etc/runtime/hookserver.d] [--name mine] [--failure-policy Fail] [--timeout-seconds 1]

The file defines the server: a ``HookServer`` instance at module level, or one ``HookServer``
subclass (made with no arguments). Its ``if __name__ == "__main__":`` block does not run. The server
is served until SIGTERM or SIGINT; ``scripts/demo --hook-server path/to/server.py`` runs it this way
in front of a real containerd.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from koordrp.sdk import HookServer, command


def load(path: Path) -> ModuleType:
    """The file as a module named after it (``pin_me.py`` is ``pin_me``, as ``import pin_me`` names it), so that
    its loggers (``logging.getLogger(__name__)``) and its classes name the author's module."""
    name = path.stem if path.stem.isidentifier() else "hook_server"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Listed, unless the name is another module's, for what looks a class's module up (pickle, dataclasses).
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def server_in(module: ModuleType, path: Path) -> HookServer:
    """The one hook server ``module`` defines: an instance, or a subclass it makes one of."""
    instances = [value for value in vars(module).values() if isinstance(value, HookServer)]
    classes = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, HookServer) and value.__module__ == module.__name__
    ]
    if len(instances) == 1:
        return instances[0]
    if not instances and len(classes) == 1:
        return classes[0]()
    found = [type(instance).__name__ + " instance" for instance in instances] + [cls.__name__ for cls in classes]
    raise SystemExit(f"{path}: define one HookServer (an instance, or a subclass); found {found or 'none'}")


def main(argv: list[str] | None = None) -> None:
    options = command.parser("python -m koordrp.sdk", __doc__.split("\n\n")[0])
    options.add_argument("file", type=Path, help="the Python file that defines the hook server")
    parsed = command.parse(options, argv)
    command.serve_until_stopped(server_in(load(parsed.file), parsed.file), parsed, source=str(parsed.file))


if __name__ == "__main__":
    main()
