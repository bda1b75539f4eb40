"""The metrics endpoint against a local user who holds connections open, against a real containerd.

koordrp runs with 1,024 file descriptors (``prlimit``, what systemd gives a unit that sets no
``LimitNOFILE``). An unprivileged process (uid and gid 65534, no groups) opens 300 connections to
its metrics endpoint, TCP and unix, and drips a request into each, one byte every two seconds: a
request that would take minutes to arrive, whose every byte would restart an idle timeout.
Meanwhile CRI calls and hook calls through koordrp succeed, /livez answers, and koordrp holds no
more than its cap of those connections; each one ends with koordrp closing it (the client reads an
end of file, or a reset where koordrp closed it with a byte unread), never with an answer or with
its request sent whole. 10,000 CRI method names koordrp does not know make one series on /metrics.

Nothing here sleeps a fixed time or bounds one: each wait is for an event (a generous bound only
fails a koordrp that never gets there).
"""

import json
import os
import re
import select
import shutil
import socket
import stat
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.web import METRICS_BOUNDS
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.hook_registration import register
from tests.support.descriptors import DESCRIPTOR_LIMIT, LimitedKoordrp, MostDescriptors, open_descriptors
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import running_container
from tests.support.scrape import free_port, sample

NOBODY = 65534
CONNECTIONS = 300
DRIP_SECONDS = 2.0
# koordrp's own descriptors beside the metrics connections it holds: a grpc call or a probe in flight.
SPARE_DESCRIPTORS = 16
# Long enough that dripped a byte every 2 s it would take minutes to arrive whole.
DRIPPED = (
    "GET /metrics HTTP/1.1\r\nHost: koordrp\r\nUser-Agent: drip\r\nX-Padding: "
    + "p" * 80
    + "\r\nAccept: text/plain\r\n\r\n"
)
# The drip client gives up waiting for koordrp well before its request would be whole (a generous bound).
CLIENT_PATIENCE = 150.0

# Run as another user, by an interpreter that user can run: stdlib only.
DRIP_CLIENT = r"""
import json, selectors, socket, struct, sys, time

spec = json.loads(sys.argv[1])
request = spec["request"].encode()
if spec["family"] == "unix":
    family, address = socket.AF_UNIX, spec["address"]
else:
    family, address = socket.AF_INET, tuple(spec["address"])
outcomes = {}
sent = {}
selector = selectors.DefaultSelector()


def end(client, outcome):
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    selector.unregister(client)
    del sent[client]
    client.close()


def drip(client):
    if sent[client] == len(request):
        return end(client, "sent whole")
    try:
        client.send(request[sent[client]:sent[client] + 1])
    except OSError:
        return end(client, "reset")
    sent[client] += 1


refused = {}
for _ in range(spec["count"]):
    client = socket.socket(family, socket.SOCK_STREAM)
    # Blocking, as a plain client connects: a unix socket's full backlog is waited out, not EAGAIN (30 s at most).
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 30, 0))
    try:
        client.connect(address)
    except OSError as error:
        refused[error.strerror] = refused.get(error.strerror, 0) + 1
        client.close()
        continue
    client.setblocking(False)
    sent[client] = 0
    selector.register(client, selectors.EVENT_READ)
    drip(client)
print(json.dumps({"connected": len(sent) + sum(outcomes.values()), "refused": refused}), flush=True)
deadline = time.monotonic() + spec["patience"]
next_drip = time.monotonic() + spec["interval"]
while sent and time.monotonic() < deadline:
    for key, _ in selector.select(max(0.0, min(next_drip, deadline) - time.monotonic())):
        try:
            data = key.fileobj.recv(65536)
        except OSError:
            end(key.fileobj, "reset")
        else:
            end(key.fileobj, "end of file" if not data else "answered")
    if time.monotonic() >= next_drip:
        for client in list(sent):
            drip(client)
        next_drip += spec["interval"]
for client in list(sent):
    end(client, "still open")
print(json.dumps({"outcomes": outcomes}), flush=True)
"""


def interpreter_for_others() -> str:
    """A Python that a user other than root may run (the tests' own may live under /root)."""
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")):
        if candidate is None:
            continue
        path = Path(candidate)
        if all(os.stat(part).st_mode & stat.S_IXOTH for part in (path, *path.parents)):
            return str(path)
    raise AssertionError("no Python interpreter that uid 65534 may run (tried the tests' own and /usr/bin/python3)")


def as_nobody(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [interpreter_for_others(), "-I", "-S", *argv],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )


def line_from(process: subprocess.Popen[str], timeout: float = 120.0) -> dict[str, Any]:
    """The next JSON line ``process`` prints (a generous bound: it comes once its connections are made)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "the drip client said nothing"
    line = process.stdout.readline()
    assert line, f"the drip client exited with {process.wait()}"
    said: dict[str, Any] = json.loads(line)
    return said


def http_get(family: str, address: Any, path: str) -> tuple[int, str]:
    """One HTTP/1.0 GET as root, on the endpoint's own family."""
    with socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET) as client:
        client.settimeout(30)
        client.connect(address)
        client.sendall(f"GET {path} HTTP/1.0\r\nHost: koordrp\r\n\r\n".encode())
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    head, _, body = answer.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture(params=["tcp", "unix"])
def endpoint(request: pytest.FixtureRequest, workdir: Path) -> tuple[str, str, Any]:
    """The metrics endpoint: its family, the flag's value, and the address a client connects to."""
    if request.param == "tcp":
        port = free_port()
        return "tcp", f"tcp:{port}:interface=127.0.0.1", ("127.0.0.1", port)
    # The test's directory is root's alone: uid 65534 may pass through it to the socket, nothing more. The
    # socket is opened to every user (mode=666), as the 0666 default was: the bounds hold all the same.
    os.chmod(workdir, 0o711)
    path = str(workdir / "metrics" / "metrics.sock")
    return "unix", f"unix:{path}:mode=666", path


@pytest.fixture
def limited(containerd: Containerd, workdir: Path, endpoint: tuple[str, str, Any]) -> Iterator[KoordrpProcess]:
    proxy = LimitedKoordrp(workdir, containerd.endpoint, [f"--metrics-endpoint={endpoint[1]}"])
    proxy.start()
    yield proxy
    proxy.stop()


def test_drip_fed_connections_are_closed_at_the_bound_while_calls_and_hooks_go_on(
    limited: KoordrpProcess, endpoint: tuple[str, str, Any], servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    family, _, address = endpoint
    limits = Path(f"/proc/{limited.pid}/limits").read_text()
    assert re.search(rf"Max open files\s+{DESCRIPTOR_LIMIT}\s+{DESCRIPTOR_LIMIT}\s", limits), limits
    server = hook_server(servers, workdir, "watcher")
    register(workdir / "hookserver.d", "watcher", server.path, ["PreRunPodSandbox", "PreCreateContainer"])
    wait_registered(limited, 1)
    with limited.channel() as channel:
        runtime = limited.runtime(channel)
        runtime.Version(api_pb2.VersionRequest(), timeout=30)
        before = open_descriptors(limited.pid)
        spec = {
            "family": family,
            "address": address,
            "count": CONNECTIONS,
            "interval": DRIP_SECONDS,
            "request": DRIPPED,
            "patience": CLIENT_PATIENCE,
        }
        sampled = MostDescriptors(limited.pid)
        sampled.start()
        dripping = as_nobody("-c", DRIP_CLIENT, json.dumps(spec))
        try:
            connected = line_from(dripping)
            assert connected == {"connected": CONNECTIONS, "refused": {}}, connected
            # koordrp's own calls go on: a CRI call, a pod's hooks, its liveness.
            assert len(runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=30).items) >= 0
            with running_container(runtime, "dripped-on", workdir) as pod:
                assert runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id), timeout=30)
            assert server.rpcs() == ["PreRunPodSandboxHook", "PreCreateContainerHook"]
            assert http_get(family, address, "/livez") == (200, "ok: koordrp's reactor answers\n")
            ended = line_from(dripping, timeout=CLIENT_PATIENCE + 60)
        finally:
            if dripping.poll() is None:
                dripping.kill()
            dripping.wait()
            most = sampled.stop()
    # Never more than the cap of them (and one on its way out), whatever the 300 did: descriptors to spare.
    assert most - before <= METRICS_BOUNDS.connections + 1 + SPARE_DESCRIPTORS, (most, before)
    # Every one was closed by koordrp: none answered, none sent whole, none left open.
    outcomes = ended["outcomes"]
    assert set(outcomes) <= {"end of file", "reset"} and sum(outcomes.values()) == CONNECTIONS, outcomes
    status, metrics = http_get(family, address, "/metrics")
    assert status == 200
    closed = {
        reason: sample(metrics, "koordrp_metrics_connections_closed_total", reason=reason)
        for reason in ("slow", "evicted", "refused", "idle", "oversized")
    }
    # Over the cap at once (refused, or evicted for a newer one), or at the request's bound (slow).
    assert closed["slow"] >= 1 and closed["slow"] + closed["evicted"] + closed["refused"] >= CONNECTIONS, closed
    assert limited.log_lines("the metrics endpoint closed connections: ")
    assert not [line for line in limited.warnings() if "Too many open files" in line]


def test_a_unix_socket_is_0660_and_a_lock_left_to_a_live_stranger_is_taken_over(containerd: Containerd, workdir: Path) -> None:
    os.chmod(workdir, 0o711)
    path = workdir / "metrics" / "metrics.sock"
    proxy = KoordrpProcess(workdir, containerd.endpoint, [f"--metrics-endpoint=unix:{path}"])
    proxy.start()
    try:
        assert (stat.S_IMODE(path.stat().st_mode), path.stat().st_uid, path.stat().st_gid) == (0o660, 0, 0)
        stranger = as_nobody(
            "-c", "import socket, sys\ntry:\n socket.socket(socket.AF_UNIX).connect(sys.argv[1])\n"
            "except OSError as e:\n print(e.strerror)\nelse:\n print('connected')", str(path)
        )
        assert stranger.communicate(timeout=60)[0] == "Permission denied\n"
        proxy.kill()  # SIGKILL: the socket and its lock stay
        assert os.readlink(f"{path}.lock") == str(proxy.pid)
        # The lock's pid is now another live process's (a pid reused): here, this test's own.
        os.unlink(f"{path}.lock")
        os.symlink(str(os.getpid()), f"{path}.lock")
        proxy.start()
        assert http_get("unix", str(path), "/livez") == (200, "ok: koordrp's reactor answers\n")
        assert os.readlink(f"{path}.lock") == str(proxy.pid)
        assert not [line for line in proxy.warnings() if "cannot serve /metrics" in line]
    finally:
        proxy.stop()


def test_ten_thousand_unknown_cri_methods_make_one_series(containerd: Containerd, workdir: Path) -> None:
    port = free_port()
    proxy = KoordrpProcess(workdir, containerd.endpoint, [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1"])
    proxy.start()
    try:
        with proxy.channel() as channel:
            proxy.runtime(channel).Version(api_pb2.VersionRequest(), timeout=30)
            before = ready_series(port)

            def unknown(number: int) -> grpc.StatusCode:
                try:
                    channel.unary_unary(f"/runtime.v1.RuntimeService/Unknown{number}", None, None)(b"", timeout=60)
                except grpc.RpcError as error:
                    return error.code()
                return grpc.StatusCode.OK

            with futures.ThreadPoolExecutor(max_workers=16) as pool:
                codes = set(pool.map(unknown, range(10_000)))
            assert codes == {grpc.StatusCode.UNIMPLEMENTED}, codes
        status, metrics = http_get("tcp", ("127.0.0.1", port), "/metrics")
        assert status == 200
        new = series(metrics) - before
        assert new == {("koordrp_cri_calls", (("code", "UNIMPLEMENTED"), ("method", "other")))}, new
        assert sample(metrics, "koordrp_cri_calls_total", method="other", code="UNIMPLEMENTED") == 10_000
    finally:
        proxy.stop()


def ready_series(port: int) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The series on /metrics once koordrp_ready is among them: a proxy's gauge appears once the probe that a
    scrape starts has ended (the runtime answered)."""
    deadline = time.monotonic() + 60
    while ("koordrp_ready", ()) not in (found := series(http_get("tcp", ("127.0.0.1", port), "/metrics")[1])):
        assert time.monotonic() < deadline, found
        time.sleep(0.1)
    return found


def series(metrics: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Each metric family and label set on /metrics (a histogram's buckets and a counter's samples are one)."""
    found = set()
    for line in metrics.splitlines():
        matched = re.fullmatch(r"(\w+?)(?:_total|_created|_bucket|_count|_sum)?(?:\{(.*)\})? \S+", line)
        if matched and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', matched.group(2) or ""))
            labels.pop("le", None)
            found.add((matched.group(1), tuple(sorted(labels.items()))))
    return found
