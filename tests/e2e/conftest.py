"""Fixtures for end-to-end tests: a private containerd, and koordrp in front of it as a real process."""

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.e2e.progress import ModuleProgress
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import NRI_RELEASES, RELEASES, Containerd, ContainerdError, require_binaries
from tests.support.daemons import DaemonError
from tests.support.dockerd import Dockerd, require_binaries as require_dockerd_binaries
from tests.support.images import ImageSet, build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.stack import start_containerd


def require(check: Callable[[], None], tests: str) -> None:
    """Skip when `check` finds the runtime missing on a developer's machine; in CI that is a failure.

    `check` raises a DaemonError (MissingBinariesError, or a harness's own error) to say what is
    missing; `tests` names what CI would otherwise silently skip ("containerd"), for the failure message.
    """
    try:
        check()
    except DaemonError as error:
        # CI must run every test: there a missing runtime must not pass as a skip.
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the {tests} tests: {error}", pytrace=False)
        pytest.skip(str(error))


def require_root() -> None:
    if os.geteuid() != 0:
        raise ContainerdError("containerd tests need root")


def require_runtime() -> None:
    """Skip on a developer's machine without containerd or root; in CI either is a failure."""
    require(require_binaries, "containerd")
    require(require_root, "containerd")


@pytest.fixture(scope="session")
def images() -> Iterator[ImageSet]:
    require_runtime()
    with tempfile.TemporaryDirectory(prefix="krp-img-") as out:
        yield build_test_images(Path(out))


class Runtimes:
    """The session's private containerds, one per release (``RELEASES``), each with the test images and,
    where the release has it, NRI enabled on its ``paths.nri_socket``; started when a test first needs it.

    A release that is not unpacked here skips its tests; in CI that is a failure.
    """

    def __init__(self, images: ImageSet) -> None:
        self._images = images
        self._started: dict[str, Containerd] = {}

    def get(self, release: str) -> Containerd:
        if release not in self._started:
            require(RELEASES[release].require, f"containerd {release}")
            self._started[release] = start_containerd(self._images, release=release, nri=RELEASES[release].nri)
        return self._started[release]

    def stop(self) -> None:
        for runtime in self._started.values():
            runtime.stop()


@pytest.fixture(scope="session")
def runtimes(images: ImageSet) -> Iterator[Runtimes]:
    started = Runtimes(images)
    yield started
    started.stop()


@pytest.fixture(scope="session")
def containerd(runtimes: Runtimes) -> Containerd:
    """The machine's containerd 1.6, private, with the test images."""
    return runtimes.get("1.6")


@pytest.fixture(params=NRI_RELEASES)
def nri_release(request: pytest.FixtureRequest) -> str:
    """Each containerd release with NRI: a test that takes it runs on every one."""
    release: str = request.param
    return release


@pytest.fixture
def nri_containerd(nri_release: str, runtimes: Runtimes) -> Containerd:
    """The session's containerd of the release, NRI enabled."""
    return runtimes.get(nri_release)


@pytest.fixture(scope="session")
def dockerd(images: ImageSet) -> Iterator[Dockerd]:
    """A private dockerd, with the test images."""
    require(require_dockerd_binaries, "dockerd")
    daemon = Dockerd(Path(tempfile.mkdtemp(prefix="krp-dk-", dir="/tmp")))
    daemon.start()
    try:
        daemon.load_images(images)
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="krp-", dir="/tmp") as path:
        yield Path(path)


@pytest.fixture
def koordrp(containerd: Containerd, workdir: Path) -> Iterator[KoordrpProcess]:
    proxy = KoordrpProcess(workdir, containerd.endpoint)
    proxy.start()
    yield proxy
    proxy.stop()


@pytest.fixture
def plugin(nri_containerd: Containerd, workdir: Path) -> Iterator[KoordrpProcess]:
    """koordrp in NRI mode, registered with the session's containerd."""
    koordrp = KoordrpProcess(workdir, nri_containerd.endpoint, nri_socket=nri_containerd.paths.nri_socket)
    koordrp.start()
    yield koordrp
    koordrp.stop()


@pytest.fixture
def servers(workdir: Path) -> Iterator[dict[str, FakeHookServer]]:
    started: dict[str, FakeHookServer] = {}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture
def hooks_dir(workdir: Path) -> Path:
    """The hookserver.d directory the koordrp fixture watches."""
    return workdir / "hookserver.d"


@pytest.fixture
def runtime(koordrp: KoordrpProcess) -> Iterator[Any]:
    """koordrp's RuntimeService, as kubelet reaches it."""
    with koordrp.channel() as channel:
        yield koordrp.runtime(channel)


def hook_server(servers: dict[str, FakeHookServer], workdir: Path, name: str) -> FakeHookServer:
    server = FakeHookServer(str(workdir / f"{name}.sock")).start()
    servers[name] = server
    return server


def wait_registered(koordrp: KoordrpProcess, servers: int) -> None:
    """Until koordrp's log says it has ``servers`` registered. Operators are told it takes a second; that is a
    figure for a quiet node, not a bound a test machine at load 12 can be held to, so the wait is long and
    only a koordrp that never notices fails it."""
    koordrp.wait_for_servers(servers, timeout=30.0)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ModuleProgress(config), "koordrp-module-progress")
