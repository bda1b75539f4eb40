"""koordrp: a runtime proxy between kubelet and the container runtime, with Koordinator's runtime hooks."""

from importlib.metadata import PackageNotFoundError, version


def koordrp_version() -> str:
    """The installed package's version (``koordrp --version``, ``twistd koordrp --version``)."""
    try:
        return version("koordrp")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
