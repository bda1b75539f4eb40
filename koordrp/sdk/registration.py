"""Registering a hook server: its hookserver.d file, written so that koordrp only ever reads it whole."""

import json
import math
import os
import tempfile
from typing import Mapping

from koordrp.hooks.config import MAX_SOCKET_PATH_BYTES
from koordrp.hooks.types import FailurePolicy, HookType
from koordrp.unix import EndpointError, parse_unix_endpoint

REGISTRATION_MODE = 0o644
"""koordrp refuses registrations others can write; it must be able to read them (it may not be root)."""


def socket_path(value: str) -> str:
    try:
        path = parse_unix_endpoint(value)
    except EndpointError as error:
        raise ValueError(f"socket path: {error}") from None
    if len(path.encode("utf-8")) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path {path!r} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a unix socket allows")
    return path


def registration_name(name: str | None, socket_path: str) -> str:
    if name is None:
        name = os.path.splitext(os.path.basename(socket_path))[0]
    # A plain file name: koordrp orders servers by it, and a dot file would hide the temporary ones.
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise ValueError(f"registration name {name!r} must be a plain file name not starting with a dot")
    return name


def checked_policy(failure_policy: FailurePolicy | str) -> FailurePolicy:
    if isinstance(failure_policy, FailurePolicy):
        return failure_policy
    try:
        return FailurePolicy(failure_policy)
    except ValueError:
        known = " or ".join(repr(policy.value) for policy in FailurePolicy)
        raise ValueError(f"failure_policy must be {known}, not {failure_policy!r}") from None


def checked_timeout(timeout_seconds: float | None) -> float | None:
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool)
        or not isinstance(timeout_seconds, (int, float))
        or not (math.isfinite(timeout_seconds) and timeout_seconds > 0)
    ):
        raise ValueError(f"timeout_seconds must be a positive finite number, not {timeout_seconds!r}")
    return timeout_seconds


def registration_document(
    socket_path: str,
    handlers: Mapping[HookType, object],
    failure_policy: FailurePolicy | str,
    timeout_seconds: float | None,
) -> dict[str, object]:
    """The registration koordrp (and Koordinator's proxy) reads: ``timeout-seconds`` is koordrp's own field."""
    document: dict[str, object] = {
        "remote-endpoint": socket_path,
        "failure-policy": checked_policy(failure_policy).value,
        # In HookType order, so that the file does not change from one start to the next.
        "runtime-hooks": [hook.value for hook in HookType if hook in handlers],
    }
    timeout = checked_timeout(timeout_seconds)
    if timeout is not None:
        document["timeout-seconds"] = timeout
    return document


class Registration:
    def __init__(self, directory: str, name: str, document: dict[str, object]) -> None:
        self.directory = directory
        self.name = name
        self.document = document

    def write(self) -> str:
        """Write ``<name>.json`` so that koordrp only ever reads a complete file.

        koordrp reacts to every change in the directory; a file written in place could be caught
        half-written. The temporary file is a dot file without the ``.json`` suffix, which koordrp
        does not read, and os.replace makes the complete file appear at once.
        """
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            os.chmod(self.directory, 0o755)  # as koordrp creates it, whatever the umask
        target = os.path.join(self.directory, f"{self.name}.json")
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{self.name}.", suffix=".tmp")
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
                os.fchmod(stream.fileno(), REGISTRATION_MODE)
                json.dump(self.document, stream, indent=1)
                stream.write("\n")
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            _unlink_quietly(temporary)
            raise
        _fsync_directory(self.directory)
        return target


def remove_registration(path: str) -> None:
    _unlink_quietly(path)
    _fsync_directory(os.path.dirname(path))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str) -> None:
    # The rename or removal itself is durable only once the directory is synced.
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
