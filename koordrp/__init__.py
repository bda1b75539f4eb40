"""koordrp: a runtime proxy between kubelet and the container runtime, with Koordinator's runtime hooks."""


def koordrp_version() -> str:
    """The installed package's version (``koordrp --version``, ``twistd koordrp --version``)."""
    # Imported here: importlib.metadata costs ~30 ms and ~0.5 MB to every process importing koordrp
    # (the daemon, each hook server on koordrp.sdk), and only --version needs it.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("koordrp")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
