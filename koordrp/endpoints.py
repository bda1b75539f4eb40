"""Unix socket endpoints as operators write them: a plain absolute path or a ``unix://`` URL."""

import os

UNIX_SCHEME = "unix://"


class EndpointError(ValueError):
    """An endpoint that koordrp cannot use."""


def parse_unix_endpoint(value: str) -> str:
    """Return the absolute, normalised socket path named by ``value``.

    koord-runtime-proxy and kubelet both accept either form, so koordrp does too; anything that is
    not an absolute path (a relative path, ``tcp://``, an empty string) is refused rather than
    guessed at, because a daemon that binds or dials the wrong place fails far from the cause.
    """
    path = value[len(UNIX_SCHEME):] if value.startswith(UNIX_SCHEME) else value
    if "://" in path:
        raise EndpointError(f"{value!r} is not a unix socket endpoint (only unix:// is supported)")
    if not path.startswith("/"):
        raise EndpointError(f"{value!r} is not an absolute path or unix:// URL")
    return os.path.normpath(path)


def grpc_target(path: str) -> str:
    """The target string grpcio dials or binds for a unix socket path."""
    return "unix:" + path
