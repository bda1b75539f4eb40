"""Clients that connect and send nothing, or drip their first bytes, against koordrp's sockets, more of them
than its cap: each is closed by koordrp (its client reads an end of file, or a reset), koordrp (at 1024
descriptors, as systemd starts it) never holds more than its cap of them, so the descriptors it keeps for
its own calls stay free, and kubelet's calls and their hooks (cri-dockerd's in Docker mode) go on meanwhile.

Each dripping client sends one byte every ``DRIP_SECONDS``, from one thread for them all: the pace of a
client that means to hold its connection, never a wait for something.
"""

import resource
import select
import socket
import threading
from pathlib import Path
from typing import Iterator

import pytest
from cri_api.v1 import api_pb2

from koordrp.bounds import OWN_DESCRIPTORS, connection_cap
from koordrp.cri.server import MOST_CONNECTIONS
from koordrp.docker.proxy import DOCKER_BOUNDS
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.dockerd import Dockerd, unix_http
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.descriptors import DESCRIPTOR_LIMIT, LimitedKoordrp, MostDescriptors, open_descriptors
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import running_container
from tests.support.waiting import eventually

SPARE_DESCRIPTORS = 8
"""What koordrp may open of its own meanwhile: a state file and its directory, a hook call, a reading of /proc."""
DRIP_SECONDS = 0.5
# HTTP/2's preface, then a SETTINGS frame of 2,000 settings (unknown ones, which a server ignores): its
# handshake is over only once the whole frame is in, hours away at this pace.
ENDLESS_HANDSHAKE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + (12000).to_bytes(3, "big") + b"\x04\x00\x00\x00\x00\x00"
ENDLESS_HANDSHAKE += b"\xff\x00\x00\x00\x00\x00" * 2000
# A head that does not end within the test: only koordrp's bound ends the connection.
ENDLESS_HEAD = b"GET /v1.41/info HTTP/1.1\r\nHost: docker\r\nX-Drip: " + b"d" * 4096
CLOSED_WITHIN = 90.0
"""How long the test waits for koordrp to close them all: a generous bound for a loaded machine, not a measure
(the bounds are 10 s from the first byte, 30 s for one that sends nothing in Docker mode), and short of grpc's
own handshake timeout (120 s), which is not koordrp's bound."""


class Drippers:
    """``count`` connections to ``path``, each sending ``data`` a byte every ``DRIP_SECONDS`` (then nothing) until
    koordrp closes it, and ``silent`` ones that send nothing; which are closed, as their client sees it (an end of
    file or a reset)."""

    def __init__(self, path: Path, data: bytes, count: int, silent: int = 0) -> None:
        self._data = data
        self._lock = threading.Lock()
        self._sockets: dict[int, tuple[socket.socket, bool]] = {}
        self._sent: dict[int, int] = {}
        self.closed: set[int] = set()
        self._stop = threading.Event()
        for index in range(count + silent):
            client = socket.socket(socket.AF_UNIX)
            client.connect(str(path))
            client.setblocking(False)
            self._sockets[client.fileno()] = (client, index < count)
            self._sent[client.fileno()] = 0
        self._thread = threading.Thread(target=self._drip, name="drippers", daemon=True)
        self._thread.start()

    @property
    def count(self) -> int:
        return len(self._sockets)

    def open(self) -> int:
        with self._lock:
            return self.count - len(self.closed)

    def _drip(self) -> None:
        poller = select.poll()
        for descriptor in self._sockets:
            poller.register(descriptor, select.POLLIN | select.POLLHUP)
        while not self._stop.is_set() and self.open():
            for descriptor, _ in poller.poll(DRIP_SECONDS * 1000):
                self._read(poller, descriptor)
            for descriptor, (client, drips) in self._sockets.items():
                if not drips or descriptor in self.closed:
                    continue
                sent = self._sent[descriptor]
                if sent == len(self._data):
                    continue
                try:
                    client.send(self._data[sent : sent + 1])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    self._close(poller, descriptor)
                    continue
                self._sent[descriptor] = sent + 1

    def _read(self, poller: "select.poll", descriptor: int) -> None:
        client, _ = self._sockets[descriptor]
        try:
            data = client.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(poller, descriptor)

    def _close(self, poller: "select.poll", descriptor: int) -> None:
        poller.unregister(descriptor)
        with self._lock:
            self.closed.add(descriptor)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        for client, _ in self._sockets.values():
            client.close()


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """Room in the test's own descriptors for every connection it opens."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def limited(containerd: Containerd, workdir: Path) -> Iterator[KoordrpProcess]:
    proxy = LimitedKoordrp(workdir, containerd.endpoint)
    proxy.start()
    yield proxy
    proxy.stop()


def test_drip_fed_connections_to_the_cri_socket_are_closed_while_kubelets_and_hook_calls_go_on(
    limited: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path, many_descriptors: None
) -> None:
    cap = connection_cap(MOST_CONNECTIONS, 1, DESCRIPTOR_LIMIT)
    assert limited.log_lines(f"CRI connections: at most {cap} open, {OWN_DESCRIPTORS} of {DESCRIPTOR_LIMIT} file descriptors")
    server = hook_server(servers, workdir, "watcher")
    register(workdir / "hookserver.d", "watcher", server.path, ["PreRunPodSandbox", "PreCreateContainer"])
    wait_registered(limited, 1)
    with limited.channel() as channel:
        runtime = limited.runtime(channel)
        limited.wait_answering(channel)
        before = open_descriptors(limited.pid)
        sampled = MostDescriptors(limited.pid)
        sampled.start()
        # More than the cap: those over it are closed as they come, the others when their handshake's bound passes.
        drippers = Drippers(limited.socket, ENDLESS_HANDSHAKE, cap + 44)
        try:
            # kubelet's connection, open before them, is served while they hold the rest of the cap, hooks and all.
            with running_container(runtime, "under-siege", workdir / "logs") as running:
                listed = runtime.ListContainers(api_pb2.ListContainersRequest(), timeout=60)
                assert running.container_id in [container.id for container in listed.containers]
            assert server.rpcs() == ["PreRunPodSandboxHook", "PreCreateContainerHook"]
            eventually(lambda: drippers.open() == 0, "every dripping connection closed by koordrp", CLOSED_WITHIN)
        finally:
            drippers.stop()
            most = sampled.stop()
        # Never more than the cap of them: the descriptors koordrp keeps for its own calls stayed free.
        assert most - before <= cap + SPARE_DESCRIPTORS, (most, before)
        assert most <= DESCRIPTOR_LIMIT - OWN_DESCRIPTORS, most
        assert runtime.Version(api_pb2.VersionRequest(), timeout=60).runtime_name == "containerd"
    # A client that connects now is served.
    with limited.channel() as fresh:
        assert limited.runtime(fresh).Version(api_pb2.VersionRequest(), timeout=60).runtime_name == "containerd"
    assert not [line for line in limited.warnings() if "Too many open files" in line or "Traceback" in line]


@pytest.fixture
def limited_docker(dockerd: Dockerd, workdir: Path) -> Iterator[KoordrpProcess]:
    process = LimitedKoordrp(workdir, dockerd.host, ["--backend-runtime-mode=Docker"])
    process.start()
    yield process
    process.stop()


def test_drip_fed_and_silent_connections_to_the_docker_socket_are_closed_while_calls_go_on(
    dockerd: Dockerd, limited_docker: KoordrpProcess, many_descriptors: None
) -> None:
    proxy = limited_docker
    # Two descriptors a connection (its own, and its exchange with dockerd): the cap is what the limit leaves.
    cap = connection_cap(DOCKER_BOUNDS.connections, 2, DESCRIPTOR_LIMIT)
    assert proxy.log_lines(f"Docker API connections: at most {cap} open, {OWN_DESCRIPTORS} of {DESCRIPTOR_LIMIT}")
    assert unix_http(proxy.socket, "GET", "/_ping")[0] == 200
    before = open_descriptors(proxy.pid)
    sampled = MostDescriptors(proxy.pid)
    sampled.start()
    # The cap all but filled, then more than it: at the cap a new connection takes the place of the one longest
    # without a request, or is closed at once while another is being let go.
    siege = Drippers(proxy.socket, ENDLESS_HEAD, cap - 20, silent=16)
    over = Drippers(proxy.socket, ENDLESS_HEAD, 40)
    try:
        # cri-dockerd's calls get in all the same, in the place of connections without a request if need be.
        result = dockerd.docker("run", "--rm", "--network", "none", BUSYBOX_REF, "echo", "through", host=proxy.endpoint)
        assert (result.returncode, result.stdout) == (0, "through\n")
        status, _, body = unix_http(proxy.socket, "GET", "/v1.41/containers/json")
        assert status == 200, body
        for drippers in (siege, over):
            eventually(lambda: drippers.open() == 0, "every dripping and silent connection closed by koordrp", CLOSED_WITHIN)
    finally:
        siege.stop()
        over.stop()
        most = sampled.stop()
    # Never more than the cap of them (the docker CLI's exchanges with dockerd beside its own).
    assert most - before <= cap + SPARE_DESCRIPTORS, (most, before)
    assert most <= DESCRIPTOR_LIMIT - OWN_DESCRIPTORS, most
    assert unix_http(proxy.socket, "GET", "/_ping")[0] == 200
    assert proxy.log_lines("the Docker API socket closed connections: ")
    assert not [line for line in proxy.warnings() if "Too many open files" in line or "Traceback" in line]
