"""A private containerd with the test images, and koordrp in front of it."""

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from tests.support.containerd import Containerd
from tests.support.images import ImageSet, build_test_images
from tests.support.koordrp_process import KoordrpProcess


def start_containerd(
    images: ImageSet, base: Path | None = None, release: str = "1.6", nri: bool = False, nri_request_timeout: str = "2s"
) -> Containerd:
    """A private containerd of `release` (with NRI if `nri`: a release with NRI, giving each plugin call
    `nri_request_timeout`), running, with `images` imported."""
    runtime = Containerd(
        base or Path(tempfile.mkdtemp(prefix="krp-cd-", dir="/tmp")), release=release, nri=nri, nri_request_timeout=nri_request_timeout
    )
    runtime.start()
    try:
        runtime.import_images(images)
    except BaseException:
        runtime.stop()
        raise
    return runtime


@contextlib.contextmanager
def containerd_and_koordrp(
    base: Path, koordrp_args: Sequence[str] = (), nri: bool = False, release: str | None = None
) -> Iterator[tuple[Containerd, KoordrpProcess]]:
    """Both running under ``base`` (``nri``: koordrp containerd's NRI plugin); both stopped, and containerd's
    state removed, on exit. ``release`` is containerd's (default: 1.7 for NRI, else the machine's 1.6)."""
    release = release or ("1.7" if nri else "1.6")
    containerd = start_containerd(build_test_images(base / "images"), base / "containerd", release=release, nri=nri)
    nri_socket = containerd.paths.nri_socket if nri else None
    proxy = KoordrpProcess(base, containerd.endpoint, koordrp_args, nri_socket=nri_socket)
    try:
        proxy.start()
        yield containerd, proxy
    finally:
        proxy.stop()
        containerd.stop()
