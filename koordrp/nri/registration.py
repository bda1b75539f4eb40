"""Where koordrp says, while it is a plugin of containerd's NRI, that it is: ``<state-dir>/nri-plugin.json``.

containerd tells nobody which plugins it has; ``koordrp check`` reads this file (and that its process
lives) to say whether koordrp is registered. It is written once containerd has synchronized the
plugin, and removed when the connection is lost or koordrp stops.
"""

import json
import os
from dataclasses import asdict, dataclass

from koordrp.files import NotAFile, create_file, open_file, read_at_most

FILE_NAME = "nri-plugin.json"
MAX_BYTES = 64 * 1024
"""More than koordrp ever writes there: a larger file is not one it wrote."""


@dataclass(frozen=True)
class Registration:
    plugin: str
    """As containerd names it: index-name."""
    socket: str
    runtime: str
    """containerd's name and version, as it told them."""
    pid: int
    since: str


def write(state_dir: str, registration: Registration) -> None:
    """Written whole (a temporary file, then a rename); an error is the caller's to report."""
    path = os.path.join(state_dir, FILE_NAME)
    temporary = path + ".new"
    with os.fdopen(create_file(temporary, 0o644), "w", encoding="utf-8") as stream:
        json.dump(asdict(registration), stream)
    os.replace(temporary, path)


def remove(state_dir: str) -> None:
    try:
        os.unlink(os.path.join(state_dir, FILE_NAME))
    except FileNotFoundError:
        pass


def read(state_dir: str) -> Registration | None:
    """What the file says, or None when there is none (or it is not one koordrp wrote)."""
    try:
        descriptor, _ = open_file(os.path.join(state_dir, FILE_NAME), follow=False)
        with os.fdopen(descriptor, "rb") as stream:
            return Registration(**json.loads(read_at_most(stream.fileno(), MAX_BYTES)))
    except (OSError, NotAFile, ValueError, TypeError):
        return None
